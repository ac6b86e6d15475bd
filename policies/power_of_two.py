"""Power of two choices: sample two replicas at random, take the less loaded one.

Nearly as balanced as least-loaded (max load ~ log log n instead of log n / log log n for
random), but without herding every router's requests onto the single least-loaded replica
when load information is shared or stale.
"""

from __future__ import annotations

import random
from typing import Any

from .load import load_key
from .types import NO_HEALTHY_REPLICA, Decision, FleetView, Policy, RouteRequest


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._rng = random.Random(seed)

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        healthy = fleet.eligible(request.model)
        if not healthy:
            return NO_HEALTHY_REPLICA
        if len(healthy) == 1:
            return Decision((healthy[0].replica_id,), "power_of_two")
        a, b = self._rng.sample(healthy, 2)
        first, second = (a, b) if load_key(a) <= load_key(b) else (b, a)
        # The rest, least loaded first, are the fallbacks for retries.
        rest = sorted((r for r in healthy if r is not a and r is not b), key=load_key)
        ranked = (first.replica_id, second.replica_id, *(r.replica_id for r in rest))
        return Decision(ranked, "power_of_two")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self._seed}
