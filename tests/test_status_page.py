"""The /status page: what a person sees in a real browser while traffic flows and a replica dies,
its data behind the admin key, and its JSON at 200 replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvroute.router.config import config_from_dict
from kvroute.router.runner import app_runner
from kvroute.router.server import Router
from kvroute.router.status import WINDOW_S, _History, _Sample

from .cdp import Browser
from .conftest import StartEmulated, StartReplica, StartRouter, launch_emulated
from .helpers import replica_source, wait_until

ROOT = Path(__file__).parent.parent
KEY = "status-admin-key"
# The README's screenshot: written when missing, or again with KVROUTE_UPDATE_DOCS=1.
DOCS_SCREENSHOT = ROOT / "docs" / "status.png"
# Red as the page's light theme draws a down or ejected replica's badge (--bad).
RED = "rgb(207, 34, 46)"

# Three tenants' long system prompts and short questions: shared prefixes, so caches get hits.
SYSTEMS = [
    f"You are the assistant of tenant {t}. " + "Answer briefly and well. " * 40 for t in "ABC"
]


async def _traffic(url: str, stop: asyncio.Event, sent: list[int], workers: int = 3) -> None:
    """Completions through the real openai client until ``stop``; errors are counted, not
    raised (a replica dies mid-way on purpose)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)

    async def loop(worker: int) -> None:
        i = 0
        while not stop.is_set():
            prompt = SYSTEMS[(worker + i) % len(SYSTEMS)] + f"Question {i}?"
            try:
                await client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
                sent[0] += 1
            except openai.APIError:
                sent[1] += 1
            i += 1

    try:
        await asyncio.gather(*(loop(w) for w in range(workers)))
    finally:
        await client.close()


def _small_png(source: Path, target: Path) -> None:
    """A screenshot small enough to commit: 64 colours are plenty for a page of text."""
    from PIL import Image  # matplotlib's dependency

    with Image.open(source) as image:
        image.convert("RGB").quantize(colors=64).save(target, optimize=True)


def _number(text: str) -> int:
    return int(text.replace(",", "")) if text and text[0].isdigit() else -1


@pytest.mark.browser
async def test_status_page_in_a_browser_shows_traffic_and_a_dead_replica(
    start_emulated: StartEmulated, start_router: StartRouter, tmp_path: Path
) -> None:
    a, b = await start_emulated(), await start_emulated()
    victim_runner, c = await launch_emulated()
    stop = asyncio.Event()
    browser: Browser | None = None
    traffic: asyncio.Task[None] | None = None
    try:
        r = await start_router(
            [replica_source(a, "a"), replica_source(b, "b"), replica_source(c, "c")],
            auth={"admin_api_key": KEY},
            # The emulated replicas' tokenizer: prompts are hashed, so predictions and reuse show.
            routing={"tokenizer": "builtin", "scrape_interval_s": 0.2},
        )
        await wait_until(lambda: r.router.registry.in_rotation() == 3, what="3 replicas up")
        browser = await Browser.launch(tmp_path / "profile")
        await browser.viewport(1100, 900)
        await browser.send(
            "Emulation.setEmulatedMedia",
            features=[{"name": "prefers-color-scheme", "value": "light"}],
        )
        await browser.goto(f"{r.url}/status?key={KEY}")
        # The key went into a header, and out of the address bar.
        await browser.wait_for(
            "document.querySelectorAll('[data-status=\"up\"]').length === 3",
            what="three replica cards marked up",
        )
        assert await browser.evaluate("location.search") == ""
        assert "live" in await browser.evaluate("document.getElementById('live').textContent")
        badges = await browser.evaluate(
            "[...document.querySelectorAll('.card .badge')].map(e => e.textContent)"
        )
        assert badges == ["✔ UP"] * 3

        sent = [0, 0]
        traffic = asyncio.create_task(_traffic(r.url, stop, sent))
        requests_js = "document.getElementById('requests').textContent"
        await browser.wait_for(
            f"parseInt({requests_js}.replace(/,/g, '')) >= 10", what="the request counter to move"
        )
        await browser.wait_for(
            "document.querySelectorAll('#decisions tr td[data-label=\"replica\"]').length >= 5",
            what="recent routing decisions listed",
        )
        # The replicas' own prefix-cache hit rate, scraped from their /metrics, shows up.
        await browser.wait_for(
            "[...document.querySelectorAll('.card .hit-rate')].some(e => e.textContent.endsWith('%'))",
            what="a replica's hit rate",
        )

        await victim_runner.cleanup()  # replica c dies: its port refuses connections
        dead = "document.querySelector('[data-replica=\"c\"]')"
        status = await browser.wait_for(
            f"['down', 'ejected'].includes({dead}.dataset.status) && {dead}.dataset.status",
            timeout_s=15,
            what="replica c's card to turn down or ejected",
        )
        badge = await browser.evaluate(f"{dead}.querySelector('.badge').textContent")
        assert badge == {"down": "✖ DOWN", "ejected": "✖ EJECTED"}[status]
        colour = await browser.evaluate(
            f"getComputedStyle({dead}.querySelector('.badge')).backgroundColor"
        )
        assert colour == RED
        assert await browser.evaluate(f"{dead}.querySelector('.why').textContent")
        rotation = "document.getElementById('rotation').textContent"
        await browser.wait_for(f"{rotation} === '2 / 3'", what="2 of 3 replicas in rotation")
        # Traffic goes on through the other two, and the counters keep moving.
        at_kill = _number(await browser.evaluate(requests_js))
        await browser.wait_for(
            f"parseInt({requests_js}.replace(/,/g, '')) > {at_kill + 5}",
            what="the request counter to move after the kill",
        )
        await browser.screenshot(tmp_path / "status.png")
        if not DOCS_SCREENSHOT.exists() or os.environ.get("KVROUTE_UPDATE_DOCS") == "1":
            _small_png(await browser.screenshot(tmp_path / "docs.png"), DOCS_SCREENSHOT)

        # A phone: one column of cards, nothing wider than the screen.
        await browser.viewport(390, 844, mobile=True)
        await browser.wait_for(
            "new Set([...document.querySelectorAll('.card')].map(e => e.offsetLeft)).size === 1",
            what="one column of cards on a phone",
        )
        width = await browser.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the page is {width}px wide on a 390px phone"
        await browser.screenshot(tmp_path / "status-phone.png")
        assert sent[0] > 0
    finally:
        stop.set()
        if traffic is not None:
            await traffic
        if browser is not None:
            await browser.close()
        await victim_runner.cleanup()


@pytest.mark.browser
async def test_status_page_asks_for_the_admin_key(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router([a], auth={"admin_api_key": KEY})
    browser = await Browser.launch(tmp_path / "profile")
    try:
        await browser.goto(r.url + "/status", wait_load=False)
        assert "admin key" in await browser.answer_dialog(KEY)
        card = "document.querySelector('[data-replica=\"a\"]')"
        await browser.wait_for(f"{card} && {card}.dataset.status === 'up'", what="replica a up")
        # Kept for the tab: a reload asks no more.
        await browser.goto(r.url + "/status")
        await browser.wait_for(f"{card} && {card}.dataset.status === 'up'", what="replica a up")
    finally:
        await browser.close()


@pytest.mark.browser
async def test_status_page_renders_200_replicas(start_router: StartRouter, tmp_path: Path) -> None:
    """The page at the fleet size the README promises (< 1 s, measured by hand, not here)."""
    replicas = [{"url": "http://127.0.0.1:9", "name": f"replica-{i:03d}"} for i in range(200)]
    r = await start_router(replicas, health={"interval_s": 30.0})
    browser = await Browser.launch(tmp_path / "profile")
    try:
        await browser.goto(r.url + "/status")
        await browser.wait_for(
            "document.querySelectorAll('.card').length === 200", what="200 replica cards"
        )
        assert await browser.evaluate("document.getElementById('rotation').textContent") == (
            "0 / 200"
        )
    finally:
        await browser.close()


async def test_status_json_lists_200_replicas() -> None:
    replicas = [{"url": f"http://10.0.{i // 250}.{i % 250}:8000"} for i in range(200)]
    router = Router(config_from_dict({"replicas": replicas}))
    status = json.loads(router.status.json())
    assert len(status["replicas"]) == 200
    assert len({row["name"] for row in status["replicas"]}) == 200
    row = status["replicas"][0]
    assert row["status"] == "down" and row["why"] == "no passing health check yet"
    assert status["fleet"]["replicas"] == 200 and status["fleet"]["in_rotation"] == 0
    checks = {"drift": "off (canary.enabled: false)", "parity": "not checked yet", "alarm": False}
    assert status["checks"] == checks
    assert status["decisions"] == []


async def test_status_data_needs_the_admin_key(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], auth={"admin_api_key": KEY})
    # Closed when done: an SDK client left open can break a later test's sockets (conftest.py).
    async with openai.AsyncOpenAI(
        base_url=r.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        await client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/status") as resp:  # the page holds no data: open
            assert resp.status == 200
            assert resp.content_type == "text/html"
            assert "kvroute status" in await resp.text()
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with http.get(r.url + "/status/events", headers=headers) as resp:
                assert resp.status == 401
        bearer = {"Authorization": f"Bearer {KEY}"}
        async with http.get(r.url + "/status/events", headers=bearer) as resp:
            assert resp.status == 200
            status = await resp.json()
        assert [row["name"] for row in status["replicas"]] == ["a"]
        (decision,) = status["decisions"]
        assert decision["replica"] == "a" and decision["model"] == "tiny"
        assert decision["prompt_tokens"] > 0 and decision["state"] == "done"
        assert status["fleet"]["requests"] == 1
        sse = {**bearer, "Accept": "text/event-stream"}
        async with http.get(r.url + "/status/events", headers=sse) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            line = await resp.content.readline()
        assert line.startswith(b"data: ")
        assert json.loads(line[6:])["replicas"][0]["name"] == "a"


async def test_status_data_without_an_admin_key_is_for_loopback_only(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http, http.get(r.url + "/status/events") as resp:
        assert resp.status == 200  # this test's client is on 127.0.0.1
    transport = mock.Mock()
    transport.get_extra_info.return_value = ("10.1.2.3", 40000)
    remote = make_mocked_request("GET", "/status/events", transport=transport)
    answer = await r.router.handle_status_events(remote)
    assert answer.status == 403


async def test_open_status_streams_end_when_the_router_stops(
    start_replica: StartReplica,
) -> None:
    """A page left open must not hold the router's shutdown for its whole drain timeout."""
    a = await start_replica("a")
    config: dict[str, Any] = {
        "replicas": [{"url": a.url, "name": "a"}],
        "shutdown": {"drain_timeout_s": 60.0},
    }
    runner = app_runner(Router(config_from_dict(config)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as http:
        headers = {"Accept": "text/event-stream"}
        async with http.get(f"http://127.0.0.1:{port}/status/events", headers=headers) as resp:
            assert (await resp.content.readline()).startswith(b"data: ")
            started = time.monotonic()
            async with asyncio.timeout(10):
                await runner.cleanup()
            assert time.monotonic() - started < 5
            with contextlib.suppress(aiohttp.ClientPayloadError):
                rest = await resp.content.read()
                assert rest.count(b"data: ") <= 5


def test_windows_need_a_minute_of_samples_else_say_since_start() -> None:
    start = _Sample(0.0, {})
    history = _History(start)
    assert history.baseline(100.0) is start  # a young router: since start is the window
    history.add(_Sample(400.0, {}))
    assert history.baseline(400.0) is start  # a page opened after a quiet spell
    history.add(_Sample(470.0, {}))
    assert history.baseline(470.0).at == 400.0  # a minute later: the last minute and more
    history.add(_Sample(400.0 + WINDOW_S + 20, {}))
    assert history.baseline(400.0 + WINDOW_S + 20).at == 470.0  # never older than the window
