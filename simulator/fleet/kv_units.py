"""The KV block pool of the fast engine, with prefix caching at the granularity of trace blocks.

The exact engine (``simulator/engine``) keeps one entry per 16-token KV block; a Mooncake prompt
of 12k tokens is ~750 of them, and the pool, the hashing and the events cost ~1 ms per request.
Here a cached entry is one *unit* (a trace block, 512 tokens in Mooncake) that owns the KV
blocks of its tokens, and capacity is still counted in KV blocks. The mechanism is vLLM's:

* The free queue holds empty blocks first (never used, or freed without a hash), then cached
  units nobody holds, least recently freed first. Allocation takes empty blocks, then evicts
  cached entries from the head of the queue. (In vLLM the free queue is one list of blocks in
  that same order: blocks without a hash are prepended, cached ones appended.)
* Departure: an eviction removes a whole unit (up to ``block_tokens / block_size`` KV blocks at
  once, 32 in Mooncake) where vLLM evicts single blocks; the surplus becomes empty blocks.
* Output blocks, and full prompt blocks computed twice (vLLM keeps both copies), are cached
  in vLLM but can never be hit by a trace request (their content is the model's output): they
  join the queue as anonymous *junk* entries that take room and are evicted like the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Index operations, applied to the router's PrefixIndex in order (after the event lag):
# ("stored", engine_hashes, parent_engine_hash, token_ids, block_size[, medium])
# | ("removed", hashes[, medium]) | ("cleared",); no medium: the GPU
IndexOp = tuple[object, ...]


class Holdings:
    """Fleet-wide: how many live replicas cache each unit now, and which units any replica ever
    cached. Every replica's pool feeds one; the loss decomposition (``loss.py``) reads it."""

    __slots__ = ("counts", "ever")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.ever: set[int] = set()

    def stored(self, key: int) -> None:
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        self.ever.add(key)

    def dropped(self, key: int) -> None:
        counts = self.counts
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]


@dataclass(slots=True, eq=False)
class Unit:
    """A cached unit: its chain key, the KV blocks it owns, and who holds it."""

    key: int  # > 0 for prefix units, < 0 for junk
    blocks: int
    ref: int = 0
    announced: bool = False  # a BlockStored told the router about it


class UnitPool:
    """KV blocks counted one by one; cached content kept per unit, evicted LRU."""

    def __init__(self, num_blocks: int, holdings: Holdings | None = None) -> None:
        self.num_blocks = num_blocks
        # With ``holdings``: the fleet's counts are kept, and ``evicted_keys`` (units this pool
        # cached once and evicted since) for the loss decomposition.
        self.holdings = holdings
        self.evicted_keys: set[int] = set()
        self.empty = num_blocks
        self.cached: dict[int, Unit] = {}
        self.lru: OrderedDict[int, Unit] = OrderedDict()  # evictable entries, head first
        self.lru_blocks = 0
        self.ops: list[IndexOp] = []
        self._removed: list[int] = []
        self._junk_keys = 0
        self.evicted_units = 0

    @property
    def free_blocks(self) -> int:
        """Blocks nobody holds: empty ones plus evictable cached ones (vLLM's free queue)."""
        return self.empty + self.lru_blocks

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: 1 - free/total."""
        return 1.0 - (self.empty + self.lru_blocks) / self.num_blocks

    def lookup(self, keys: Sequence[int]) -> list[Unit]:
        """The leading units of ``keys`` that are cached."""
        get = self.cached.get
        hits: list[Unit] = []
        for key in keys:
            unit = get(key)
            if unit is None:
                break
            hits.append(unit)
        return hits

    def touch(self, units: list[Unit]) -> None:
        """Take a reference on hit units; a free one leaves the queue (no eviction)."""
        lru = self.lru
        for unit in units:
            if unit.ref == 0:
                del lru[unit.key]
                self.lru_blocks -= unit.blocks
            unit.ref += 1

    def allocate(self, n: int) -> None:
        """Take ``n`` blocks, evicting cached entries from the head of the queue as needed."""
        if n > self.empty + self.lru_blocks:
            raise ValueError(f"cannot allocate {n} KV blocks: {self.free_blocks} free")
        lru = self.lru
        while self.empty < n:
            key, unit = lru.popitem(last=False)
            self.lru_blocks -= unit.blocks
            self.empty += unit.blocks
            if key > 0:
                del self.cached[key]
                self.evicted_units += 1
                if self.holdings is not None:
                    self.holdings.dropped(key)
                    self.evicted_keys.add(key)
                if unit.announced:
                    self._removed.append(key)
        self.empty -= n

    def register(self, key: int, blocks: int, announce: bool) -> Unit | None:
        """Cache a unit a request just filled (its blocks move to the unit, held once).

        None when the key is cached already: the request's copy stays private (see module doc).
        """
        if key in self.cached:
            return None
        unit = Unit(key, blocks, 1, announce)
        self.cached[key] = unit
        if self.holdings is not None:
            self.holdings.stored(key)
            self.evicted_keys.discard(key)
        return unit

    def forget(self) -> None:
        """The replica is gone: its cached units leave the fleet's counts."""
        if self.holdings is not None:
            for key in self.cached:
                self.holdings.dropped(key)
            self.holdings = None

    def release(self, units: list[Unit], junk_blocks: int, empty_blocks: int) -> None:
        """Free a request's blocks in vLLM's order: its tail first, so its head is evicted last.

        ``junk_blocks`` (its full private blocks) join the queue before its units, in reverse;
        ``empty_blocks`` (its partial block) become empty.
        """
        self.empty += empty_blocks
        lru = self.lru
        if junk_blocks > 0:
            self._junk_keys -= 1
            lru[self._junk_keys] = Unit(self._junk_keys, junk_blocks)
            self.lru_blocks += junk_blocks
        for unit in reversed(units):
            unit.ref -= 1
            if unit.ref == 0:
                lru[unit.key] = unit
                self.lru_blocks += unit.blocks

    def stored(self, keys: list[int], parent: int | None) -> None:
        """Announce units (a chain after ``parent``): one token per unit, its key."""
        self._flush_removed()
        self.ops.append(("stored", keys, parent, keys, 1))

    def extend_ops(self, ops: list[IndexOp]) -> None:
        """Queue other tiers' operations after this pool's own so far."""
        if ops:
            self._flush_removed()
            self.ops.extend(ops)

    def _flush_removed(self) -> None:
        if self._removed:
            self.ops.append(("removed", self._removed))
            self._removed = []

    def take_ops(self) -> list[IndexOp]:
        self._flush_removed()
        ops = self.ops
        self.ops = []
        return ops
