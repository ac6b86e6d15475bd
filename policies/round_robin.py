"""Round robin over the healthy replicas."""

from __future__ import annotations

from .types import NO_HEALTHY_REPLICA, Decision, FleetView, Policy, RouteRequest


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        healthy = fleet.eligible(request.model)
        if not healthy:
            return NO_HEALTHY_REPLICA
        start = self._next % len(healthy)
        self._next = start + 1
        ids = [r.replica_id for r in healthy]
        return Decision(tuple(ids[start:] + ids[:start]), "round_robin")
