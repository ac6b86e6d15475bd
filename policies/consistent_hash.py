"""Consistent hashing on a session key, with bounded loads.

Requests that share a key (a session header or the body's ``user``) go to the same replica,
so its prefix cache stays warm, unless that replica already holds more than (1 + eps) times
the average in-flight count; then the key spills to the next replica on the ring. Requests
without a key have no affinity to keep and go to the least-loaded replica.
"""

from __future__ import annotations

import math
from typing import Any

from .hash_ring import FleetRing, bounded_walk, hash_key
from .least_loaded import LeastLoaded
from .types import NO_HEALTHY_REPLICA, Decision, FleetView, Policy, RouteRequest


class ConsistentHash(Policy):
    name = "consistent_hash"

    def __init__(self, eps: float = 0.25, vnodes: int = 160) -> None:
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
        self.eps = eps
        self.vnodes = vnodes
        self._ring = FleetRing(vnodes)
        self._no_key = LeastLoaded()

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        if request.routing_key is None:
            fallback = self._no_key.decide(request, fleet)
            return Decision(fallback.ranked, "no_key_least_loaded") if fallback.ranked else fallback
        healthy = {r.replica_id: r for r in fleet.eligible(request.model)}
        if not healthy:
            return NO_HEALTHY_REPLICA
        ranked, home_full = bounded_walk(
            self._ring.synced(fleet), hash_key(request.routing_key), healthy, self.eps
        )
        return Decision(tuple(ranked), "hash_spill" if home_full else "hash_home")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "eps": self.eps, "vnodes": self.vnodes}
