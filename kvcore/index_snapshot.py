"""A prefix index as bytes: what a starting router loads to route warm at once (issue 36).

A snapshot holds, for one model pool, every replica's confirmed blocks (its engine -> router
hash maps by medium, as ``PrefixIndex.held_blocks`` gives them; predictions are left out, they
stand for another router's requests) and, per KV-event source, the last sequence number applied
to them. A router that loads it takes each source's live events from that number on; the
subscriber's gap repair replays what it missed meanwhile (router/kv_subscriber.py).

Checked twice over: the bytes (a magic word, a format version, an xxh3-64 checksum of the body)
and what they were taken from (:class:`Identity`: pool, model, block size, tokenizer, the router's
hash scheme): router hashes from another model, block size or hash scheme would match nothing,
or the wrong replicas. Pure: no I/O, no clock (the taker passes its time in).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from xxhash import xxh3_64_intdigest

from kvroute.kvcore.block_hashing import HASH_SCHEME
from kvroute.kvcore.prefix_index import EngineHash, PrefixIndex
from kvroute.policies import ReplicaState

MAGIC = b"KVRIDX"
VERSION = 1
_HEADER = len(MAGIC) + 1 + 8  # magic, version byte, checksum


class SnapshotError(ValueError):
    """Bytes that are not a snapshot this router can read (the message says why)."""


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """What the index's hashes depend on. None: not known on this side (not compared)."""

    pool: str
    model: str | None = None
    block_size: int | None = None
    tokenizer: str | None = None
    hash_scheme: str = HASH_SCHEME


class SourceSeq(msgspec.Struct, array_like=True, frozen=True):
    replica: str
    endpoint: str
    seq: int


class HeldBlocks(msgspec.Struct, array_like=True):
    replica: str
    medium: str
    engine_hashes: list[int | bytes]
    router_hashes: list[int]


class ReplicaLines(msgspec.Struct, array_like=True):
    """A replica's latency lines as the taker learnt them (``ReplicaLatency.state``)."""

    replica: str
    prefill: list[float]
    decode: list[float]
    prefill_samples: int
    decode_samples: int


class IndexSnapshot(msgspec.Struct, kw_only=True):
    identity: Identity
    taken_at: float  # the taker's wall clock, seconds since the epoch
    sources: list[SourceSeq]
    blocks: list[HeldBlocks]
    # Learnt latency lines per replica (kv_aware with cost_unit time or speed, or an SLO): a
    # router that starts from the snapshot prices each replica as the taker had learnt to,
    # instead of at the prior until its own first answers. Empty from a taker without lines
    # (and from routers before this field: msgspec reads them as empty).
    lines: list[ReplicaLines] = msgspec.field(default_factory=list)

    @property
    def entries(self) -> int:
        return sum(len(b.router_hashes) for b in self.blocks)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexSnapshot)


def take(
    index: PrefixIndex,
    identity: Identity,
    sources: Iterable[SourceSeq],
    replicas: Iterable[str],
    taken_at: float,
    states: Iterable[ReplicaState] = (),
) -> IndexSnapshot:
    """The confirmed blocks ``replicas`` hold in ``index``, with the sources' last sequence
    numbers; take both in one step (no event applied between) so that they agree. ``states``:
    the replicas whose learnt latency lines go with them (those with lines and samples)."""
    blocks = [
        HeldBlocks(replica, medium, engine, router)
        for replica in replicas
        for medium, (engine, router) in index.held_blocks(replica).items()
    ]
    lines = []
    for state in states:
        latency = state.latency
        if latency is None or not (latency.prefill_samples or latency.decode_samples):
            continue
        prefill, decode, prefill_samples, decode_samples = latency.state()
        lines.append(
            ReplicaLines(state.replica_id, prefill, decode, prefill_samples, decode_samples)
        )
    return IndexSnapshot(
        identity=identity, taken_at=taken_at, sources=list(sources), blocks=blocks, lines=lines
    )


def restore_lines(snapshot: IndexSnapshot, states: Iterable[ReplicaState]) -> list[str]:
    """Give each of ``states`` that has latency lines but has learnt nothing yet the
    snapshot's lines of its replica; the names of those that took them. A replica this router
    has already seen answer keeps its own."""
    theirs = {lines.replica: lines for lines in snapshot.lines}
    took = []
    for state in states:
        latency, lines = state.latency, theirs.get(state.replica_id)
        if latency is None or lines is None or latency.prefill_samples or latency.decode_samples:
            continue
        samples = (lines.prefill_samples, lines.decode_samples)
        if latency.load(lines.prefill, lines.decode, samples):
            took.append(state.replica_id)
    return took


def encode(snapshot: IndexSnapshot) -> bytes:
    body = _encoder.encode(snapshot)
    return MAGIC + bytes((VERSION,)) + xxh3_64_intdigest(body).to_bytes(8, "big") + body


def decode(data: bytes) -> IndexSnapshot:
    """The snapshot in ``data``; SnapshotError if it is not one, another version, or damaged."""
    if not data.startswith(MAGIC) or len(data) < _HEADER:
        raise SnapshotError("not a kvroute index snapshot (no magic word)")
    version = data[len(MAGIC)]
    if version != VERSION:
        raise SnapshotError(f"snapshot format version {version}, this router reads {VERSION}")
    body = memoryview(data)[_HEADER:]
    if xxh3_64_intdigest(body).to_bytes(8, "big") != data[len(MAGIC) + 1 : _HEADER]:
        raise SnapshotError("snapshot checksum mismatch (truncated or damaged)")
    try:
        snapshot = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(f"snapshot body does not decode: {exc}") from None
    for held in snapshot.blocks:
        if len(held.engine_hashes) != len(held.router_hashes):
            raise SnapshotError(f"replica {held.replica}: engine and router hashes differ in count")
    return snapshot


def refusal(theirs: Identity, mine: Identity) -> str | None:
    """Why a snapshot taken as ``theirs`` must not be loaded into ``mine``; None: it may.

    A field either side does not know is not compared (a tokenizer discovered later, a block
    size not configured): only a known difference refuses.
    """
    if theirs.pool != mine.pool:
        return f"it is pool {theirs.pool!r}'s, this is pool {mine.pool!r}"
    if theirs.hash_scheme != mine.hash_scheme:
        return f"block hash scheme {theirs.hash_scheme!r}, this router's is {mine.hash_scheme!r}"
    for name in ("model", "block_size", "tokenizer"):
        a, b = getattr(theirs, name), getattr(mine, name)
        if a is not None and b is not None and a != b:
            return f"{name.replace('_', ' ')} {a!r}, this router's is {b!r}"
    return None


def restore(snapshot: IndexSnapshot, index: PrefixIndex, replicas: Iterable[str]) -> dict[str, int]:
    """Hold the snapshot's blocks of ``replicas`` (this router's members; others are skipped)
    in ``index``; returns the blocks restored per replica."""
    wanted = frozenset(replicas)
    restored: dict[str, int] = {}
    for held in snapshot.blocks:
        if held.replica not in wanted:
            continue
        engine: list[EngineHash] = held.engine_hashes
        n = index.restore_blocks(
            held.replica, held.medium, engine, held.router_hashes, snapshot.identity.block_size
        )
        restored[held.replica] = restored.get(held.replica, 0) + n
    return restored
