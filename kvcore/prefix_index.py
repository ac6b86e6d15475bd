"""Which replica holds which KV block: the prefix index fed by KV events (DESIGN.md 2 and 3).

Pure and synchronous: no asyncio, no I/O, no wall clock (times are passed in), so the live
router's event subscriber and the fleet simulator share it.

Layout, chosen for lookup latency, ingest rate and memory (measured by ``kvroute bench index``):

* a block's *value*: one int with two bitmasks of replica indices (replica names are interned to
  small ints): the replicas holding the block by events in the low ``_shift`` bits, and the
  replicas holding it or predicted to hold it in the bits above. A running AND of values along a
  request gives both leading runs at once (held ⊆ held or predicted, so the AND is non-zero
  while any run goes on). A block no replica holds or is predicted to hold is not indexed.
* *runs*: the indexed blocks, in chains as they were stored (an event's blocks, continued by the
  next events of the chain, up to ``_MAX_RUN``): ``_runs[id]`` holds their router hashes
  packed in one ``bytes`` (kvcore/packed_runs.py), ``_vals[id]`` their values as pieces
  ``(value, start, value, start, value, ...)`` (each value holds from its start, 0 for the
  first, to the next start or the run's end), and ``_seg`` maps each router hash to its run id.
  :meth:`PrefixIndex.match` looks up one block, then finds how far the request's next hashes
  are the run's (``packed_runs.follow``): those blocks' values are the run's pieces there, and
  their running AND (``packed_runs.walk``) gives where replicas drop out. A request over a
  shared prefix costs a dict lookup or two instead of one per block, and stays exact whatever
  it is (nothing assumes that its hashes form a chain). Why it matters, measured on the dev box
  (2 vCPU VM, 5M entries): a dict lookup that misses the caches costs ~0.5-1 us, and 128 of
  them alone took ~60 us, more than the lookup budget. A lookup's loops and the assembly of
  its result run in C (the extension kvcore/_speedups.c; pure-Python twins give the same
  results where it is not built, 2-3x slower). At 5M entries much of a lookup's time is cache
  misses on the index's memory: the same lookup repeated warm takes ~5 us.
* ingest: an event of blocks new to the index extends its parent's run (or starts one); an event
  of indexed blocks that lie in a row in one run (a replica storing a prefix another one
  stored: the common case) only edits that run's pieces, with no per-block dict write. Values
  changing never split a run; a run splits only where blocks leave the index (the largest part
  keeps its id, so only the others' blocks are remapped). Predictions and their expiry edit
  the pieces of the spans of runs they cover (found with ``packed_runs.follow``); everything
  else (partial overlaps, removals) rebuilds the pieces of the runs it touches.
* per replica and medium, ``engine hash -> router hash`` (the value is the very int object that is
  a key of ``_seg``), so ``BlockRemoved``, which carries only engine hashes, can be applied.
* per replica, ``extra``: router hash -> references beyond the first, for the rare block held
  twice by one replica (on GPU and CPU, or under two engine hashes that the router hashes alike,
  e.g. a cache salt the router was not told about). A bit is cleared only when its last
  reference goes.
* predictions: the high bits above (only live ones: every ``predict``/``match``/``expire`` first
  purges what expired by its ``now``, from a heap of the blocks each call predicted, each once),
  and per replica router hash -> expiry. A real ``BlockStored`` of the block on that replica
  supersedes (deletes) its prediction, so a replica is never both holding and predicted for one
  block. A block predicted and not held there is indexed with that replica's high bit: the
  index answers "predicted here?" without a lookup of the expiries. The bookkeeping is bound by
  dict operations on large dicts (each a CPU cache miss): it keeps them few per block, and
  keys the dicts by the caller's own int objects (found by identity, ~2x faster).

Only ints, bytes, tuples of ints, dicts of ints and lists: after a young collection the garbage
collector tracks none of the index's millions of objects, so collections stay cheap.

The router recomputes its own chained hashes from each ``BlockStored``'s ``token_ids``, chaining
from the router hash of the parent block, found through that replica's engine -> router map.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, islice, pairwise, repeat
from operator import is_, ne
from typing import NamedTuple, cast

from kvroute.kvcore import packed_runs
from kvroute.kvcore.block_hashing import chain_hashes, root_seed
from kvroute.kvcore.cache_groups import GROUP_KINDS, GroupHoldings, hybrid_hit
from kvroute.kvcore.kv_tiers import TierCapacity, TierHoldings, TierRun
from kvroute.kvcore.packed_runs import Run, W, find, unpack, word

DEFAULT_MEDIUM = "GPU"
# A cache group's engine -> router map is keyed "<medium>#g<group>" (group 0: the medium alone,
# so a single-group model's maps, snapshots and hot path are what they were).
GROUP_SEP = "#g"


def _map_key(medium: str, group: int) -> str:
    """The engine -> router map of ``group`` on ``medium`` (group 0: the medium alone)."""
    return f"{medium}{GROUP_SEP}{group}" if group else medium


EngineHash = int | bytes

Pieces = tuple[int, ...]  # (value, start, value, start, value, ...) along a run

_MIN_SHIFT = 256  # replica indices below it need no re-encoding of the values (see _reshift)
_RENEW_MEMO_TAIL = 4  # a prompt's last blocks that each key its renewal memo (_memo_renewed)
_MAX_RUN = 256  # blocks: events extend a run up to there (a lookup scans a run to find a block)
_sink: deque[object] = deque(maxlen=0)
_consume = _sink.extend  # runs an iterator in C, keeping nothing


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
    unplaced_group_blocks: int = 0  # a group's blocks whose place in the event is unknown
    cleared: int = 0  # clear_replica calls (AllBlocksCleared, resyncs)
    predicted: int = 0  # (block, replica) predictions recorded
    expired: int = 0  # predictions that expired unconfirmed


class _Replica:
    __slots__ = (
        "bit",
        "both",
        "capacity",
        "copies",
        "extra",
        "groups",
        "index",
        "last_new",
        "last_old",
        "maps",
        "name",
        "pbit",
        "tiers",
    )

    def __init__(self, name: str, index: int, shift: int) -> None:
        self.name = name
        self.index = index
        self.bit = 1 << index  # held
        self.pbit = self.bit << shift  # held or predicted
        self.both = self.bit | self.pbit  # held (so also held or predicted)
        self.maps: dict[str, dict[EngineHash, int]] = {}
        # Under memory pressure vLLM caches a block a second time (the same hash, a second
        # physical copy) and later sends a BlockRemoved for each copy it evicts: per map key,
        # the copies beyond the first, so only the last copy's removal drops the block. (A
        # request with vLLM's opt-in kv_cache_report_mode "full" re-reports blocks it reused:
        # counted as copies too, its blocks outstay their eviction by one removal.)
        self.copies: dict[str, dict[EngineHash, int]] = {}
        self.extra: dict[int, int] = {}
        # The last value this replica was added to, and the result: the pieces of a chain it
        # stores one event after another share one value object (fewer ints, and equal pieces
        # next to each other merge).
        self.last_old = self.last_new = 0
        self.capacity = TierCapacity()
        # Blocks per tier, kept from the first event of a tier other than the GPU on (a
        # replica without offloading costs nothing more).
        self.tiers: TierHoldings | None = None
        # Blocks per KV cache group, kept from the first event of a hybrid model's second group
        # (or of a sliding-window/mamba group) on: see kvcore/cache_groups.py.
        self.groups: dict[int, GroupHoldings] | None = None


class PrefixIndex:
    """Router block hash -> replicas holding it, fed by vLLM KV events and predictions."""

    def __init__(self) -> None:
        self._seg: dict[int, int] = {}  # router hash -> run id
        self._runs: list[Run] = []  # run id -> its blocks; () if free
        self._vals: list[Pieces] = []  # run id -> its blocks' values; () if free
        self._free_ids: list[int] = []
        self._shift = _MIN_SHIFT
        self._low = (1 << _MIN_SHIFT) - 1  # the held bits of a value
        self._replicas: dict[str, _Replica] = {}
        self._by_index: list[_Replica] = []
        self._bits: list[int] = []  # shared single-bit ints, one per replica index
        self._names: list[str] = []  # replica index -> name
        self._same: list[PrefixMatch] = []  # PrefixMatch(n, n), built once per n
        self._entries = 0
        self._pred_only = 0  # blocks with a value but no holder: only predicted
        self._pred_count = 0  # (block, replica) predictions
        self._pred_exp: list[dict[int, float]] = []  # replica index -> router hash -> expiry
        # (expiry, seq, replica index, the prompt's router hashes)
        self._pred_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._pred_seq = 0
        # (replica index, a prompt prefix's last hash) -> until when the last renewal of that
        # prefix's hinted predictions spares another (see predict), oldest first
        self._renewed: OrderedDict[tuple[int, int], float] = OrderedDict()
        self.stats = IndexStats()
        # The block size of the last BlockStored applied: how the router learns the replicas'.
        self.block_size: int | None = None
        # Whether some replica announced a tier below its GPU (then ``tier_run`` answers).
        self.tiered = False
        # Whether some replica keeps cache groups (then ``match`` applies vLLM's hybrid rule).
        self.hybrid = False

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
            rep.last_old = rep.last_new = 0
        vals = self._vals
        for rid, pieces in enumerate(vals):
            if pieces:
                moved = list(pieces)
                for t in range(0, len(moved), 2):
                    value = moved[t]
                    moved[t] = value & low | (value >> old_shift) << shift
                vals[rid] = tuple(moved)

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
        return len(self._seg) - self._pred_only

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
        group: int = 0,
        group_kind: str | None = None,
        group_window: int | None = None,
    ) -> int:
        """Index one BlockStored event; returns the blocks newly indexed.

        ``parent_engine_hash`` None (or int 0, as some senders write "no parent") starts a chain
        at the root, seeded by ``extra_key``; otherwise the parent must be known for this replica
        (on any medium), else the event is counted in ``stats.unknown_parent`` and skipped.
        Token ids must lie in [0, 2**32) (OverflowError otherwise). ``group`` is the event's
        ``group_idx``, with its spec kind and sliding window (tokens): a hybrid model's groups
        hold blocks apart (kvcore/cache_groups.py).
        """
        rep = self._replicas.get(replica) or self._replica(replica)
        self.block_size = block_size
        med = medium or DEFAULT_MEDIUM
        key = med
        if group or group_kind is not None:
            key = self._group_key(rep, med, group, group_kind, group_window)
        emap = rep.maps.get(key)
        if emap is None:
            emap = rep.maps[key] = {}
        parent: int | None = None
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
        if rep.groups is not None and len(engine_hashes) < len(hashes):
            engine_hashes, hashes = self._place_group_blocks(rep, emap, engine_hashes, hashes, key)
        n = min(len(engine_hashes), len(hashes))  # zip(strict=False), as events are read
        if n < len(hashes):
            hashes = hashes[:n]
        ehs = engine_hashes if len(engine_hashes) == n else engine_hashes[:n]
        return self._store(rep, emap, ehs, hashes, parent, med, group)

    def _place_group_blocks(
        self,
        rep: _Replica,
        emap: dict[EngineHash, int],
        engine_hashes: Sequence[EngineHash],
        hashes: list[int],
        key: str,
    ) -> tuple[list[EngineHash], list[int]]:
        """A hybrid group's event skips its null and masked blocks (sliding-window blocks out
        of the window, mamba blocks between aligned ones: vLLM's ``cache_full_blocks``), so its
        hashes are not the token blocks in order. vLLM's block hash is the content's in every
        group: each is placed by another group's map (the full-attention group stores every
        block, the same step and before); one no group knows is dropped and counted, one this
        group holds already is counted as another copy and left out (the router hash is another
        map's very object, which ``_store``'s undo by identity must not meet)."""
        known = set(hashes)
        ehs: list[EngineHash] = []
        rhs: list[int] = []
        for eh in engine_hashes:
            if eh in emap:  # held in this group already: another copy of it
                copies = rep.copies.setdefault(key, {})
                copies[eh] = copies.get(eh, 0) + 1
                continue
            for other in rep.maps.values():
                rh = other.get(eh)
                if rh is not None and rh in known:
                    ehs.append(eh)
                    rhs.append(rh)
                    break
            else:
                self.stats.unplaced_group_blocks += 1
        return ehs, rhs

    def _group_key(
        self, rep: _Replica, med: str, group: int, kind: str | None, window: int | None
    ) -> str:
        """The map key of ``group`` on ``med``; makes the replica hybrid when the group is not
        group 0 of a plain model, and learns the group's kind and window."""
        groups = rep.groups
        if groups is None:
            if not group and kind not in GROUP_KINDS:
                return med  # group 0 of full attention: a single-group model so far
            groups = rep.groups = {0: GroupHoldings()}
            for key, emap in rep.maps.items():  # what group 0 held before the replica was hybrid
                if GROUP_SEP not in key:
                    groups[0].add(list(emap.values()))
            self.hybrid = True
        holdings = groups.get(group)
        if holdings is None:
            holdings = groups[group] = GroupHoldings()
            rep.groups = dict(sorted(groups.items()))  # vLLM's order: full attention first
        holdings.learn(kind, window)
        return _map_key(med, group)

    def _store(
        self,
        rep: _Replica,
        emap: dict[EngineHash, int],
        ehs: Sequence[EngineHash],
        hashes: list[int],
        parent: int | None,
        med: str,
        group: int = 0,
    ) -> int:
        """Map and hold blocks whose router hashes are known (an event's, a snapshot's), on
        tier ``med``."""
        n = len(hashes)
        # The engine -> router map, and the blocks this event adds to the replica.
        before = len(emap)
        _consume(map(emap.setdefault, ehs, hashes))  # the common case: all new to this medium
        if len(emap) - before == n:
            added = hashes
        else:  # an engine hash known already, or twice in the event: undo, one by one
            for eh, rh in zip(ehs, hashes, strict=True):
                if emap.get(eh) is rh:
                    del emap[eh]
            key = _map_key(med, group)
            added = self._map_blocks(rep, emap, ehs, hashes, med, key)
        self.stats.stored += len(added)
        if rep.groups is not None:
            rep.groups[group].add(added)
            if group:  # tiers and their capacity follow group 0
                if added:
                    self._entries += self._hold(rep, added, parent)
                return len(added)
        rep.capacity.update(med, len(emap))
        tiers = rep.tiers
        if tiers is None and med != DEFAULT_MEDIUM:
            tiers = rep.tiers = TierHoldings()
            self.tiered = True
            gpu = rep.maps.get(DEFAULT_MEDIUM)
            if gpu:
                tiers.add(DEFAULT_MEDIUM, gpu.values())
            tiers.add(med, emap.values())
        elif tiers is not None and added:
            tiers.add(med, added)
        if added:
            self._entries += self._hold(rep, added, parent)
        return len(added)

    # --- snapshots (kvcore/index_snapshot.py) ----------------------------------------------

    def held_blocks(self, replica: str) -> dict[str, tuple[list[EngineHash], list[int]]]:
        """One replica's engine -> router hash maps by medium, in the order they were stored:
        what a snapshot needs to rebuild the replica's entries (predictions are not in it)."""
        rep = self._replicas.get(replica)
        if rep is None:
            return {}
        return {med: (list(emap), list(emap.values())) for med, emap in rep.maps.items() if emap}

    def restore_blocks(
        self,
        replica: str,
        medium: str,
        engine_hashes: Sequence[EngineHash],
        router_hashes: Sequence[int],
        block_size: int | None,
    ) -> int:
        """Hold blocks taken from a snapshot (``held_blocks`` of another index); returns the
        blocks newly indexed. Stored in pieces, each continuing the one before it (held_blocks
        keeps the order chains were stored in, so runs stay chains mostly): a stretch that is
        the next blocks of an indexed run (another replica's, restored before), or blocks new
        to the index, so that most pieces take ingest's fast paths."""
        if len(engine_hashes) != len(router_hashes):
            raise ValueError("engine and router hashes differ in length")
        rep = self._replicas.get(replica) or self._replica(replica)
        if block_size is not None:
            self.block_size = block_size
        med, sep, g = medium.partition(GROUP_SEP)  # a group's map (its kind comes with events)
        group = int(g) if sep else 0
        if group:
            self._group_key(rep, med, group, None, None)
        emap = rep.maps.get(medium)
        if emap is None:
            emap = rep.maps[medium] = {}
        seg = self._seg
        added = 0
        parent: int | None = None
        i, n = 0, len(router_hashes)
        while i < n:
            rid = seg.get(router_hashes[i])
            if rid is not None:
                k = max(1, packed_runs.follow(self._runs[rid], router_hashes, i, _MAX_RUN)[1])
            else:
                k = 1
                while i + k < n and k < _MAX_RUN and router_hashes[i + k] not in seg:
                    k += 1
            hashes = list(router_hashes[i : i + k])
            added += self._store(rep, emap, engine_hashes[i : i + k], hashes, parent, med, group)
            parent = hashes[-1]
            i += k
        return added

    def _map_blocks(
        self,
        rep: _Replica,
        emap: dict[EngineHash, int],
        engine_hashes: Sequence[EngineHash],
        hashes: list[int],
        medium: str,
        key: str,
    ) -> list[int]:
        """Map the engine hashes one by one; the router hashes newly mapped, in order."""
        added: list[int] = []
        setdefault = emap.setdefault
        for eh, rh in zip(engine_hashes, hashes, strict=True):
            old = setdefault(eh, rh)
            if old is not rh:
                if old == rh:  # the same block stored again: another copy of it
                    copies = rep.copies.setdefault(key, {})
                    copies[eh] = copies.get(eh, 0) + 1
                    continue
                held = rep.copies.get(key)
                if held:
                    held.pop(eh, None)  # reused for other content: the old one's copies went
                if old in added:
                    # Reused within this very event (no engine sends that; a broken or
                    # hostile publisher may): the earlier block is not held yet, so it is
                    # dropped from what this event adds rather than released.
                    added.remove(old)
                else:
                    self._release(rep, [old])  # an engine hash reused for other content
                    if rep.tiers is not None:
                        rep.tiers.drop(medium, [old])
                emap[eh] = rh
            added.append(rh)
        return added

    def _hold(self, rep: _Replica, hashes: list[int], parent: int | None) -> int:
        """Add ``rep`` as a holder of these blocks (a chain, in order, after ``parent``);
        returns the new (block, replica) entries (the others count as extra references)."""
        seg = self._seg
        runs = self._runs
        vals = self._vals
        k = len(hashes)
        packed = packed_runs.pack(hashes)
        rid = seg.get(hashes[0])
        if rid is None and k <= _MAX_RUN:  # new: normally all of them, after the parent's run
            prid = None
            if parent is not None:
                prid = seg.get(parent)
                if prid is not None and (
                    not runs[prid].endswith(word(parent)) or len(runs[prid]) // W + k > _MAX_RUN
                ):
                    prid = None
            target = prid if prid is not None else self._new_id()
            before = len(seg)
            _consume(map(seg.setdefault, hashes, repeat(target)))
            if len(seg) - before == k:
                both = rep.both
                if prid is None:
                    runs[target] = packed
                    vals[target] = (both,)
                else:
                    run = runs[prid]
                    runs[prid] = run + packed
                    if vals[prid][-1] != both:
                        vals[prid] = (*vals[prid], len(run) // W, both)
                return k
            # Some known already, or twice in the event: undo, then one by one.
            own = set(unpack(runs[target]))
            for rh in hashes:
                if seg.get(rh) == target and rh not in own:
                    del seg[rh]
            if prid is None:
                self._free_id(target)
        elif rid is not None:
            run = runs[rid]
            j = find(run, packed[:W])
            if j >= 0 and run.startswith(packed, j * W):
                # Blocks in a row in one run: only its pieces change, if none is here yet.
                added = self._add_range(vals[rid], len(run) // W, j, j + k, rep)
                if added is not None:
                    vals[rid] = added
                    return k
        # One by one: values of blocks met earlier in this event come from ``new_values``.
        current = self._values_of(hashes)
        new_values: dict[int, int] = {}
        extra = rep.extra
        bit, both = rep.bit, rep.both
        exp = self._pred_exp[rep.index]
        predicted = self._pred_count
        shift = self._shift
        held = 0
        for rh in hashes:
            value = new_values.get(rh, -1)
            if value < 0:
                value = current[rh]
            if value & bit:
                extra[rh] = extra.get(rh, 0) + 1
                continue
            if predicted and value >> shift & bit:  # its prediction here is superseded
                del exp[rh]
                self._pred_count -= 1
            new_values[rh] = value | both
            held += 1
        self._apply(new_values, hashes if parent is None else (parent, *hashes))
        return held

    def _add_range(self, pieces: Pieces, n: int, a: int, b: int, rep: _Replica) -> Pieces | None:
        """``pieces`` (of a run of ``n`` blocks) with ``rep`` holding blocks ``a:b`` as well;
        None if it holds or is predicted to hold one of them already."""
        bit = rep.bit
        low = self._low
        shift = self._shift
        predicted = self._pred_count
        out: list[int] = []  # the new pieces: equal neighbours make one
        only_predicted = 0
        start = 0
        last = len(pieces) - 1
        for t in range(0, last + 1, 2):
            value = pieces[t]
            end = pieces[t + 1] if t < last else n
            if end <= a or start >= b:
                if not out:
                    out.append(value)
                elif out[-1] != value:
                    out += (start, value)
                start = end
                continue
            if value & bit or (predicted and value >> shift & bit):
                return None
            lo = start if start > a else a
            hi = end if end < b else b
            if not value & low:
                only_predicted += hi - lo
            if value is not rep.last_old:  # blocks that shared a value share the new one
                rep.last_old = value
                rep.last_new = value | rep.both
            added = rep.last_new
            if start < lo:
                if not out:
                    out.append(value)
                elif out[-1] != value:
                    out += (start, value)
            if not out:
                out.append(added)
            elif out[-1] != added:
                out += (lo, added)
            if hi < end:
                out += (hi, value)
            start = end
        self._pred_only -= only_predicted
        return tuple(out)

    def apply_removed(
        self,
        replica: str,
        engine_hashes: Sequence[EngineHash],
        medium: str | None = DEFAULT_MEDIUM,
        group: int = 0,
    ) -> int:
        """Apply one BlockRemoved event; returns the blocks removed (unknown ones are counted).
        A removal concerns its ``group`` only: another group may hold the block still."""
        rep = self._replicas.get(replica)
        med = medium or DEFAULT_MEDIUM
        key = _map_key(med, group)
        emap = rep.maps.get(key) if rep is not None else None
        if rep is None or emap is None:
            self.stats.unknown_removed += len(engine_hashes)
            return 0
        gone: list[int] = []
        copies = rep.copies.get(key)
        for eh in engine_hashes:
            if copies:
                n = copies.get(eh)
                if n:  # one copy of several evicted: the block is still held
                    if n == 1:
                        del copies[eh]
                    else:
                        copies[eh] = n - 1
                    continue
            rh = emap.pop(eh, None)
            if rh is None:
                self.stats.unknown_removed += 1
                continue
            gone.append(rh)
        if rep.groups is not None:
            rep.groups[group].drop(gone)
        if not group:
            rep.capacity.update(med, len(emap), removed=bool(gone))
            if rep.tiers is not None:
                rep.tiers.drop(med, gone)
        self._release(rep, gone)
        self.stats.removed += len(gone)
        return len(gone)

    def clear_replica(self, replica: str) -> None:
        """Forget every block of one replica (AllBlocksCleared, or before a resync).

        Its predictions stay: they stand for requests already sent there, which will store
        their blocks again.
        """
        self.stats.cleared += 1
        rep = self._replicas.get(replica)
        if rep is None:
            return
        mine = {rh: 0 for emap in rep.maps.values() for rh in emap.values()}
        current = self._values_of(mine)
        bit, both = rep.bit, rep.both
        new: dict[int, int] = {}
        for rh in mine:
            value = current[rh]
            if value & bit:  # held here, so not predicted here: both of its bits go
                new[rh] = value ^ both
        self._entries -= len(new)
        self._apply(new)
        rep.maps = {}
        rep.copies = {}
        rep.extra = {}
        if rep.groups is not None:  # the groups' kinds stay: the model did not change
            for holdings in rep.groups.values():
                holdings.held = {}
        rep.capacity.clear()
        if rep.tiers is not None:
            rep.tiers = TierHoldings()

    def _release(self, rep: _Replica, hashes: Iterable[int]) -> None:
        """Drop one reference of ``rep`` to each of these blocks (each it holds)."""
        extra = rep.extra
        dropped: list[int] = []
        for rh in hashes:
            n = extra.get(rh)
            if n:
                if n == 1:
                    del extra[rh]
                else:
                    extra[rh] = n - 1
            else:
                dropped.append(rh)
        if not dropped:
            return
        current = self._values_of(dropped)
        both = rep.both
        new: dict[int, int] = {}
        for rh in dropped:
            # Held here, so not predicted here: both of its bits go.
            new[rh] = new.get(rh, current[rh]) ^ both
        self._entries -= len(dropped)
        self._apply(new)

    # --- tiers ----------------------------------------------------------------------------

    def tier_run(
        self, replica: str, router_hashes: Sequence[int], match: PrefixMatch
    ) -> TierRun | None:
        """How ``replica`` would serve the prompt its ``match`` covers, tier by tier
        (kvcore/kv_tiers.py); None when it has announced no tier but its GPU."""
        rep = self._replicas.get(replica)
        if rep is None or rep.tiers is None:
            return None
        return rep.tiers.run(router_hashes, match.confirmed, match.blocks)

    def tier_capacity(self) -> dict[str, dict[str, dict[str, int | bool]]]:
        """Per replica and tier: blocks held, the capacity learnt from its events, and whether
        that is its size (the tier has evicted) or a lower bound."""
        return {rep.name: rep.capacity.describe() for rep in self._by_index}

    # --- predictions ----------------------------------------------------------------------

    def predict(
        self,
        replica: str,
        router_hashes: Sequence[int],
        now: float,
        ttl_s: float,
        *,
        held: int = 0,
        known: int = 0,
    ) -> None:
        """Record that ``replica`` will soon hold these blocks (the router just sent the prompt).

        Blocks it already holds by events are skipped. A prediction counts in :meth:`match`
        until ``now + ttl_s`` or until a BlockStored of that block on that replica replaces it;
        predicting a block again extends its expiry. Also purges what expired by ``now``.
        ValueError for a hash outside [0, 2**64) (as :func:`block_hashes` never gives).

        ``held`` and ``known`` are hints from a match of this replica a moment ago (the dispatch
        ledger passes them): its leading ``held`` blocks were held by events and its leading
        ``known`` blocks held or predicted. The held ones are not looked up again, and the
        predicted ones are renewed in one pass at most every ``ttl_s / 2`` per prompt prefix
        (keyed by the prefix's last hash: hashes are chained), so a hinted prediction lasts
        ``ttl_s / 2`` to ``ttl_s`` after its latest renewal. Without hints (the default) every
        block is looked up, exactly as described above. A 150k-token conversation's next turn
        costs its new blocks only, instead of a Python pass over all 10k of them.
        """
        self.expire(now)
        if ttl_s <= 0 or not router_hashes:
            return
        rep = self._replica(replica)
        known = min(known, len(router_hashes))
        todo: Sequence[int] = router_hashes
        first = 0  # where the blocks this call may add to the index start
        stale: list[int] = []
        if known:
            held = min(held, known)
            stale = self._renew(rep, router_hashes, held, known, now, ttl_s)
            todo = [*stale, *router_hashes[known:]]
            if not todo:  # nothing new: the prompt was predicted or held, and renewed
                return
            first = held if stale else known
        try:  # before any change: runs hold 64-bit hashes (as plain ints)
            packed = packed_runs.pack(todo)
        except OverflowError:
            raise ValueError("router hashes must lie in [0, 2**64)") from None
        if set(map(type, todo)) == {int}:
            # The caller's ints, not copies, become the dicts' keys: a conversation's next
            # requests bring the same objects (the tokenizer's prefix cache keeps them), and a
            # dict finds a key by identity ~2x faster than an equal int (no cache miss on it).
            # ``todo`` may be the caller's own list from here on: slice or copy it, never
            # mutate or keep it.
            todo = todo if type(todo) is list else list(todo)
        else:
            todo = unpack(packed)
        n = len(todo)
        pbit = rep.pbit
        expires = now + ttl_s
        exp = self._pred_exp[rep.index]
        seg = self._seg
        # Whole-prompt passes run in C (map, count, dict.update), with as few dict operations
        # a block as the bookkeeping allows: a conversation new to the replica is thousands
        # of blocks, and each operation on the index's large dicts misses the CPU caches.
        # As ints (numpy's have no to_bytes); an int is itself, so the identity still holds.
        before = int(router_hashes[first - 1]) if first else None
        # The prompt's tail ``todo`` follows ``before``: rows of blocks new to the index are
        # found in C (not by walking the prompt, as _place does) unless ``before`` is new too.
        tail = not stale and (before is None or before in seg or before not in todo)
        placed = self._place_leading(todo, packed, before, pbit) if tail else 0
        rest = todo
        if placed:  # not indexed, so not predicted here (a prediction is indexed)
            exp.update(zip(islice(todo, placed), repeat(expires)))
            self._pred_only += placed  # their value: the predicted bit alone
            before = todo[placed - 1]
            rest = todo[placed:]
        rids = list(map(seg.get, rest))
        fresh, indexed = rest, []
        if rids.count(None) != len(rest):
            fresh = [rh for rh, rid in zip(rest, rids, strict=True) if rid is None]
            indexed = [rh for rh, rid in zip(rest, rids, strict=True) if rid is not None]
        size = len(exp)
        exp.update(zip(fresh, repeat(expires)))
        distinct = len(exp) - size == len(fresh)
        if not distinct:  # a block twice: its first time predicts it, the next finds it so
            fresh = list(dict.fromkeys(fresh))
        added: list[int] = []
        renewed: list[int] = []
        if indexed and not self._predict_indexed(rep, indexed, expires, added, renewed):
            distinct = False
        if fresh:
            self._pred_only += len(fresh)
            if distinct and tail:
                rows = [(before, fresh)]
                if len(fresh) != len(rest):
                    rows = []
                    new_here = bytes(map(is_, rids, repeat(None)))
                    a = new_here.find(1)
                    while a >= 0:
                        b = new_here.find(0, a)
                        b = len(rest) if b < 0 else b
                        rows.append((rest[a - 1] if a else before, rest[a:b]))
                        a = new_here.find(1, b)
                self._place_rows(rows, lambda blocks: (pbit,))
            else:
                # The blocks new to the index go after the block before them: the chain from
                # there (not the whole prompt, which placing would walk block by block).
                chain = tuple(map(int, router_hashes[max(0, first - 1) :]))
                self._place(dict.fromkeys(fresh, pbit), chain)
        new = placed + len(fresh) + len(added)
        recorded = new + len(renewed)
        self._pred_count += new
        # Every block of the prompt is now held or predicted for at least ttl_s / 2.
        self._memo_renewed(rep, router_hashes, len(router_hashes), now + ttl_s / 2)
        if recorded:
            self.stats.predicted += recorded
            self._pred_seq += 1
            # The blocks whose expiry this call set, each once, in prompt order (a block
            # predicted by another call with an expiry by then goes in the same purge either
            # way).
            if recorded == n:
                blocks = tuple(todo)
            else:
                keep = {*todo[:placed], *fresh, *added, *renewed}
                blocks = tuple(dict.fromkeys(compress(todo, map(keep.__contains__, todo))))
            heapq.heappush(self._pred_heap, (expires, self._pred_seq, rep.index, blocks))

    def _place_leading(
        self, blocks: list[int], packed: bytes, before: int | None, value: int
    ) -> int:
        """Index the leading blocks of ``blocks`` (``packed``: as a run) that are new to the
        index, with ``value``, as _place_rows places a row after ``before``; returns how many.
        A chunk of a run at a time goes into ``_seg`` in one pass that also tells whether they
        were new (one pass where a lookup and an insertion made two); a chunk with a block
        indexed already, or twice, is undone and ends it."""
        seg = self._seg
        runs = self._runs
        vals = self._vals
        done = 0
        while done < len(blocks):
            chunk = blocks[done : done + _MAX_RUN]
            k = len(chunk)
            grow = None  # before's run, if the row continues it
            if not done and before is not None:
                rid = seg.get(before)
                if rid is not None:
                    run = runs[rid]
                    if run.endswith(word(before)) and len(run) // W + k <= _MAX_RUN:
                        grow = rid
            if grow is not None:
                target = grow
            else:  # the id _new_id gives next
                target = self._free_ids[-1] if self._free_ids else len(runs)
            size = len(seg)
            _consume(map(seg.setdefault, chunk, repeat(target)))
            if len(seg) - size != k:
                own = set(unpack(runs[grow])) if grow is not None else set()
                for rh in chunk:
                    if seg.get(rh) == target and rh not in own:
                        del seg[rh]
                return done
            words = packed[done * W : (done + k) * W]
            if grow is not None:
                run = runs[grow]
                vals[grow] = _joined(vals[grow], len(run) // W, (value,))
                runs[grow] = run + words
            else:
                rid = self._new_id()
                runs[rid] = words
                vals[rid] = (value,)
            done += k
        return done

    def _predict_indexed(
        self,
        rep: _Replica,
        hashes: list[int],
        expires: float,
        added: list[int],
        renewed: list[int],
    ) -> bool:
        """Predict ``rep`` holds these indexed blocks until ``expires``, unless it holds them:
        ``added`` gets those newly predicted, ``renewed`` those predicted already whose expiry
        this extends. Returns False if a block is there twice (it counts once)."""
        bit, pbit, both = rep.bit, rep.pbit, rep.both
        exp = self._pred_exp[rep.index]

        def predicted(value: int) -> int:
            return value if value & both else value | pbit

        kept: list[int] = []  # predicted here already
        distinct = True
        if not self._edit(hashes, predicted, added, kept, bit):  # block by block
            unique = list(dict.fromkeys(hashes))
            distinct = len(unique) == len(hashes)
            current = self._values_of(unique)
            added += [rh for rh in unique if not current[rh] & both]
            kept = [rh for rh in unique if current[rh] & both == pbit]
            self._apply({rh: current[rh] | pbit for rh in added})
        if kept:
            olds = list(map(exp.get, kept))
            renewed += [
                rh for rh, old in zip(kept, olds, strict=True) if old is not None and old < expires
            ]
        exp.update(zip(added, repeat(expires)))
        exp.update(zip(renewed, repeat(expires)))
        return distinct

    def _memo_renewed(
        self, rep: _Replica, router_hashes: Sequence[int], end: int, until: float
    ) -> None:
        """Remember until when a renewal of ``router_hashes[:end]`` is spared: keyed by its
        last hash (the chain names the whole prefix) and by the few before it, since a
        conversation's next turn often parts from its previous prompt a block or two before
        that prompt's end (the generation prompt's block now holds the reply), and would
        otherwise renew it all."""
        memo = self._renewed
        for rh in router_hashes[max(0, end - _RENEW_MEMO_TAIL) : end]:
            key = (rep.index, rh)
            memo[key] = until
            memo.move_to_end(key)

    def _renew(
        self,
        rep: _Replica,
        router_hashes: Sequence[int],
        held: int,
        known: int,
        now: float,
        ttl_s: float,
    ) -> list[int]:
        """Extend the predictions among blocks ``held:known`` (see :meth:`predict`); returns
        those that are neither predicted nor held any more, to be predicted afresh."""
        memo = self._renewed
        key = (rep.index, router_hashes[known - 1])
        until = memo.get(key)
        if until is not None and until > now:
            return []
        self._memo_renewed(rep, router_hashes, known, now + ttl_s / 2)
        exp = self._pred_exp[rep.index]
        expires = now + ttl_s
        renewed: list[int] = []
        unknown: list[int] = []
        get = exp.get
        # One pass, a lookup and a store of each key back to back (the store then hits the
        # CPU caches): faster here than C passes over the whole span, measured.
        for rh in router_hashes[held:known]:
            old = get(rh)
            if old is None:
                unknown.append(rh)
            elif old < expires:
                exp[rh] = expires
                renewed.append(rh)
        if renewed:
            self.stats.predicted += len(renewed)
            self._pred_seq += 1
            heapq.heappush(self._pred_heap, (expires, self._pred_seq, rep.index, tuple(renewed)))
        if not unknown:
            return []
        # Held by events since the match, or their prediction expired: look them up.
        values = self._values_at(unknown)
        if values is None:
            current = self._values_of(unknown)
            values = [current[rh] for rh in unknown]
        bit = rep.bit
        return [rh for rh, value in zip(unknown, values, strict=True) if not value & bit]

    def unpredict(self, replica: str, router_hashes: Sequence[int]) -> int:
        """Withdraw ``replica``'s predictions of these blocks (the request failed there).

        Blocks held by events are untouched. Returns how many predictions went; their heap
        entries stay and are skipped when they come due.
        """
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        exp = self._pred_exp[rep.index]
        withdrawn = [rh for rh in router_hashes if exp.pop(rh, None) is not None]
        self._unpredicted(rep, withdrawn, router_hashes)
        return len(withdrawn)

    def expire(self, now: float) -> int:
        """Drop predictions whose expiry is at or before ``now``; returns how many."""
        renewed = self._renewed
        while renewed:  # renewal memos that no longer spare a renewal
            key, until = next(iter(renewed.items()))
            if until > now:
                break
            del renewed[key]
        heap = self._pred_heap
        dropped = 0
        while heap and heap[0][0] <= now:
            due_at, _, ridx, prompt = heapq.heappop(heap)
            exp = self._pred_exp[ridx]
            # An entry's blocks are distinct and had its expiry when it was pushed; one
            # renewed, withdrawn or superseded since has another or none. Passes in C.
            due: Sequence[int] = prompt
            if exp.get(prompt[0]) == due_at:  # likely all due: out in one pass, back if not
                expiries = list(map(exp.pop, prompt, repeat(None)))
                if expiries.count(due_at) != len(prompt):
                    pairs = list(zip(prompt, expiries, strict=True))
                    exp.update((rh, e) for rh, e in pairs if e is not None and e > now)
                    due = [rh for rh, e in pairs if e is not None and e <= now]
            else:  # likely renewed since
                expiries = list(map(exp.get, prompt))
                if None not in expiries and min(cast("list[float]", expiries)) > now:
                    continue
                due = [
                    rh for rh, e in zip(prompt, expiries, strict=True) if e is not None and e <= now
                ]
                _consume(map(exp.__delitem__, due))
            self._unpredicted(self._by_index[ridx], due, prompt)
            dropped += len(due)
        self.stats.expired += dropped
        return dropped

    def _unpredicted(self, rep: _Replica, hashes: Sequence[int], chain: Sequence[int]) -> None:
        """Clear ``rep``'s predicted bit of these blocks (its predictions of them are gone)."""
        if not hashes:
            return
        pbit = rep.pbit
        # Predicted here, so not held here; each block once (its expiry entry went once).
        if not self._edit(hashes, pbit.__xor__):
            current = self._values_of(hashes)
            self._apply({rh: current[rh] ^ pbit for rh in hashes}, chain)
        self._pred_count -= len(hashes)

    # --- runs -----------------------------------------------------------------------------

    def _new_id(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        self._runs.append(b"")
        self._vals.append(())
        return len(self._runs) - 1

    def _free_id(self, rid: int) -> None:
        self._runs[rid] = b""
        self._vals[rid] = ()
        self._free_ids.append(rid)

    def _values_of(self, hashes: Iterable[int]) -> dict[int, int]:
        """The current value of each of these blocks (0 if not indexed), and of the other
        blocks of their runs."""
        seg = self._seg
        runs = self._runs
        vals = self._vals
        out: dict[int, int] = {}
        touched: dict[int, None] = {}
        for rh in hashes:
            rid = seg.get(rh)
            if rid is None:
                out[rh] = 0
            else:
                touched[rid] = None
        for rid in touched:
            run = unpack(runs[rid])
            out.update(zip(run, _expand(vals[rid], len(run)), strict=True))
        return out

    def _apply(self, new: dict[int, int], chain: Sequence[int] | None = None) -> None:
        """Give these blocks these values (0: not indexed any more). Runs change their pieces,
        and split where blocks leave; blocks new to the index continue the run of the block
        before them in ``chain`` (the operation's blocks, in order) if it ends there, or make
        runs of their own."""
        if not new:
            return
        seg = self._seg
        runs = self._runs
        vals = self._vals
        low = self._low
        touched: dict[int, None] = {}
        fresh: dict[int, int] = {}
        for rh, value in new.items():
            rid = seg.get(rh)
            if rid is None:
                if value:
                    fresh[rh] = value
            else:
                touched[rid] = None
        only_predicted = 0
        for rid in touched:
            run = unpack(runs[rid])
            old = _expand(vals[rid], len(run))
            values = [new.get(rh, v) for rh, v in zip(run, old, strict=True)]
            for before, after in zip(old, values, strict=True):
                if before is not after:
                    only_predicted -= not before & low
                    only_predicted += bool(after) and not after & low
            if 0 in values:
                self._split(rid, run, values)
            else:
                vals[rid] = _pieces(values)
        if fresh:
            only_predicted += sum(not value & low for value in fresh.values())
            self._place(fresh, chain)
        self._pred_only += only_predicted

    def _split(self, rid: int, run: list[int], values: list[int]) -> None:
        """Keep the blocks of run ``rid`` whose value is not 0, as runs of consecutive blocks
        (the longest keeps the id); the others leave the index."""
        seg = self._seg
        runs = self._runs
        vals = self._vals
        parts: list[tuple[int, int]] = []
        n = len(run)
        start = 0
        while start < n:
            if not values[start]:
                del seg[run[start]]
                start += 1
                continue
            end = start + 1
            while end < n and values[end]:
                end += 1
            parts.append((start, end))
            start = end
        if not parts:
            self._free_id(rid)
            return
        keep = max(parts, key=lambda part: part[1] - part[0])
        for start, end in parts:
            blocks = run[start:end]
            pieces = _pieces(values[start:end])
            if (start, end) == keep:
                runs[rid] = packed_runs.pack(blocks)
                vals[rid] = pieces
            else:
                other = self._new_id()
                runs[other] = packed_runs.pack(blocks)
                vals[other] = pieces
                seg.update(zip(blocks, repeat(other)))

    def _place(self, fresh: dict[int, int], chain: Sequence[int] | None) -> None:
        """Index blocks new to the index (with their values), by rows of ``chain``."""
        rows: list[tuple[int | None, list[int]]] = []  # (the block before, the row)
        seen: set[int] = set()
        if chain is not None:
            before: int | None = None
            row: list[int] | None = None
            for rh in chain:
                if rh in fresh and rh not in seen:
                    seen.add(rh)
                    if row is None:
                        row = []
                        rows.append((before, row))
                    row.append(rh)
                else:
                    row = None
                before = rh
        rows += [(None, [rh]) for rh in fresh if rh not in seen]
        self._place_rows(rows, lambda blocks: _pieces([fresh[rh] for rh in blocks]))

    def _place_rows(
        self,
        rows: list[tuple[int | None, list[int]]],
        pieces_of: Callable[[list[int]], Pieces],
    ) -> None:
        """Index rows of blocks new to the index (``pieces_of(blocks)``: their values), each
        continuing the run of the block before it if that run ends there and has room."""
        seg = self._seg
        runs = self._runs
        vals = self._vals
        for before, row in rows:
            for start in range(0, len(row), _MAX_RUN):
                blocks = row[start : start + _MAX_RUN]
                rid = seg.get(before) if before is not None and not start else None
                if rid is not None and before is not None:
                    run = runs[rid]
                    n = len(run) // W
                    if run.endswith(word(before)) and n + len(blocks) <= _MAX_RUN:
                        vals[rid] = _joined(vals[rid], n, pieces_of(blocks))
                        runs[rid] = run + packed_runs.pack(blocks)
                        seg.update(zip(blocks, repeat(rid)))
                        continue
                rid = self._new_id()
                runs[rid] = packed_runs.pack(blocks)
                vals[rid] = pieces_of(blocks)
                seg.update(zip(blocks, repeat(rid)))

    # Predictions edit runs by spans of positions (found with ``packed_runs.follow``, as a
    # lookup does) and their pieces, never block by block: a 30-block turn expiring cost a
    # Python pass over each of its runs (256 blocks) to rebuild values it did not change.

    def _spans(self, hashes: Sequence[int]) -> dict[int, list[tuple[int, int, int]]] | None:
        """Where these indexed blocks are: run id -> ``(j, k, i)`` in order of ``j``, the run's
        blocks ``j:k`` being ``hashes[i:i + k - j]``. None (then the block by block way) if a
        block is there twice, or not found: a hash that the runs' words do not compare equal
        to."""
        get = self._seg.get
        runs = self._runs
        follow = packed_runs.follow
        out: dict[int, list[tuple[int, int, int]]] = {}
        i, n = 0, len(hashes)
        while i < n:
            rid = get(hashes[i])
            if rid is None:
                return None
            run = runs[rid]
            j, span = follow(run, hashes, i, min(n - i, len(run) // W))
            if span <= 0:
                return None
            found = out.get(rid)
            if found is None:
                out[rid] = [(j, j + span, i)]
            else:
                found.append((j, j + span, i))
            i += span
        for ranges in out.values():  # a block twice in ``hashes``: spans overlap
            if len(ranges) > 1:
                ranges.sort()
                if any(a[1] > b[0] for a, b in pairwise(ranges)):
                    return None
        return out

    def _values_at(self, hashes: Sequence[int]) -> list[int] | None:
        """The current value of each of these blocks (0 if not indexed), in order; None as
        :meth:`_spans` says."""
        get = self._seg.get
        runs = self._runs
        vals = self._vals
        follow = packed_runs.follow
        out: list[int] = []
        i, n = 0, len(hashes)
        while i < n:
            rid = get(hashes[i])
            if rid is None:
                out.append(0)
                i += 1
                continue
            run = runs[rid]
            j, span = follow(run, hashes, i, min(n - i, len(run) // W))
            if span <= 0:
                return None
            pieces = vals[rid]
            last = len(pieces) - 1
            t = 0
            while t < last and pieces[t + 1] <= j:
                t += 2
            x, end = j, j + span
            while True:
                y = pieces[t + 1] if t < last and pieces[t + 1] < end else end
                out.extend(repeat(pieces[t], y - x))
                if y == end:
                    break
                x = y
                t += 2
            i += span
        return out

    def _edit(
        self,
        hashes: Sequence[int],
        change: Callable[[int], int],
        changed: list[int] | None = None,
        kept: list[int] | None = None,
        kept_unless: int = 0,
    ) -> bool:
        """Give these indexed blocks the values ``change(value)`` (0: they leave the index).
        ``changed`` gets those whose value changed, ``kept`` those whose value did not and has
        none of the bits of ``kept_unless``. False, changing nothing, where :meth:`_spans`
        finds no spans."""
        spans = self._spans(hashes)
        if spans is None:
            return False
        for rid, ranges in spans.items():
            self._edit_run(rid, ranges, change, hashes, changed, kept, kept_unless)
        return True

    def _edit_run(
        self,
        rid: int,
        ranges: list[tuple[int, int, int]],
        change: Callable[[int], int],
        hashes: Sequence[int],
        changed: list[int] | None,
        kept: list[int] | None,
        kept_unless: int,
    ) -> None:
        """:meth:`_edit` on one run: its blocks in ``ranges`` (see :meth:`_spans`)."""
        run = self._runs[rid]
        n = len(run) // W
        pieces = self._vals[rid]
        low = self._low
        cuts = set(pieces[1::2])
        for j, k, _ in ranges:
            cuts.add(j)
            cuts.add(k)
        cuts.discard(0)
        cuts.discard(n)
        bounds = sorted(cuts)
        bounds.append(n)
        # The new pieces as starts and values; equal neighbours merge.
        starts: list[int] = []
        values: list[int] = []
        done: dict[int, int] = {}  # old value -> new: blocks that shared one share the other
        gone: list[int] = []  # blocks whose value is now 0
        only_predicted = 0
        last = len(pieces) - 1
        t = r = x = 0
        nr = len(ranges)
        for y in bounds:  # [x, y): in one piece, and in one range or none
            while t < last and pieces[t + 1] <= x:
                t += 2
            value = pieces[t]
            while r < nr and ranges[r][1] <= x:
                r += 1
            if r < nr and ranges[r][0] <= x:
                new = done.get(value)
                if new is None:
                    new = done[value] = change(value)
                if new != value:
                    gained = bool(new) and not new & low
                    only_predicted += (y - x) * (gained - (not value & low))
                    j, _, i = ranges[r]
                    if not new:  # leaves the index; the caller's objects are the keys
                        gone += hashes[i + x - j : i + y - j]
                    elif changed is not None:
                        changed += hashes[i + x - j : i + y - j]
                    value = new
                elif kept is not None and not value & kept_unless:
                    j, _, i = ranges[r]
                    kept += hashes[i + x - j : i + y - j]
            if not values or values[-1] != value:
                starts.append(x)
                values.append(value)
            x = y
        self._pred_only += only_predicted
        if 0 not in values:
            self._vals[rid] = _interleaved(starts, values)
            return
        # Blocks leave the index: keep the others as runs of consecutive blocks (the
        # longest keeps the id), as _split does.
        seg = self._seg
        _consume(map(seg.__delitem__, gone))
        parts: list[tuple[int, int, list[int], list[int]]] = []  # (start, end, starts, values)
        ends = [*starts[1:], n]
        open_part = False
        for a, b, value in zip(starts, ends, values, strict=True):
            if not value:
                open_part = False
            elif open_part:
                s, _, ps, pv = parts[-1]
                parts[-1] = (s, b, ps, pv)
                ps.append(a - s)
                pv.append(value)
            else:
                parts.append((a, b, [0], [value]))
                open_part = True
        if not parts:
            self._free_id(rid)
            return
        keep = max(parts, key=lambda part: part[1] - part[0])
        for part in parts:
            a, b, ps, pv = part
            blocks = run[a * W : b * W]
            if part is keep:
                self._runs[rid] = blocks
                self._vals[rid] = _interleaved(ps, pv)
            else:
                other = self._new_id()
                self._runs[other] = blocks
                self._vals[other] = _interleaved(ps, pv)
                seg.update(zip(unpack(blocks), repeat(other)))

    # --- queries --------------------------------------------------------------------------

    def match(self, router_hashes: Sequence[int], now: float) -> dict[str, PrefixMatch]:
        """Per replica with at least one leading block: its longest contiguous prefix match.

        One dict lookup per run the request goes through (see the module docstring), a running
        AND of the values of the run pieces it covers, and the blocks where that loses
        replicas; it stops at the first block no candidate holds or is predicted to.
        Predictions that expired by ``now`` are purged first (so time must not run backwards
        between calls).
        """
        if not router_hashes:
            return {}
        heap = self._pred_heap
        if heap and heap[0][0] <= now:
            self.expire(now)
        q = router_hashes
        get = self._seg.get
        rid = get(q[0])
        if rid is None:
            return {}
        n = len(q)
        runs = self._runs
        vals = self._vals
        follow = packed_runs.follow
        walk = packed_runs.walk
        run = runs[rid]
        ends: list[tuple[int, int]] = []  # (run length, replicas whose runs have it)
        alive = 0
        i = 0
        while True:
            # Where the block is in its run, and how far the request follows the run from
            # there: exact whatever the request (no chain assumed).
            j, span = follow(run, q, i, n - i)
            if not span:  # equal to an indexed hash but no 64-bit int (say 5.0): not held
                break
            # The running AND of the values over run[j:j + span].
            alive = walk(vals[rid], j, j + span, i, alive, ends)
            if not alive:
                break
            i += span
            if i == n:
                break
            rid = get(q[i])
            if rid is None:
                break
            run = runs[rid]
        if alive:
            ends.append((i, alive))
        if not ends:
            return {}
        same = self._same
        if len(same) <= ends[-1][0]:
            same += [PrefixMatch(k, k) for k in range(len(same), ends[-1][0] + 1)]
        found = packed_runs.assemble(ends, self._low, self._shift, self._names, same, PrefixMatch)
        if self.hybrid:
            self._hybrid_matches(q, found)
        return found

    def _hybrid_matches(self, q: Sequence[int], found: dict[str, PrefixMatch]) -> None:
        """Cut each hybrid replica's confirmed run to the hit its cache groups agree on (the
        run held by any group bounds it). A prediction beyond stands: the replica that serves
        the predicted prompt holds all its groups' blocks for it."""
        block_size = self.block_size or 1
        for name, m in list(found.items()):
            groups = self._replicas[name].groups
            if groups is None or not m.confirmed:
                continue
            hit = hybrid_hit(tuple(groups.values()), q, m.confirmed, block_size)
            if hit == m.confirmed:
                continue
            blocks = m.blocks if m.blocks > m.confirmed else hit
            if blocks:
                found[name] = PrefixMatch(blocks, hit)
            else:
                del found[name]

    def replicas_holding(self, router_hash: int) -> frozenset[str]:
        """Replicas that hold this block according to events (predictions not included)."""
        rid = self._seg.get(router_hash)
        mask = 0
        if rid is not None:
            pieces = self._vals[rid]
            at = find(self._runs[rid], word(router_hash))
            t = 0
            while t < len(pieces) - 1 and pieces[t + 1] <= at:
                t += 2
            mask = pieces[t] & self._low
        names = []
        while mask:
            top = mask.bit_length() - 1
            names.append(self._names[top])
            mask ^= self._bits[top]
        return frozenset(names)


def _expand(pieces: Pieces, n: int) -> list[int]:
    """The value of each of the ``n`` blocks of a run, from its pieces."""
    values: list[int] = []
    start = 0
    value = pieces[0]
    for t in range(1, len(pieces), 2):
        values.extend(repeat(value, pieces[t] - start))
        start = pieces[t]
        value = pieces[t + 1]
    values.extend(repeat(value, n - start))
    return values


def _pieces(values: list[int]) -> Pieces:
    """The pieces of a run whose blocks have these values."""
    out = [values[0]]
    for start in compress(range(1, len(values)), map(ne, values, islice(values, 1, None))):
        out.append(start)
        out.append(values[start])
    return tuple(out)


def _joined(pieces: Pieces, n: int, more: Pieces) -> Pieces:
    """The pieces of a run of ``n`` blocks followed by the blocks of ``more``'s run."""
    shifted = [x + n if t % 2 else x for t, x in enumerate(more)]
    if pieces[-1] == more[0]:
        return (*pieces, *shifted[1:])
    return (*pieces, n, *shifted)


def _interleaved(starts: list[int], values: list[int]) -> Pieces:
    """The pieces of a run from its pieces' starts (the first is 0) and values."""
    out: list[int] = [0] * (2 * len(values) - 1)
    out[0::2] = values
    out[1::2] = starts[1:]
    return tuple(out)
