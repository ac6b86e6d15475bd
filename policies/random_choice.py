"""Uniformly random choice among the healthy replicas."""

from __future__ import annotations

import random
from typing import Any

from .types import NO_HEALTHY_REPLICA, Decision, FleetView, Policy, RouteRequest


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._rng = random.Random(seed)

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        healthy = fleet.eligible(request.model)
        if not healthy:
            return NO_HEALTHY_REPLICA
        ids = [r.replica_id for r in healthy]
        self._rng.shuffle(ids)
        return Decision(tuple(ids), "random")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self._seed}
