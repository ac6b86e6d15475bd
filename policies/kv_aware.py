"""kv_aware: one cost, the expected time to first token, for prefix affinity and load at once.

Per eligible replica, in prefill-token equivalents:

    cost = uncached prompt tokens (the prompt minus the prefix the replica already holds)
         + prefill work queued ahead (the router's own not-yet-started prompts there, plus
           requests the replica reports waiting that the router did not send, at
           ``waiting_request_tokens`` each)
         + ``decode_weight`` x sequences decoding there (each slows every engine step a little)
         + ``kv_pressure_weight`` x uncached tokens when the replica reports its KV cache nearly
           full (above ``kv_high``): new blocks there would evict or preempt.

The cheapest replica wins. Replicas within ``margin`` of the cheapest (``max(margin_tokens,
margin_ratio x cheapest)``) are near ties, broken by power-of-two choices over a bounded-load
consistent-hash ring keyed by the prompt's first blocks: the two first replicas with room on the
ring (load below ``(1 + eps)`` x the mean) are the prefix's two homes, and the less loaded of
them takes it. So a cold prefix lands on a stable home (its next requests then find it cached),
cold prefixes spread evenly over the fleet, and a hot prefix whose home is busy grows a second
home instead of piling onto one replica: once the home's queue outweighs the cached prefix, the
other replicas are cheaper, and the ring picks the same second home every time.

Pure: the router (or the simulator) fills in ``RouteRequest.prefix_tokens`` from the prefix
index and the load fields of ``ReplicaState``; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
import random
from typing import Any

from .hash_ring import FleetRing, hash_key, load_bound
from .types import NO_HEALTHY_REPLICA, Decision, FleetView, Policy, ReplicaState, RouteRequest

# Decision reasons (exported as the X-Kvroute-Reason header and a metric label).
AFFINITY = "kv_affinity"  # the cheapest replica holds a prefix of the prompt
LOAD_OVER_AFFINITY = "kv_load"  # another replica held a longer prefix but was too busy
HOME = "kv_home"  # near tie: the prefix's first home on the ring
SECOND_HOME = "kv_second_home"  # near tie: the second home, less loaded than the first
SPILL = "kv_spill"  # near tie: both homes above the load bound, walked on
NO_PREFIX = "kv_no_prefix"  # near tie, no block hashes nor session key: power of two on load
LEAST_COST = "kv_least_cost"  # a clear winner on load, no replica holds any of the prompt


class KvAware(Policy):
    name = "kv_aware"

    def __init__(
        self,
        margin_tokens: int = 64,
        margin_ratio: float = 0.1,
        decode_weight: float = 4.0,
        waiting_request_tokens: int = 256,
        kv_high: float = 0.95,
        kv_pressure_weight: float = 1.0,
        eps: float = 0.25,
        key_blocks: int = 4,
        vnodes: int = 160,
        seed: int | None = None,
    ) -> None:
        for label, value in (
            ("margin_ratio", margin_ratio),
            ("decode_weight", decode_weight),
            ("kv_pressure_weight", kv_pressure_weight),
            ("eps", eps),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be a finite number >= 0, got {value}")
        if margin_tokens < 0 or waiting_request_tokens < 0:
            raise ValueError("margin_tokens and waiting_request_tokens must be >= 0")
        if not 0 < kv_high <= 1:
            raise ValueError(f"kv_high must be in (0, 1], got {kv_high}")
        if key_blocks < 1 or vnodes < 1:
            raise ValueError("key_blocks and vnodes must be >= 1")
        self.margin_tokens = margin_tokens
        self.margin_ratio = margin_ratio
        self.decode_weight = decode_weight
        self.waiting_request_tokens = waiting_request_tokens
        self.kv_high = kv_high
        self.kv_pressure_weight = kv_pressure_weight
        self.eps = eps
        self.key_blocks = key_blocks
        self.vnodes = vnodes
        self._seed = seed
        self._rng = random.Random(seed)
        self._ring = FleetRing(vnodes)

    # -- the cost ----------------------------------------------------------------------

    def cost(self, replica: ReplicaState, request: RouteRequest) -> float:
        """Expected time to first token on ``replica``, in prefill-token equivalents."""
        cached = request.prefix_tokens.get(replica.replica_id, 0) if request.prefix_tokens else 0
        uncached = max(1, request.prompt_tokens - cached)
        foreign_waiting = max(0, (replica.reported_waiting or 0) - replica.prefilling)
        queued = replica.prefill_tokens + foreign_waiting * self.waiting_request_tokens
        decoding = max(0, replica.in_flight - replica.prefilling)
        cost = uncached + queued + self.decode_weight * decoding
        usage = replica.reported_kv_usage
        if usage is not None and usage >= self.kv_high:
            cost += self.kv_pressure_weight * uncached
        return cost

    # -- the decision ------------------------------------------------------------------

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        eligible = fleet.eligible(request.model)
        if not eligible:
            return NO_HEALTHY_REPLICA
        costs = {r.replica_id: self.cost(r, request) for r in eligible}
        ranked = sorted(eligible, key=lambda r: costs[r.replica_id])
        best = costs[ranked[0].replica_id]
        margin = max(float(self.margin_tokens), self.margin_ratio * best)
        ties = [r for r in ranked if costs[r.replica_id] <= best + margin]
        prefix = request.prefix_tokens or {}
        longest = max((prefix.get(r.replica_id, 0) for r in eligible), default=0)
        if len(ties) == 1:
            chosen = ties[0]
            held = prefix.get(chosen.replica_id, 0)
            reason = AFFINITY if held > 0 and held >= longest else LEAST_COST
        else:
            chosen, reason = self._break_tie(ties, eligible, request, fleet)
        if prefix.get(chosen.replica_id, 0) < longest:
            reason = LOAD_OVER_AFFINITY
        rest = tuple(r.replica_id for r in ranked if r is not chosen)
        return Decision((chosen.replica_id, *rest), reason)

    def _break_tie(
        self,
        ties: list[ReplicaState],
        eligible: list[ReplicaState],
        request: RouteRequest,
        fleet: FleetView,
    ) -> tuple[ReplicaState, str]:
        key = self._key(request)
        if key is None:
            # Nothing to keep a home for: plain power of two choices on load.
            a, b = self._rng.sample(ties, 2)
            return (a if _load(a) <= _load(b) else b), NO_PREFIX
        ring = self._ring.synced(fleet)
        by_id = {r.replica_id: r for r in ties}
        total = sum(r.in_flight for r in eligible)
        bound = load_bound(total, len(eligible), self.eps)
        homes: list[ReplicaState] = []
        full: list[ReplicaState] = []
        for replica_id in ring.walk(key):
            replica = by_id.get(replica_id)
            if replica is None:
                continue
            (homes if replica.in_flight < bound else full).append(replica)
            if len(homes) == 2 or len(homes) + len(full) == len(ties):
                break
        if not homes:
            return min(full, key=_load), SPILL
        spilled = bool(full)  # the ring's first tie replica(s) were above the bound
        if len(homes) == 2 and _load(homes[1]) < _load(homes[0]):
            return homes[1], SPILL if spilled else SECOND_HOME
        return homes[0], SPILL if spilled else HOME

    def _key(self, request: RouteRequest) -> int | None:
        hashes = request.block_hashes
        if hashes:
            # A chained hash stands for its whole prefix: the first key_blocks blocks.
            return hashes[min(self.key_blocks, len(hashes)) - 1]
        if request.routing_key is not None:
            return hash_key(request.routing_key)
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "margin_tokens": self.margin_tokens,
            "margin_ratio": self.margin_ratio,
            "decode_weight": self.decode_weight,
            "waiting_request_tokens": self.waiting_request_tokens,
            "kv_high": self.kv_high,
            "kv_pressure_weight": self.kv_pressure_weight,
            "eps": self.eps,
            "key_blocks": self.key_blocks,
            "vnodes": self.vnodes,
            "seed": self._seed,
        }


def _load(replica: ReplicaState) -> tuple[int, int]:
    return (replica.in_flight_tokens, replica.in_flight)
