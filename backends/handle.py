"""A handle on one replica the router can send traffic to."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.health.breaker import BreakerSettings, CircuitBreaker
from kvroute.health.drift import DriftState
from kvroute.policies import ReplicaState


@dataclass(slots=True)
class ReplicaHandle:
    name: str
    base_url: str
    # Position in the fleet; indexes shared per-replica tables such as the load board.
    index: int
    breaker_settings: BreakerSettings = field(default_factory=BreakerSettings)
    # The data-parallel rank this endpoint sends to (X-data-parallel-rank), whose engine's
    # metrics it reads (``engine="k"``); None: the whole replica.
    data_parallel_rank: int | None = None
    # Its speed against the others' as configured (``replicas[].speed``): where its latency
    # lines start.
    speed: float = 1.0
    state: ReplicaState = field(init=False)
    breaker: CircuitBreaker = field(init=False)
    # Unix time the replica left rotation (unhealthy or ejected); None while in rotation.
    out_since: float | None = field(init=False, default=None)
    # Why the last health probe failed while the replica is out ("connection refused to
    # host:port", a timeout, an HTTP status and its text); None while healthy.
    down_reason: str | None = field(init=False, default=None)
    # Ejected by its breaker yet taking traffic: no other replica of its model is in rotation
    # (router/registry.py, panic routing).
    panic: bool = field(init=False, default=False)
    # What the output-drift canary found (health/canary.py), quarantine included.
    drift: DriftState = field(init=False, default_factory=DriftState)

    def __post_init__(self) -> None:
        self.breaker = CircuitBreaker(self.breaker_settings)
        # Unknown until the first probe passes: no traffic to a replica not known to be up.
        self.state = ReplicaState(replica_id=self.name, healthy=False, speed=self.speed)
