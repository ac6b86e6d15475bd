"""The block pool: the mechanism under the prefix cache (vLLM's ``BlockPool``).

It owns every KV block, their reference counts, the map from block hash to cached blocks, the
free queue and the KV events. It decides nothing about requests; the KV cache manager and the
scheduler above it do.

* The free queue holds every block with ``ref_cnt == 0``; allocation takes from its head. A
  freed block that holds a cached hash joins the tail, so cached blocks are evicted least
  recently freed first; a freed block without a hash (a partial block, or any block with
  caching off) joins the head and is reused first, as in vLLM 0.32 (older vLLM appended both).
  A request frees its blocks tail first, so its last block is the first of them to go.
* Evicting a cached block emits ``BlockRemoved``; caching full blocks emits one ``BlockStored``.
* Two requests may compute the same block at the same time (vLLM does not deduplicate): both
  copies are cached under one hash and each copy is announced and removed on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from kvroute.kvcore.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
)

from .config import OffloadTier
from .offload_store import OffloadStore

KV_CACHE_SPEC_KIND = "full_attention"
GROUP_IDX = 0


@dataclass(slots=True, eq=False)
class Block:
    """One KV block: an id, how many requests hold it, and its hash once it is full and cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """KV blocks, their free queue, the hash-to-block map and the event queue."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        offload: tuple[OffloadTier, ...] = (),
    ) -> None:
        self.num_blocks = num_blocks
        # Tiers below the GPU, fastest first, filled as blocks are cached (offload_store.py).
        self.offload = [OffloadStore(t, GROUP_IDX, KV_CACHE_SPEC_KIND) for t in offload]
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        # hash -> the cached block, or {block_id: block} when several copies share the hash.
        self.cached: dict[int, Block | dict[int, Block]] = {}
        self.events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including evictable cached ones."""
        return len(self.free_queue)

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: 1 - free/total, evictable cached blocks count as free."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: int) -> Block | None:
        entry = self.cached.get(block_hash)
        if entry is None or isinstance(entry, Block):
            return entry
        return next(iter(entry.values()))

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue (no eviction)."""
        free_queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del free_queue[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot get {n} free blocks from the pool")
        popitem = self.free_queue.popitem
        out: list[Block] = []
        for _ in range(n):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one reference on each block, in eviction-priority order.

        Blocks now unused and cached go to the tail of the free queue (LRU); blocks without a
        hash, which can never be hit, go to its head in the given order (vLLM 0.32's
        ``prepend_n``/``append_n``).
        """
        free_queue = self.free_queue
        uncached: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    free_queue[block.block_id] = block
        if uncached:
            move_to_end = free_queue.move_to_end
            for block in reversed(uncached):
                free_queue[block.block_id] = block
                move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self,
        blocks: list[Block],
        block_hashes: list[int],
        num_cached: int,
        num_full: int,
        token_ids: list[int],
        lora_name: str | None,
        extra_keys: list[tuple[Any, ...] | None],
    ) -> None:
        """Cache ``blocks[num_cached:num_full]`` (now full) and announce them in one BlockStored.

        ``extra_keys`` holds one entry per newly cached block, as vLLM >= 0.17 publishes them.
        """
        cached = self.cached
        new_hashes = block_hashes[num_cached:num_full]
        for block, block_hash in zip(blocks[num_cached:num_full], new_hashes, strict=True):
            block.block_hash = block_hash
            entry = cached.get(block_hash)
            if entry is None:
                cached[block_hash] = block
            elif isinstance(entry, Block):
                cached[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
        bs = self.block_size
        self.events.append(
            BlockStored(
                block_hashes=cast("list[ExternalBlockHash]", new_hashes),
                parent_block_hash=block_hashes[num_cached - 1] if num_cached else None,
                token_ids=token_ids[num_cached * bs : num_full * bs],
                block_size=bs,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=lora_name,
                extra_keys=extra_keys,
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )
        if self.offload:
            parent = block_hashes[num_cached - 1] if num_cached else None
            tokens = token_ids[num_cached * bs : num_full * bs]
            for store in self.offload:
                store.store(new_hashes, parent, tokens, bs, lora_name, extra_keys, self.events)

    def _evict(self, block: Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        entry = self.cached[block_hash]
        if isinstance(entry, Block):
            del self.cached[block_hash]
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                self.cached[block_hash] = next(iter(entry.values()))
        block.block_hash = None
        self.events.append(
            BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=GROUP_IDX)
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held by a request."""
        if len(self.free_queue) != self.num_blocks:
            return False
        self.cached = {}
        for block in self.blocks:
            block.block_hash = None
        for store in self.offload:  # vLLM resets the connector's cache with the GPU's
            store.clear()
        if self.enable_caching:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events = self.events
        self.events = []
        return events
