"""Index snapshots (kvcore/index_snapshot.py): a restored index answers as the one it was taken
from, and a snapshot of another model, block size, tokenizer or format is refused."""

from __future__ import annotations

import random

import msgspec
import pytest
from xxhash import xxh3_64_intdigest

from kvroute.kvcore import index_snapshot
from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.index_snapshot import Identity, SnapshotError, SourceSeq
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import ReplicaLatency, ReplicaState
from kvroute.policies.latency import LatencyPrior

BS = 4
ME = Identity(pool="default", model="tiny", block_size=BS, tokenizer="builtin")


def _fleet_index(seed: int) -> tuple[PrefixIndex, list[list[int]]]:
    """Three replicas storing, offloading and evicting chains of shared prefixes."""
    rng = random.Random(seed)
    index = PrefixIndex()
    trunks = [[rng.randrange(1, 500) for _ in range(BS * 6)] for _ in range(4)]
    prompts: list[list[int]] = []
    next_hash = 1
    for step in range(300):
        replica = f"r{rng.randrange(3)}"
        prompt = rng.choice(trunks) + [rng.randrange(1, 500) for _ in range(BS * rng.randrange(5))]
        prompts.append(prompt)
        blocks = len(prompt) // BS
        engine = list(range(next_hash, next_hash + blocks))
        next_hash += blocks
        cut = rng.randrange(blocks)  # stored in two events: the second names its parent
        medium = "CPU" if step % 7 == 0 else "GPU"
        index.apply_stored(replica, engine[:cut], None, prompt[: cut * BS], BS, medium)
        if cut:
            index.apply_stored(
                replica, engine[cut:], engine[cut - 1], prompt[cut * BS :], BS, medium
            )
        else:
            index.apply_stored(replica, engine, None, prompt, BS, medium)
        if step % 5 == 0:
            index.apply_removed(replica, engine[-2:], medium)
    return index, prompts


def _matches(index: PrefixIndex, prompts: list[list[int]]) -> list[object]:
    return [index.match(block_hashes(p, BS, None), now=0.0) for p in prompts]


def test_a_restored_index_matches_as_the_original() -> None:
    index, prompts = _fleet_index(1)
    sources = [SourceSeq("r0", "ipc:///a", 41), SourceSeq("r1", "ipc:///b", 7)]
    snap = index_snapshot.take(index, ME, sources, index.replicas, taken_at=123.0)
    data = index_snapshot.encode(snap)

    loaded = index_snapshot.decode(data)
    fresh = PrefixIndex()
    restored = index_snapshot.restore(loaded, fresh, ["r0", "r1", "r2"])

    assert loaded.sources == sources and loaded.taken_at == 123.0
    # Every (engine hash, block) pair: a block on GPU and CPU counts once per medium.
    pairs = sum(len(e) for rep in index.replicas for e, _ in index.held_blocks(rep).values())
    assert sum(restored.values()) == pairs
    assert fresh.entries == index.entries and fresh.blocks == index.blocks
    assert _matches(fresh, prompts) == _matches(index, prompts)
    assert fresh.block_size == BS


def test_a_restored_index_follows_later_events() -> None:
    """Engine hashes come with the blocks: a later event's parent and a removal resolve."""
    index = PrefixIndex()
    prompt = list(range(1, 1 + BS * 4))
    index.apply_stored("r0", [11, 12], None, prompt[: 2 * BS], BS)
    fresh = PrefixIndex()
    snap = index_snapshot.take(index, ME, [], ["r0"], 0.0)
    index_snapshot.restore(index_snapshot.decode(index_snapshot.encode(snap)), fresh, ["r0"])

    assert fresh.apply_stored("r0", [13, 14], 12, prompt[2 * BS :], BS) == 2
    assert fresh.stats.unknown_parent == 0
    hashes = block_hashes(prompt, BS, None)
    assert fresh.match(hashes, 0.0)["r0"].confirmed == 4
    assert fresh.apply_removed("r0", [11]) == 1
    assert "r0" not in fresh.match(hashes, 0.0)


def test_replicas_this_router_does_not_have_are_skipped() -> None:
    index, prompts = _fleet_index(2)
    snap = index_snapshot.take(index, ME, [], index.replicas, 0.0)
    fresh = PrefixIndex()
    restored = index_snapshot.restore(snap, fresh, ["r1"])
    assert set(restored) == {"r1"}
    assert fresh.replicas == ("r1",)
    for got in _matches(fresh, prompts):
        assert set(got) <= {"r1"}  # type: ignore[arg-type]


def test_bytes_engine_hashes_round_trip() -> None:
    """vLLM without int block hashes sends 32-byte digests."""
    index = PrefixIndex()
    index.apply_stored("r0", [b"\x01" * 32], None, [1, 2, 3, 4], BS)
    snap = index_snapshot.decode(
        index_snapshot.encode(index_snapshot.take(index, ME, [], ["r0"], 0))
    )
    assert snap.blocks[0].engine_hashes == [b"\x01" * 32]


@pytest.mark.parametrize(
    ("theirs", "why"),
    [
        (Identity(pool="default", model="other", block_size=BS), "model 'other'"),
        (Identity(pool="default", model="tiny", block_size=16), "block size 16"),
        (Identity(pool="default", tokenizer="sha:1"), "tokenizer 'sha:1'"),
        (Identity(pool="chat"), "pool 'chat'"),
        (Identity(pool="default", hash_scheme="sha256-v9"), "hash scheme 'sha256-v9'"),
    ],
)
def test_another_model_block_size_tokenizer_or_scheme_is_refused(
    theirs: Identity, why: str
) -> None:
    reason = index_snapshot.refusal(theirs, ME)
    assert reason is not None and why in reason


def test_what_one_side_does_not_know_is_not_compared() -> None:
    assert index_snapshot.refusal(Identity(pool="default"), ME) is None
    assert index_snapshot.refusal(ME, Identity(pool="default")) is None


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda b: b"{}", "no magic"),
        (lambda b: b[:6] + b"\x09" + b[7:], "version 9"),
        (lambda b: b[:-3], "checksum"),
        (lambda b: b[:-1] + bytes((b[-1] ^ 1,)), "checksum"),
    ],
)
def test_damaged_or_foreign_bytes_are_refused(mangle: object, why: str) -> None:
    index, _ = _fleet_index(3)
    data = index_snapshot.encode(index_snapshot.take(index, ME, [], index.replicas, 0))
    with pytest.raises(SnapshotError, match=why):
        index_snapshot.decode(mangle(data))  # type: ignore[operator]


def _learnt(name: str, seconds_per_token: float, answers: int) -> ReplicaState:
    state = ReplicaState(name, latency=ReplicaLatency(LatencyPrior()))
    assert state.latency is not None
    for k in range(answers):
        work = 500 + 300 * k
        state.latency.observe_prefill(work, 0.05 + seconds_per_token * work)
        state.latency.observe_decode(4 + k % 8, 0.02 + 0.001 * (k % 8))
    return state


def test_learnt_latency_lines_travel_with_the_snapshot() -> None:
    index, _ = _fleet_index(3)
    taker = [_learnt("r0", 1e-4, 40), _learnt("r1", 4e-4, 40), _learnt("r2", 0.0, 0)]
    snap = index_snapshot.take(index, ME, [], index.replicas, 1.0, taker)
    assert [lines.replica for lines in snap.lines] == ["r0", "r1"]  # r2 learnt nothing

    loaded = index_snapshot.decode(index_snapshot.encode(snap))
    fresh = [ReplicaState(n, latency=ReplicaLatency(LatencyPrior())) for n in ("r0", "r1", "r2")]
    seen = _learnt("r1", 9e-4, 3)  # this router has seen r1 answer: it keeps its own lines
    fresh[1] = seen
    before = seen.latency.describe() if seen.latency else {}
    assert index_snapshot.restore_lines(loaded, fresh) == ["r0"]
    r0 = fresh[0].latency
    assert r0 is not None and taker[0].latency is not None
    assert r0.describe() == taker[0].latency.describe()
    assert r0.ttft(4096) == pytest.approx(0.05 + 1e-4 * 4096, rel=0.05)  # not the prior's
    assert seen.latency is not None and seen.latency.describe() == before
    assert fresh[2].latency is not None and fresh[2].latency.prefill_samples == 0


def test_a_snapshot_without_lines_still_loads() -> None:
    """Snapshots from routers before the lines were kept: no ``lines`` field at all."""
    index, prompts = _fleet_index(4)
    snap = index_snapshot.take(index, ME, [], index.replicas, 1.0)
    as_before = msgspec.msgpack.encode(
        {k: v for k, v in msgspec.to_builtins(snap).items() if k != "lines"}
    )
    data = index_snapshot.encode(snap)
    header = data[: len(data) - len(msgspec.msgpack.encode(snap))]
    old = header[:-8] + xxh3_64_intdigest(as_before).to_bytes(8, "big") + as_before
    loaded = index_snapshot.decode(old)
    assert loaded.lines == []
    fresh = PrefixIndex()
    index_snapshot.restore(loaded, fresh, ["r0", "r1", "r2"])
    assert _matches(fresh, prompts) == _matches(index, prompts)
