"""Small helpers for tests: polling with a deadline instead of sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail the test with ``what`` if it does not in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        await asyncio.sleep(0.01)
