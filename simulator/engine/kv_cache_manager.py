"""Per-request KV blocks over the block pool (vLLM's ``KVCacheManager``).

Finds a request's prefix-cache hit, allocates the blocks its next tokens need, caches blocks as
they fill (prompt and output alike, at allocation time, as vLLM does) and frees them. It keeps
vLLM's prefix-cache counters: tokens queried and tokens hit, for new requests only (a preempted
request's lookup on resume is not counted, like vLLM's ``PrefixCacheStats``).
"""

from __future__ import annotations

from .block_pool import Block, BlockPool
from .config import OffloadTier
from .request import Sequence


class KVCacheManager:
    """Block tables of the live requests, on one block pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        offload: tuple[OffloadTier, ...] = (),
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching, offload)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Loads from offload tiers: KV tokens per medium, all time, and seconds not yet charged.
        self.loaded_tokens: dict[str, int] = {}
        self.load_seconds = 0.0
        self.pending_load_s = 0.0

    def offload_hits(self, seq: Sequence, start: int) -> int:
        """After ``start`` GPU-hit blocks, how many more the offload tiers hold in a row (the
        connector's lookup), never the block of the prompt's last token."""
        stores = self.pool.offload
        if not stores or not self.enable_caching:
            return 0
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        n = 0
        for block_hash in seq.block_hashes[start:max_blocks]:
            if not any(block_hash in s for s in stores):
                break
            n += 1
        return n

    def charge_load(self, seq: Sequence, start: int, n: int, kv_bytes_per_token: float) -> None:
        """``seq`` loads its blocks ``start:start + n`` from the fastest tier holding each:
        count the tokens per medium and the seconds (pending until the engine's step)."""
        bs = self.block_size
        for block_hash in seq.block_hashes[start : start + n]:
            store = next((s for s in self.pool.offload if block_hash in s), None)
            if store is None:  # evicted by the very store that cached it again: a tiny tier
                continue
            store.touch((block_hash,))
            self.loaded_tokens[store.medium] = self.loaded_tokens.get(store.medium, 0) + bs
            seconds = bs * kv_bytes_per_token / store.tier.load_bytes_per_s
            self.load_seconds += seconds
            self.pending_load_s += seconds

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """The longest run of cached blocks that prefixes ``seq``.

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed,
        because its logits give the next token. Partial blocks are never cached, so never hit.
        """
        if not self.enable_caching:
            return []
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        get = self.pool.get_cached_block
        hits: list[Block] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        """Count a scheduled new request's lookup in the prefix-cache counters (in tokens)."""
        if self.enable_caching and seq.num_preemptions == 0:
            self.prefix_cache_queries += len(seq.token_ids)
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, hit_blocks: list[Block] | None = None
    ) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens, after ``hit_blocks`` if any.

        False, with nothing changed, when the free blocks do not suffice (hit blocks that sit in
        the free queue count against them: taking them makes them unavailable for allocation).
        """
        bs = self.block_size
        blocks = seq.blocks
        if hit_blocks is None:
            # Fast path, most decode steps: room in the last block and no block fills up.
            end = seq.num_computed_tokens + num_new_tokens
            if end <= len(blocks) * bs and (
                not self.enable_caching or end // bs <= seq.num_cached_blocks
            ):
                return True
            num_hits = 0
        else:
            num_hits = len(hit_blocks)
        num_computed = seq.num_computed_tokens + num_hits * bs
        end = num_computed + num_new_tokens
        num_new_blocks = -(-end // bs) - len(blocks) - num_hits
        if num_new_blocks > 0 or hit_blocks:
            pool = self.pool
            needed = num_new_blocks
            if hit_blocks:
                needed += sum(1 for b in hit_blocks if b.ref_cnt == 0)
            if needed > pool.num_free_blocks:
                return False
            if hit_blocks:
                pool.touch(hit_blocks)
                blocks.extend(hit_blocks)
                seq.num_cached_blocks = num_hits
            if num_new_blocks > 0:
                blocks.extend(pool.get_new_blocks(num_new_blocks))
        if self.enable_caching:
            token_ids = seq.token_ids
            num_full = min(end, len(token_ids)) // bs
            num_cached = seq.num_cached_blocks
            if num_full > num_cached:
                first, rest = seq.event_extra_first, seq.event_extra_rest
                extra = [rest] * (num_full - num_cached)
                if num_cached == 0:
                    extra[0] = first
                self.pool.cache_full_blocks(
                    blocks, seq.block_hashes, num_cached, num_full, token_ids, seq.lora_name, extra
                )
                seq.num_cached_blocks = num_full
        return True

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, last block first, so its tail is evicted before its head."""
        blocks = seq.blocks
        if blocks:
            self.pool.free_blocks(reversed(blocks))
            seq.blocks = []
        seq.num_cached_blocks = 0
