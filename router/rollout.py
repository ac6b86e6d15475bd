"""A rolling upgrade of the launched replicas: each one drained, stopped, started again with the
new arguments, checked, and back in rotation before the next (``max_unavailable`` at a time).

Driven by ``POST /admin/rollout`` (router/fleet_admin.py); its progress is the ``rollout``
object of ``/admin/replicas``. Pause lets the replicas being replaced finish their step and
starts no more until resumed; abort does the same and ends the rollout, leaving the replicas
replaced so far on the new arguments (the fleet's own arguments, for replicas added later,
change only when a rollout completes). A step that fails (the new process does not start, or
is not ready in time, or the drift canary finds it differs) fails the rollout: nothing more is
replaced, and the error says which replica and why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvroute.backends.launcher import LaunchSpec

from .membership import FleetError, FleetMembership

log = logging.getLogger(__name__)

RUNNING, PAUSED, ABORTED, DONE, FAILED = "running", "paused", "aborted", "done", "failed"


@dataclass(frozen=True)
class RolloutPlan:
    pool: str  # whose launched replicas it replaces
    spec: LaunchSpec  # what every replica runs afterwards
    max_unavailable: int
    drain_timeout_s: float
    readiness_timeout_s: float


@dataclass
class Rollout:
    plan: RolloutPlan
    targets: list[str]
    state: str = RUNNING
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    current: list[str] = field(default_factory=list)
    replaced: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    @property
    def active(self) -> bool:
        return self.state in (RUNNING, PAUSED)

    def start(self, membership: FleetMembership) -> None:
        self._task = asyncio.create_task(self._run(membership), name="kvroute-rollout")

    def pause(self) -> None:
        if self.state == RUNNING:
            self.state = PAUSED
            log.info("rollout paused (%d of %d replaced)", len(self.replaced), len(self.targets))

    def resume(self) -> None:
        if self.state == PAUSED:
            self.state = RUNNING
            self._wake.set()
            log.info("rollout resumed")

    def abort(self) -> None:
        if self.active:
            self.state = ABORTED
            self._wake.set()
            log.info("rollout aborted (%d of %d replaced)", len(self.replaced), len(self.targets))

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def close(self) -> None:
        """At shutdown: a step in progress is cancelled (the launcher stops what it started)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, membership: FleetMembership) -> None:
        pending = deque(self.targets)
        steps: dict[asyncio.Task[None], str] = {}
        plan = self.plan
        while pending or steps:
            while pending and len(steps) < plan.max_unavailable and self.state == RUNNING:
                name = pending.popleft()
                self.current.append(name)
                steps[asyncio.create_task(self._step(membership, name))] = name
            if not steps:
                if self.state in (ABORTED, FAILED):
                    break
                self._wake.clear()
                await self._wake.wait()  # paused: until resumed or aborted
                continue
            done, _ = await asyncio.wait(steps, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                name = steps.pop(task)
                self.current.remove(name)
                exc = task.exception()
                if exc is not None:
                    self.state = FAILED
                    self.error = str(exc) if isinstance(exc, FleetError) else repr(exc)
                    log.error("rollout failed at replica %s: %s", name, self.error)
        if self.state == RUNNING:
            self.state = DONE
            membership.fleets[plan.pool].spec = plan.spec  # replicas added later run it too
        self.finished_at = time.time()
        log.info("rollout %s: %d of %d replaced", self.state, len(self.replaced), len(self.targets))

    async def _step(self, membership: FleetMembership, name: str) -> None:
        plan = self.plan
        result = await membership.replace(
            name, plan.spec, plan.drain_timeout_s, plan.readiness_timeout_s
        )
        self.replaced.append(
            {
                "name": name,
                "seconds": round(result.seconds, 3),
                "drain_s": round(result.drain.seconds, 3),
                "start_s": round(result.start_s, 3),
                "finished": result.drain.finished,
                "moved": result.drain.moved,
                "lost": result.drain.lost,
                "pid": result.pid,
            }
        )
        log.info(
            "rollout: replica %s replaced in %.1fs (%d streams moved)",
            name,
            result.seconds,
            result.drain.moved,
        )

    def progress(self) -> dict[str, Any]:
        done = {r["name"] for r in self.replaced}
        return {
            "state": self.state,
            "pool": self.plan.pool,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "targets": self.targets,
            "replaced": self.replaced,
            "current": list(self.current),
            "remaining": [n for n in self.targets if n not in done and n not in self.current],
            "error": self.error,
            "args": list(self.plan.spec.extra_args),
            "model_path": self.plan.spec.model_path,
            "max_unavailable": self.plan.max_unavailable,
        }


def new_spec(spec: LaunchSpec, args: list[str] | None, model_path: str | None) -> LaunchSpec:
    """The fleet's launch spec with the rollout's new arguments and model."""
    changes: dict[str, Any] = {}
    if args is not None:
        changes["extra_args"] = tuple(args)
    if model_path is not None:
        changes["model_path"] = model_path
    return dataclasses.replace(spec, **changes)
