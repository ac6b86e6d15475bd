"""Where the hit rate goes: each request's shortfall against the pooled-LRU bound, by cause.

Per request, ``bound`` is what one LRU cache of the whole fleet's capacity would have reused
(``bounds.pooled_lru_hits``: its matched units, in tokens as the engine counts them) and ``hit``
what the fleet reused (the engines' prefix-cache hit tokens). When ``hit < bound`` the missing
tokens are the bound's units above the hit, each put in the first category that fits, judged
when the request was routed (its units' state then, the index's claim, the policy's reason):

1. ``evicted_while_queued``: the chosen replica held it when routed, not when it ran;
2. ``wrong_prediction``: the router's index said the chosen replica held it (a KV event or a
   prediction), and it did not;
3. ``spread_load``: another replica held it, the chosen one did not, and the policy said load
   won over affinity (``LOAD_REASONS``); ``spread_other``: the same for any other reason (the
   index did not know, or the policy ignores prefixes);
4. ``evicted_on_chosen``: no replica held it; the chosen one had, and evicted it;
5. ``evicted_elsewhere``: no replica held it; others had (the fleet's caches, holding
   duplicates and split in N LRUs, kept less than one pooled LRU of their total size);
6. ``not_yet_cached``: no replica had computed it yet (its first request was still queued or
   prefilling; the bound caches a prompt the instant it arrives);
7. ``not_served``: the request was rejected or left with no replica.

When ``hit > bound`` (N caches are not one LRU: a replica may keep what the pool evicts) the
excess is ``above_bound``. So, summed over requests: ``hit = bound - sum(categories) +
above_bound`` exactly. With ``--fail`` a rerouted request is judged at its last routing, and its
hits on every replica it met count (as in the hit rate).

Cost: a few dict lookups per unit of the bound's prefix per request, and a count kept per cached
unit by every replica's pool (``kv_units.Holdings``). The fast engine model only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvroute.policies.kv_aware import LOAD_OVER_AFFINITY, SPILL

from .kv_units import Holdings, UnitPool
from .units import SimRequest

CATEGORIES = (
    "evicted_while_queued",
    "wrong_prediction",
    "spread_load",
    "spread_other",
    "evicted_on_chosen",
    "evicted_elsewhere",
    "not_yet_cached",
    "not_served",
)
_QUEUED, _PREDICTED, _LOAD, _OTHER, _ON_CHOSEN, _ELSEWHERE, _NOT_YET, _NOT_SERVED = range(8)
# Decision reasons that mean load won over affinity.
LOAD_REASONS = frozenset({LOAD_OVER_AFFINITY, SPILL})


@dataclass(frozen=True)
class LossBreakdown:
    """Token totals over a run: the bound, the hits, each category, and the excess."""

    bound_tokens: int
    hit_tokens: int
    tokens: dict[str, int]  # category -> tokens the bound reused and the fleet did not
    above_bound_tokens: int

    def shares(self) -> dict[str, float]:
        """Each category as a share of the bound's tokens (they sum to 1 - hit/bound + above)."""
        b = self.bound_tokens
        return {k: (v / b if b else 0.0) for k, v in self.tokens.items()}

    def as_dict(self) -> dict[str, Any]:
        b = self.bound_tokens
        return {
            "bound_tokens": b,
            "hit_tokens": self.hit_tokens,
            "hit_over_bound": round(self.hit_tokens / b, 6) if b else None,
            "shares_of_bound": {k: round(v, 6) for k, v in self.shares().items()},
            "above_bound_share": round(self.above_bound_tokens / b, 6) if b else 0.0,
            "tokens": dict(self.tokens),
            "above_bound_tokens": self.above_bound_tokens,
        }


class LossTracker:
    """Records each routed request's units by category (``routed``); ``breakdown`` at the end."""

    def __init__(
        self,
        requests: tuple[SimRequest, ...],
        bound_units: list[int],
        block_tokens: int,
        block_size: int,
        holdings: Holdings,
    ) -> None:
        self.requests = requests
        self.bound_units = bound_units
        self.block_tokens = block_tokens
        self.block_size = block_size
        self.holdings = holdings
        self.codes: list[bytes | None] = [None] * len(requests)

    def routed(self, request: SimRequest, chosen: UnitPool, predicted: int, reason: str) -> None:
        """``request`` goes to the replica whose pool is ``chosen``; the index matched
        ``predicted`` of its units there; the policy said ``reason``."""
        b = self.bound_units[request.index]
        if not b:
            return
        cached = chosen.cached
        evicted = chosen.evicted_keys
        counts = self.holdings.counts
        ever = self.holdings.ever
        spread = _LOAD if reason in LOAD_REASONS else _OTHER
        codes = bytearray(b)
        for u, key in enumerate(request.unit_keys[:b]):
            if key in cached:
                codes[u] = _QUEUED
            elif u < predicted:
                codes[u] = _PREDICTED
            elif key in counts:
                codes[u] = spread
            elif key in evicted:
                codes[u] = _ON_CHOSEN
            elif key in ever:
                codes[u] = _ELSEWHERE
            else:
                codes[u] = _NOT_YET
        self.codes[request.index] = bytes(codes)

    def breakdown(self, hit_tokens: list[int]) -> LossBreakdown:
        totals = [0] * len(CATEGORIES)
        bound_total = above = 0
        for request, hit in zip(self.requests, hit_tokens, strict=True):
            b = self.bound_units[request.index]
            bound = self._tokens(request, b)
            bound_total += bound
            if hit >= bound:
                above += hit - bound
                continue
            codes = self.codes[request.index]
            if codes is None:
                totals[_NOT_SERVED] += bound - hit
                continue
            # Unit u spans tokens [tok(u), tok(u+1)) of the bound; the part above the hit is lost.
            low = self._tokens(request, 0)
            for u in range(b):
                high = self._tokens(request, u + 1)
                if high > hit:
                    totals[codes[u]] += high - (low if low > hit else hit)
                low = high
        return LossBreakdown(
            bound_total,
            sum(hit_tokens),
            dict(zip(CATEGORIES, totals, strict=True)),
            above,
        )

    def _tokens(self, request: SimRequest, units: int) -> int:
        """Hit tokens of a prefix of ``units`` units, counted as the engine counts them: whole
        KV blocks, never the block with the last prompt token (``bounds._hit_tokens``)."""
        n = request.input_tokens
        bs = self.block_size
        blocks = min(units * self.block_tokens, n) // bs
        return min(blocks * bs, (n - 1) // bs * bs)
