"""Router block hashing and the prefix index: events in, longest-prefix matches out."""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvroute.kvcore import block_hashing, packed_runs, prefix_index
from kvroute.kvcore.block_hashing import block_hashes, chain_hashes, extra_key, root_seed
from kvroute.kvcore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.kvcore.prefix_index import PrefixIndex, PrefixMatch
from kvroute.simulator.engine import Engine, EngineConfig, EngineRequest

speedups: ModuleType | None
try:
    from kvroute.kvcore import _speedups as speedups
except ImportError:  # not built: test_speedups_are_built says so
    speedups = None

BS = 4
NOT_BUILT = "kvroute.kvcore._speedups is not built: run `pip install -e .` (needs a C compiler)"

# The C extension and the pure-Python twins that run where it is not built: same results.
IMPLEMENTATIONS = ("c", "python")


@contextmanager
def implementation(name: str) -> Iterator[None]:
    """Hash blocks and run the index's loops in C, or on the Python twins (as where the
    extension is not built)."""
    on = name == "c"
    assert block_hashing.use_speedups(on) == on, NOT_BUILT
    assert packed_runs.use_speedups(on) == on, NOT_BUILT
    try:
        yield
    finally:  # back to the default
        block_hashing.use_speedups()
        packed_runs.use_speedups()


class Index:
    """An int-like that is no int (as numpy's integers)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def toks(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


# --- hashing -----------------------------------------------------------------------------------


def test_hashes_are_deterministic_chained_and_documented() -> None:
    t = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # two full blocks and a partial one
    hs = block_hashes(t, BS)
    assert hs == block_hashes(list(t), BS)
    assert len(hs) == 2  # the partial block has no hash
    # The documented definition: xxh3_64 of little-endian uint32 tokens, seeded by the parent.
    h0 = xxh3_64_intdigest(b"".join(x.to_bytes(4, "little") for x in t[:4]), 0)
    h1 = xxh3_64_intdigest(b"".join(x.to_bytes(4, "little") for x in t[4:8]), h0)
    assert hs == [h0, h1]
    assert chain_hashes(t[4:], BS, h0) == [h1]
    assert block_hashes(t[:3], BS) == []


def test_changed_token_changes_its_block_and_later_only() -> None:
    base = toks(6)
    hs = block_hashes(base, BS)
    for k in range(6):
        changed = list(base)
        changed[k * BS + 2] += 1000
        hk = block_hashes(changed, BS)
        assert hk[:k] == hs[:k]
        assert all(a != b for a, b in zip(hk[k:], hs[k:], strict=True))


def test_extra_key_changes_every_block() -> None:
    base = toks(5)
    plain = block_hashes(base, BS)
    lora = block_hashes(base, BS, extra_key="lora-a")
    other = block_hashes(base, BS, extra_key="lora-b")
    assert root_seed(None) == 0
    assert all(a != b for a, b in zip(plain, lora, strict=True))
    assert all(a != b for a, b in zip(lora, other, strict=True))
    assert lora == block_hashes(base, BS, extra_key="lora-a")


def test_an_adapter_and_a_salt_of_the_same_name_key_apart() -> None:
    keys = {
        extra_key(None, None),
        extra_key("a", None),
        extra_key(None, "a"),
        extra_key("a", "a"),
        extra_key("a", "b"),
        extra_key("b", "a"),
    }
    assert len(keys) == 6 and extra_key(None, None) is None


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_tokens_and_block_size_raise(impl: str) -> None:
    with implementation(impl):
        with pytest.raises(OverflowError):
            block_hashes([-1, 0, 0, 0], BS)
        with pytest.raises(OverflowError):
            block_hashes([2**32, 0, 0, 0], BS)
        with pytest.raises(TypeError):
            block_hashes([1.5, 0, 0, 0], BS)  # type: ignore[list-item]
        with pytest.raises(ValueError):
            block_hashes([1, 2], 0)


def test_speedups_are_built() -> None:
    # Without the extension everything works on the Python twins, with hashing and lookups
    # several times slower (see kvcore/block_hashing.py): this makes a missing build visible.
    assert speedups is not None, NOT_BUILT
    assert block_hashing._chain is speedups.chain_hashes  # the defaults
    assert packed_runs.pack is speedups.pack_u64
    assert packed_runs.follow is speedups.follow
    assert packed_runs.walk is speedups.walk
    assert packed_runs.assemble is speedups.assemble


def test_c_xxh3_is_xxhash_for_every_length() -> None:
    # Every path of XXH3-64: 0-16, 17-128 and 129-240 bytes, and longer ones in stripes and
    # 1024-byte blocks (block sizes up to 500+ tokens), with seeds that wrap.
    assert speedups is not None, NOT_BUILT
    rng = random.Random(9)
    for length in [*range(2100), 4096, 5000, 10_000]:
        data = rng.randbytes(length)
        for seed in (0, 2**64 - 1, rng.getrandbits(64)):
            assert speedups.xxh3_64(data, seed) == xxh3_64_intdigest(data, seed), (length, seed)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_chain_hashes_follow_the_definition_for_any_block_size(impl: str) -> None:
    rng = random.Random(4)
    with implementation(impl):
        for block_size in (1, 2, 3, 4, 5, 16, 17, 32, 60, 61, 64, 128, 300):
            tokens = [
                rng.getrandbits(32) for _ in range(block_size * 3 + rng.randrange(block_size))
            ]
            parent = rng.getrandbits(64)
            expected = []
            h = parent
            for b in range(len(tokens) // block_size):
                block = tokens[b * block_size : (b + 1) * block_size]
                h = xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in block), h)
                expected.append(h)
            assert chain_hashes(tokens, block_size, parent) == expected
            assert chain_hashes(tuple(tokens), block_size, parent) == expected
        assert chain_hashes([1, 2, 3], 4, 7) == []
        edges: list[Any] = [0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1, True, Index(7)]
        packed = b"".join(t.__index__().to_bytes(4, "little") for t in edges)
        assert chain_hashes(edges, 8, 9) == [xxh3_64_intdigest(packed, 9)]


def test_packing_and_run_following_match_their_python_twins() -> None:
    assert speedups is not None, NOT_BUILT
    rng = random.Random(8)
    odd: list[Any] = [-1, 2**64, 2**64 + 5, 5.0, "x", True]  # hashes no run holds
    for _ in range(400):
        run = [rng.getrandbits(64) for _ in range(rng.randint(1, 40))]
        packed_run = packed_runs.pack_python(run)
        assert speedups.pack_u64(run) == packed_run
        assert speedups.pack_u64(tuple(run)) == packed_run
        start = rng.randint(0, len(run))
        q: list[Any] = [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
        q += [*run[start : rng.randint(start, len(run))], rng.getrandbits(64)]
        if rng.random() < 0.3:
            q.insert(rng.randrange(len(q) + 1), rng.choice(odd))
        for _ in range(6):
            i = rng.randint(0, len(q))
            limit = rng.randint(0, 45)
            got = speedups.follow(packed_run, q, i, limit)
            assert got == packed_runs.follow_python(packed_run, q, i, limit), (q, i, limit)
    # Positions far out of range: no match, as the twin's range checks say.
    run = [rng.getrandbits(64) for _ in range(5)]
    for i, limit in ((2**70, 5), (-(2**70), 5), (0, 2**70), (0, -(2**70))):
        got = speedups.follow(packed_runs.pack_python(run), run, i, limit)
        assert got == packed_runs.follow_python(packed_runs.pack_python(run), run, i, limit)
    # Ints of 0 to 3 digits (the C code reads small ones straight from their digits).
    edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1, True]
    assert speedups.pack_u64(edges) == packed_runs.pack_python(edges)
    assert speedups.follow(packed_runs.pack_python(edges), edges, 0, 99) == (0, len(edges))
    cases: list[tuple[list[Any], type[Exception]]] = [
        ([-1], OverflowError),
        ([-(2**40)], OverflowError),
        ([2**64], OverflowError),
        ([2**90], OverflowError),
        (["x"], TypeError),
    ]
    for bad, error in cases:
        for pack in (speedups.pack_u64, packed_runs.pack_python):
            with pytest.raises(error):
                pack(bad)


def test_walk_matches_its_python_twin() -> None:
    assert speedups is not None, NOT_BUILT
    rng = random.Random(12)
    for _ in range(500):
        n = rng.randint(1, 40)
        starts = sorted(rng.sample(range(1, n), rng.randint(0, min(6, n - 1)))) if n > 1 else []
        values = [rng.getrandbits(rng.choice([3, 70, 300])) | 1 for _ in range(len(starts) + 1)]
        pieces = (values[0], *(x for pair in zip(starts, values[1:], strict=True) for x in pair))
        j = rng.randrange(n)
        end = rng.randint(j + 1, n)
        i = rng.choice([0, 0, rng.randint(1, 50)])
        alive = rng.getrandbits(300) | rng.choice([0, 2**400 - 1])
        c_ends: list[tuple[int, int]] = [(0, 1)]
        py_ends = list(c_ends)
        got = speedups.walk(pieces, j, end, i, alive, c_ends)
        assert got == packed_runs.walk_python(pieces, j, end, i, alive, py_ends)
        assert c_ends == py_ends


def test_walk_refuses_positions_that_would_overflow() -> None:
    assert speedups is not None, NOT_BUILT
    with pytest.raises(ValueError, match="positions"):
        speedups.walk((7, 3, 5), 0, 10, sys.maxsize, 7, [])
    with pytest.raises(ValueError, match="piece starts"):
        speedups.walk((7, -3, 5), 0, 10, 1, 7, [])


def random_ends(rng: random.Random, count: int, shift: int) -> tuple[list[tuple[int, int]], int]:
    """Where replicas' runs end along a request, as a lookup finds them: each replica's held
    run ends at or before its run with predictions (or it has no held run at all)."""
    ends: dict[int, int] = {}
    longest = 0
    for k in rng.sample(range(count), rng.randint(0, count)):
        both = rng.randint(1, 60)
        held = rng.choice([None, both, rng.randint(1, both)])
        ends[both] = ends.get(both, 0) | 1 << (k + shift)
        if held is not None:
            ends[held] = ends.get(held, 0) | 1 << k
        longest = max(longest, both)
    return sorted(ends.items()), longest


def test_assemble_matches_its_python_twin_in_order() -> None:
    assert speedups is not None, NOT_BUILT
    rng = random.Random(6)
    names = [f"r{i}" for i in range(300)]
    for count in (1, 7, 8, 9, 64, 200, 300):
        shift = max(count, rng.choice([count, 256, 300]))
        low = (1 << shift) - 1
        for _ in range(30):
            ends, longest = random_ends(rng, count, shift)
            same = [PrefixMatch(k, k) for k in range(longest + 1)]
            c_out = speedups.assemble(ends, low, shift, names[:count], same, PrefixMatch)
            py_out = packed_runs.assemble_python(ends, low, shift, names[:count], same, PrefixMatch)
            assert list(c_out.items()) == list(py_out.items())  # same order too
            assert all(type(m) is PrefixMatch for m in c_out.values())
            assert all(m.confirmed <= m.blocks for m in c_out.values())
            # Where both runs end together, the shared PrefixMatch of that length.
            assert all(m is same[m.blocks] for m in c_out.values() if m.confirmed == m.blocks)
    for assemble in (speedups.assemble, packed_runs.assemble_python):
        with pytest.raises(IndexError):  # a bit with no name
            assemble([(1, 1 << 9)], 0, 0, names[:8], [PrefixMatch(0, 0)] * 2, PrefixMatch)
    with pytest.raises(TypeError):
        speedups.assemble([(1, 2, 3)], 0, 0, names, [], PrefixMatch)  # type: ignore[list-item]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_hashes_outside_64_bits_are_never_indexed(impl: str) -> None:
    with implementation(impl):
        idx = PrefixIndex()
        t = toks(3)
        idx.apply_stored("r", [1, 2, 3], None, t, BS)
        rh = block_hashes(t, BS)
        assert idx.match([*rh[:2], -1, rh[2]], 0.0) == {"r": PrefixMatch(2, 2)}
        assert idx.match([rh[0], 2**64], 0.0) == {"r": PrefixMatch(1, 1)}
        with pytest.raises(ValueError, match="2\\*\\*64"):
            idx.predict("r", [rh[0], -5], now=0.0, ttl_s=1.0)
        assert idx.predicted_entries == 0
        assert idx.match(rh, 0.0) == {"r": PrefixMatch(3, 3)}


# --- events -> match ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_block_cached_twice_stays_until_its_last_copy_is_evicted(impl: str) -> None:
    """Under pressure vLLM caches a block a second time (same hash, another physical copy)
    and sends a BlockRemoved per copy it evicts: the first removal leaves it held."""
    with implementation(impl):
        idx = PrefixIndex()
        t = toks(2)
        rh = block_hashes(t, BS)
        idx.apply_stored("r", [1, 2], None, t, BS)
        idx.apply_stored("r", [2], 1, t[BS:], BS)  # block 2's second copy
        assert idx.apply_removed("r", [2]) == 0  # one copy of two gone
        assert idx.match(rh, 0.0) == {"r": PrefixMatch(2, 2)}
        assert idx.apply_removed("r", [2]) == 1  # the last copy
        assert idx.match(rh, 0.0) == {"r": PrefixMatch(1, 1)}
        # Cleared, the copies go too: a block stored once after that is removed at once.
        idx.apply_stored("r", [2], 1, t[BS:], BS)
        idx.apply_stored("r", [2], 1, t[BS:], BS)
        idx.clear_replica("r")
        idx.apply_stored("r", [1, 2], None, t, BS)
        assert idx.apply_removed("r", [2]) == 1


def test_stored_chain_and_partial_prefixes() -> None:
    idx = PrefixIndex()
    t = toks(4)
    assert idx.apply_stored("r1", [11, 12], None, t[: 2 * BS], BS) == 2
    assert idx.apply_stored("r1", [13, 14], 12, t[2 * BS :], BS) == 2
    rh = block_hashes(t, BS)
    assert idx.match(rh, 0.0) == {"r1": PrefixMatch(4, 4)}
    assert idx.match(rh[:2], 0.0) == {"r1": PrefixMatch(2, 2)}
    # A request that diverges after block 2, and one longer than what is cached.
    other = block_hashes(t[: 2 * BS] + toks(3, 500), BS)
    assert idx.match(other, 0.0) == {"r1": PrefixMatch(2, 2)}
    assert idx.match(block_hashes(t + toks(2, 900), BS), 0.0) == {"r1": PrefixMatch(4, 4)}
    # A request that shares only block 2's tokens, not block 1: no match (chained hashes).
    assert idx.match(block_hashes(t[2 * BS :], BS), 0.0) == {}
    assert idx.match([], 0.0) == {}
    assert idx.entries == 4 and idx.stats.stored == 4
    assert idx.replicas_holding(rh[3]) == frozenset({"r1"})
    assert idx.replicas_holding(12345) == frozenset()


def test_two_replicas_different_depths() -> None:
    idx = PrefixIndex()
    t = toks(5)
    idx.apply_stored("a", [1, 2, 3, 4, 5], None, t, BS)
    idx.apply_stored("b", [9, 8], None, t[: 2 * BS], BS)  # its own engine hashes
    rh = block_hashes(t, BS)
    assert idx.match(rh, 0.0) == {"a": PrefixMatch(5, 5), "b": PrefixMatch(2, 2)}
    assert idx.replicas_holding(rh[0]) == frozenset({"a", "b"})
    assert idx.entries == 7 and idx.blocks == 5
    idx.apply_removed("a", [1])
    assert idx.match(rh, 0.0) == {"b": PrefixMatch(2, 2)}
    assert idx.replicas_holding(rh[0]) == frozenset({"b"})


def test_removed_middle_block_cuts_the_run() -> None:
    idx = PrefixIndex()
    t = toks(6)
    idx.apply_stored("r", [1, 2, 3, 4, 5, 6], None, t, BS)
    assert idx.apply_removed("r", [3]) == 1
    rh = block_hashes(t, BS)
    assert idx.match(rh, 0.0) == {"r": PrefixMatch(2, 2)}
    assert idx.entries == 5 and idx.stats.removed == 1
    assert idx.apply_removed("r", [3, 77]) == 0  # already gone, never known
    assert idx.apply_removed("nobody", [1]) == 0
    assert idx.stats.unknown_removed == 3
    # Stored again (its parent 2 is still known): the run is whole again.
    assert idx.apply_stored("r", [3], 2, t[2 * BS : 3 * BS], BS) == 1
    assert idx.match(rh, 0.0) == {"r": PrefixMatch(6, 6)}


def test_unknown_parent_is_counted_and_skipped() -> None:
    idx = PrefixIndex()
    t = toks(3)
    assert idx.apply_stored("r", [5, 6], 4, t[BS:], BS) == 0
    assert idx.stats.unknown_parent == 1 and idx.stats.unknown_parent_blocks == 2
    assert idx.entries == 0
    assert idx.match(block_hashes(t, BS), 0.0) == {}
    # Another replica's engine hashes are no parent for this one.
    idx.apply_stored("other", [4], None, t[:BS], BS)
    assert idx.apply_stored("r", [5, 6], 4, t[BS:], BS) == 0
    assert idx.stats.unknown_parent == 2


def test_bytes_and_int_engine_hashes_and_parent_zero() -> None:
    idx = PrefixIndex()
    t = toks(3)
    d = [bytes([i]) * 32 for i in range(1, 4)]
    idx.apply_stored("bytes", d[:1], None, t[:BS], BS)
    idx.apply_stored("bytes", d[1:], d[0], t[BS:], BS)
    idx.apply_stored("int", [2**64 - 1, -5], 0, t[: 2 * BS], BS)  # 0: no parent
    idx.apply_stored("int", [7], -5, t[2 * BS :], BS)
    rh = block_hashes(t, BS)
    assert idx.match(rh, 0.0) == {"bytes": PrefixMatch(3, 3), "int": PrefixMatch(3, 3)}
    idx.apply_removed("bytes", [d[1]])
    idx.apply_removed("int", [2**64 - 1])
    assert idx.match(rh, 0.0) == {"bytes": PrefixMatch(1, 1)}
    # bytes zero is a real hash, not "no parent"
    assert idx.apply_stored("z", [1], b"\x00" * 32, t[:BS], BS) == 0
    assert idx.stats.unknown_parent == 1


def test_extra_key_and_media() -> None:
    idx = PrefixIndex()
    t = toks(2)
    idx.apply_stored("r", [1, 2], None, t, BS, extra_key="lora")
    assert idx.match(block_hashes(t, BS), 0.0) == {}
    lora = block_hashes(t, BS, extra_key="lora")
    assert idx.match(lora, 0.0) == {"r": PrefixMatch(2, 2)}
    # The same blocks offloaded to CPU: one (block, replica) entry, held until both media drop it.
    idx.apply_stored("r", [1, 2], None, t, BS, medium="CPU", extra_key="lora")
    assert idx.entries == 2
    idx.apply_removed("r", [1, 2])  # GPU
    assert idx.match(lora, 0.0) == {"r": PrefixMatch(2, 2)}
    idx.apply_removed("r", [1], medium="CPU")
    assert idx.match(lora, 0.0) == {} and idx.entries == 1


def test_two_engine_hashes_for_one_router_hash_are_refcounted() -> None:
    # E.g. a cache salt the router does not know: the engine has two copies of equal tokens.
    idx = PrefixIndex()
    t = toks(1)
    idx.apply_stored("r", [1], None, t, BS)
    idx.apply_stored("r", [2], None, t, BS)
    idx.apply_stored("r", [2], None, t, BS)  # a second copy of engine block 2 (vLLM's)
    assert idx.entries == 1
    idx.apply_removed("r", [1])
    assert idx.match(block_hashes(t, BS), 0.0) == {"r": PrefixMatch(1, 1)}
    idx.apply_removed("r", [2])  # one copy of two
    assert idx.match(block_hashes(t, BS), 0.0) == {"r": PrefixMatch(1, 1)}
    idx.apply_removed("r", [2])
    assert idx.match(block_hashes(t, BS), 0.0) == {} and idx.entries == 0
    # An engine hash reused for other content moves to the new content.
    other = toks(1, 50)
    idx.apply_stored("r", [3], None, t, BS)
    assert idx.apply_stored("r", [3], None, other, BS) == 1
    assert idx.match(block_hashes(t, BS), 0.0) == {}
    assert idx.match(block_hashes(other, BS), 0.0) == {"r": PrefixMatch(1, 1)}
    assert idx.entries == 1


def test_clear_replica() -> None:
    idx = PrefixIndex()
    t = toks(3)
    idx.apply_stored("a", [1, 2, 3], None, t, BS)
    idx.apply_stored("a", [1, 2, 3], None, t, BS, medium="CPU")
    idx.apply_stored("b", [1, 2], None, t[: 2 * BS], BS)
    idx.clear_replica("a")
    idx.clear_replica("never-seen")
    rh = block_hashes(t, BS)
    assert idx.match(rh, 0.0) == {"b": PrefixMatch(2, 2)}
    assert idx.entries == 2 and idx.stats.cleared == 2
    # After a clear the old engine hashes are unknown parents.
    assert idx.apply_stored("a", [4], 3, toks(1, 100), BS) == 0
    assert idx.apply_stored("a", [1], None, t[:BS], BS) == 1
    assert idx.match(rh, 0.0) == {"a": PrefixMatch(1, 1), "b": PrefixMatch(2, 2)}


def test_predictions_count_until_ttl_then_expire() -> None:
    idx = PrefixIndex()
    rh = block_hashes(toks(4), BS)
    idx.predict("r", rh, now=10.0, ttl_s=2.0)
    assert idx.match(rh, 10.0) == {"r": PrefixMatch(4, 0)}
    assert idx.match(rh[:2], 11.9) == {"r": PrefixMatch(2, 0)}
    assert idx.replicas_holding(rh[0]) == frozenset()  # predictions are not holdings
    assert idx.predicted_entries == 4
    assert idx.expire(11.99) == 0
    assert idx.match(rh, 12.0) == {}  # expired at now + ttl, and purged by the match
    assert idx.predicted_entries == 0 and idx.stats.expired == 4
    idx.predict("r", rh, now=13.0, ttl_s=1.0)
    assert idx.expire(14.0) == 4 and idx.predicted_entries == 0
    # A renewed prediction outlives the older one's expiry purge.
    idx.predict("r", rh, now=20.0, ttl_s=1.0)
    idx.predict("r", rh[:2], now=20.5, ttl_s=1.0)
    idx.expire(21.0)
    assert idx.match(rh, 21.2) == {"r": PrefixMatch(2, 0)}
    idx.predict("q", rh, now=30.0, ttl_s=1.0)  # purges everything before 30
    assert idx.predicted_entries == 4


def test_a_next_turn_parting_in_its_previous_prompts_last_block_renews_only_what_is_new() -> None:
    """A conversation's next turn often parts from its previous prompt in that prompt's last
    block (the generation prompt's block now holds the reply). Its hinted prediction renews
    only its new blocks, not the whole history again, and the history stays predicted."""
    idx = PrefixIndex()
    history = list(range(1, 101))
    idx.predict("r", history, now=0.0, ttl_s=10.0)
    turn = [*history[:-1], *range(1000, 1010)]  # parts at the previous prompt's last block
    match = idx.match(turn, 1.0)["r"]
    assert match == PrefixMatch(99, 0)
    before = idx.stats.predicted
    idx.predict("r", turn, now=1.0, ttl_s=10.0, held=match.confirmed, known=match.blocks)
    assert idx.stats.predicted - before == 10
    assert idx.match(turn, 9.9) == {"r": PrefixMatch(109, 0)}
    # Past the spared time (ttl_s / 2) the next turn renews the history in one pass.
    later = [*turn[:-1], 2000]
    idx.predict("r", later, now=6.0, ttl_s=10.0, held=0, known=108)
    assert idx.match(later, 15.9) == {"r": PrefixMatch(109, 0)}


def test_predictions_superseded_by_events_and_combined() -> None:
    idx = PrefixIndex()
    t = toks(4)
    rh = block_hashes(t, BS)
    idx.predict("r", rh, now=0.0, ttl_s=1.0)
    idx.apply_stored("r", [1, 2], None, t[: 2 * BS], BS)
    assert idx.match(rh, 0.5) == {"r": PrefixMatch(4, 2)}
    assert idx.predicted_entries == 2  # the stored blocks' predictions are gone
    assert idx.match(rh, 5.0) == {"r": PrefixMatch(2, 2)}  # events outlive predictions
    # Blocks already held are not predicted again; a second replica's prediction is its own.
    idx.predict("r", rh, now=6.0, ttl_s=1.0)
    idx.predict("s", rh[:1], now=6.0, ttl_s=1.0)
    assert idx.predicted_entries == 3
    assert idx.match(rh, 6.5) == {"r": PrefixMatch(4, 2), "s": PrefixMatch(1, 0)}
    # A predicted block in the middle bridges a confirmed gap for blocks, not for confirmed.
    idx.apply_stored("r", [3, 4], 2, t[2 * BS :], BS)
    idx.apply_removed("r", [2])
    idx.predict("r", rh, now=7.0, ttl_s=1.0)
    assert idx.match(rh, 7.5)["r"] == PrefixMatch(4, 1)


# --- property test against a brute-force model -------------------------------------------------

BLOCK_TOKENS = {b: [b * 10 + i for i in range(BS)] for b in range(3)}
REPLICAS = ("r0", "r1", "r2")


def engine_hash(replica: str, path: tuple[int, ...]) -> int | bytes:
    h = xxh3_64_intdigest(repr(path).encode(), 99) or 1
    return h.to_bytes(8, "little") * 4 if replica == "r2" else h  # r2 uses digest bytes


def path_tokens(path: tuple[int, ...]) -> list[int]:
    return [t for b in path for t in BLOCK_TOKENS[b]]


paths = st.lists(st.integers(0, 2), min_size=0, max_size=4).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("stored"), st.sampled_from(REPLICAS), paths, paths.filter(bool)),
        st.tuples(st.just("removed"), st.sampled_from(REPLICAS), paths.filter(bool), st.just(())),
        st.tuples(st.just("cleared"), st.sampled_from(REPLICAS), st.just(()), st.just(())),
        st.tuples(st.just("predict"), st.sampled_from(REPLICAS), paths.filter(bool), st.just(())),
    ),
    max_size=30,
)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=150, deadline=None)
@given(
    ops,
    st.lists(paths.filter(bool), min_size=1, max_size=4),
    st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=30, max_size=30),
)
def test_match_equals_brute_force_model(
    impl: str,
    events: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]],
    queries: list[tuple[int, ...]],
    steps: list[float],
) -> None:
    with implementation(impl):
        check_against_model(events, queries, steps, REPLICAS)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_match_equals_brute_force_model_many_replicas(impl: str) -> None:
    with implementation(impl):
        check_many_replicas()


def check_many_replicas() -> None:
    # More replicas than the low half of the index's values first holds (256): it re-encodes.
    replicas = tuple(f"r{i}" for i in range(300))
    rng = random.Random(3)

    def path() -> tuple[int, ...]:
        return tuple(rng.randrange(3) for _ in range(rng.randint(1, 4)))

    events = [("stored", r, (), path()) for r in replicas]  # every replica holds something
    for _ in range(1200):
        kind = rng.choices(["stored", "removed", "cleared", "predict"], [6, 2, 0.2, 2])[0]
        rep = rng.choice(replicas[: rng.choice([3, 40, 300])])  # some replicas are busy
        a = path()[: rng.randrange(3)] if kind == "stored" else path()
        events.append(
            (kind, rep, a if kind != "cleared" else (), path() if kind == "stored" else ())
        )
    queries = [path() for _ in range(4)]
    steps = [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in events]
    check_against_model(events, queries, steps, replicas)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_match_equals_brute_force_model_short_runs(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Runs of at most 2 blocks and values re-encoded from the 5th replica on: more of the
    # index's run splitting, joining and re-encoding, against the same model.
    monkeypatch.setattr(prefix_index, "_MAX_RUN", 2)
    monkeypatch.setattr(prefix_index, "_MIN_SHIFT", 4)
    with implementation(impl):
        check_many_replicas()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_match_is_exact_for_requests_that_are_not_chains(impl: str) -> None:
    with implementation(impl):
        check_requests_that_are_not_chains()


def check_requests_that_are_not_chains() -> None:
    # match skips along stored runs of blocks by comparing hashes; a request need not be a
    # chain: shuffled, repeated and unknown hashes get exactly the per-block answer.
    rng = random.Random(5)
    idx = PrefixIndex()
    docs = [toks(12, 1000 * d) for d in range(4)]
    for r in range(6):
        for d, doc in enumerate(docs):
            depth = rng.randint(1, 12)
            ehs = [r * 10_000 + d * 100 + i for i in range(depth)]
            idx.apply_stored(f"r{r}", ehs[:5], None, doc[: BS * min(5, depth)], BS)
            if depth > 5:
                idx.apply_stored(f"r{r}", ehs[5:], ehs[4], doc[5 * BS : depth * BS], BS)
        if r % 2:
            idx.apply_removed(f"r{r}", [r * 10_000 + 3])  # a hole in one chain
    known = [h for doc in docs for h in block_hashes(doc, BS)]
    for _ in range(300):
        q = known[: rng.randint(1, len(known))]
        if rng.random() < 0.5:
            q = [rng.choice(known) for _ in range(rng.randint(1, 30))]
        elif rng.random() < 0.5:
            q = [*q[:5], 12345, *q[5:]]
        expected = {}
        for name in idx.replicas:
            n = 0
            while n < len(q) and name in idx.replicas_holding(q[n]):
                n += 1
            if n:
                expected[name] = PrefixMatch(n, n)
        assert idx.match(q, 0.0) == expected


def check_against_model(
    events: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]],
    queries: list[tuple[int, ...]],
    steps: list[float],
    replicas: tuple[str, ...],
) -> None:
    ttl = 1.5
    idx = PrefixIndex()
    model: dict[str, set[tuple[int, ...]]] = {r: set() for r in replicas}
    # A block stored again while held is another copy (vLLM's duplicates): a removal takes
    # one copy, and the block goes with its last.
    copies: dict[tuple[str, tuple[int, ...]], int] = {}
    predicted: dict[tuple[str, tuple[int, ...]], float] = {}  # (replica, path) -> expiry
    unknown_parent = 0
    now = 0.0
    for (kind, rep, a, b), step in zip(events, steps, strict=False):
        now += step
        held = model[rep]
        if kind == "stored":
            parent = engine_hash(rep, a) if a else None
            new = [a + b[: i + 1] for i in range(len(b))]
            idx.apply_stored(rep, [engine_hash(rep, p) for p in new], parent, path_tokens(b), BS)
            if a and a not in held:
                unknown_parent += 1
            else:
                for p in new:
                    if p in held:
                        copies[(rep, p)] = copies.get((rep, p), 0) + 1
                    held.add(p)
                    predicted.pop((rep, p), None)
        elif kind == "removed":
            idx.apply_removed(rep, [engine_hash(rep, a)])
            if copies.get((rep, a)):
                copies[(rep, a)] -= 1
            else:
                held.discard(a)
        elif kind == "cleared":
            idx.clear_replica(rep)
            held.clear()
            for key in [k for k in copies if k[0] == rep]:
                del copies[key]
        else:
            idx.predict(rep, block_hashes(path_tokens(a), BS), now, ttl)
            for k in range(1, len(a) + 1):
                if a[:k] not in held:
                    predicted[(rep, a[:k])] = now + ttl
        assert idx.entries == sum(len(s) for s in model.values())
        for q in queries:
            expected = {}
            for r, s in model.items():
                n = c = 0
                while n < len(q) and (q[: n + 1] in s or predicted.get((r, q[: n + 1]), 0) > now):
                    n += 1
                while c < len(q) and q[: c + 1] in s:
                    c += 1
                if n:
                    expected[r] = PrefixMatch(n, c)
            assert idx.match(block_hashes(path_tokens(q), BS), now) == expected
        # The match purged what expired by now.
        assert idx.predicted_entries == sum(e > now for e in predicted.values())
        assert idx.blocks == len(set().union(*model.values()))
    assert idx.stats.unknown_parent == unknown_parent


# --- driven by the engine model's real events --------------------------------------------------


def feed(idx: PrefixIndex, replica: str, events: list[object]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            idx.apply_stored(
                replica,
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids,
                ev.block_size,
                ev.medium,
                ev.lora_name,
            )
        elif isinstance(ev, BlockRemoved):
            idx.apply_removed(replica, ev.block_hashes, ev.medium)
        elif isinstance(ev, AllBlocksCleared):
            idx.clear_replica(replica)


def test_index_tracks_engine_prefix_cache() -> None:
    rng = random.Random(7)
    cfg = EngineConfig(
        block_size=BS, num_blocks=48, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256
    )
    engine = Engine(cfg)
    idx = PrefixIndex()
    systems = [[rng.randrange(1000) for _ in range(BS * rng.randint(2, 5))] for _ in range(4)]
    prompts = [
        rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        for _ in range(40)
    ]
    now = 0.0
    n = 0
    checked = hits_seen = 0
    # Bursts of concurrent requests (evictions, preemptions), each followed by a probe that
    # repeats an earlier prompt alone: the index must predict the engine's hit exactly.
    for burst in range(12):
        for _ in range(rng.randint(1, 6)):
            n += 1
            engine.add_request(EngineRequest(f"q{n}", rng.choice(prompts), rng.randint(1, 6), now))
        while engine.has_unfinished_requests():
            out = engine.step(now)
            now += out.duration_s
            feed(idx, "e", out.events)
        probe = rng.choice(prompts)
        rh = block_hashes(probe, BS)
        m = idx.match(rh, now).get("e", PrefixMatch(0, 0))
        assert m.blocks == m.confirmed
        expected_hit_blocks = min(m.confirmed, (len(probe) - 1) // BS)
        n += 1
        engine.add_request(EngineRequest(f"p{n}", probe, 1, now))
        out = engine.step(now)
        feed(idx, "e", out.events)
        (res,) = [o for o in out.outputs if o.request_id == f"p{n}"]
        assert res.num_cached_tokens == expected_hit_blocks * BS
        checked += 1
        hits_seen += expected_hit_blocks > 0
        # The index holds exactly as many blocks as the engine's prefix cache.
        assert idx.entries == len(engine._kv.pool.cached)
        if burst == 8:
            assert engine.reset_prefix_cache()
            feed(idx, "e", engine.step(now).events)
            assert idx.entries == 0
    assert checked == 12 and hits_seen >= 3
    assert idx.stats.removed > 0  # the small cache did evict
    assert idx.stats.unknown_parent == 0 and idx.stats.unknown_removed == 0


def test_index_bench_small_run_records_a_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvroute.bench.index_bench import add_index_bench

    out = tmp_path / "B.md"
    parser = argparse.ArgumentParser(prog="kvroute")
    add_index_bench(parser.add_subparsers().add_parser("bench").add_subparsers())
    argv = ["bench", "index", "--entries", "3000", "--replicas", "8", "--lookups", "50"]
    monkeypatch.setattr(sys, "argv", ["kvroute", *argv])  # the command line it reproduces
    args = parser.parse_args([*argv, "--output-md", str(out)])
    assert args.func(args) == 0
    text = out.read_text()
    assert text.startswith("# Benchmarks") and "## Prefix index, " in text
    assert "kvroute bench index --entries 3000 --replicas 8 --lookups 50" in text
    assert "| (block, replica) entries | 3,000 |" in text
    assert "- hashing and lookup loops: C (kvcore/_speedups.c)" in text
    # A warm start's snapshot of the whole index restores to the same matches.
    assert re.search(
        r"\| warm start: decoded and restored, s \(matches equal\) \| [\d.]+ \(yes\) \|", text
    )
    args = parser.parse_args([*argv, "--output-md", str(out), "--no-record"])
    assert args.func(args) == 0
    assert out.read_text() == text
    # On the Python twins, said so in the section; the defaults come back afterwards.
    other = tmp_path / "twins.md"
    args = parser.parse_args([*argv, "--no-speedups", "--output-md", str(other)])
    assert args.func(args) == 0
    assert "- hashing and lookup loops: pure Python (--no-speedups)" in other.read_text()
    assert "| (block, replica) entries | 3,000 |" in other.read_text()
    assert speedups is not None, NOT_BUILT
    assert packed_runs.pack is speedups.pack_u64
    assert block_hashing._chain is speedups.chain_hashes
