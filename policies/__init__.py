"""Routing policies: pure, synchronous decisions shared by the router and the simulator.

One small module per policy behind ``Policy.decide(request, fleet)``, built by name from the
registry; the cost model, power-of-two choices and bounded-load hashing live here.
"""

from .latency import LatencyPrior, ReplicaLatency
from .registry import DEFAULT_POLICY, POLICIES, PolicyConfigError, build_policy
from .types import Decision, FleetView, Policy, ReplicaState, RouteRequest

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Decision",
    "FleetView",
    "LatencyPrior",
    "Policy",
    "PolicyConfigError",
    "ReplicaLatency",
    "ReplicaState",
    "RouteRequest",
    "build_policy",
]
