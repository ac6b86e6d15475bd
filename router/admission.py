"""Admission control: at most N requests at once, a bounded queue, 429 beyond it."""

from __future__ import annotations

import asyncio
from collections import deque

from . import errors


class Admission:
    """``limit`` requests in service at once (0: no limit); ``queue`` more may wait for a slot."""

    def __init__(self, limit: int, queue: int, queue_timeout_s: float) -> None:
        self.limit = limit
        self.queue = queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if there is room; ApiError 429 otherwise."""
        if not self.limit or (self.active < self.limit and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= self.queue:
            raise errors.too_many_requests(self.limit, self._retry_after_s())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot just as it gave up: pass the slot on
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise errors.too_many_requests(self.limit, self._retry_after_s()) from None
            raise
        # The releasing request handed its slot over: ``active`` already counts this one.

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # hand the slot over
                return
        self.active -= 1

    def _retry_after_s(self) -> int:
        # Slots turn over as fast as requests finish; a second is a fair wait to suggest.
        return 1
