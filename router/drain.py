"""Take one replica out of service without losing a request: the one drain procedure that a
rollout, ``DELETE /admin/replicas`` and the autoscaler share.

1. Out of new routing: ``ReplicaState.draining`` (policies and retries skip it) and its blocks
   forgotten in the prefix index (nothing prefers it for its cache any more).
2. What it is serving gets up to ``timeout_s`` to finish there.
3. What is still open is cut in a way the router recovers from (``UpstreamClient.cut_movable``):
   a stream resumes on another replica from the text already sent, a whole answer not yet
   started is retried. The client sees one complete answer.
4. A request that could not be moved (a stream that cannot be resumed: n > 1, structured
   output, resumes used up) either ends with the replica (``keep_unmovable`` False: a rollout,
   an admin's DELETE) or keeps the replica in rotation (True: the autoscaler never removes a
   replica with streams it could not move).

Stopping the process or unregistering the replica is the caller's next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.backends.handle import ReplicaHandle

from .upstream_client import UpstreamClient

log = logging.getLogger(__name__)

POLL_S = 0.05
# After the cut, how long the cut requests get to leave the replica's books (they move at once;
# this only bounds a request caught between connecting and sending).
CUT_SETTLE_S = 5.0


@dataclass
class DrainReport:
    name: str
    seconds: float = 0.0
    finished: int = 0  # in flight when the drain began and finished on the replica
    moved: int = 0  # cut and continued on another replica
    lost: int = 0  # still open when the replica went: ended with it
    kept: bool = False  # not drained: it had requests that could not be moved (keep_unmovable)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "seconds": round(self.seconds, 3),
            "finished": self.finished,
            "moved": self.moved,
            "lost": self.lost,
            "kept": self.kept,
        }


class Drainer:
    def __init__(
        self,
        clear_cached: Callable[[str], None],
        client: Callable[[], UpstreamClient | None],
        poll_s: float = POLL_S,
    ) -> None:
        self._clear_cached = clear_cached  # out of its pool's prefix index
        self._client = client  # opened with the app, so asked for each time
        self._poll_s = poll_s

    async def drain(
        self, handle: ReplicaHandle, timeout_s: float, *, keep_unmovable: bool = False
    ) -> DrainReport:
        state = handle.state
        started = time.monotonic()
        report = DrainReport(handle.name)
        state.draining = True
        self._clear_cached(handle.name)
        at_start = state.in_flight
        deadline = started + timeout_s
        while state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(self._poll_s)
        client = self._client()
        if state.in_flight > 0 and client is not None:
            if keep_unmovable and client.unmovable(handle.base_url):
                state.draining = False  # back in rotation: its cache refills from its events
                report.kept = True
                report.seconds = time.monotonic() - started
                log.info("replica %s kept: it serves streams that could not be moved", handle.name)
                return report
            report.moved = await self._cut(handle, client)
        report.lost = state.in_flight
        report.finished = max(0, at_start - report.moved - report.lost)
        report.seconds = time.monotonic() - started
        log.info(
            "replica %s drained in %.1fs: %d finished, %d moved elsewhere, %d lost",
            handle.name,
            report.seconds,
            report.finished,
            report.moved,
            report.lost,
        )
        return report

    async def _cut(self, handle: ReplicaHandle, client: UpstreamClient) -> int:
        """Cut what can move, again while requests are still arriving at the replica's pool
        (one dispatched a moment before the drain may still be connecting)."""
        moved = 0
        settle = time.monotonic() + CUT_SETTLE_S
        state = handle.state
        while True:
            cut, left = client.cut_movable(handle.base_url, f"replica {handle.name} is draining")
            moved += cut
            if state.in_flight <= left or time.monotonic() >= settle:
                return moved
            await asyncio.sleep(self._poll_s)
