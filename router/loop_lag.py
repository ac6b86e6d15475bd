"""How late the event loop runs a timer: the router's own stall meter.

Every ``interval_s`` a timer is due; the lag is how much later than due the loop ran it. One
callback handle, rescheduled from itself (no task, no allocation beyond the handle), so the
meter costs a few microseconds every tenth of a second. A lag of 50 ms means every stream the
router relays waited up to 50 ms for its next chunk.
"""

from __future__ import annotations

import asyncio

from .metrics import Histogram

INTERVAL_S = 0.1


class LoopLagMonitor:
    def __init__(self, histogram: Histogram, interval_s: float = INTERVAL_S) -> None:
        self.histogram = histogram
        self.interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        # loop.time() is read fresh, not the loop iteration's start: callbacks that ran before
        # this one in the same iteration count as lag. uvloop's clock ticks in whole ms, so a
        # timer may run a fraction of a millisecond early: that is no lag.
        self.histogram.observe(max(0.0, self._loop.time() - self._due))
        self._schedule()
