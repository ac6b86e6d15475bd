"""A /metrics page, fetched and parsed (``kvcore.stats.parse_metrics``): from a thread with
urllib, or from an event loop with aiohttp."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable

import aiohttp

from kvroute.kvcore.stats import MetricsPage, parse_metrics


def scrape(metrics_url: str, only: Iterable[str] = (), timeout: float = 10) -> MetricsPage:
    """GET ``metrics_url`` (the whole URL, /metrics included), parsed; raises OSError."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:
        return parse_metrics(resp.read(), only=only)


async def metrics_text(http: aiohttp.ClientSession, base: str) -> str:
    """``base``'s /metrics page as text; raises for a status that is not 2xx."""
    async with http.get(base + "/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


async def metrics_page(
    http: aiohttp.ClientSession, base: str, only: Iterable[str] = ()
) -> MetricsPage:
    """``base``'s /metrics page, parsed (only the samples whose names start with one of ``only``, when given)."""
    return parse_metrics(await metrics_text(http, base), only=only)
