"""KV cache events as vLLM publishes them, and their exact msgpack wire encoding.

The engine model creates these events the way vLLM's ``BlockPool`` does; the emulated replica
publishes them with :func:`encode_event_batch`, byte for byte what a real vLLM sends, and the
router's subscriber reads real and emulated replicas alike with :func:`decode_event_batch`.

Wire rules (``reference/vllm-interface.md`` section 1, vLLM ``vllm/distributed/kv_events.py``):

* A batch is always a msgpack array ``[ts, events, data_parallel_rank]`` (``EventBatch`` is
  ``array_like`` in every version).
* Events are msgspec tagged structs: the tag is the class name, the tag field is ``"type"``.
  vLLM <= 0.23 encodes them as arrays: tag first, then EVERY field of that version, defaults
  included (msgspec ignores ``omit_defaults`` for ``array_like`` structs, msgspec issue #720;
  reference/vllm-interface.md 1.3 says trailing defaults are dropped, which msgspec 0.18-0.23
  does not do). vLLM >= 0.24 encodes maps: fields equal to their default omitted, required
  fields always written (nil included).
* msgspec sizes a struct's map header by its number of fields, not by the fields written: vLLM
  0.24-0.32's BlockStored (at most 15 keys) gets a fixmap header, 0.33's (16, with
  ``lookahead_token_ids``) a map16 header (``de 00 nn``). The map layout here mirrors 0.32, the
  version this project runs; a 0.33 decoder reads it all the same.
* Block hashes are uint64 ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or raw
  32-byte digests; vLLM 0.10's builtin ``hash()`` gave signed int64.

The public event types are plain dataclasses so that consumers need not know msgspec; private
msgspec structs mirror vLLM's definitions and do the byte-exact encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import msgspec

ExternalBlockHash: TypeAlias = int | bytes
"""A block hash as it appears in events: uint64/int64 or raw digest bytes (vLLM's alias)."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # vLLM's offloading connector: host memory
MEDIUM_STORAGE = "STORAGE"  # vLLM's tiering secondaries: local disk, file or object stores
LOCALITY_REMOTE = "REMOTE"
EventLayout: TypeAlias = Literal["map", "array"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks entered the prefix cache (one vLLM ``cache_full_blocks`` call).

    ``token_ids`` concatenates the blocks' tokens (``len(block_hashes) * block_size`` of them in
    every event vLLM sends for full-attention models); ``parent_block_hash`` is the hash of the
    block before the first one, ``None`` for a sequence's first block. ``extra_keys`` has one
    entry per block (``None`` when the block's hash had no extra keys), as vLLM >= 0.17 sends it.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    # Where the offloaded copy lives relative to the publisher (LOCAL/REMOTE; None: local).
    locality: str | None = None
    # The group's window in tokens, for sliding-window groups (hybrid models, docs/routing.md).
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from the cache (vLLM sends one event per evicted block).

    A removal concerns its ``medium`` only: a block offloaded to CPU stays there when the GPU
    evicts it, and the reverse (vLLM's offloading connector announces each medium apart)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None


def tier_of(medium: str | None, locality: str | None = None) -> str:
    """The index's name for where a block lives: its medium (GPU when unset), with
    ``:REMOTE`` for a copy another host keeps (loaded over the network, not a local bus)."""
    name = medium or MEDIUM_GPU
    return f"{name}:{LOCALITY_REMOTE}" if locality == LOCALITY_REMOTE else name


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset (``reset_prefix_cache``)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class MalformedEventBatch(ValueError):
    """A payload that is not a KV event batch; the only exception the decoder raises."""


# --- Wire structs for encoding: verbatim mirrors of vLLM's definitions. ---------------------------


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM ``EventBatch`` (all versions): always an array."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM >= 0.24 ``KVCacheEvent``: tagged map."""


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    """vLLM 0.30-0.32 ``BlockStored`` (fields after kv_cache_spec_kind are always None here)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM <= 0.23 ``KVCacheEvent``: tagged array."""


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    """vLLM 0.22-0.23 ``BlockStored``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def encode_event_batch(
    ts: float,
    events: list[KVEvent],
    data_parallel_rank: int = 0,
    layout: str = "map",
) -> bytes:
    """Encode a batch exactly as vLLM's ``ZmqEventPublisher`` does.

    ``layout="map"`` is vLLM >= 0.24 (tagged maps, byte-exact with 0.24-0.32); ``layout="array"``
    is vLLM <= 0.23 (tagged arrays of 0.22-0.23's fields, all written). vLLM's publisher stamps
    the rank into every batch, so the batch is the 3-element array ``[ts, events, rank]``.
    """
    if layout == "map":
        wire: list[Any] = [_to_map(e) for e in events]
    elif layout == "array":
        wire = [_to_array(e) for e in events]
    else:
        raise ValueError(f"unknown KV event layout {layout!r}: expected 'map' or 'array'")
    return _ENCODER.encode(_EventBatch(float(ts), wire, data_parallel_rank))


def _to_map(e: KVEvent) -> _MapEvent:
    if isinstance(e, BlockStored):
        return _MapBlockStored(
            e.block_hashes,
            e.parent_block_hash,
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.medium,
            e.lora_name,
            e.extra_keys,
            e.group_idx,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
            locality=e.locality,
        )
    if isinstance(e, BlockRemoved):
        return _MapBlockRemoved(e.block_hashes, e.medium, e.group_idx, locality=e.locality)
    return _MapAllBlocksCleared()


def _to_array(e: KVEvent) -> _ArrayEvent:
    if isinstance(e, BlockStored):
        return _ArrayBlockStored(
            e.block_hashes,
            e.parent_block_hash,
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.medium,
            e.lora_name,
            e.extra_keys,
            e.group_idx,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
        )
    if isinstance(e, BlockRemoved):
        return _ArrayBlockRemoved(e.block_hashes, e.medium, e.group_idx)
    return _ArrayAllBlocksCleared()


# --- Lenient wire structs for decoding any vLLM version 0.10 ... 0.33. ----------------------------
# Every field after block_size (BlockStored) or block_hashes (BlockRemoved) is optional, because
# it appeared in a later version; unknown map keys and extra trailing array items are ignored by
# msgspec, so newer versions decode too.


class _InBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _InMapEvent(msgspec.Struct, tag=True, kw_only=True):
    pass


class _InMapBlockStored(_InMapEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class _InMapBlockRemoved(_InMapEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class _InMapAllBlocksCleared(_InMapEvent, tag="AllBlocksCleared"):
    pass


class _InArrayEvent(msgspec.Struct, tag=True, array_like=True):
    pass


class _InArrayBlockStored(_InArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _InArrayBlockRemoved(_InArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _InArrayAllBlocksCleared(_InArrayEvent, tag="AllBlocksCleared"):
    pass


_BATCH_DECODER = msgspec.msgpack.Decoder(_InBatch)
_MAP_DECODER = msgspec.msgpack.Decoder(
    _InMapBlockStored | _InMapBlockRemoved | _InMapAllBlocksCleared
)
_ARRAY_DECODER = msgspec.msgpack.Decoder(
    _InArrayBlockStored | _InArrayBlockRemoved | _InArrayAllBlocksCleared
)
_ANY_DECODER = msgspec.msgpack.Decoder()
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def decode_event_batch(
    payload: bytes | bytearray | memoryview,
) -> tuple[float, list[KVEvent], int | None]:
    """Decode a KV event batch from any vLLM 0.10-0.33 (either layout) or from this package.

    Returns ``(ts, events, data_parallel_rank)``; the rank is ``None`` when the batch has only
    two elements. Block hashes may be ints or bytes; a ``parent_block_hash`` of nil or ``0``
    (the llm-d simulator's "no parent") both become ``None``. Events whose ``type`` is a string
    this decoder does not know are skipped, so a newer vLLM's new event kinds do not cost the
    known events of the batch. Anything else that does not fit raises
    :class:`MalformedEventBatch`, never another exception.

    The decoder does not check that ``len(token_ids) == len(block_hashes) * block_size``
    (vLLM's hybrid-cache events can skip null blocks); a consumer that relies on it checks it.
    """
    try:
        batch = _BATCH_DECODER.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise MalformedEventBatch(f"not a KV event batch: {exc}") from exc
    events: list[KVEvent] = []
    for raw in batch.events:
        event = _decode_event(raw)
        if event is not None:
            events.append(event)
    return batch.ts, events, batch.data_parallel_rank


def _decode_event(raw: msgspec.Raw) -> KVEvent | None:
    view = memoryview(raw)
    if not view:
        raise MalformedEventBatch("empty event")
    first = view[0]
    # msgpack: fixmap 0x80-0x8f, map16 0xde, map32 0xdf; fixarray 0x90-0x9f, array16/32 0xdc/0xdd.
    is_map = 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)
    is_array = 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)
    if not (is_map or is_array):
        raise MalformedEventBatch("an event must be a msgpack map or array")
    try:
        wire = (_MAP_DECODER if is_map else _ARRAY_DECODER).decode(view)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        if _has_unknown_tag(view):
            return None
        raise MalformedEventBatch(f"bad KV event: {exc}") from exc
    if isinstance(wire, _InMapBlockStored | _InArrayBlockStored):
        if wire.block_size == 0 and not wire.token_ids and wire.medium not in (None, MEDIUM_GPU):
            # vLLM's offloading connector without self-describing events: a placeholder with
            # no tokens nor block size, which no consumer can index. Skipped, not the batch.
            return None
        if wire.block_size <= 0:
            raise MalformedEventBatch(f"bad KV event: block_size {wire.block_size}")
        parent = wire.parent_block_hash
        return BlockStored(
            wire.block_hashes,
            None if parent == 0 else parent,
            wire.token_ids,
            wire.block_size,
            wire.lora_id,
            wire.medium,
            wire.lora_name,
            wire.extra_keys,
            wire.group_idx,
            wire.kv_cache_spec_kind,
            getattr(wire, "locality", None),
            wire.kv_cache_spec_sliding_window,
        )
    if isinstance(wire, _InMapBlockRemoved | _InArrayBlockRemoved):
        return BlockRemoved(
            wire.block_hashes, wire.medium, wire.group_idx, getattr(wire, "locality", None)
        )
    return AllBlocksCleared()


def _has_unknown_tag(view: memoryview) -> bool:
    """Whether an event that failed typed decoding is a well-formed event of an unknown type."""
    try:
        obj = _ANY_DECODER.decode(view)
    except (msgspec.DecodeError, TypeError, ValueError):
        return False
    tag = obj.get("type") if isinstance(obj, dict) else obj[0] if obj else None
    return isinstance(tag, str) and tag not in _KNOWN_TAGS


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` publishes, given the endpoint configured for the
    replica: vLLM's ``ZmqEventPublisher.offset_endpoint_port``. Rank 0 and TCP port 0 are
    unchanged, TCP ports move up by the rank, ``inproc://`` endpoints take a ``_dp{rank}``
    suffix. vLLM refuses other schemes for ranks above 0; ``ipc://`` takes the suffix here
    (the emulated replica's layout), as a path cannot be offset."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
