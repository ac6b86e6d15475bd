"""The fast prefix index equals the reference model (kvcore/reference_index.py) on any history.

Random histories of KV events and predictions (several replicas and media, chains that
extend each other, engine hashes reused for other content, unknown parents, removals of
unknown blocks, clears, withdrawals and expiries), the same calls on both indexes; after each
call every lookup, count and statistic must agree. Both hashing implementations run.
"""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvroute.kvcore import block_hashing, packed_runs
from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.reference_index import ReferenceIndex

BS = 4
REPLICAS = ("a", "b", "c")
MEDIA = ("GPU", "CPU")
# Three documents of six blocks; a chain is a document's blocks [start, end).
DOCS = [[d * 1000 + i for i in range(6 * BS)] for d in range(3)]

chains = st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 6)).map(
    lambda t: (t[0], t[1], max(t[1] + 1, t[2]))
)
calls = st.lists(
    st.one_of(
        # stored: replica, medium, chain, engine-hash salt (another salt: a second engine
        # hash for the same blocks), content shift (another document under the same engine
        # hashes: an engine hash reused for other content)
        st.tuples(
            st.just("stored"),
            st.sampled_from(REPLICAS),
            st.sampled_from(MEDIA),
            chains,
            st.integers(0, 1),
            st.sampled_from([0, 0, 1]),
        ),
        st.tuples(st.just("removed"), st.sampled_from(REPLICAS), st.sampled_from(MEDIA), chains),
        st.tuples(st.just("cleared"), st.sampled_from(REPLICAS)),
        st.tuples(
            st.just("predict"), st.sampled_from(REPLICAS), chains, st.sampled_from([0, 1, 3])
        ),
        st.tuples(st.just("unpredict"), st.sampled_from(REPLICAS), chains),
        st.tuples(st.just("time"), st.sampled_from([0.5, 1.0, 2.5])),
    ),
    min_size=5,
    max_size=40,
)


def engine_hash(replica: str, doc: int, block: int, salt: int) -> int | bytes:
    h = xxh3_64_intdigest(f"{replica}/{doc}/{block}/{salt}".encode()) or 1
    return h.to_bytes(8, "little") if replica == "c" else h  # c sends digest bytes


def apply(idx: PrefixIndex | ReferenceIndex, call: tuple[object, ...], now: float) -> None:
    kind = call[0]
    if kind == "stored":
        _, rep, medium, (doc, start, end), salt, shift = call
        ehs = [engine_hash(rep, doc, b, salt) for b in range(start, end)]  # type: ignore[arg-type]
        parent = engine_hash(rep, doc, start - 1, salt) if start else None  # type: ignore[arg-type]
        tokens = DOCS[(doc + shift) % len(DOCS)][start * BS : end * BS]  # type: ignore[index,operator]
        idx.apply_stored(rep, ehs, parent, tokens, BS, medium)  # type: ignore[arg-type]
    elif kind == "removed":
        _, rep, medium, (doc, start, end) = call
        ehs = [engine_hash(rep, doc, b, 0) for b in range(start, end)]  # type: ignore[arg-type]
        idx.apply_removed(rep, ehs, medium)  # type: ignore[arg-type]
    elif kind == "cleared":
        idx.clear_replica(call[1])  # type: ignore[arg-type]
    elif kind == "predict":
        _, rep, (doc, start, end), ttl = call
        hashes = block_hashes(DOCS[doc][: end * BS], BS)  # type: ignore[index]
        idx.predict(rep, hashes, now, ttl)  # type: ignore[arg-type]
    elif kind == "unpredict":
        _, rep, (doc, start, end) = call
        idx.unpredict(rep, block_hashes(DOCS[doc][: end * BS], BS))  # type: ignore[arg-type,index]


@pytest.mark.parametrize("speedups", [True, False], ids=["c", "python"])
@settings(max_examples=200, deadline=None)
@given(history=calls)
@example(  # an engine hash reused for other content, then a second hash for the same block
    history=[
        ("stored", "a", "GPU", (0, 0, 3), 0, 0),
        ("stored", "a", "GPU", (0, 0, 2), 0, 1),
        ("stored", "a", "CPU", (1, 0, 2), 1, 0),
        ("removed", "a", "GPU", (0, 0, 1)),
    ]
)
@example(  # a block stored twice (a second copy), one copy evicted: still held
    history=[
        ("stored", "a", "CPU", (1, 0, 1), 0, 0),
        ("stored", "a", "CPU", (1, 0, 1), 0, 0),
        ("removed", "a", "CPU", (1, 0, 1)),
    ]
)
@example(  # copies of a block, then its engine hash reused for other content, then removed
    history=[
        ("stored", "a", "GPU", (0, 0, 2), 0, 0),
        ("stored", "a", "GPU", (0, 0, 2), 0, 0),
        ("stored", "a", "GPU", (0, 0, 2), 0, 1),
        ("removed", "a", "GPU", (0, 0, 2)),
    ]
)
def test_fast_index_equals_reference(speedups: bool, history: list[tuple[object, ...]]) -> None:
    block_hashing.use_speedups(speedups)
    packed_runs.use_speedups(speedups)
    try:
        fast, ref = PrefixIndex(), ReferenceIndex()
        queries = [block_hashes(doc, BS) for doc in DOCS]
        queries.append([*queries[0][:2], *queries[1][2:]])  # not a chain
        now = 0.0
        for call in history:
            if call[0] == "time":
                now += call[1]  # type: ignore[operator]
                continue
            apply(fast, call, now)
            apply(ref, call, now)
            for q in queries:
                assert fast.match(q, now) == ref.match(q, now), call
            assert fast.entries == ref.entries
            assert fast.blocks == ref.blocks
            assert fast.predicted_entries == ref.predicted_entries
            assert fast.stats == ref.stats
            assert set(fast.replicas) == set(ref.replicas)
            for h in queries[0][:3]:
                assert fast.replicas_holding(h) == ref.replicas_holding(h)
    finally:
        block_hashing.use_speedups(True)
        packed_runs.use_speedups(True)


def test_hinted_predictions_match_the_reference_within_their_guarantee() -> None:
    """The dispatch ledger passes ``held``/``known`` from a match a moment ago: the fast index
    then skips what the replica holds and renews a prefix at most every ttl/2. Up to the
    expiry of the prediction that was not renewed, lookups equal the exact reference's."""
    rng = random.Random(9)
    ttl = 4.0
    for _ in range(200):
        fast, ref = PrefixIndex(), ReferenceIndex()
        doc = DOCS[rng.randrange(len(DOCS))]
        hashes = block_hashes(doc, BS)
        held = rng.randint(0, 3)
        if held:
            ehs = [engine_hash("a", 9, b, 0) for b in range(held)]
            for idx in (fast, ref):
                idx.apply_stored("a", ehs, None, doc[: held * BS], BS)
        first = rng.randint(1, len(hashes))
        for idx in (fast, ref):
            idx.predict("a", hashes[:first], 0.0, ttl)
        if rng.random() < 0.5:  # the dispatch right after the match
            t0 = t1 = rng.uniform(0.0, ttl / 2 - 0.01)
        else:  # the match just before the first prediction expires, the dispatch just after
            t0, t1 = ttl - 0.05, ttl + 0.01
        match = fast.match(hashes, t0).get("a")
        hints = {"held": match.confirmed, "known": match.blocks} if match else {}
        fast.predict("a", hashes, t1, ttl, **hints)
        ref.predict("a", hashes, t1, ttl)
        for t in (t1, max(t1, ttl / 2), max(t1, ttl - 0.01)):
            assert fast.match(hashes, t) == ref.match(hashes, t)


# --- long prompts: predictions over several runs ----------------------------------------------

LONG_BS = 2
LONG_DOCS = [[d * 100_000 + i for i in range(700 * LONG_BS)] for d in range(3)]
LONG_HASHES = [block_hashes(doc, LONG_BS) for doc in LONG_DOCS]


def long_prompt(rng: random.Random) -> list[int]:
    """A prefix of a document (~700 blocks: several runs), now and then not a chain, with a
    block twice, or shuffled."""
    d = rng.randrange(len(LONG_HASHES))
    end = rng.choice([rng.randint(1, 40), rng.randint(200, 700), 700])
    prompt = list(LONG_HASHES[d][:end])
    kind = rng.random()
    if kind < 0.1:  # another document's blocks from some point
        cut = rng.randint(0, end)
        prompt[cut:] = LONG_HASHES[(d + 1) % len(LONG_HASHES)][cut:end]
    elif kind < 0.2:
        for _ in range(rng.randint(1, 3)):
            prompt.insert(rng.randint(0, len(prompt)), rng.choice(prompt))
    elif kind < 0.25:
        rng.shuffle(prompt)
    return prompt


def long_history_call(
    idx: PrefixIndex | ReferenceIndex, rng: random.Random, now: float, hinted: bool
) -> None:
    """One random call on ``idx``; ``rng`` must be in the same state for every index fed."""
    kind = rng.random()
    replica = rng.choice(REPLICAS)
    if kind < 0.15:  # a stored chain (superseding predictions), salted for a second copy
        d = rng.randrange(len(LONG_DOCS))
        start = rng.randrange(700)
        end = min(700, start + rng.randint(1, 300))
        salt = rng.choice([0, 0, 1])
        ehs = [engine_hash(replica, 10 + d, b, salt) for b in range(start, end)]
        parent = engine_hash(replica, 10 + d, start - 1, salt) if start else None
        tokens = LONG_DOCS[d][start * LONG_BS : end * LONG_BS]
        idx.apply_stored(replica, ehs, parent, tokens, LONG_BS, rng.choice(MEDIA))
    elif kind < 0.22:
        d = rng.randrange(len(LONG_DOCS))
        start = rng.randrange(700)
        ehs = [engine_hash(replica, 10 + d, b, 0) for b in range(start, start + 50)]
        idx.apply_removed(replica, ehs, rng.choice(MEDIA))
    elif kind < 0.25:
        idx.clear_replica(replica)
    elif kind < 0.8:
        prompt = long_prompt(rng)
        ttl = rng.choice([0.5, 1.0, 2.0, 4.0])
        if hinted and isinstance(idx, PrefixIndex) and rng.random() < 0.7:
            match = idx.match(prompt, now).get(replica)
            held, known = (match.confirmed, match.blocks) if match else (0, 0)
            if rng.random() < 0.25:  # stale or wrong hints
                held, known = rng.randint(0, len(prompt)), rng.randint(0, len(prompt))
            idx.predict(replica, prompt, now, ttl, held=held, known=known)
        else:
            idx.predict(replica, prompt, now, ttl)
    elif kind < 0.9:
        idx.unpredict(replica, long_prompt(rng))
    else:
        idx.expire(now)


def assert_same(fast: PrefixIndex, other: PrefixIndex | ReferenceIndex, now: float) -> None:
    for q in [*LONG_HASHES, [*LONG_HASHES[0][:300], *LONG_HASHES[1][300:]]]:
        assert fast.match(q, now) == other.match(q, now)
    assert fast.entries == other.entries
    assert fast.blocks == other.blocks
    assert fast.predicted_entries == other.predicted_entries
    assert fast.stats == other.stats


def replay_together(
    fast: PrefixIndex, other: PrefixIndex | ReferenceIndex, seed: int, hinted: bool
) -> None:
    """The same 40 random calls on both, compared (and ``fast``'s runs checked) after each."""
    rng_fast, rng_other = random.Random(seed), random.Random(seed)
    now = 0.0
    for step in range(40):
        now += (0.0, 0.25, 0.5, 1.5)[step % 4]
        long_history_call(fast, rng_fast, now, hinted=hinted)
        long_history_call(other, rng_other, now, hinted=hinted)
        assert_same(fast, other, now)
        check_layout(fast)


def check_layout(idx: PrefixIndex) -> None:
    """Runs hold distinct blocks, each mapped to its run; pieces are canonical, never 0."""
    blocks = 0
    for rid, run in enumerate(idx._runs):
        if not run:
            continue
        hashes = packed_runs.unpack(run)
        assert len(set(hashes)) == len(hashes) <= 256
        assert all(idx._seg[h] == rid for h in hashes)
        pieces = idx._vals[rid]
        values, starts = pieces[0::2], pieces[1::2]
        assert 0 not in values
        assert all(a != b for a, b in pairwise(values))
        assert list(starts) == sorted(set(starts)) and all(0 < s < len(hashes) for s in starts)
        blocks += len(hashes)
    assert blocks == len(idx._seg)


@pytest.mark.parametrize("speedups", [True, False], ids=["c", "python"])
def test_long_prompts_equal_the_reference(speedups: bool) -> None:
    """Prompts of hundreds of blocks over several runs, predicted, renewed, withdrawn,
    superseded and expiring a part at a time: the fast index's span edits equal the model."""
    block_hashing.use_speedups(speedups)
    packed_runs.use_speedups(speedups)
    try:
        for seed in range(12):
            replay_together(PrefixIndex(), ReferenceIndex(), seed, hinted=False)
    finally:
        block_hashing.use_speedups(True)
        packed_runs.use_speedups(True)


def block_by_block(idx: PrefixIndex) -> PrefixIndex:
    """``idx`` with predictions applied block by block, as before spans (the fallbacks)."""
    idx._spans = lambda hashes: None  # type: ignore[method-assign]
    idx._values_at = lambda hashes: None  # type: ignore[method-assign]
    idx._place_leading = lambda *args: 0  # type: ignore[method-assign]
    return idx


@pytest.mark.parametrize("speedups", [True, False], ids=["c", "python"])
def test_span_edits_equal_block_by_block_edits(speedups: bool) -> None:
    """The same calls, hinted predictions included, with predictions editing runs by spans
    and block by block: the same lookups, counts and stats, and sound runs."""
    block_hashing.use_speedups(speedups)
    packed_runs.use_speedups(speedups)
    try:
        for seed in range(12):
            slow = block_by_block(PrefixIndex())
            replay_together(PrefixIndex(), slow, seed, hinted=True)
            check_layout(slow)
    finally:
        block_hashing.use_speedups(True)
        packed_runs.use_speedups(True)


def test_values_at_equals_values_of() -> None:
    """The values a span at a time (stale hinted blocks) equal the block by block lookup."""
    rng = random.Random(3)
    idx = PrefixIndex()
    for step in range(60):
        long_history_call(idx, rng, step * 0.25, hinted=True)
        hashes = long_prompt(rng)
        values = idx._values_at(hashes)
        current = idx._values_of(hashes)
        assert values == [current[h] for h in hashes]


@pytest.mark.parametrize("speedups", [True, False], ids=["c", "python"])
def test_a_hinted_prompt_repeating_a_block_after_its_known_prefix(speedups: bool) -> None:
    """A block already predicted here comes again after the hinted prefix: it is indexed once
    (the leading placement undoes its row without dropping the block it did not add)."""
    packed_runs.use_speedups(speedups)
    try:
        fast, ref = PrefixIndex(), ReferenceIndex()
        fast.predict("a", [1, 2, 3], 0.0, 10.0)
        ref.predict("a", [1, 2, 3], 0.0, 10.0)
        fast.predict("a", [1, 2, 3, 4, 2], 0.0, 10.0, held=0, known=3)
        ref.predict("a", [1, 2, 3, 4, 2], 0.0, 10.0)
        assert_same(fast, ref, 0.0)
        assert fast.match([1, 2, 3, 4], 0.0) == ref.match([1, 2, 3, 4], 0.0)
        check_layout(fast)
    finally:
        packed_runs.use_speedups(True)


def test_numpy_block_hashes_predict_as_their_ints() -> None:
    import numpy as np  # with the vllm extra the test command installs (tests/test_stats.py too)

    plain, numpy_fed = PrefixIndex(), PrefixIndex()
    for idx in (plain, numpy_fed):
        idx.predict("a", [1], 0.0, 10.0)
    plain.predict("a", [1, 2, 2], 0.0, 20.0)
    numpy_fed.predict("a", [np.uint64(1), np.uint64(2), np.uint64(2)], 0.0, 20.0)
    assert_same(numpy_fed, plain, 0.0)
    assert numpy_fed.match([1, 2], 0.0) == plain.match([1, 2], 0.0)
    check_layout(numpy_fed)
