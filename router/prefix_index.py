"""Which replica holds which KV block: the prefix index fed by KV events (DESIGN.md 2 and 3).

Pure and synchronous: no asyncio, no I/O, no wall clock (times are passed in), so the live
router's event subscriber and the fleet simulator share it.

Layout, chosen for memory and lookup latency (measured by ``kvroute bench index``):

* ``_holders``: router block hash -> one int with two bitmasks of replica indices (replica names
  are interned to small ints): the replicas holding the block by events in the low ``_shift``
  bits, and the replicas holding it or predicted to hold it in the bits above. One dict lookup
  per block answers both, and a running AND of these ints along a request gives both leading
  runs at once (held ⊆ held or predicted, so the int is non-zero while any run goes on). A block
  held by one replica stores that replica's shared, pre-built int, so the common case costs one
  dict slot and the key. A block only predicted has an entry with no low bits.
* per replica and medium, ``engine hash -> router hash`` (the value is the very int object that is
  the key in ``_holders``), so ``BlockRemoved``, which carries only engine hashes, can be applied.
* per replica, ``extra``: router hash -> references beyond the first, for the rare block held
  twice by one replica (on GPU and CPU, or under two engine hashes that the router hashes alike,
  e.g. a cache salt the router was not told about). A bit is cleared only when its last
  reference goes.
* predictions: the high bits above (only live ones: every ``predict``/``match``/``expire`` first
  purges what expired by its ``now``, from a heap), and per replica router hash -> expiry. A
  real ``BlockStored`` of the block on that replica supersedes (deletes) its prediction, so a
  replica is never both holding and predicted for one block.

The index holds only ints, dicts of ints and a few lists: a garbage collection does not walk its
millions of entries (dicts of untracked ints are untracked themselves).

Lookup latency, measured on the dev box (2 vCPU, 5M entries, 200 replicas): a dict lookup that
misses every cache costs ~0.5 us, most of a 128-block ``match``; so ``match`` looks up only the
blocks up to where every run has ended, in one C-level pipeline of iterators (no per-block
bytecode), and reads held and predicted replicas from the same lookup. (A numpy open-addressing
table, gathered in one call, was tried: on that box each numpy call costs a few us and the pure
Python probing slows ingest by ~20%, for no gain.)

The router recomputes its own chained hashes from each ``BlockStored``'s ``token_ids``, chaining
from the router hash of the parent block, found through that replica's engine -> router map.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, islice, repeat, takewhile
from operator import and_, ne
from typing import NamedTuple

from .block_hashing import chain_hashes, root_seed

DEFAULT_MEDIUM = "GPU"

EngineHash = int | bytes

_MIN_SHIFT = 256  # replica indices below it need no re-encoding of the index (see _reshift)


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
    __slots__ = ("bit", "both", "extra", "index", "maps", "name", "pbit")

    def __init__(self, name: str, index: int, shift: int) -> None:
        self.name = name
        self.index = index
        self.bit = 1 << index  # held
        self.pbit = self.bit << shift  # held or predicted
        self.both = self.bit | self.pbit  # held (so also held or predicted): a shared value
        self.maps: dict[str, dict[EngineHash, int]] = {}
        self.extra: dict[int, int] = {}


class PrefixIndex:
    """Router block hash -> replicas holding it, fed by vLLM KV events and predictions."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._shift = _MIN_SHIFT
        self._low = (1 << _MIN_SHIFT) - 1  # the held bits of a _holders value
        self._replicas: dict[str, _Replica] = {}
        self._by_index: list[_Replica] = []
        self._bits: list[int] = []  # shared single-bit ints, one per replica index
        self._boths: list[int] = []  # replica index -> its value as a block's single holder
        self._names: list[str] = []  # replica index -> name
        self._same: list[PrefixMatch] = []  # PrefixMatch(n, n), built once per n
        self._entries = 0
        self._pred_only = 0  # _holders entries with no holder, only predictions
        self._pred_count = 0  # (block, replica) predictions
        self._pred_exp: list[dict[int, float]] = []  # replica index -> router hash -> expiry
        self._pred_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._pred_seq = 0
        # _set's last (old value, change) -> new value: blocks that shared a value share the next.
        self._last_old = self._last_delta = self._last_new = 0
        self.stats = IndexStats()
        # The block size of the last BlockStored applied: how the router learns the replicas'.
        self.block_size: int | None = None

    # --- replicas -------------------------------------------------------------------------

    def _replica(self, name: str) -> _Replica:
        rep = self._replicas.get(name)
        if rep is None:
            index = len(self._by_index)
            if index >= self._shift:
                self._reshift(2 * self._shift)
            rep = _Replica(name, index, self._shift)
            self._replicas[name] = rep
            self._by_index.append(rep)
            self._bits.append(rep.bit)
            self._boths.append(rep.both)
            self._names.append(name)
            self._pred_exp.append({})
        return rep

    def _reshift(self, shift: int) -> None:
        """Move the held-or-predicted bits of every value up to ``shift`` (more replicas)."""
        old_shift, low = self._shift, self._low
        self._shift = shift
        self._low = (1 << shift) - 1
        for rep in self._by_index:
            rep.pbit = rep.bit << shift
            rep.both = rep.bit | rep.pbit
        self._boths = [rep.both for rep in self._by_index]
        self._last_old = self._last_delta = self._last_new = 0
        holders = self._holders
        for rh, value in holders.items():
            holders[rh] = self._shared(value & low | (value >> old_shift) << shift)

    def _shared(self, value: int) -> int:
        """``value``, or the equal pre-built int if one replica holds the block (and no other
        replica is predicted to): no per-block int object for the common case."""
        held = value & self._low
        if held and not held & (held - 1):
            single = self._boths[held.bit_length() - 1]
            if value == single:
                return single
        return value

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
        return len(self._holders) - self._pred_only

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

        holders = self._holders
        bit = rep.bit
        both = rep.both
        extra = rep.extra
        predicted = self._pred_count  # no prediction anywhere: no entry is only predicted
        added = 0
        new_entries = 0
        # An event's blocks mostly share their value object (one holder's pre-built int, or an
        # int built for the blocks before): build the new value once per run of equal objects,
        # so the blocks keep sharing it (fewer ints, and lookups touch fewer cache lines).
        last: int | None = None
        last_new = 0
        setdefault = emap.setdefault
        for eh, rh in zip(engine_hashes, hashes, strict=False):
            old = setdefault(eh, rh)  # one lookup in the (big) map for the common, new case
            if old is not rh:
                if old == rh:
                    continue  # the same block stored again
                self._unref(rep, old)  # an engine hash reused for other content
                emap[eh] = rh
            added += 1
            value = holders.get(rh)
            if value is None:
                holders[rh] = both
                new_entries += 1
            elif value & bit:
                extra[rh] = extra.get(rh, 0) + 1
            else:
                if value is not last:
                    last = value
                    last_new = value | both
                holders[rh] = last_new
                new_entries += 1
                if predicted:
                    if not value & self._low:
                        self._pred_only -= 1  # was only predicted
                    if value >> self._shift & bit:  # its prediction here is superseded
                        del self._pred_exp[rep.index][rh]
                        self._pred_count -= 1
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
        bit = rep.bit
        dropped = 0
        for emap in rep.maps.values():
            for rh in emap.values():
                value = holders.get(rh)
                if value is None or not value & bit:
                    continue  # a second reference already cleared
                self._set(rh, value, rep.both)
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
        # Held here, so not predicted here: both of its bits go.
        value = self._holders[rh]
        self._set(rh, value, rep.both)
        self._entries -= 1

    def _set(self, rh: int, old: int, delta: int) -> None:
        """Replace ``rh``'s value ``old`` by ``old ^ delta``: a holder or a prediction less."""
        low = self._low
        if not old & low:
            self._pred_only -= 1
        if old is self._last_old and delta is self._last_delta:  # as in apply_stored
            value = self._last_new
        else:
            value = self._shared(old ^ delta)
            self._last_old, self._last_delta, self._last_new = old, delta, value
        if not value:
            del self._holders[rh]
            return
        if not value & low:
            self._pred_only += 1
        self._holders[rh] = value

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
        ridx, bit, pbit = rep.index, rep.bit, rep.pbit
        expires = now + ttl_s
        holders = self._holders
        exp = self._pred_exp[ridx]
        recorded: list[int] = []
        last = -1
        last_new = 0
        for rh in router_hashes:
            value = holders.get(rh, 0)
            if value & bit:
                continue
            old = exp.get(rh)
            if old is None:
                if value is not last:  # as in apply_stored: equal values stay shared
                    last = value
                    last_new = value | pbit
                holders[rh] = last_new
                if not value:
                    self._pred_only += 1
                self._pred_count += 1
            elif old >= expires:
                continue
            exp[rh] = expires
            recorded.append(rh)
        if recorded:
            self.stats.predicted += len(recorded)
            self._pred_seq += 1
            heapq.heappush(self._pred_heap, (expires, self._pred_seq, ridx, tuple(recorded)))

    def unpredict(self, replica: str, router_hashes: Sequence[int]) -> int:
        """Withdraw ``replica``'s predictions of these blocks (the request failed there).

        Blocks held by events are untouched. Returns how many predictions went; their heap
        entries stay and are skipped when they come due.
        """
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        exp = self._pred_exp[rep.index]
        pbit = rep.pbit
        dropped = 0
        for rh in router_hashes:
            if exp.pop(rh, None) is not None:
                self._set(rh, self._holders[rh], pbit)
                self._pred_count -= 1
                dropped += 1
        return dropped

    def expire(self, now: float) -> int:
        """Drop predictions whose expiry is at or before ``now``; returns how many."""
        heap = self._pred_heap
        dropped = 0
        while heap and heap[0][0] <= now:
            _, _, ridx, hashes = heapq.heappop(heap)
            exp = self._pred_exp[ridx]
            pbit = self._by_index[ridx].pbit
            for rh in hashes:
                e = exp.get(rh)
                if e is not None and e <= now:  # not superseded, nor renewed beyond now
                    value = self._holders[rh]  # predicted here, so not held here
                    self._set(rh, value, pbit)
                    del exp[rh]
                    self._pred_count -= 1
                    dropped += 1
        self.stats.expired += dropped
        return dropped

    # --- queries --------------------------------------------------------------------------

    def match(self, router_hashes: Sequence[int], now: float) -> dict[str, PrefixMatch]:
        """Per replica with at least one leading block: its longest contiguous prefix match.

        O(blocks up to where every run has ended + replicas matched): one dict lookup per block
        and a running AND of the values, in C-level iterators that stop at the first block no
        candidate holds or is predicted to; then the (few) blocks where the AND loses replicas.
        Predictions that expired by ``now`` are purged first (so time must not run backwards
        between calls).
        """
        if not router_hashes:
            return {}
        heap = self._pred_heap
        if heap and heap[0][0] <= now:
            self.expire(now)
        runs = list(
            takewhile(bool, accumulate(map(self._holders.get, router_hashes, repeat(0)), and_))
        )
        n = len(runs)
        out: dict[str, PrefixMatch] = {}
        if not n:
            return out
        names = self._names
        bits = self._bits
        low = self._low
        shift = self._shift
        same = self._same
        while len(same) <= n:
            same.append(PrefixMatch(len(same), len(same)))
        confirmed: dict[int, int] = {}
        alive = runs[0]
        # Blocks where the running AND changes: there some runs end (length = that block).
        for length in (*compress(range(1, n), map(ne, runs, islice(runs, 1, None))), n):
            if length < n:
                ended = alive ^ runs[length]  # no ~: bitwise ops on negative ints are slow
                alive = runs[length]
            else:
                ended = alive
            held = ended & low
            while held:  # measured faster than bin()/str.find and than 1 << top
                top = held.bit_length() - 1
                confirmed[top] = length
                held ^= bits[top]
            ended >>= shift
            while ended:  # a replica's held run ends at or before its run with predictions
                top = ended.bit_length() - 1
                c = confirmed.get(top, 0)
                out[names[top]] = same[length] if c == length else PrefixMatch(length, c)
                ended ^= bits[top]
        return out

    def replicas_holding(self, router_hash: int) -> frozenset[str]:
        """Replicas that hold this block according to events (predictions not included)."""
        mask = self._holders.get(router_hash, 0) & self._low
        names = []
        while mask:
            top = mask.bit_length() - 1
            names.append(self._names[top])
            mask ^= self._bits[top]
        return frozenset(names)
