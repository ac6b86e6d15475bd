"""Who is in the fleet, changed while the router serves: replicas added (a static URL, or one
more launched process), removed through the drain (router/drain.py), and replaced with new
arguments (one step of a rollout, router/rollout.py).

The one place that pairs the launcher's processes (``LaunchedFleet``) with the routing core's
replicas (``RoutingCore.add_replica``/``remove_replica``: registry, probes, KV-event
subscribers, index), and that says what each replica is doing: serving, starting or draining.
The launcher is blocking; its calls run in a thread.

A replica joins when its own health check passes (the launcher waits for it), then the router
probes it at once (models, adapters); with the drift canary on, it stays out of new routing
until the canary has checked it and found no drift.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.backends.handle import ReplicaHandle
from kvroute.backends.launcher import LaunchedFleet, LaunchedReplica, LaunchSpec
from kvroute.backends.process import LaunchError
from kvroute.health.drift import DRIFT, ERROR

from .config import (
    ConfigError,
    ReplicaConfig,
    check_replica_url,
    replica_name_from_url,
    replica_problems,
)
from .core import RoutingCore
from .dp_ranks import expand_ranks, replica_of
from .drain import Drainer, DrainReport

log = logging.getLogger(__name__)

POLL_S = 0.05
# Grace for a drained replica's process to exit on SIGTERM before it is killed.
STOP_GRACE_S = 10.0

STARTING, DRAINING, SERVING = "starting", "draining", "serving"


class FleetError(Exception):
    """A fleet change that cannot be made; ``status`` is the HTTP status the admin API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Replaced:
    """One replica replaced: the drain, and the new process's start up to readiness."""

    drain: DrainReport
    start_s: float
    pid: int | None

    @property
    def seconds(self) -> float:
        return self.drain.seconds + self.start_s


def _merged(name: str, reports: Sequence[DrainReport]) -> DrainReport:
    """One report for a replica drained rank by rank."""
    if len(reports) == 1:
        return reports[0]
    return DrainReport(
        name,
        max(r.seconds for r in reports),
        sum(r.finished for r in reports),
        sum(r.moved for r in reports),
        sum(r.lost for r in reports),
        any(r.kept for r in reports),
    )


class FleetMembership:
    def __init__(
        self,
        core: RoutingCore,
        drainer: Drainer,
        launched: LaunchedFleet | None,
        *,
        workers: int = 1,
        pool_fleets: Sequence[LaunchedFleet] = (),
    ) -> None:
        self.core = core
        self.drainer = drainer
        # Each pool's launched replicas, by pool name: a config without pools has one pool
        # (``launched``), a config with pools a fleet per pool with launch: (``pool_fleets``,
        # whose replicas' names start with their pool's).
        self.fleets: dict[str, LaunchedFleet] = {}
        if launched is not None:
            self.fleets[core.pools.sole.name] = launched
        for fleet in pool_fleets:
            self.fleets[fleet.spec.name_prefix.removesuffix("-")] = fleet
        self._workers = workers
        # Replicas not serving: name -> STARTING or DRAINING (names being started may not be
        # in the registry yet).
        self.phases: dict[str, str] = {}
        # Launcher slots being (re)started, per pool.
        self._slots_busy: dict[str, set[int]] = {name: set() for name in self.fleets}
        self.on_drained: Callable[[DrainReport], None] = lambda report: None  # metrics

    # -- what the fleet is doing --------------------------------------------------------

    def phase(self, name: str) -> str:
        return self.phases.get(name, SERVING)

    def counts(self) -> dict[str, int]:
        """Replicas serving, starting and draining (the kvroute_fleet_replicas gauge)."""
        out = {SERVING: 0, STARTING: 0, DRAINING: 0}
        for name in self.core.registry.handles:
            out[self.phase(name)] += 1
        out[STARTING] += sum(
            1
            for n, p in self.phases.items()
            if p == STARTING and n not in self.core.registry.handles
        )
        return out

    def check_changeable(self) -> None:
        """Refuse fleet changes this router cannot make (409), saying why."""
        if self._workers > 1:
            raise FleetError(
                409,
                "fleet changes need listen.workers: 1: each worker process keeps its own view of "
                "the fleet, and only one may own the launched replicas",
            )

    @property
    def launched(self) -> LaunchedFleet | None:
        """The launched fleet of a router with one (the autoscaler's); None otherwise."""
        return next(iter(self.fleets.values())) if len(self.fleets) == 1 else None

    def launched_pool(self, pool: str | None) -> str:
        """The pool whose launched replicas a launch or rollout acts on: ``pool``, or the only
        one that launched any. Refused (400/409) saying why otherwise."""
        self.check_changeable()
        names = ", ".join(self.fleets)
        if pool is None:
            if len(self.fleets) == 1:
                return next(iter(self.fleets))
            if not self.fleets:
                raise FleetError(
                    409,
                    "this router launched no replicas (no launch: in its config): it can only "
                    'register static replicas ({"url": ...}) and remove replicas',
                )
            raise FleetError(
                400, f"pool: this router launched replicas in several pools ({names}): say which"
            )
        if self.core.pools.named(pool) is None:
            known = ", ".join(p.name for p in self.core.pools)
            raise FleetError(400, f"pool: no model pool named {pool!r} (pools: {known})")
        if pool not in self.fleets:
            raise FleetError(
                409,
                f"pool {pool} launched no replicas (no launch: in its config); pools that did: "
                f"{names or 'none'}",
            )
        return pool

    # -- adding ---------------------------------------------------------------------------

    async def add_static(self, replica: ReplicaConfig, pool: str | None = None) -> ReplicaHandle:
        """Register a replica by URL in model pool ``pool`` (needed when there are several);
        it joins rotation on its first passing probe."""
        self.check_changeable()
        pools = self.core.pools
        names = ", ".join(p.name for p in pools)
        if pool is None and len(pools) > 1:
            raise FleetError(
                400, f"pool: this router serves {len(pools)} model pools ({names}): say which"
            )
        if pool is not None and pools.named(pool) is None:
            raise FleetError(400, f"pool: no model pool named {pool!r} (pools: {names})")
        try:
            check_replica_url(replica.url, "url")
        except ConfigError as exc:
            raise FleetError(400, "; ".join(exc.problems)) from None
        for key, endpoint in (("kv_events", replica.kv_events), ("kv_replay", replica.kv_replay)):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise FleetError(
                    400, f"{key}: a ZMQ endpoint, tcp://HOST:PORT or ipc://PATH, got {endpoint!r}"
                )
        if replica.kv_replay is not None and replica.kv_events is None:
            raise FleetError(400, "kv_replay: needs kv_events (the replay of which events?)")
        problems = replica_problems(replica, "body")
        if problems:
            raise FleetError(400, "; ".join(p.removeprefix("body.") for p in problems))
        name = replica.name or replica_name_from_url(replica.url)
        if not name.strip():
            raise FleetError(400, "name: must not be empty")
        taken = {replica_of(n) for n in self.core.registry.handles} | set(self.phases)
        if name in taken:
            raise FleetError(409, f"a replica named {name!r} is already in the fleet")
        await self.core.add_replica(replica, ready=False, pool=pool)
        await self.core.prober.probe_all()
        log.info("replica %s (%s) registered by an admin", name, replica.url)
        # A data-parallel replica joins as its ranks: rank 0 stands for it.
        return self.core.registry.handles[expand_ranks([replica])[0].name or name]

    async def add_launched(
        self, readiness_timeout_s: float, pool: str | None = None
    ) -> ReplicaHandle:
        """Start one more of ``pool``'s launched replicas (its fleet's arguments) and bring it
        into rotation."""
        pool = self.launched_pool(pool)
        slot = self._reserve_slot(pool)
        try:
            handle, _ = await self._start_and_join(pool, slot, None, readiness_timeout_s)
            return handle
        finally:
            self._slots_busy[pool].discard(slot)

    def _reserve_slot(self, pool: str) -> int:
        taken = {r.slot for r in self.fleets[pool].replicas} | self._slots_busy[pool]
        slot = next(i for i in range(len(taken) + 1) if i not in taken)
        self._slots_busy[pool].add(slot)
        return slot

    async def _start_and_join(
        self,
        pool: str,
        slot: int,
        spec: LaunchSpec | None,
        readiness_timeout_s: float,
    ) -> tuple[ReplicaHandle, LaunchedReplica]:
        launched = self.fleets[pool]
        deadline = time.monotonic() + readiness_timeout_s
        name = (spec or launched.spec).replica_name(slot)
        self.phases[name] = STARTING
        try:
            try:
                # The readiness timeout bounds the start too (a model still loading), not
                # the launch's startup timeout: a rollout may allow more time, or less.
                replica = await asyncio.to_thread(
                    launched.start_replica, slot, spec, max(0.0, deadline - time.monotonic())
                )
            except LaunchError as exc:
                if time.monotonic() >= deadline:
                    raise FleetError(
                        504,
                        f"replica {name} was not ready within readiness_timeout_s "
                        f"{readiness_timeout_s:g}s: {exc}",
                    ) from None
                raise FleetError(502, f"replica {name} did not start: {exc}") from None
            try:
                handle = await self._join(replica, deadline, pool)
            except FleetError:
                await self.core.remove_replica(replica.name)
                await asyncio.to_thread(launched.stop_replica, replica.name, STOP_GRACE_S)
                raise
        finally:
            self.phases.pop(name, None)
        return handle, replica

    async def _join(self, replica: LaunchedReplica, deadline: float, pool: str) -> ReplicaHandle:
        """Into the core's fleet; in rotation once probed (and checked by the canary, if on)."""
        joined_at = time.time()
        config = ReplicaConfig(
            url=replica.url,
            name=replica.name,
            kv_events=replica.kv_events,
            kv_replay=replica.kv_replay,
            data_parallel_size=replica.data_parallel_size,
            speed=replica.speed,
        )
        await self.core.add_replica(config, ready=False, pool=pool)
        # A data-parallel replica joins as its ranks, all at once; rank 0 stands for the
        # process (the canary asks its URL, whichever rank vLLM picks).
        ranks = self.ranks_of(replica.name)
        handle = ranks[0]
        gated = self.core.canary is not None
        for rank in ranks:
            rank.state.draining = gated  # out of new routing until the canary has seen it
        await self.core.prober.probe_all()
        while not all(rank.state.healthy for rank in ranks):
            if time.monotonic() >= deadline:
                raise FleetError(
                    504, f"replica {replica.name} did not pass its health probe in time"
                )
            await asyncio.sleep(POLL_S)
        if gated:
            await self._canary_passed(handle, joined_at, deadline)
            for rank in ranks:
                rank.state.draining = False
        log.info("replica %s (%s) is in rotation", replica.name, replica.url)
        return handle

    async def _canary_passed(self, handle: ReplicaHandle, since: float, deadline: float) -> None:
        drift = handle.drift
        while True:
            checked = drift.checked_at is not None and drift.checked_at >= since
            if checked and drift.last_result not in (None, ERROR):
                if drift.last_result == DRIFT or drift.quarantined:
                    where = drift.quarantine or drift.last_divergence
                    detail = (
                        f": on {where.prompt!r} its output token {where.position} is "
                        f"{list(where.got[:1])} where the {where.reference} has "
                        f"{list(where.expected[:1])}"
                        if where is not None
                        else ""
                    )
                    raise FleetError(
                        502,
                        f"replica {handle.name}: the drift canary finds its output differs from "
                        f"the fleet's{detail}",
                    )
                return
            if time.monotonic() >= deadline:
                raise FleetError(504, f"replica {handle.name}: no drift canary verdict in time")
            await asyncio.sleep(POLL_S)

    # -- removing and replacing -----------------------------------------------------------

    def handle(self, name: str) -> ReplicaHandle:
        handle = self.core.registry.handles.get(name)
        if handle is None:
            raise FleetError(404, f"no replica named {name!r}")
        return handle

    async def remove(
        self, name: str, drain_timeout_s: float, *, keep_unmovable: bool = False
    ) -> DrainReport:
        """Drain ``name``, then unregister it and stop its process if the router launched it.
        With ``keep_unmovable``, a replica serving streams that cannot move stays (report.kept).
        A data-parallel replica (``name`` without ``@dpK``) drains all its ranks at once."""
        self.check_changeable()
        ranks = self.ranks_of(name)
        if name in self.phases:
            raise FleetError(409, f"replica {name} is already {self.phases[name]}")
        owner = self.core.pools.of_replica(ranks[0].name)
        leaving = {h.name for h in ranks}
        others = [
            h
            for n, h in self.core.registry.handles.items()
            if n not in leaving
            and self.core.pools.of_replica(n) is owner
            and self.core.registry.may_take(h, time.monotonic())
        ]
        if not others:
            where = f" of model pool {owner.name}" if len(self.core.pools) > 1 and owner else ""
            raise FleetError(409, f"removing {name} would leave no replica{where} in rotation")
        self.phases[name] = DRAINING
        try:
            reports = await asyncio.gather(
                *(
                    self.drainer.drain(h, drain_timeout_s, keep_unmovable=keep_unmovable)
                    for h in ranks
                )
            )
            report = _merged(name, reports)
            self.on_drained(report)
            if report.kept:
                for handle in ranks:
                    handle.state.draining = False
                return report
            await self._stop(name)
        finally:
            self.phases.pop(name, None)
        return report

    def ranks_of(self, name: str) -> list[ReplicaHandle]:
        """``name``'s handle, or a data-parallel replica's ranks' (404 when none)."""
        handles = self.core.registry.handles
        if name in handles:
            return [handles[name]]
        ranks = [h for n, h in handles.items() if replica_of(n) == name]
        if not ranks:
            raise FleetError(404, f"no replica named {name!r}")
        return ranks

    async def _stop(self, name: str) -> LaunchedReplica | None:
        """Out of the core's fleet, and its process stopped when launched here."""
        await self.core.remove_replica(name)
        pool = self._launched_by(name)
        if pool is None:
            return None
        return await asyncio.to_thread(self.fleets[pool].stop_replica, name, STOP_GRACE_S)

    def _launched_by(self, name: str) -> str | None:
        """The pool whose launched fleet runs ``name`` (None: not launched here)."""
        return next(
            (p for p, f in self.fleets.items() if any(r.name == name for r in f.replicas)), None
        )

    def in_rotation(self, pool: str) -> int:
        """Replicas of ``pool`` taking traffic now."""
        now = time.monotonic()
        registry = self.core.registry
        members = self.core.pools.named(pool)
        return sum(
            1
            for name, handle in registry.handles.items()
            if members is not None and name in members.members and registry.may_take(handle, now)
        )

    def launched_names(self, pool: str | None = None) -> list[str]:
        """``pool``'s launched replicas (None: the only launched fleet's, if any)."""
        fleet = self.fleets.get(pool) if pool is not None else self.launched
        return [r.name for r in fleet.replicas] if fleet is not None else []

    async def _roll_back(self, pool: str, slot: int, name: str, readiness_timeout_s: float) -> str:
        """A replacement that failed (did not start, not ready, or drifting): start the slot
        again on the fleet's own arguments, so a failed step costs no capacity. Says how that
        went, for the step's error."""
        # The previous arguments ran before: give them at least the launch's own startup
        # time, whatever the rollout allowed its replacement (a failed rollout must not leave
        # the fleet a replica short because the model takes longer to load than that).
        startup_s = self.fleets[pool].spec.startup_timeout_s
        try:
            await self._start_and_join(pool, slot, None, max(readiness_timeout_s, startup_s))
        except FleetError as again:
            return f"starting {name} again on its previous arguments failed too: {again}"
        return f"{name} runs its previous arguments again"

    async def replace(
        self, name: str, spec: LaunchSpec, drain_timeout_s: float, readiness_timeout_s: float
    ) -> Replaced:
        """One rollout step: drain ``name`` (every rank of it), stop it, start its slot again
        with ``spec``."""
        ranks = self.ranks_of(name)
        pool = self._launched_by(name)
        if pool is None:
            raise FleetError(409, f"replica {name} was not launched by this router")
        old = next(r for r in self.fleets[pool].replicas if r.name == name)
        self.phases[name] = DRAINING
        self._slots_busy[pool].add(old.slot)
        try:
            drain = _merged(
                name, await asyncio.gather(*(self.drainer.drain(h, drain_timeout_s) for h in ranks))
            )
            self.on_drained(drain)
            await self._stop(name)
            self.phases.pop(name, None)
            started = time.monotonic()
            try:
                _, replica = await self._start_and_join(pool, old.slot, spec, readiness_timeout_s)
            except FleetError as exc:
                rolled = await self._roll_back(pool, old.slot, name, readiness_timeout_s)
                raise FleetError(exc.status, f"{exc}; {rolled}") from None
        finally:
            self.phases.pop(name, None)
            self._slots_busy[pool].discard(old.slot)
        return Replaced(drain, time.monotonic() - started, replica.process.pid)
