"""The offload tiers under the block pool: vLLM's OffloadingConnector, as the engine model sees it.

vLLM 0.32 offloads on store: each full block the GPU caches is copied to the CPU tier (and
cascaded to every secondary tier); each tier keeps what fits, least recently used first out,
and announces its stores and evictions with its own ``medium`` (the connector's self-describing
events: the same hashes, parent and token ids as the GPU's ``BlockStored``). A removal on one
tier leaves the others' copies. A new request's prefix is the GPU's hit, then the connector's
lookup from the first block the GPU misses: each next block from the fastest tier holding it.
Here each tier is an ordered set of block hashes; the load's time is the engine's to charge.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

from kvroute.kvcore.kv_events import BlockRemoved, BlockStored, ExternalBlockHash, KVEvent

from .config import OffloadTier


class OffloadStore:
    """One tier: block hashes stored write-through, evicted LRU, announced with ``medium``."""

    def __init__(self, tier: OffloadTier, group_idx: int, spec_kind: str) -> None:
        self.tier = tier
        self.medium = tier.medium
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self._group_idx = group_idx
        self._spec_kind = spec_kind
        self.stored_blocks = 0  # copies made (store bytes = this x bytes per block)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def store(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
        extra_keys: list[tuple[Any, ...] | None],
        events: list[KVEvent],
    ) -> None:
        """Copy the blocks ``hashes`` (a chain after ``parent``; ``token_ids`` theirs) here."""
        held = self.blocks
        new = [h for h in hashes if h not in held]
        for h in hashes:
            if h in held:
                held.move_to_end(h)
        if not new:
            return
        room = self.tier.num_blocks
        evicted: list[int] = []
        while len(held) + len(new) > room and held:
            evicted.append(held.popitem(last=False)[0])
        if evicted:
            events.append(
                BlockRemoved(cast("list[ExternalBlockHash]", evicted), self.medium, self._group_idx)
            )
        # Each run of blocks new here is one event (a block held already breaks the chain).
        fresh = set(new)
        runs: list[tuple[int, list[int]]] = []  # (first index in hashes, the run)
        for i, h in enumerate(hashes):
            if h in fresh and runs and runs[-1][0] + len(runs[-1][1]) == i:
                runs[-1][1].append(h)
            elif h in fresh:
                runs.append((i, [h]))
        for start, run in runs:
            events.append(
                BlockStored(
                    block_hashes=cast("list[ExternalBlockHash]", run),
                    parent_block_hash=hashes[start - 1] if start else parent,
                    token_ids=list(token_ids[start * block_size : (start + len(run)) * block_size]),
                    block_size=block_size,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=extra_keys[start : start + len(run)],
                    group_idx=self._group_idx,
                    kv_cache_spec_kind=self._spec_kind,
                )
            )
        for h in new[-room:]:
            held[h] = None
        self.stored_blocks += len(new)

    def touch(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def clear(self) -> None:
        self.blocks.clear()
