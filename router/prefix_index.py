"""Which replica holds which KV block: the prefix index fed by KV events (DESIGN.md 2 and 3).

Pure and synchronous: no asyncio, no I/O, no wall clock (times are passed in), so the live
router's event subscriber and the fleet simulator share it.

Layout, chosen for memory (measured by ``kvroute bench index``):

* ``_holders``: router block hash -> int bitmask of replica indices (replica names are interned
  to small ints). A block held by one replica stores a shared, pre-built single-bit int, so the
  common case costs one dict slot and the key.
* per replica and medium, ``engine hash -> router hash`` (the value is the very int object that is
  the key in ``_holders``), so ``BlockRemoved``, which carries only engine hashes, can be applied.
* per replica, ``extra``: router hash -> references beyond the first, for the rare block held
  twice by one replica (on GPU and CPU, or under two engine hashes that the router hashes alike,
  e.g. a cache salt the router was not told about). A bit is cleared only when its last
  reference goes.
* predictions: router hash -> bitmask of replicas predicted to hold it (only live ones: every
  ``predict``/``match``/``expire`` first purges what expired by its ``now``, from a heap), and per
  replica router hash -> expiry. A real ``BlockStored`` of the block on that replica supersedes
  (deletes) its prediction.

The router recomputes its own chained hashes from each ``BlockStored``'s ``token_ids``, chaining
from the router hash of the parent block, found through that replica's engine -> router map.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import or_
from typing import NamedTuple

from .block_hashing import chain_hashes, root_seed

DEFAULT_MEDIUM = "GPU"

EngineHash = int | bytes


class PrefixMatch(NamedTuple):
    """One replica's match for a request.

    ``blocks``: length of the leading run of the request's blocks that the replica holds,
    confirmed by events or predicted. ``confirmed``: length of the leading run held by events
    alone (``confirmed <= blocks``). A NamedTuple: building 200 of them per lookup must be cheap
    (a frozen dataclass costs ~1 us each).
    """

    blocks: int
    confirmed: int


@dataclass(slots=True)
class IndexStats:
    """Counters since the index was created."""

    stored: int = 0  # blocks indexed from BlockStored
    removed: int = 0  # blocks removed by BlockRemoved
    unknown_parent: int = 0  # BlockStored events skipped: parent engine hash not known
    unknown_parent_blocks: int = 0  # blocks in those skipped events
    unknown_removed: int = 0  # BlockRemoved hashes that were not indexed for that replica
    short_token_ids: int = 0  # BlockStored events with fewer token_ids than blocks * block_size
    cleared: int = 0  # clear_replica calls (AllBlocksCleared, resyncs)
    predicted: int = 0  # (block, replica) predictions recorded
    expired: int = 0  # predictions that expired unconfirmed


class _Replica:
    __slots__ = ("bit", "extra", "index", "maps", "name")

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index
        self.bit = 1 << index
        self.maps: dict[str, dict[EngineHash, int]] = {}
        self.extra: dict[int, int] = {}


class PrefixIndex:
    """Router block hash -> replicas holding it, fed by vLLM KV events and predictions."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._replicas: dict[str, _Replica] = {}
        self._by_index: list[_Replica] = []
        self._bits: list[int] = []  # shared single-bit ints, one per replica index
        self._names: list[str] = []  # replica index -> name
        self._same: list[PrefixMatch] = []  # PrefixMatch(n, n), built once per n
        self._entries = 0
        self._pred: dict[int, int] = {}  # router hash -> replicas predicted (bitmask)
        self._pred_exp: list[dict[int, float]] = []  # replica index -> router hash -> expiry
        self._pred_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._pred_seq = 0
        self.stats = IndexStats()
        # The block size of the last BlockStored applied: how the router learns the replicas'.
        self.block_size: int | None = None

    # --- replicas -------------------------------------------------------------------------

    def _replica(self, name: str) -> _Replica:
        rep = self._replicas.get(name)
        if rep is None:
            rep = _Replica(name, len(self._by_index))
            self._replicas[name] = rep
            self._by_index.append(rep)
            self._bits.append(rep.bit)
            self._names.append(name)
            self._pred_exp.append({})
        return rep

    @property
    def replicas(self) -> tuple[str, ...]:
        """Every replica name the index has seen, in first-seen order."""
        return tuple(r.name for r in self._by_index)

    @property
    def entries(self) -> int:
        """Confirmed (block, replica) pairs (a block on two media of one replica counts once)."""
        return self._entries

    @property
    def blocks(self) -> int:
        """Distinct router block hashes held by at least one replica."""
        return len(self._holders)

    @property
    def predicted_entries(self) -> int:
        """(block, replica) predictions stored (expired ones go at the next purge)."""
        return sum(len(d) for d in self._pred_exp)

    # --- events ---------------------------------------------------------------------------

    def apply_stored(
        self,
        replica: str,
        engine_hashes: Sequence[EngineHash],
        parent_engine_hash: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        medium: str | None = DEFAULT_MEDIUM,
        extra_key: str | None = None,
    ) -> int:
        """Index one BlockStored event; returns the blocks newly indexed.

        ``parent_engine_hash`` None (or int 0, as some senders write "no parent") starts a chain
        at the root, seeded by ``extra_key``; otherwise the parent must be known for this replica
        (on any medium), else the event is counted in ``stats.unknown_parent`` and skipped.
        Token ids must lie in [0, 2**32) (OverflowError otherwise).
        """
        rep = self._replica(replica)
        self.block_size = block_size
        med = medium or DEFAULT_MEDIUM
        emap = rep.maps.get(med)
        if emap is None:
            emap = rep.maps[med] = {}
        if parent_engine_hash is None or (
            type(parent_engine_hash) is int and parent_engine_hash == 0
        ):
            seed = root_seed(extra_key)
        else:
            parent = emap.get(parent_engine_hash)
            if parent is None:
                for other in rep.maps.values():
                    parent = other.get(parent_engine_hash)
                    if parent is not None:
                        break
                else:
                    self.stats.unknown_parent += 1
                    self.stats.unknown_parent_blocks += len(engine_hashes)
                    return 0
            seed = parent
        if len(token_ids) < len(engine_hashes) * block_size:
            self.stats.short_token_ids += 1
        hashes = chain_hashes(token_ids, block_size, seed)

        holders = self._holders
        bit = rep.bit
        extra = rep.extra
        pred = self._pred
        ridx = rep.index
        added = 0
        new_entries = 0
        setdefault = emap.setdefault
        for eh, rh in zip(engine_hashes, hashes, strict=False):
            old = setdefault(eh, rh)  # one lookup in the (big) map for the common, new case
            if old is not rh:
                if old == rh:
                    continue  # the same block stored again
                self._unref(rep, old)  # an engine hash reused for other content
                emap[eh] = rh
            added += 1
            mask = holders.get(rh)
            if mask is None:
                holders[rh] = bit
                new_entries += 1
            elif mask & bit:
                extra[rh] = extra.get(rh, 0) + 1
            else:
                holders[rh] = mask | bit
                new_entries += 1
            if pred:
                pm = pred.get(rh)
                if pm is not None and pm & bit:
                    self._unpredict(rh, pm, ridx)
        self._entries += new_entries
        self.stats.stored += added
        return added

    def apply_removed(
        self,
        replica: str,
        engine_hashes: Sequence[EngineHash],
        medium: str | None = DEFAULT_MEDIUM,
    ) -> int:
        """Apply one BlockRemoved event; returns the blocks removed (unknown ones are counted)."""
        rep = self._replicas.get(replica)
        emap = rep.maps.get(medium or DEFAULT_MEDIUM) if rep is not None else None
        if rep is None or emap is None:
            self.stats.unknown_removed += len(engine_hashes)
            return 0
        removed = 0
        for eh in engine_hashes:
            rh = emap.pop(eh, None)
            if rh is None:
                self.stats.unknown_removed += 1
                continue
            self._unref(rep, rh)
            removed += 1
        self.stats.removed += removed
        return removed

    def clear_replica(self, replica: str) -> None:
        """Forget every block of one replica (AllBlocksCleared, or before a resync).

        Its predictions stay: they stand for requests already sent there, which will store
        their blocks again.
        """
        self.stats.cleared += 1
        rep = self._replicas.get(replica)
        if rep is None:
            return
        holders = self._holders
        keep = ~rep.bit
        bits = self._bits
        dropped = 0
        for emap in rep.maps.values():
            for rh in emap.values():
                mask = holders.get(rh)
                if mask is None or not mask & rep.bit:
                    continue  # a second reference already cleared
                mask &= keep
                dropped += 1
                if mask:
                    holders[rh] = bits[mask.bit_length() - 1] if mask & (mask - 1) == 0 else mask
                else:
                    del holders[rh]
        self._entries -= dropped
        rep.maps = {}
        rep.extra = {}

    def _unref(self, rep: _Replica, rh: int) -> None:
        extra = rep.extra
        n = extra.get(rh)
        if n:
            if n == 1:
                del extra[rh]
            else:
                extra[rh] = n - 1
            return
        holders = self._holders
        mask = holders[rh] & ~rep.bit
        if mask:
            # A single remaining holder shares the pre-built int: no per-block int object.
            holders[rh] = self._bits[mask.bit_length() - 1] if mask & (mask - 1) == 0 else mask
        else:
            del holders[rh]
        self._entries -= 1

    # --- predictions ----------------------------------------------------------------------

    def predict(self, replica: str, router_hashes: Sequence[int], now: float, ttl_s: float) -> None:
        """Record that ``replica`` will soon hold these blocks (the router just sent the prompt).

        Blocks it already holds by events are skipped. A prediction counts in :meth:`match`
        until ``now + ttl_s`` or until a BlockStored of that block on that replica replaces it;
        predicting a block again extends its expiry. Also purges what expired by ``now``.
        """
        self.expire(now)
        if ttl_s <= 0 or not router_hashes:
            return
        rep = self._replica(replica)
        ridx, bit = rep.index, rep.bit
        expires = now + ttl_s
        holders = self._holders
        pred = self._pred
        exp = self._pred_exp[ridx]
        recorded: list[int] = []
        for rh in router_hashes:
            if holders.get(rh, 0) & bit:
                continue
            old = exp.get(rh)
            if old is None:
                pm = pred.get(rh)
                pred[rh] = bit if pm is None else pm | bit
            elif old >= expires:
                continue
            exp[rh] = expires
            recorded.append(rh)
        if recorded:
            self.stats.predicted += len(recorded)
            self._pred_seq += 1
            heapq.heappush(self._pred_heap, (expires, self._pred_seq, ridx, tuple(recorded)))

    def _unpredict(self, rh: int, mask: int, ridx: int) -> None:
        mask ^= self._bits[ridx]
        if mask:
            self._pred[rh] = mask
        else:
            del self._pred[rh]
        del self._pred_exp[ridx][rh]

    def expire(self, now: float) -> int:
        """Drop predictions whose expiry is at or before ``now``; returns how many."""
        heap = self._pred_heap
        dropped = 0
        while heap and heap[0][0] <= now:
            _, _, ridx, hashes = heapq.heappop(heap)
            exp = self._pred_exp[ridx]
            for rh in hashes:
                e = exp.get(rh)
                if e is not None and e <= now:  # not superseded, nor renewed beyond now
                    self._unpredict(rh, self._pred[rh], ridx)
                    dropped += 1
        self.stats.expired += dropped
        return dropped

    # --- queries --------------------------------------------------------------------------

    def match(self, router_hashes: Sequence[int], now: float) -> dict[str, PrefixMatch]:
        """Per replica with at least one leading block: its longest contiguous prefix match.

        O(blocks in the request + replicas matched): a dict lookup and an AND of replica
        bitmasks per block, stopping at the first block no candidate holds. Predictions that
        expired by ``now`` are purged first (so time must not run backwards between calls).
        """
        if not router_hashes:
            return {}
        n = len(router_hashes)
        masks = list(map(self._holders.get, router_hashes, repeat(0, n)))
        combined = masks
        if self._pred:
            heap = self._pred_heap
            if heap and heap[0][0] <= now:
                self.expire(now)
            pmasks = list(map(self._pred.get, router_hashes, repeat(0, n)))
            if any(pmasks):
                combined = list(map(or_, masks, pmasks))
                if combined == masks:
                    combined = masks
        names = self._names
        bits = self._bits
        out: dict[str, PrefixMatch] = {}
        if combined is masks:  # no live prediction involved: confirmed == blocks
            same = self._same
            for length, ended in _leading_runs(masks):
                while len(same) <= length:
                    same.append(PrefixMatch(len(same), len(same)))
                pm = same[length]
                while ended:  # measured faster than bin()/str.find and than 1 << top
                    top = ended.bit_length() - 1
                    out[names[top]] = pm
                    ended ^= bits[top]
            return out
        confirmed: dict[int, int] = {}
        for length, ended in _leading_runs(masks):
            while ended:
                top = ended.bit_length() - 1
                confirmed[top] = length
                ended ^= bits[top]
        for length, ended in _leading_runs(combined):
            while ended:
                top = ended.bit_length() - 1
                out[names[top]] = PrefixMatch(length, confirmed.get(top, 0))
                ended ^= bits[top]
        return out

    def replicas_holding(self, router_hash: int) -> frozenset[str]:
        """Replicas that hold this block according to events (predictions not included)."""
        mask = self._holders.get(router_hash, 0)
        names = []
        while mask:
            top = mask.bit_length() - 1
            names.append(self._names[top])
            mask ^= self._bits[top]
        return frozenset(names)


def _leading_runs(masks: list[int]) -> list[tuple[int, int]]:
    """(run length, bitmask of the replicas whose leading run of ``masks`` has that length)."""
    alive = masks[0]
    if not alive:
        return []
    runs: list[tuple[int, int]] = []
    i = 0
    for i, m in enumerate(masks):
        new = alive & m
        if new != alive:
            runs.append((i, alive ^ new))  # no ~: bitwise ops on negative ints are slow
            alive = new
            if not alive:
                return runs
    runs.append((i + 1, alive))
    return runs
