"""Which replica holds which KV block: the prefix index fed by KV events (DESIGN.md 2 and 3).

Pure and synchronous: no asyncio, no I/O, no wall clock (times are passed in), so the live
router's event subscriber and the fleet simulator share it.

Layout, chosen for lookup latency and memory (measured by ``kvroute bench index``):

* the block table: an open-addressing hash table in numpy arrays, router block hash (uint64, 0
  marks an empty slot) -> two uint32 mask ids: the replicas holding the block by events, and the
  replicas predicted to hold it. Linear probing from the home slot ``hash >> shift`` (the top
  bits: the hashes are xxh3 outputs), without wrap-around (a pad of spare slots follows the last
  home slot), backward-shift deletion (no tombstones: a key is never separated from its home slot
  by an empty slot). 16 bytes a slot, at most 70% full. A Python dict costs ~3 dependent cache
  misses per lookup (index, entry, key object); :meth:`PrefixIndex.match` instead looks up all of
  a prompt's blocks in a handful of vectorised numpy steps, whose cache misses overlap.
* mask ids: rows of ``W`` uint64 words (replica bitmasks, most significant word first) in one
  numpy array. Row 0 is the empty mask; every replica owns a shared single-bit row (a block held
  by one replica costs no row of its own); a block held (or predicted) by several replicas owns a
  row, freed when the set shrinks back to one.
* hashes the table cannot hold (0, or ints outside [0, 2**64): never produced by the router's
  hashing, but accepted) live in two small dicts of Python int bitmasks; lookups that meet them
  take the scalar path, which is also the reference the vectorised one must equal.
* per replica and medium, ``engine hash -> router hash``, so ``BlockRemoved``, which carries only
  engine hashes, can be applied.
* per replica, ``extra``: router hash -> references beyond the first, for the rare block held
  twice by one replica (on GPU and CPU, or under two engine hashes that the router hashes alike,
  e.g. a cache salt the router was not told about). A bit is cleared only when its last
  reference goes.
* predictions: the predicted mask id in the block table (only live ones: every
  ``predict``/``match``/``expire`` first purges what expired by its ``now``, from a heap), and per
  replica router hash -> expiry. A real ``BlockStored`` of the block on that replica supersedes
  (deletes) its prediction.

Few objects the garbage collector tracks: the table, masks and the engine -> router dicts hold
only ints (untracked), so a full collection of a router with millions of entries stays cheap.

The router recomputes its own chained hashes from each ``BlockStored``'s ``token_ids``, chaining
from the router hash of the parent block, found through that replica's engine -> router map.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from .block_hashing import chain_hashes, root_seed

DEFAULT_MEDIUM = "GPU"

EngineHash = int | bytes

_HASH_END = 1 << 64  # table keys lie in [1, 2**64)
_WIN = 16  # slots compared per block in the vectorised probe (one gather of 128 bytes)
_PAD = 1024  # slots after the last home slot; the very last one stays empty (a probe sentinel)
_MIN_BITS = 12  # initial table: 4096 home slots
_MAX_LOAD = 0.7
_MIN_IDS = 256  # initial mask rows
_BIT64 = [1 << i for i in range(64)]

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]


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
    __slots__ = ("bit", "col", "extra", "index", "maps", "name", "sid", "wbit")

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index
        self.bit = 1 << index
        self.wbit = 1 << (index & 63)  # its bit within its mask word
        self.col = 0  # its mask word's column (set by the index: depends on the row width)
        self.sid = 0  # its single-replica mask id (set by the index)
        self.maps: dict[str, dict[EngineHash, int]] = {}
        self.extra: dict[int, int] = {}


class PrefixIndex:
    """Router block hash -> replicas holding it, fed by vLLM KV events and predictions."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}
        self._by_index: list[_Replica] = []
        self._bits: list[int] = []  # shared single-bit ints, one per replica index
        self._names: list[str] = []  # replica index -> name
        self._same: list[PrefixMatch] = []  # PrefixMatch(n, n), built once per n
        self._entries = 0
        self._held_blocks = 0  # keys with a non-empty held mask (table and odd dict)
        self._pred_count = 0  # (block, replica) predictions stored
        self._pred_exp: list[dict[int, float]] = []  # replica index -> router hash -> expiry
        self._pred_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._pred_seq = 0
        # Keys the table cannot hold (0, or outside [0, 2**64)): router hash -> bitmask.
        self._odd_held: dict[int, int] = {}
        self._odd_pred: dict[int, int] = {}
        # Mask rows (see the module docstring); set up by _set_rows.
        self._width = 1  # W: uint64 words a row
        self._rows_flat: U64 = np.zeros(_MIN_IDS, np.uint64)
        self._rows: U64 = self._rows_flat.reshape(-1, 1)
        self._rows_mv = self._rows_flat.data
        self._free_ids: list[int] = []
        self._next_id = 1  # row 0: the empty mask
        self._single: dict[int, int] = {}  # single-replica mask id -> replica index
        # Block table; set up by _set_table.
        self._keys: U64 = np.zeros(0, np.uint64)
        self._vals: U32 = np.zeros(0, np.uint32)
        self._set_table(_MIN_BITS, self._keys, self._vals.reshape(-1, 2))
        self._arange: npt.NDArray[np.intp] = np.arange(256)
        self.stats = IndexStats()
        # The block size of the last BlockStored applied: how the router learns the replicas'.
        self.block_size: int | None = None

    # --- replicas -------------------------------------------------------------------------

    def _replica(self, name: str) -> _Replica:
        rep = self._replicas.get(name)
        if rep is None:
            rep = _Replica(name, len(self._by_index))
            if rep.index >> 6 >= self._width:
                self._widen((rep.index >> 6) + 1)
            rep.col = self._width - 1 - (rep.index >> 6)
            self._replicas[name] = rep
            self._by_index.append(rep)
            self._bits.append(rep.bit)
            self._names.append(name)
            self._pred_exp.append({})
            rep.sid = self._alloc_id()
            self._rows_mv[rep.sid * self._width + rep.col] = rep.wbit
            self._single[rep.sid] = rep.index
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
        return self._held_blocks

    @property
    def predicted_entries(self) -> int:
        """(block, replica) predictions stored (expired ones go at the next purge)."""
        return self._pred_count

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
        if self._used + len(hashes) > self._max_used:
            self._grow()  # room for every block of the event: no growth inside the loop

        # The common cases inline (a table key that is new, or held by one other replica, or by
        # several); the rest (odd keys, a full pad, predictions) through the general helpers.
        keys = self._keys_mv
        vals = self._vals_mv
        shift = self._shift
        last = self._last
        sid = rep.sid
        col = rep.col
        wbit = rep.wbit
        width = self._width
        single = self._single
        extra = rep.extra
        added = 0
        new_entries = 0
        new_keys = 0  # table slots taken (flushed into self._used before any helper call)
        new_blocks = 0
        setdefault = emap.setdefault
        for eh, rh in zip(engine_hashes, hashes, strict=False):
            old = setdefault(eh, rh)  # one lookup in the (big) map for the common, new case
            if old is not rh:
                if old == rh:
                    continue  # the same block stored again
                self._used += new_keys
                new_keys = 0
                self._unref(rep, old)  # an engine hash reused for other content
                emap[eh] = rh
            added += 1
            s = rh >> shift
            k = keys[s]
            while k and k != rh:
                s += 1
                k = keys[s]
            if k:
                i = s + s
                mid = vals[i]
                if mid == sid:
                    extra[rh] = extra.get(rh, 0) + 1
                    continue
                if not mid:
                    vals[i] = sid
                    new_blocks += 1
                elif mid in single:
                    vals[i] = self._with_bit(mid, rep)
                else:
                    rows = self._rows_mv
                    j = mid * width + col
                    w = rows[j]
                    if w & wbit:
                        extra[rh] = extra.get(rh, 0) + 1
                        continue
                    rows[j] = w | wbit
                new_entries += 1
                if self._pred_count and vals[i + 1]:
                    pid = vals[i + 1]
                    if self._rows_mv[pid * width + col] & wbit:
                        self._used += new_keys
                        new_keys = 0
                        self._unpredict(rh, rep.index)
            elif rh and s < last:
                keys[s] = rh
                vals[s + s] = sid
                new_keys += 1
                new_blocks += 1
                new_entries += 1
            else:  # an odd key, or the pad is full
                self._used += new_keys
                new_keys = 0
                if self._held_add(rh, rep):
                    new_entries += 1
                keys = self._keys_mv
                vals = self._vals_mv
                shift = self._shift
                last = self._last
        self._used += new_keys
        self._held_blocks += new_blocks
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
        dropped = 0
        for emap in rep.maps.values():
            for rh in emap.values():
                if self._held_remove(rh, rep):  # False: a second reference already cleared
                    dropped += 1
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
        self._held_remove(rh, rep)
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
        exp = self._pred_exp[ridx]
        recorded: list[int] = []
        ids = self._lookup(router_hashes)  # held mask ids: predicting does not change them
        held_ids = ids[:, 0].tolist() if ids is not None else None
        for i, rh in enumerate(router_hashes):
            if held_ids is not None:
                if self._has(held_ids[i], rep):
                    continue
            elif self._masks(rh)[0] & bit:
                continue
            old = exp.get(rh)
            if old is None:
                self._pred_add(rh, rep)
                self._pred_count += 1
            elif old >= expires:
                continue
            exp[rh] = expires
            recorded.append(rh)
        if recorded:
            self.stats.predicted += len(recorded)
            self._pred_seq += 1
            heapq.heappush(self._pred_heap, (expires, self._pred_seq, ridx, tuple(recorded)))

    def _unpredict(self, rh: int, ridx: int) -> None:
        rep = self._by_index[ridx]
        if _in_table(rh):
            s = self._find(rh)
            vals = self._vals_mv
            i = s + s
            vals[i + 1] = new = self._without_bit(vals[i + 1], rep)
            if not new and not vals[i]:
                self._delete(s)
        else:
            mask = self._odd_pred[rh] ^ rep.bit
            if mask:
                self._odd_pred[rh] = mask
            else:
                del self._odd_pred[rh]
        del self._pred_exp[ridx][rh]
        self._pred_count -= 1

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
                    self._unpredict(rh, ridx)
                    dropped += 1
        self.stats.expired += dropped
        return dropped

    # --- queries --------------------------------------------------------------------------

    def match(self, router_hashes: Sequence[int], now: float) -> dict[str, PrefixMatch]:
        """Per replica with at least one leading block: its longest contiguous prefix match.

        Vectorised: one probe of the block table for all of the request's blocks, then a running
        AND of their replica bitmasks; a few numpy calls whatever the replica count. Predictions
        that expired by ``now`` are purged first (so time must not run backwards between calls).
        """
        if not router_hashes:
            return {}
        heap = self._pred_heap
        if heap and heap[0][0] <= now:
            self.expire(now)
        ids = self._lookup(router_hashes)
        if ids is None:
            return self._match_scalar(router_hashes)
        rows = self._rows
        held = rows[ids[:, 0]]
        names = self._names
        width = self._width
        out: dict[str, PrefixMatch] = {}
        if not self._pred_count or not ids[:, 1].any():  # confirmed == blocks
            same = self._same
            for f, word in _ended(held):
                length, c = divmod(f, width)
                length += 1
                base = (width - 1 - c) << 6
                while len(same) <= length:
                    same.append(PrefixMatch(len(same), len(same)))
                pm = same[length]
                while word:  # measured faster than bin()/str.find and than 1 << top
                    top = word.bit_length() - 1
                    out[names[base + top]] = pm
                    word ^= _BIT64[top]
            return out
        confirmed: dict[int, int] = {}
        for f, word in _ended(held):
            length, c = divmod(f, width)
            base = (width - 1 - c) << 6
            while word:
                top = word.bit_length() - 1
                confirmed[base + top] = length + 1
                word ^= _BIT64[top]
        for f, word in _ended(held | rows[ids[:, 1]]):
            length, c = divmod(f, width)
            length += 1
            base = (width - 1 - c) << 6
            while word:
                top = word.bit_length() - 1
                r = base + top
                out[names[r]] = PrefixMatch(length, confirmed.get(r, 0))
                word ^= _BIT64[top]
        return out

    def replicas_holding(self, router_hash: int) -> frozenset[str]:
        """Replicas that hold this block according to events (predictions not included)."""
        mask, _ = self._masks(router_hash)
        names = []
        while mask:
            top = mask.bit_length() - 1
            names.append(self._names[top])
            mask ^= self._bits[top]
        return frozenset(names)

    def _lookup(self, router_hashes: Sequence[int]) -> U32 | None:
        """(held mask id, predicted mask id) per block, or None where the scalar path must go.

        Every key lies within its run of occupied slots from its home slot, so for each block the
        first slot of its window that holds the block or is empty answers it (an empty slot's ids
        are 0); a window that is all other keys (rare) is resolved by a scalar probe.
        """
        try:
            h = np.frombuffer(array("Q", router_hashes), np.uint64)
        except (OverflowError, TypeError):
            return None  # not uint64s: the scalar path treats them as the dicts did
        if (self._odd_held or self._odd_pred) and not h.all():
            return None  # a hash 0 while odd keys are held
        n = len(h)
        home = (h >> self._shift_u64).view(np.intp)
        window = self._windows[home]
        stop = window == h[:, None]
        stop |= window == 0
        pos = stop.argmax(1)
        slot = home + pos
        ids: U32 = self._pairs[slot]
        ar = self._arange
        if len(ar) < n:
            ar = self._arange = np.arange(2 * n)
        if not stop[ar[:n], pos].all():  # some window had neither the block nor an empty slot
            for i in np.flatnonzero(~stop[ar[:n], pos]).tolist():
                s = self._find(int(h[i]))
                ids[i] = self._pairs[s] if s >= 0 else 0
        return ids

    def _match_scalar(self, router_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """match() one block at a time, with Python int bitmasks (any hashable keys)."""
        pairs = [self._masks(rh) for rh in router_hashes]
        masks = [p[0] for p in pairs]
        combined = [p[0] | p[1] for p in pairs]
        names = self._names
        bits = self._bits
        out: dict[str, PrefixMatch] = {}
        if combined == masks:
            for length, ended in _leading_runs(masks):
                while ended:
                    top = ended.bit_length() - 1
                    out[names[top]] = PrefixMatch(length, length)
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

    # --- (held, predicted) masks of one key -------------------------------------------------

    def _masks(self, rh: int) -> tuple[int, int]:
        """The bitmasks of the replicas holding and predicted to hold ``rh``."""
        if not _in_table(rh):
            return self._odd_held.get(rh, 0), self._odd_pred.get(rh, 0)
        s = self._find(rh)
        if s < 0:
            return 0, 0
        return self._mask(self._vals_mv[s + s]), self._mask(self._vals_mv[s + s + 1])

    def _held_add(self, rh: int, rep: _Replica) -> bool:
        """Mark ``rh`` held by ``rep`` (superseding its prediction); False if it already was."""
        if not _in_table(rh):
            mask = self._odd_held.get(rh, 0)
            if mask & rep.bit:
                return False
            self._odd_held[rh] = mask | rep.bit
            if not mask:
                self._held_blocks += 1
            if self._odd_pred.get(rh, 0) & rep.bit:
                self._unpredict(rh, rep.index)
            return True
        s = self._insert(rh)
        vals = self._vals_mv
        i = s + s
        mid = vals[i]
        if self._has(mid, rep):
            return False
        vals[i] = self._with_bit(mid, rep)
        if not mid:
            self._held_blocks += 1
        if self._has(vals[i + 1], rep):
            self._unpredict(rh, rep.index)
        return True

    def _held_remove(self, rh: int, rep: _Replica) -> bool:
        """Clear ``rep``'s held bit of ``rh``; False if it was not set."""
        if not _in_table(rh):
            mask = self._odd_held.get(rh, 0)
            if not mask & rep.bit:
                return False
            mask ^= rep.bit
            if mask:
                self._odd_held[rh] = mask
            else:
                del self._odd_held[rh]
                self._held_blocks -= 1
            return True
        s = self._find(rh)
        if s < 0:
            return False
        vals = self._vals_mv
        i = s + s
        mid = vals[i]
        if not self._has(mid, rep):
            return False
        vals[i] = new = self._without_bit(mid, rep)
        if not new:
            self._held_blocks -= 1
            if not vals[i + 1]:
                self._delete(s)
        return True

    def _pred_add(self, rh: int, rep: _Replica) -> None:
        """Set ``rep``'s predicted bit of ``rh`` (not set before)."""
        if not _in_table(rh):
            self._odd_pred[rh] = self._odd_pred.get(rh, 0) | rep.bit
            return
        s = self._insert(rh)
        i = s + s + 1
        self._vals_mv[i] = self._with_bit(self._vals_mv[i], rep)

    # --- mask rows ------------------------------------------------------------------------

    def _mask(self, mid: int) -> int:
        """The replica bitmask of mask id ``mid`` as a Python int."""
        rows = self._rows_mv
        width = self._width
        base = mid * width
        mask = rows[base]
        for j in range(base + 1, base + width):
            mask = (mask << 64) | rows[j]
        return mask

    def _has(self, mid: int, rep: _Replica) -> bool:
        return bool(self._rows_mv[mid * self._width + rep.col] & rep.wbit)

    def _with_bit(self, mid: int, rep: _Replica) -> int:
        """The mask id of mask(``mid``) | ``rep`` (its bit not in it): ``mid`` or a new id."""
        if not mid:
            return rep.sid
        other = self._single.get(mid)
        width = self._width
        if other is not None:
            mid = self._alloc_id()
            o = self._by_index[other]
            self._rows_mv[mid * width + o.col] = o.wbit
        rows = self._rows_mv
        j = mid * width + rep.col
        rows[j] = rows[j] | rep.wbit
        return mid

    def _without_bit(self, mid: int, rep: _Replica) -> int:
        """The mask id of mask(``mid``) less ``rep`` (its bit in it): ``mid``, 0 or a single."""
        if mid == rep.sid:
            return 0
        rows = self._rows_mv
        j = mid * self._width + rep.col
        rows[j] = rows[j] ^ rep.wbit
        mask = self._mask(mid)
        if mask & (mask - 1):
            return mid
        # One replica left: its shared row; this one is freed (zeroed) for reuse.
        rows[mid * self._width + self._by_index[mask.bit_length() - 1].col] = 0
        self._free_ids.append(mid)
        return self._by_index[mask.bit_length() - 1].sid

    def _alloc_id(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        mid = self._next_id
        if mid * self._width >= len(self._rows_flat):
            self._set_rows(self._width, 2 * len(self._rows))
        self._next_id = mid + 1
        return mid

    def _widen(self, width: int) -> None:
        """Rows of ``width`` words (more replicas); the old words keep their significance."""
        old, old_width = self._rows, self._width
        self._set_rows(width, len(old))
        self._rows[:, width - old_width :] = old
        for rep in self._by_index:
            rep.col = width - 1 - (rep.index >> 6)

    def _set_rows(self, width: int, count: int) -> None:
        flat = np.zeros(width * count, np.uint64)
        old = self._rows
        rows = flat.reshape(count, width)
        if width == self._width:
            rows[: len(old)] = old
        self._width = width
        self._rows_flat = flat
        self._rows = rows
        self._rows_mv = flat.data

    # --- block table ----------------------------------------------------------------------

    def _set_table(self, bits: int, keys: U64, pairs: U32) -> None:
        """Install a table of 2**bits home slots (plus the pad) filled with ``keys``/``pairs``."""
        size = (1 << bits) + _PAD
        self._bits_log = bits
        self._shift = 64 - bits
        self._shift_u64 = np.uint64(self._shift)
        self._max_used = int((1 << bits) * _MAX_LOAD)
        self._last = size - 1  # never filled: every probe stops by then
        if len(keys) != size:
            keys = np.zeros(size, np.uint64)
            pairs = np.zeros((size, 2), np.uint32)
        self._keys = keys
        self._vals = pairs.reshape(-1)
        self._pairs = pairs
        self._keys_mv = keys.data
        self._vals_mv = self._vals.data
        self._windows = np.lib.stride_tricks.as_strided(
            keys, shape=(1 << bits, _WIN), strides=(8, 8), writeable=False
        )
        self._used = int(np.count_nonzero(keys))

    def _grow(self) -> None:
        """Rehash into twice the home slots (vectorised: keys placed in order of home slot)."""
        occupied = np.flatnonzero(self._keys)
        keys = self._keys[occupied]
        pairs = self._pairs[occupied]
        bits = self._bits_log + 1
        while True:
            home = (keys >> np.uint64(64 - bits)).view(np.intp)
            order = np.argsort(home, kind="stable")
            ar = np.arange(len(keys))
            pos = np.maximum.accumulate(home[order] - ar) + ar
            if not len(pos) or pos[-1] < (1 << bits) + _PAD - 1:
                break
            bits += 1  # the pad overflowed: practically never
        size = (1 << bits) + _PAD
        new_keys = np.zeros(size, np.uint64)
        new_pairs = np.zeros((size, 2), np.uint32)
        new_keys[pos] = keys[order]
        new_pairs[pos] = pairs[order]
        self._set_table(bits, new_keys, new_pairs)

    def _find(self, rh: int) -> int:
        """The slot of table key ``rh`` (in [1, 2**64)), or -1."""
        keys = self._keys_mv
        s = rh >> self._shift
        k = keys[s]
        while k != rh:
            if not k:
                return -1
            s += 1
            k = keys[s]
        return s

    def _insert(self, rh: int) -> int:
        """The slot of table key ``rh`` (in [1, 2**64)), taken (ids 0) if it was absent."""
        while True:
            keys = self._keys_mv
            s = rh >> self._shift
            k = keys[s]
            while k and k != rh:
                s += 1
                k = keys[s]
            if k:
                return s
            if s < self._last and self._used < self._max_used:
                keys[s] = rh
                self._used += 1
                return s
            self._grow()

    def _delete(self, s: int) -> None:
        """Empty slot ``s``, moving back later keys of its run that may fill the hole."""
        keys = self._keys_mv
        vals = self._vals_mv
        shift = self._shift
        j = s
        while True:
            j += 1
            k = keys[j]
            if not k:
                break
            if k >> shift <= s:
                keys[s] = k
                vals[s + s] = vals[j + j]
                vals[s + s + 1] = vals[j + j + 1]
                s = j
        keys[s] = 0
        vals[s + s] = 0
        vals[s + s + 1] = 0
        self._used -= 1


def _in_table(rh: int) -> bool:
    """Whether router hash ``rh`` can be a table key (the router's hashes always can but 0)."""
    try:
        return 0 < rh < _HASH_END
    except TypeError:  # not a number: only the odd-key dicts can hold it
        return False


def _ended(masks: U64) -> zip[tuple[int, int]]:
    """(flat index, word) of the non-zero words of ``cum[i] & ~cum[i + 1]``, ``cum`` being the
    running AND of ``masks`` (rows) and ``cum[n]`` 0: row i holds the replicas whose leading run
    is i + 1 blocks long. Row-major order: run lengths ascending, then words most significant
    first."""
    cum = np.bitwise_and.accumulate(masks, axis=0)
    ended = cum.copy()
    ended[:-1] ^= cum[1:]
    flat = ended.reshape(-1)
    nz = np.flatnonzero(flat)
    return zip(nz.tolist(), flat[nz].tolist(), strict=True)


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
