"""Small helpers for tests: polling with a deadline instead of sleeping."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 15.0, what: str = ""
) -> None:
    """Poll ``predicate`` until it holds; fail the test with ``what`` if it does not in time.
    The default is generous: a loaded CI box stalls probes, sockets and NATS for seconds, and
    a wait that ends when its predicate holds costs nothing more when the test passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        await asyncio.sleep(0.01)


def wait_until_sync(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """``wait_until`` for tests without an event loop."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat fields after the command name (state, ppid, pgrp, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int | None) -> bool:
    fields = _stat_fields(pid) if pid is not None else None
    return fields is not None and fields[0] != "Z"


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and (f := _stat_fields(entry)) and f[0] != "Z" and int(f[1]) == pid
    ]


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and (f := _stat_fields(entry)) and f[0] != "Z" and int(f[2]) == pgid
    ]


DATA = Path(__file__).parent / "data"  # small excerpts of the public traces (see its README)
MOONCAKE = DATA / "mooncake_conversation_600.jsonl"
AZURE_CODE = DATA / "azure2023_code_1000.csv"
AZURE_CONV = DATA / "azure2023_conv_1000.csv"
CLAUDE_CODE = DATA / "claude_code_sessions_10.tar.xz"


def full_traces_dir() -> Path | None:
    """$KVROUTE_TRACES: where the whole public traces are, for the few tests that check figures
    published for the full files; None when unset (those tests then skip, saying why)."""
    value = os.environ.get("KVROUTE_TRACES")
    return Path(value) if value else None


def replica_source(running: Any, name: str, events: bool = True) -> dict[str, Any]:
    """A router config's replica entry for an emulated replica (conftest's ``Running``), with
    its KV-event and replay endpoints unless ``events`` is False."""
    entry: dict[str, Any] = {"url": running.url, "name": name}
    if events:
        entry |= {"kv_events": running.events, "kv_replay": running.replay}
    return entry


async def serve_app(app: Any, **runner_options: Any) -> tuple[Any, int]:
    """``app`` (an aiohttp Application) serving on a free loopback port: its runner (the caller
    cleans it up) and the port."""
    from aiohttp import web

    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def serve_router(router: Any) -> tuple[Any, str]:
    """``router`` (a ``Router``) serving on a free loopback port: its aiohttp runner (the caller
    cleans it up) and its URL."""
    runner, port = await serve_app(router.build_app(), handler_cancellation=True)
    return runner, f"http://127.0.0.1:{port}"


async def budget_buses_connected(*routers: Any) -> None:
    """Until each in-process router's budget bus (tenants.budget_bus) is connected to NATS."""
    for r in routers:
        bus = r.router._budget_bus
        assert bus is not None
        await wait_until(lambda bus=bus: bus.connected, what="the budget bus connected")


async def reset_prefix_cache(url: str, timeout_s: float = 60.0) -> None:
    """Empty a real vLLM replica's prefix cache. vLLM answers ``{"success": false}`` while any
    block is held (a request an earlier test abandoned may still be decoding): retry until
    it succeeds, or fail the test, so a test never starts with the last test's blocks cached
    (vLLM publishes no BlockStored for a block it already holds)."""
    import httpx

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            response = await http.post(url + "/reset_prefix_cache")
            assert response.status_code == 200, response.text
            if response.json().get("success"):
                return
            if loop.time() > deadline:
                raise AssertionError(f"{url} did not reset its prefix cache in {timeout_s:g} s")
            await asyncio.sleep(0.2)
