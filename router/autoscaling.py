"""The live autoscaler: every ``interval_s``, the pure decision (kvcore/autoscale.py) on the
serving replicas' own queue and KV usage, acted on through the fleet membership.

Up: that many launched replicas started at once (each joins when ready; meanwhile they count
as starting, so the next decisions do not ask again). Down: the serving launched replica with
the least in flight is drained like any other (router/drain.py), except that a replica serving
streams that could not be moved elsewhere is kept, never removed. Nothing is decided while a
rollout runs: both change the fleet, one at a time.

``min`` and ``max`` count every replica in the fleet, listed ones too; only launched replicas
are added or drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvroute.backends.handle import ReplicaHandle
from kvroute.kvcore.autoscale import Autoscaler, AutoscaleSettings, ReplicaSignal

from .membership import DRAINING, SERVING, STARTING, FleetError, FleetMembership

log = logging.getLogger(__name__)

Signals = Callable[[list[ReplicaHandle]], list[ReplicaSignal]]


def scraped_signals(handles: list[ReplicaHandle]) -> list[ReplicaSignal]:
    """What each replica last reported in /metrics (health/scrape.py), unknown counting as idle,
    and the router's own requests in flight there (its dispatch ledger's)."""
    return [
        ReplicaSignal(
            h.state.reported_waiting or 0, h.state.reported_kv_usage or 0.0, h.state.in_flight
        )
        for h in handles
    ]


class AutoscaleLoop:
    def __init__(
        self,
        membership: FleetMembership,
        settings: AutoscaleSettings,
        *,
        drain_timeout_s: float,
        readiness_timeout_s: float,
        busy: Callable[[], bool] = lambda: False,
        on_action: Callable[[str, int], None] = lambda action, n: None,
        signals: Signals = scraped_signals,
    ) -> None:
        self.membership = membership
        self.settings = settings
        self.scaler = Autoscaler(settings)
        self._drain_timeout_s = drain_timeout_s
        self._readiness_timeout_s = readiness_timeout_s
        self._busy = busy  # a rollout is changing the fleet
        self._on_action = on_action
        self._signals = signals
        self._task: asyncio.Task[None] | None = None
        # Its own changes under way, by kind: counted as starting/draining from the moment they
        # are asked for, before the membership knows of them.
        self._changes: dict[asyncio.Task[object], str] = {}
        self.last_decision = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-autoscaler")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._changes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                self.tick(time.monotonic())
            except Exception:  # a bug in one decision must not end autoscaling for good
                log.exception("autoscaler decision failed")

    def serving(self) -> list[ReplicaHandle]:
        membership = self.membership
        return [
            h
            for name, h in membership.core.registry.handles.items()
            if membership.phase(name) == SERVING and h.state.healthy and not h.state.draining
        ]

    def tick(self, now: float) -> int:
        """One decision, acted on in the background; returns it (+N, -1 or 0)."""
        if self._busy():
            return 0
        counts = self.membership.counts()
        mine = list(self._changes.values())
        starting = max(counts[STARTING], mine.count(STARTING))
        draining = max(counts[DRAINING], mine.count(DRAINING))
        serving = self.serving()
        decision = self.scaler.decide(now, self._signals(serving), starting, draining)
        self.last_decision = decision
        if decision > 0:
            log.info("autoscaler: starting %d replicas (%d serving)", decision, len(serving))
            for _ in range(decision):
                self._spawn(self.membership.add_launched(self._readiness_timeout_s), STARTING)
            self._on_action("up", decision)
        elif decision < 0:
            launched = set(self.membership.launched_names())
            candidates = [h for h in serving if h.name in launched]
            if candidates:
                victim = min(candidates, key=lambda h: h.state.in_flight)
                log.info("autoscaler: draining %s (%d serving)", victim.name, len(serving))
                self._spawn(
                    self.membership.remove(victim.name, self._drain_timeout_s, keep_unmovable=True),
                    DRAINING,
                )
                self._on_action("down", 1)
        return decision

    def _spawn(self, change: Coroutine[Any, Any, object], kind: str) -> None:
        task = asyncio.create_task(change)
        self._changes[task] = kind
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[object]) -> None:
        self._changes.pop(task, None)
        with contextlib.suppress(asyncio.CancelledError):
            exc = task.exception()
            if isinstance(exc, FleetError):
                log.warning("autoscaler: %s", exc)
            elif exc is not None:
                log.error("autoscaler: fleet change failed: %r", exc)

    async def settle(self) -> None:
        """Until the changes started so far are done (tests, shutdown)."""
        while self._changes:
            await asyncio.gather(*list(self._changes), return_exceptions=True)
