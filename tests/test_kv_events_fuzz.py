"""KV events from a hostile or broken publisher, end to end: fuzzed histories of wire frames
(valid batches with odd contents, garbage, damaged payloads, sequence numbers that jump, repeat
or go back) through the subscriber into the fast prefix index and the reference index. Neither
raises out of the subscriber, the two always agree, and garbage is counted, never applied
(issue 37, item 4). A short run in CI; KVROUTE_FUZZ_EXAMPLES for a long one."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_event_batch,
)
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.reference_index import ReferenceIndex
from kvroute.router.kv_subscriber import KVEventSubscriber

BS = 4
DOCS = [[d * 1000 + i for i in range(6 * BS)] for d in range(2)]
QUERIES = [block_hashes(doc, BS) for doc in DOCS]
FUZZ_EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "150"))

# Engine hashes: small ints that collide on purpose, the extremes, digest bytes of odd lengths.
hashes = st.one_of(
    st.integers(0, 12),
    st.sampled_from([(1 << 64) - 1, 1 << 63, -1]),
    st.binary(min_size=0, max_size=9),
)
tokens = st.one_of(
    # A document's blocks, as vLLM sends them.
    st.tuples(st.integers(0, 1), st.integers(0, 5), st.integers(1, 6)).map(
        lambda t: DOCS[t[0]][t[1] * BS : max(t[1] + 1, t[2]) * BS]
    ),
    # Anything else: too few or too many tokens, negative or huge ids.
    st.lists(st.one_of(st.integers(0, 50), st.sampled_from([-1, 1 << 40])), max_size=30),
)
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, min_size=0, max_size=7),
    parent_block_hash=st.one_of(st.none(), hashes),
    token_ids=tokens,
    block_size=st.sampled_from([BS, BS, BS, 1, 16]),
    medium=st.sampled_from(["GPU", "GPU", "CPU", None, "tape"]),
    lora_name=st.sampled_from([None, None, "adapter"]),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=5),
    medium=st.sampled_from(["GPU", "CPU", None]),
)
events = st.lists(st.one_of(stored, stored, removed, st.just(AllBlocksCleared())), max_size=4)
payloads = st.one_of(
    events.map(lambda e: encode_event_batch(0.0, e)),
    events.map(lambda e: encode_event_batch(0.0, e, layout="array")),
    st.binary(max_size=40),  # garbage
    events.flatmap(  # a valid batch, damaged
        lambda e: st.tuples(st.just(encode_event_batch(0.0, e)), st.integers(0, 60)).map(
            lambda t: t[0][: t[1]] + b"\xc1" + t[0][t[1] + 1 :]
        )
    ),
)
# Sequence numbers: mostly the next one, sometimes a jump, a repeat, a step back.
steps = st.sampled_from([1, 1, 1, 1, 2, 5, 0, -3])
frames = st.lists(st.tuples(steps, payloads), min_size=1, max_size=25)


class _Sinks:
    def __init__(self) -> None:
        self.fast, self.ref = PrefixIndex(), ReferenceIndex()


def _subscriber(sink: Any) -> KVEventSubscriber:
    # No sockets are opened: the frames are handed to it as its receive loop would.
    return KVEventSubscriber("r", "tcp://127.0.0.1:9", None, sink)


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(history=frames)
def test_fuzzed_event_histories_keep_the_fast_index_equal_to_the_reference(
    history: list[tuple[int, bytes]],
) -> None:
    async def run() -> None:
        sinks = _Sinks()
        fast, ref = _subscriber(sinks.fast), _subscriber(sinks.ref)
        seq = 0
        for step, payload in history:
            seq = max(0, seq + step)
            message = [b"kv", seq.to_bytes(8, "big"), payload]
            await fast._on_live(message)
            await ref._on_live(message)
            for q in QUERIES:
                assert sinks.fast.match(q, 0.0) == sinks.ref.match(q, 0.0)
            assert sinks.fast.entries == sinks.ref.entries
            assert sinks.fast.blocks == sinks.ref.blocks
            assert fast.stats.sink_errors == ref.stats.sink_errors
        # Garbage was counted (each bad payload once), and no frame ended the subscriber.
        assert fast.stats.malformed == ref.stats.malformed
        assert fast.stats.batches + fast.stats.malformed <= len(history)
        await fast.close()
        await ref.close()

    asyncio.run(run())


def test_one_engine_hash_named_twice_in_an_event_leaves_the_indexes_alike() -> None:
    """What the fuzz found: a publisher naming one engine hash for two blocks of one event.
    The fast index held both blocks with only the second mapped (a block no event could
    remove, counted as no entry at all); now it keeps the second only, as the reference."""
    q = block_hashes(DOCS[0], BS)
    for idx in (fast := PrefixIndex(), ref := ReferenceIndex()):
        idx.apply_stored("r", [7, 7], None, DOCS[0][: 2 * BS], BS, "GPU")
    assert fast.entries == ref.entries == 1
    assert fast.match(q, 0.0) == ref.match(q, 0.0) == {}
    for idx in (fast, ref):
        idx.apply_removed("r", [7], "GPU")
    assert fast.entries == ref.entries == 0
