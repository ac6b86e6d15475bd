"""KV event wire format: byte-exact vLLM encoding in both layouts, and a decoder that never crashes."""

from __future__ import annotations

import contextlib
import struct
from importlib.util import find_spec
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.kvcore.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    MalformedEventBatch,
    decode_event_batch,
    encode_event_batch,
)
from kvroute.simulator.engine import Engine, EngineConfig, EngineRequest

H1 = 0xDEADBEEF01234567
H2 = 0x1122334455667788
TOKENS = list(range(32))


def stored(**overrides: Any) -> BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [H1, H2],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    fields.update(overrides)
    return BlockStored(**fields)


SAMPLE: list[KVEvent] = [
    stored(),
    stored(
        block_hashes=[2**64 - 1],
        parent_block_hash=H1,
        token_ids=list(range(16)),
        lora_name="ad",
        extra_keys=[("ad", "salt")],
        kv_cache_spec_kind="full_attention",
    ),
    stored(block_hashes=[b"\xab" * 32], parent_block_hash=b"\xcd" * 32, token_ids=[1] * 16),
    stored(block_hashes=[-5], group_idx=None),  # vLLM 0.10 builtin hash(): signed
    BlockRemoved([H1], "GPU", 0),
    BlockRemoved([b"\x01" * 32], None),
    AllBlocksCleared(),
]


# --- golden bytes ---------------------------------------------------------------------------------


def test_array_layout_matches_the_reference_bytes() -> None:
    """reference/vllm-interface.md 1.3, "Example bytes (array mode, 2 blocks of 16)":
    93 cb41d954fc40200000 93 9a ab"BlockStored" 92 cf deadbeef01234567 cf 1122334455667788
    c0 dc0020 00..1f 10 c0 a3"GPU" c0 c0 00 ...

    That event is a 10-item array: vLLM 0.20-0.21's nine fields, all written. The array layout
    here is 0.22-0.23's, which has two more fields (kv_cache_spec_kind, sliding window), also
    written as nil: msgspec never omits defaults of array_like structs (msgspec issue #720).
    """
    ts_bytes = bytes.fromhex("41d954fc40200000")
    (ts,) = struct.unpack(">d", ts_bytes)
    reference_event = (
        b"\xabBlockStored"
        + b"\x92\xcf"
        + H1.to_bytes(8, "big")
        + b"\xcf"
        + H2.to_bytes(8, "big")
        + b"\xc0"  # parent nil
        + b"\xdc\x00\x20"
        + bytes(range(32))
        + b"\x10"  # block_size 16
        + b"\xc0\xa3GPU\xc0"  # lora_id nil, medium, lora_name nil
        + b"\xc0\x00"  # extra_keys nil, group_idx 0
    )
    expected = (
        b"\x93\xcb"
        + ts_bytes
        + b"\x91"  # one event (the reference batch held three)
        + b"\x9c"  # 12 items: tag + 0.23's 11 fields
        + reference_event
        + b"\xc0\xc0"  # kv_cache_spec_kind, kv_cache_spec_sliding_window
        + b"\x00"  # data_parallel_rank
    )
    assert encode_event_batch(ts, [stored()], 0, layout="array") == expected


def test_map_layout_keys_and_order_match_the_reference() -> None:
    """reference 1.3: {"type":"BlockStored","block_hashes":[...],"parent_block_hash":nil,
    "token_ids":[...],"block_size":16,"lora_id":nil,"medium":"GPU","lora_name":nil,"group_idx":0}
    """
    payload = encode_event_batch(1.5, [stored()], 0, layout="map")
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank) == (1.5, 0)
    assert list(events[0].items()) == [
        ("type", "BlockStored"),
        ("block_hashes", [H1, H2]),
        ("parent_block_hash", None),
        ("token_ids", TOKENS),
        ("block_size", 16),
        ("lora_id", None),
        ("medium", "GPU"),
        ("lora_name", None),
        ("group_idx", 0),
    ]
    # msgpack header: fixarray(3), float64 ts, fixarray(1), fixmap(9), "type"
    assert payload.startswith(b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x91\x89\xa4type")


def test_engine_events_have_the_shape_vllm_0_32_publishes() -> None:
    """reference/vllm-cpu.md: a real 0.32 replica sent {"type": "BlockStored", ...,
    "lora_name": None, "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}.
    """
    engine = Engine(EngineConfig(block_size=4, num_blocks=2))
    engine.add_request(EngineRequest("a", [1, 2, 3, 4, 5], 3, 0.0))
    events: list[KVEvent] = []
    while engine.has_unfinished_requests():
        events += engine.step(0.0).events
    engine.add_request(EngineRequest("b", [9, 9, 9, 9, 9], 1, 0.0))  # evicts a's blocks
    events += engine.step(0.0).events
    assert engine.reset_prefix_cache()
    events += engine.step(0.0).events
    _, wire, _ = msgspec.msgpack.decode(encode_event_batch(0.0, events))
    kinds = [e["type"] for e in wire]
    assert kinds[0] == "BlockStored" and "BlockRemoved" in kinds and kinds[-1] == "AllBlocksCleared"
    first = wire[0]
    assert list(first) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert (first["extra_keys"], first["group_idx"], first["kv_cache_spec_kind"]) == (
        [None],
        0,
        "full_attention",
    )
    assert all(isinstance(h, int) and 0 < h < 2**64 for h in first["block_hashes"])
    removed = wire[kinds.index("BlockRemoved")]
    assert list(removed) == ["type", "block_hashes", "medium", "group_idx"]
    assert wire[-1] == {"type": "AllBlocksCleared"}


def test_array_layout_writes_every_field_like_msgspec_does() -> None:
    events: list[KVEvent] = [
        stored(group_idx=None),
        BlockRemoved([H1], "GPU"),
        BlockRemoved([H1], "GPU", 0),
        AllBlocksCleared(),
    ]
    _, wire, _ = msgspec.msgpack.decode(encode_event_batch(0.0, events, layout="array"))
    assert wire[0] == ["BlockStored", [H1, H2], None, TOKENS, 16, None, "GPU", None] + [None] * 4
    assert wire[1] == ["BlockRemoved", [H1], "GPU", None]
    assert wire[2] == ["BlockRemoved", [H1], "GPU", 0]
    assert wire[3] == ["AllBlocksCleared"]


def test_unknown_layout_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown KV event layout 'json'"):
        encode_event_batch(0.0, [], layout="json")


# --- decoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["map", "array"])
def test_round_trip(layout: str) -> None:
    payload = encode_event_batch(1712345678.25, SAMPLE, 3, layout=layout)
    assert decode_event_batch(payload) == (1712345678.25, SAMPLE, 3)


def test_round_trip_of_engine_events() -> None:
    engine = Engine(EngineConfig(block_size=4, num_blocks=8))
    for i in range(4):
        engine.add_request(
            EngineRequest(f"r{i}", [i % 2] * 9, 6, 0.0, lora_name="x" if i == 3 else None)
        )
    while engine.has_unfinished_requests():
        events = engine.step(0.0).events
        for layout in ("map", "array"):
            assert decode_event_batch(encode_event_batch(2.0, events, 0, layout))[1] == events


def enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_decoder_reads_every_version() -> None:
    # vLLM 0.10: arrays, no medium; BlockRemoved with hashes only; signed int64 hashes.
    v010 = enc([1.0, [["BlockStored", [-1, 2], None, [0] * 8, 4, None], ["BlockRemoved", [3]]], 0])
    ts, events, rank = decode_event_batch(v010)
    assert (ts, rank) == (1.0, 0)
    assert events == [BlockStored([-1, 2], None, [0] * 8, 4, None, None), BlockRemoved([3], None)]
    # vLLM 0.33 map with fields this decoder does not know: ignored (locality is read: where an
    # offloaded copy lives).
    v033 = {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": 4,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "locality": "LOCAL",
        "session_id": "s",
        "lookahead_token_ids": [[1]],
    }
    [event] = decode_event_batch(enc([2, [v033]]))[1]
    assert event == BlockStored(
        [5], 4, [1, 2], 2, None, "GPU", None, [None], 0, "full_attention", "LOCAL"
    )
    # Arrays longer than this decoder knows (0.22's sliding window, ...) are fine too.
    longer = ["BlockStored", [5], None, [1, 2], 2, None, "GPU", None, None, 0, "x", 128, "y"]
    [event] = decode_event_batch(enc([0.0, [longer], 1]))[1]
    assert isinstance(event, BlockStored) and event.kv_cache_spec_kind == "x"


def test_decoder_details() -> None:
    # The llm-d simulator's legacy events say "no parent" with 0.
    [event] = decode_event_batch(enc([0.0, [["BlockStored", [1], 0, [7], 1]]]))[1]
    assert isinstance(event, BlockStored) and event.parent_block_hash is None
    # A two-element batch has no rank.
    assert decode_event_batch(enc([0.5, []])) == (0.5, [], None)
    # Unknown event kinds are skipped; the known ones in the batch still count.
    batch = [
        {"type": "BlockTransferred", "block_hashes": [1]},
        ["FutureEvent", 1, 2],
        {"type": "AllBlocksCleared"},
    ]
    assert decode_event_batch(enc([0.0, batch, 0]))[1] == [AllBlocksCleared()]
    # Accepts any bytes-like payload.
    payload = encode_event_batch(0.0, SAMPLE)
    assert decode_event_batch(bytearray(payload))[1] == SAMPLE
    assert decode_event_batch(memoryview(payload))[1] == SAMPLE


MALFORMED: list[Any] = [
    b"",
    b"\xc1",
    b"\x93\xcb\x00",
    b"not msgpack at all",
    enc({"ts": 1.0}),
    enc([]),
    enc([1.0]),
    enc(["1.0", []]),
    enc([1.0, "events"]),
    enc([1.0, [1]]),
    enc([1.0, ["BlockStored"]]),
    enc([1.0, [[]]]),
    enc([1.0, [{}]]),
    enc([1.0, [{"type": 5}]]),
    enc([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    enc([1.0, [["BlockStored", [True], None, [1], 1]]]),
    enc([1.0, [["BlockStored", [1], None, ["a"], 1]]]),
    enc([1.0, [["BlockStored", [1], None, [1], 0]]]),
    enc([1.0, [["BlockStored", [1], None, [1], 1, "lora-id-not-int"]]]),
    enc([1.0, [["BlockRemoved", 1]]]),
    enc([1.0, [], "rank"]),
    None,
    "a string",
    12,
]


@pytest.mark.parametrize("payload", MALFORMED)
def test_malformed_payloads_raise_one_error_type(payload: Any) -> None:
    with pytest.raises(MalformedEventBatch):
        decode_event_batch(payload)
    assert issubclass(MalformedEventBatch, ValueError)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(payload: bytes) -> None:
    with contextlib.suppress(MalformedEventBatch):
        decode_event_batch(payload)


@settings(max_examples=300, deadline=None)
@given(
    layout=st.sampled_from(["map", "array"]),
    cut=st.integers(0, 10_000),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_damaged_payloads_never_crash_the_decoder(
    layout: str, cut: int, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(encode_event_batch(1.0, SAMPLE, 0, layout))
    for pos, value in flips:
        data[pos % len(data)] = value
    try:
        _, events, _ = decode_event_batch(bytes(data[: max(1, cut % (len(data) + 1))]))
    except MalformedEventBatch:
        return
    for event in events:  # whatever decodes is well-typed
        assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
        if isinstance(event, BlockStored):
            assert event.block_size > 0
            assert all(type(t) is int for t in event.token_ids)
            assert all(type(h) in (int, bytes) for h in event.block_hashes)


# --- against vLLM itself --------------------------------------------------------------------------


class V023Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM 0.23 structs, copied from the 0.23 definitions (reference 1.1-1.2)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V023Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V023BlockStored(V023Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class V023BlockRemoved(V023Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class V023AllBlocksCleared(V023Event, tag="AllBlocksCleared"):
    pass


class V023KVEventBatch(V023Batch):
    events: list[V023BlockStored | V023BlockRemoved | V023AllBlocksCleared]


def test_array_layout_decodes_with_vllm_0_23_structs() -> None:
    payload = encode_event_batch(3.0, SAMPLE, 2, layout="array")
    batch = msgspec.msgpack.Decoder(V023KVEventBatch).decode(payload)
    assert (batch.ts, batch.data_parallel_rank) == (3.0, 2)
    first = batch.events[0]
    assert isinstance(first, V023BlockStored)
    assert (first.block_hashes, first.token_ids, first.medium, first.group_idx) == (
        [H1, H2],
        TOKENS,
        "GPU",
        0,
    )
    assert [type(e).__name__ for e in batch.events] == [
        "V023BlockStored",
        "V023BlockStored",
        "V023BlockStored",
        "V023BlockStored",
        "V023BlockRemoved",
        "V023BlockRemoved",
        "V023AllBlocksCleared",
    ]
    # And vLLM 0.23 encodes its own objects to exactly our bytes.
    theirs = V023KVEventBatch(
        3.0,
        [V023BlockStored([H1, H2], None, TOKENS, 16, None, "GPU", None, group_idx=0)],
        2,
    )
    assert msgspec.msgpack.encode(theirs) == encode_event_batch(3.0, [stored()], 2, "array")


@pytest.mark.vllm
@pytest.mark.skipif(find_spec("vllm") is None, reason="vllm is not installed")
def test_map_layout_is_byte_identical_to_vllm() -> None:
    from vllm.distributed import kv_events as v

    ours = encode_event_batch(7.5, SAMPLE, 0, layout="map")
    batch = msgspec.msgpack.Decoder(v.KVEventBatch).decode(ours)
    assert (batch.ts, batch.data_parallel_rank) == (7.5, 0)
    assert [type(e).__name__ for e in batch.events] == [type(e).__name__ for e in SAMPLE]
    first = batch.events[1]
    assert isinstance(first, v.BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.lora_name, first.extra_keys) == (
        [2**64 - 1],
        H1,
        "ad",
        [("ad", "salt")],
    )
    # vLLM's own objects, encoded as its publisher does, give exactly our bytes.
    theirs = v.KVEventBatch(
        ts=7.5,
        events=[
            v.BlockStored(
                block_hashes=[H1, H2],
                parent_block_hash=None,
                token_ids=TOKENS,
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            v.BlockRemoved(block_hashes=[H1], medium="GPU", group_idx=0),
            v.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    mine: list[KVEvent] = [
        stored(extra_keys=[None, None], kv_cache_spec_kind="full_attention"),
        BlockRemoved([H1], "GPU", 0),
        AllBlocksCleared(),
    ]
    assert msgspec.msgpack.Encoder().encode(theirs) == encode_event_batch(7.5, mine, 0, "map")
    # And our decoder reads what vLLM encodes.
    assert decode_event_batch(msgspec.msgpack.Encoder().encode(theirs)) == (7.5, mine, 0)
