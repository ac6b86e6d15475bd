"""The tiers below the GPU for the fast engine: vLLM's offloading connector over trace units.

vLLM (0.32, ``OffloadingConnectorScheduler``) offloads on store, not on eviction: every full
block a request computes is copied to the CPU tier (and cascaded to every secondary tier, the
tiering manager's "always offload to all tiers"); each tier evicts least recently used. A new
request's prefix is served by the GPU prefix cache first, then by the connector's lookup from
the first block the GPU misses, block by block, from the fastest tier holding it; the loaded
blocks land in the GPU cache (announced there as any other). Each tier announces what it
stores and evicts with its own ``medium``. Units here stand for trace blocks (kv_units.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvroute.simulator.engine.config import OffloadTier

from .kv_units import IndexOp


class OffloadUnits:
    """One tier: units stored write-through, evicted LRU, each announced with ``medium``."""

    def __init__(self, tier: OffloadTier) -> None:
        self.tier = tier
        self.medium = tier.medium
        self.lru: OrderedDict[int, int] = OrderedDict()  # unit key -> its KV blocks
        self.used = 0
        self.stored_units = 0
        self.evicted_units = 0

    def __contains__(self, key: int) -> bool:
        return key in self.lru

    def store(
        self, units: Sequence[tuple[int, int]], parent: int | None, ops: list[IndexOp]
    ) -> None:
        """Copy these units (a chain after ``parent``) here; ones held already are touched."""
        lru = self.lru
        new: list[int] = []
        removed: list[int] = []
        cap = self.tier.num_blocks
        for key, blocks in units:
            if key in lru:
                lru.move_to_end(key)
                continue
            if blocks > cap:
                continue
            while self.used + blocks > cap:
                old, old_blocks = lru.popitem(last=False)
                self.used -= old_blocks
                removed.append(old)
                self.evicted_units += 1
            lru[key] = blocks
            self.used += blocks
            new.append(key)
        if removed:
            ops.append(("removed", removed, self.medium))
        if new:
            self.stored_units += len(new)
            # Units held already split the chain: each run of new ones is its own event.
            fresh = set(new)
            run: list[int] = []
            before = parent
            for key, _ in units:
                if key in fresh:
                    run.append(key)
                    continue
                if run:
                    ops.append(("stored", run, before, run, 1, self.medium))
                    run = []
                before = key
            if run:
                ops.append(("stored", run, before, run, 1, self.medium))

    def touch(self, keys: Sequence[int]) -> None:
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)


def lower_hits(tiers: Sequence[OffloadUnits], keys: Sequence[int]) -> list[OffloadUnits]:
    """For each of ``keys`` in a row from the first, the fastest tier holding it; stops at the
    first key no tier holds (the connector's lookup ends there)."""
    found: list[OffloadUnits] = []
    for key in keys:
        for tier in tiers:
            if key in tier:
                found.append(tier)
                break
        else:
            break
    return found
