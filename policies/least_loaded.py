"""Send each request to the replica with the least in-flight work."""

from __future__ import annotations

from .load import load_key
from .types import NO_HEALTHY_REPLICA, Decision, FleetView, Policy, RouteRequest


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self) -> None:
        # Rotating the scan start spreads ties (an idle fleet) instead of always picking the first.
        self._rotation = 0

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        healthy = fleet.eligible(request.model)
        if not healthy:
            return NO_HEALTHY_REPLICA
        n = len(healthy)
        start = self._rotation % n
        self._rotation = start + 1
        rotated = healthy[start:] + healthy[:start]
        ranked = sorted(rotated, key=load_key)  # stable: ties keep the rotated order
        return Decision(tuple(r.replica_id for r in ranked), "least_loaded")
