"""Read each replica's own /metrics: queue depth, KV usage, prefix-cache hits, block size.

vLLM's /metrics page is large (histograms with many buckets), so only the lines of the few
families we use are parsed (``kvcore.stats.parse_metrics``); the router stays cheap at one scrape
per replica per interval. What is read goes into ``ReplicaState.reported_*`` (the policy's fresh
load signals) and into ``ReplicaReport`` (exported, so operators can compare the replicas'
reported prefix-cache hits with what the router predicted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from kvroute.kvcore.stats import MetricsPage, parse_metrics

from .probe import Probeable

log = logging.getLogger(__name__)

WANTED = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # before vLLM 0.10
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries",  # before vLLM 0.10
    "vllm:gpu_prefix_cache_hits",
    "vllm:cache_config_info",
)


@dataclass(slots=True)
class ReplicaReport:
    """The replica's own numbers from its last successful scrape (cumulative counters)."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None  # tokens looked up in the prefix cache
    prefix_hits: float | None = None  # of those, tokens found cached
    block_size: int | None = None


def parse_vllm_metrics(text: bytes) -> ReplicaReport:
    """The fields of ``ReplicaReport`` from a vLLM /metrics page (missing ones stay None).

    Gauges and counters are summed over a replica's label sets (engine index, model name).
    """
    page = parse_metrics(text, only=WANTED)
    report = ReplicaReport()
    for labels, _ in page.series("vllm:cache_config_info"):
        size = labels.get("block_size")
        if size and size.isdigit():
            report.block_size = int(size)
    if "vllm:num_requests_waiting" in page:
        report.waiting = int(page.sum("vllm:num_requests_waiting"))
    if "vllm:num_requests_running" in page:
        report.running = int(page.sum("vllm:num_requests_running"))
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        series = page.series(name)
        if series:  # a fraction per engine: the mean over data-parallel engines
            report.kv_usage = sum(value for _, value in series) / len(series)
            break
    report.prefix_queries = _first_sum(
        page, "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"
    )
    report.prefix_hits = _first_sum(page, "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
    return report


def _first_sum(page: MetricsPage, *names: str) -> float | None:
    """The sum of the first of ``names`` the page has (older vLLM names come last)."""
    for name in names:
        if name in page:
            return page.sum(name)
    return None


class MetricsScraper:
    """Scrapes every healthy replica's /metrics on an interval, concurrently."""

    def __init__(
        self,
        replicas: Callable[[], Sequence[Probeable]],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        on_block_size: Callable[[str, int], None] = lambda replica, size: None,
    ) -> None:
        self._replicas = replicas
        self._interval_s = interval_s
        self._on_block_size = on_block_size
        self.reports: dict[str, ReplicaReport] = {}
        self.scraped_at: dict[str, float] = {}  # monotonic time of each last good scrape
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._task: asyncio.Task[None] | None = None

    async def scrape_all(self) -> None:
        replicas = [r for r in self._replicas() if r.state.healthy]
        await asyncio.gather(*(self._scrape(r) for r in replicas))

    async def _scrape(self, replica: Probeable) -> None:
        state = replica.state
        try:
            response = await self._client.get(replica.base_url + "/metrics")
            if response.status_code != 200:
                raise ValueError(f"status {response.status_code}")
            report = parse_vllm_metrics(response.content)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            # Stale signals are worse than none: the policy falls back to its own accounting.
            state.reported_waiting = None
            state.reported_kv_usage = None
            log.debug("scrape of %s failed: %s", state.replica_id, exc)
            return
        self.reports[state.replica_id] = report
        self.scraped_at[state.replica_id] = time.monotonic()
        state.reported_waiting = report.waiting
        state.reported_kv_usage = report.kv_usage
        if report.block_size is not None:
            self._on_block_size(state.replica_id, report.block_size)

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet."""
        self.reports.pop(replica_id, None)
        self.scraped_at.pop(replica_id, None)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-metrics-scrape")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.scrape_all()
            except Exception:  # one bad round must not end scraping for good
                log.exception("metrics scrape round failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()
