"""Routing policies: pure, synchronous decisions shared by the router and the simulator."""

from .registry import DEFAULT_POLICY, POLICIES, PolicyConfigError, build_policy
from .types import Decision, FleetView, Policy, ReplicaState, RouteRequest

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Decision",
    "FleetView",
    "Policy",
    "PolicyConfigError",
    "ReplicaState",
    "RouteRequest",
    "build_policy",
]
