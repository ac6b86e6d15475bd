"""The prefix index's meaning, written the plain way: the model the fast index is tested against.

``ReferenceIndex`` has ``PrefixIndex``'s interface and results (matches, counts, stats) with
none of its layout: per replica, a map from engine hash to router hash per medium, a
reference count per router hash it holds, and an expiry per predicted block; a lookup walks
the request's blocks replica by replica. Orders of magnitude slower; use it to check the
fast index (tests/test_prefix_index.py drives both with the same random events and requests)
or to read what a result means. Hashing runs on the pure-Python twin, so the C extension is
checked too.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.kvcore.block_hashing import chain_hashes_python, root_seed
from kvroute.kvcore.prefix_index import DEFAULT_MEDIUM, EngineHash, IndexStats, PrefixMatch

_U64 = 1 << 64


class ReferenceIndex:
    def __init__(self) -> None:
        self._maps: dict[str, dict[str, dict[EngineHash, int]]] = {}  # replica, medium
        self._refs: dict[str, dict[int, int]] = {}  # replica -> router hash -> references
        # replica -> (medium, engine hash) -> copies beyond the first: vLLM caches a block a
        # second time under memory pressure and sends a BlockRemoved for each copy it evicts.
        self._copies: dict[str, dict[tuple[str, EngineHash], int]] = {}
        self._predicted: dict[str, dict[int, float]] = {}  # replica -> router hash -> expiry
        self.block_size: int | None = None
        self.stats = IndexStats()

    def _replica(self, name: str) -> None:
        if name not in self._maps:
            self._maps[name] = {}
            self._refs[name] = {}
            self._copies[name] = {}
            self._predicted[name] = {}

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(self._maps)

    @property
    def entries(self) -> int:
        return sum(len(refs) for refs in self._refs.values())

    @property
    def blocks(self) -> int:
        return len(set().union(*self._refs.values())) if self._refs else 0

    @property
    def predicted_entries(self) -> int:
        return sum(len(p) for p in self._predicted.values())

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
        self._replica(replica)
        self.block_size = block_size
        maps = self._maps[replica]
        med = medium or DEFAULT_MEDIUM
        emap = maps.setdefault(med, {})
        copies = self._copies[replica]
        if parent_engine_hash is None or (
            type(parent_engine_hash) is int and parent_engine_hash == 0
        ):
            seed = root_seed(extra_key)
        else:
            known = [m[parent_engine_hash] for m in maps.values() if parent_engine_hash in m]
            if not known:
                self.stats.unknown_parent += 1
                self.stats.unknown_parent_blocks += len(engine_hashes)
                return 0
            # The medium of this event first, then the others in the order they were seen.
            seed = emap.get(parent_engine_hash, known[0])
        if len(token_ids) < len(engine_hashes) * block_size:
            self.stats.short_token_ids += 1
        hashes = chain_hashes_python(token_ids, block_size, seed)
        added = 0
        for eh, rh in zip(engine_hashes, hashes, strict=False):
            old = emap.get(eh)
            if old == rh:  # the same block stored again: another copy of it
                copies[(med, eh)] = copies.get((med, eh), 0) + 1
                continue
            if old is not None:
                copies.pop((med, eh), None)  # an engine hash reused for other content: the
                self._release(replica, old)  # old content's copies went with it
            emap[eh] = rh
            self._hold(replica, rh)
            added += 1
        self.stats.stored += added
        return added

    def _hold(self, replica: str, rh: int) -> None:
        refs = self._refs[replica]
        refs[rh] = refs.get(rh, 0) + 1
        self._predicted[replica].pop(rh, None)  # events supersede a prediction

    def _release(self, replica: str, rh: int) -> None:
        refs = self._refs[replica]
        if refs[rh] == 1:
            del refs[rh]
        else:
            refs[rh] -= 1

    def apply_removed(
        self,
        replica: str,
        engine_hashes: Sequence[EngineHash],
        medium: str | None = DEFAULT_MEDIUM,
    ) -> int:
        med = medium or DEFAULT_MEDIUM
        emap = self._maps.get(replica, {}).get(med)
        if emap is None:
            self.stats.unknown_removed += len(engine_hashes)
            return 0
        copies = self._copies[replica]
        removed = 0
        for eh in engine_hashes:
            n = copies.get((med, eh), 0)
            if n:  # one copy of several evicted: the block is still held
                if n == 1:
                    del copies[(med, eh)]
                else:
                    copies[(med, eh)] = n - 1
                continue
            rh = emap.pop(eh, None)
            if rh is None:
                self.stats.unknown_removed += 1
                continue
            self._release(replica, rh)
            removed += 1
        self.stats.removed += removed
        return removed

    def clear_replica(self, replica: str) -> None:
        """Every block of the replica goes; its predictions stay (requests already sent)."""
        self.stats.cleared += 1
        if replica in self._maps:
            self._maps[replica] = {}
            self._refs[replica] = {}
            self._copies[replica] = {}

    # --- predictions ----------------------------------------------------------------------

    def predict(self, replica: str, router_hashes: Sequence[int], now: float, ttl_s: float) -> None:
        self.expire(now)
        if ttl_s <= 0 or not router_hashes:
            return
        if any(not 0 <= rh < _U64 for rh in router_hashes):
            raise ValueError("router hashes must lie in [0, 2**64)")
        self._replica(replica)
        held = self._refs[replica]
        predicted = self._predicted[replica]
        expires = now + ttl_s
        for rh in router_hashes:
            old = predicted.get(rh)
            if rh in held or (old is not None and old >= expires):
                continue
            predicted[rh] = expires  # new, or extended
            self.stats.predicted += 1

    def unpredict(self, replica: str, router_hashes: Sequence[int]) -> int:
        predicted = self._predicted.get(replica)
        if predicted is None:
            return 0
        return sum(predicted.pop(rh, None) is not None for rh in router_hashes)

    def expire(self, now: float) -> int:
        dropped = 0
        for predicted in self._predicted.values():
            due = [rh for rh, e in predicted.items() if e <= now]
            for rh in due:
                del predicted[rh]
            dropped += len(due)
        self.stats.expired += dropped
        return dropped

    # --- lookups --------------------------------------------------------------------------

    def match(self, router_hashes: Sequence[int], now: float) -> dict[str, PrefixMatch]:
        """Per replica with at least one leading block: held or predicted, and held alone."""
        self.expire(now)
        q = router_hashes
        out: dict[str, PrefixMatch] = {}
        for replica, held in self._refs.items():
            predicted = self._predicted[replica]
            n = 0
            while n < len(q) and (q[n] in held or q[n] in predicted):
                n += 1
            c = 0
            while c < len(q) and q[c] in held:
                c += 1
            if n:
                out[replica] = PrefixMatch(n, c)
        return out

    def replicas_holding(self, router_hash: int) -> frozenset[str]:
        return frozenset(r for r, held in self._refs.items() if router_hash in held)
