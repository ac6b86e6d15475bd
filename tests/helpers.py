"""Small helpers for tests: polling with a deadline instead of sleeping."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail the test with ``what`` if it does not in time."""
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


def traces_dir() -> Path:
    """Where the public traces are: $KVROUTE_TRACES, else ../shared/traces beside the checkout,
    else /work/shared/traces (a clone elsewhere on the dev machines); the first that exists."""
    repo = Path(__file__).resolve().parents[1]
    candidates = [repo.parent / "shared" / "traces", Path("/work/shared/traces")]
    if os.environ.get("KVROUTE_TRACES"):
        candidates.insert(0, Path(os.environ["KVROUTE_TRACES"]))
    return next((c for c in candidates if c.is_dir()), candidates[0])
