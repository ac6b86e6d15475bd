"""The replicas the router routes to, and the one answer to "may this replica take traffic now?".

Each ``ReplicaHandle`` owns its ``ReplicaState`` (what policies read) and its circuit breaker.
The registry keeps them in one place with the outcomes of live traffic: it records each
outcome on the replica's breaker, ejects and reinstates replicas, stamps when they left
rotation, and checks a replica at once when a dropped connection may mean it died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container, Sequence
from typing import Protocol

from kvroute.backends.handle import ReplicaHandle
from kvroute.health.breaker import BreakerSettings, BreakerState
from kvroute.policies import FleetView

from .config import Config, ReplicaConfig, replica_base_url, replica_name_from_url

log = logging.getLogger(__name__)

# Failures that may mean the replica process is gone (see ``ReplicaRegistry._check_alive``);
# "gateway_retry": the endpoint picker's gateway moved on to the next endpoint of its list.
CONNECTION_FAILURES = frozenset({"broken_stream", "protocol", "gateway_retry"})


class RegistryHooks(Protocol):
    """What the registry asks of the rest of the router (metrics, the upstream client, probes)."""

    def ejected(self, handle: ReplicaHandle, kind: str) -> None: ...

    def abandon_waiting(self, handle: ReplicaHandle, why: str) -> int: ...

    async def responds(self, handle: ReplicaHandle) -> bool: ...


def breaker_settings(config: Config) -> BreakerSettings:
    b = config.breaker
    return BreakerSettings(
        b.consecutive_failures,
        b.failure_rate,
        b.min_requests,
        b.window_s,
        b.cooldown_s,
        b.max_cooldown_s,
        b.half_open_requests,
        b.close_after_successes,
    )


class ReplicaRegistry:
    def __init__(
        self,
        config: Config,
        hooks: RegistryHooks,
        replicas: Sequence[ReplicaConfig] | None = None,
    ) -> None:
        """``replicas``: the fleet (every model pool's, pool by pool); default the config's."""
        self.breakers_enabled = config.breaker.enabled
        self.panic_routing = config.breaker.panic_routing
        self._hooks = hooks
        self._settings = breaker_settings(config)
        self._positions = 0
        self.handles: dict[str, ReplicaHandle] = {}
        for replica in config.replicas if replicas is None else replicas:
            self._add(replica)
        self.fleet = FleetView([h.state for h in self.handles.values()], membership_version=1)
        # Replicas whose breaker is not closed: reinstated when their cool-down is over.
        self._tripped: dict[str, ReplicaHandle] = {}
        self._checking: set[str] = set()  # replicas being checked after a dropped connection
        # Ejected replicas taking traffic because nothing else serves their models (panic).
        self.panicking: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self.handles)

    def _add(self, replica: ReplicaConfig) -> ReplicaHandle:
        name = replica.name or replica_name_from_url(replica.url)
        # Positions are never reused: they index the workers' shared load board.
        handle = ReplicaHandle(
            name,
            replica_base_url(replica.url),
            self._positions,
            self._settings,
            replica.data_parallel_rank,
            replica.speed,
        )
        self._positions += 1
        self.handles[name] = handle
        return handle

    def replace(
        self, replicas: Sequence[ReplicaConfig], *, ready: bool
    ) -> tuple[list[ReplicaHandle], list[ReplicaHandle]]:
        """Discovery says the fleet is now ``replicas``: (added, removed) handles.

        Replicas still in the fleet keep their handle (health, breaker, load). New ones join in
        rotation when ``ready`` (their readiness is already known, e.g. Kubernetes'), else
        after their first passing probe. The caller tells the ledger (``members_changed``).
        """
        wanted = {r.name or replica_name_from_url(r.url): r for r in replicas}
        removed = [h for name, h in self.handles.items() if name not in wanted]
        for handle in removed:
            del self.handles[handle.name]
            self._tripped.pop(handle.name, None)
            handle.state.healthy = False  # a dispatch still open on it must not make it eligible
        added = []
        for name, replica in wanted.items():
            if name not in self.handles:
                handle = self._add(replica)
                handle.state.healthy = ready
                added.append(handle)
        if added or removed:
            self.fleet.replicas = [h.state for h in self.handles.values()]
            self.fleet.membership_version += 1
            self._update_panic(time.monotonic())
        return added, removed

    def in_rotation(self) -> int:
        return sum(
            1
            for r in self.fleet.replicas
            if r.healthy and not r.ejected and not r.quarantined and not r.draining
        )

    # -- may it take traffic? ---------------------------------------------------------

    def may_take(self, handle: ReplicaHandle, now: float) -> bool:
        """Healthy by its probes, not quarantined by the drift canary, not draining, and let
        through by its breaker (half-open: a trial slot)."""
        state = handle.state
        return (
            state.healthy
            and not state.quarantined
            and not state.draining
            and (handle.breaker.allows(now) or handle.name in self.panicking)
        )

    def candidate(
        self, ranked: tuple[str, ...], tried: set[str], members: Container[str] | None = None
    ) -> str | None:
        """The best replica not tried yet that may take traffic now, else one that joined or
        came back since the decision (a stream resumed long after it was routed, while the
        fleet was changing), else any that may. ``members``: the replicas of the request's
        model pool, the only ones a joiner may come from."""
        now = time.monotonic()
        fallback = None
        for replica_id in ranked:
            handle = self.handles.get(replica_id)  # gone since the decision (removed, replaced)
            if handle is None or not self.may_take(handle, now):
                continue
            if replica_id not in tried:
                return replica_id
            if fallback is None:
                fallback = replica_id
        for replica_id, handle in self.handles.items():
            if members is not None and replica_id not in members:
                continue
            if replica_id not in tried and self.may_take(handle, now):
                return replica_id
        return fallback

    def before_decision(self, now: float) -> None:
        """Ejected replicas whose cool-down is over take trial requests again (half-open)."""
        if not self._tripped:
            return
        for handle in self._tripped.values():
            if handle.state.ejected and handle.breaker.allows(now):
                handle.state.ejected = False
        self._update_panic(now)

    def _update_panic(self, now: float) -> None:
        """Envoy's panic mode, for breakers: where no replica in rotation serves a model, the
        replicas of that model out only by their breakers (their health checks pass) take
        traffic anyway.

        A breaker counts failures of live traffic, and overload causes those too (a slow
        first byte on a busy replica trips it at once): ejecting the last replicas of a model
        turns overload into an outage, every request failing at once, where trying them may
        still answer. Replicas down by their health checks stay out: those are not answering.
        """
        if not self.panic_routing:
            return
        serving: set[str] = set()
        serves_any = False  # a replica in rotation whose models are not known yet
        spare: list[ReplicaHandle] = []
        for handle in self.handles.values():
            state = handle.state
            if not state.healthy or state.quarantined or state.draining:
                continue
            if handle.name in self._tripped:  # its breaker is open or half-open
                spare.append(handle)
            elif state.models is None:
                serves_any = True
            else:
                serving.update(state.models)
        panicking = frozenset(
            h.name
            for h in spare
            if not serves_any
            and (not serving if h.state.models is None else not (h.state.models & serving))
        )
        if panicking == self.panicking:
            return
        for name in self.panicking - panicking:
            back = self.handles.get(name)
            if back is None:
                continue
            back.panic = False
            if back.breaker.state is not BreakerState.CLOSED:
                back.state.ejected = not back.breaker.allows(now)
        for name in panicking:
            spared = self.handles[name]
            spared.panic = True
            spared.state.ejected = False
        if panicking and not self.panicking:
            log.warning(
                "no replica in rotation for %s: routing to the ejected ones anyway (panic) until "
                "one is back",
                ", ".join(sorted(panicking)),
            )
        elif not panicking:
            log.info("panic over: replicas back in rotation")
        self.panicking = panicking

    def dispatched(self, handle: ReplicaHandle) -> None:
        """A request is on its way to ``handle``: a half-open breaker counts its trial."""
        handle.breaker.dispatched()
        if handle.breaker.state is BreakerState.HALF_OPEN and handle.name not in self.panicking:
            handle.state.ejected = not handle.breaker.allows(time.monotonic())

    # -- outcomes ---------------------------------------------------------------------

    def mark_down(self, handle: ReplicaHandle) -> None:
        """Out of rotation until a probe passes again."""
        if handle.state.healthy:
            handle.out_since = time.time()
        handle.state.healthy = False
        self._update_panic(time.monotonic())

    def record(self, handle: ReplicaHandle, ok: bool, kind: str = "") -> None:
        """One outcome of live traffic on a replica, for its breaker."""
        if kind in CONNECTION_FAILURES and handle.name not in self._checking:
            # A dropped connection may be a dead replica: find out now, not at the next probe.
            self._checking.add(handle.name)
            task = asyncio.create_task(self._check_alive(handle))
            task.add_done_callback(lambda _: self._checking.discard(handle.name))
        if not self.breakers_enabled:
            return
        now = time.monotonic()
        breaker = handle.breaker
        if kind == "stalled":
            opened = breaker.trip(now, "sent nothing within timeouts.first_byte_s")
        else:
            opened = breaker.record(now, ok, kind)
        if opened:
            self._eject(handle, kind or "failure")
        elif breaker.state is BreakerState.CLOSED:
            if self._tripped.pop(handle.name, None) is not None:
                log.info("replica %s is back in rotation", handle.name)
                if handle.state.healthy and not handle.state.quarantined:
                    handle.out_since = None
                self._update_panic(now)
            handle.state.ejected = False
        elif handle.name not in self.panicking:
            handle.state.ejected = not breaker.allows(now)

    async def _check_alive(self, handle: ReplicaHandle) -> None:
        """Out of rotation at once if the replica no longer answers its health check.

        An HTTP check, not a bare connect: a SIGKILLed vLLM keeps its listening socket (the
        kernel still completes connections) until its multi-GB address space is torn down, 1-2 s
        on a loaded box, but it answers nothing from the moment it dies.
        """
        if await self._hooks.responds(handle):
            return
        if handle.state.healthy:
            self.mark_down(handle)
            log.warning(
                "replica %s is down (no answer to its health check): out of rotation", handle.name
            )
            self._hooks.abandon_waiting(handle, "the replica is down")

    def _eject(self, handle: ReplicaHandle, kind: str) -> None:
        if handle.out_since is None:
            handle.out_since = time.time()
        handle.state.ejected = True
        self._tripped[handle.name] = handle
        self._update_panic(time.monotonic())
        reason = handle.breaker.last_reason
        self._hooks.ejected(handle, kind)
        # In panic it keeps taking traffic: its waiting requests would only come back to it.
        abandoned = 0 if handle.panic else self._hooks.abandon_waiting(handle, f"ejected: {reason}")
        log.warning(
            "replica %s ejected for %.1fs: %s (%d waiting requests sent elsewhere)",
            handle.name,
            handle.breaker.open_until - handle.breaker.opened_at,
            reason,
            abandoned,
        )

    def probed(self) -> None:
        """A probe changed something: stamp who left rotation and who came back."""
        self._update_panic(time.monotonic())
        for handle in self.handles.values():
            state = handle.state
            out = (
                not state.healthy
                or state.ejected
                or state.quarantined
                or handle.name in self.panicking
            )
            if out and handle.out_since is None:
                handle.out_since = time.time()
            elif not out:
                handle.out_since = None
