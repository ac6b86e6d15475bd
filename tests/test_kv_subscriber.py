"""The KV-event subscriber against the emulated replica's real publisher (PUB + ROUTER replay)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kvroute.backends.process import free_ports
from kvroute.kvcore.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_event_batch,
    encode_event_batch,
)
from kvroute.router.kv_subscriber import KVEventSubscriber, KVEventSubscribers
from kvroute.simulator.replica.kv_publisher import KVEventPublisher

from .conftest import Running

END_SEQ = b"\xff" * 8
BS = 4


class Recorder:
    """An in-memory EventSink: every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def apply_stored(
        self,
        replica: str,
        engine_hashes: Sequence[int | bytes],
        parent_engine_hash: int | bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        medium: str | None = "GPU",
        extra_key: str | None = None,
    ) -> int:
        self.calls.append(
            (
                "stored",
                replica,
                tuple(engine_hashes),
                parent_engine_hash,
                tuple(token_ids),
                block_size,
                medium,
                extra_key,
            )
        )
        return len(engine_hashes)

    def apply_removed(
        self, replica: str, engine_hashes: Sequence[int | bytes], medium: str | None = "GPU"
    ) -> int:
        self.calls.append(("removed", replica, tuple(engine_hashes), medium))
        return len(engine_hashes)

    def clear_replica(self, replica: str) -> None:
        self.calls.append(("clear", replica))

    def stored_ids(self) -> list[int]:
        """The first block hash of each stored call (tests store one block per batch)."""
        return [c[2][0] for c in self.calls if c[0] == "stored"]

    def after_last_clear(self) -> list[int]:
        clears = [i for i, c in enumerate(self.calls) if c[0] == "clear"]
        start = clears[-1] + 1 if clears else 0
        return [c[2][0] for c in self.calls[start:] if c[0] == "stored"]


def stored(block_id: int) -> BlockStored:
    return BlockStored(
        block_hashes=[block_id],
        parent_block_hash=None,
        token_ids=[block_id % 1000] * BS,
        block_size=BS,
    )


async def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


class Source:
    """A publisher on free ports (or Unix sockets in ``ipc_dir``) and the addresses a
    subscriber uses."""

    ipc_dir: Path | None = None

    def __init__(
        self, replay: bool = True, buffer_steps: int = 10_000, ipc_dir: Path | None = None
    ) -> None:
        self.events_port, self.replay_port = free_ports(2)
        self.ipc_dir = ipc_dir
        self.replay = replay
        self.buffer_steps = buffer_steps
        self.published: list[int] = []  # block id of each batch, by seq
        self.pub = self._new_publisher()

    def _new_publisher(self) -> KVEventPublisher:
        pub = KVEventPublisher(
            self.endpoint if self.ipc_dir else f"tcp://*:{self.events_port}",
            (self.replay_endpoint if self.ipc_dir else f"tcp://*:{self.replay_port}")
            if self.replay
            else None,
            topic="kv",
            buffer_steps=self.buffer_steps,
        )
        pub.start()
        return pub

    async def restart(self) -> None:
        await self.pub.close()
        self.published = []
        self.pub = self._new_publisher()

    @property
    def endpoint(self) -> str:
        if self.ipc_dir:
            return f"ipc://{self.ipc_dir}/events"
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str | None:
        if not self.replay:
            return None
        if self.ipc_dir:
            return f"ipc://{self.ipc_dir}/replay"
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, count: int, base: int) -> list[int]:
        ids = [base + i for i in range(count)]
        for block_id in ids:
            self.pub.publish([stored(block_id)])
            self.published.append(block_id)
        return ids

    async def sync(self, sink: Recorder, base: int = 900_000) -> None:
        """Publish probe batches until one reaches the sink (a SUB misses what is sent before
        its subscription reaches the PUB: the slow joiner)."""
        deadline = time.monotonic() + 5
        before = len(sink.stored_ids())
        while len(sink.stored_ids()) == before:
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            self.publish(1, base + len(self.published))
            await asyncio.sleep(0.02)


@pytest.fixture
async def sources() -> AsyncIterator[Callable[..., Source]]:
    made: list[Source] = []

    def make(**kwargs: Any) -> Source:
        made.append(Source(**kwargs))
        return made[-1]

    yield make
    for source in made:
        await source.pub.close()


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[..., KVEventSubscriber]]:
    made: list[KVEventSubscriber] = []

    def make(source: Source, sink: Recorder, **kwargs: Any) -> KVEventSubscriber:
        replay = kwargs.pop("replay_endpoint", source.replay_endpoint)
        sub = KVEventSubscriber("r1", source.endpoint, replay, sink, **kwargs)
        sub.start()
        made.append(sub)
        return sub

    yield make
    for sub in made:
        await sub.close()


async def test_live_events_reach_the_sink_in_order(sources, subscribe) -> None:
    source = sources()
    sink = Recorder()
    sub = subscribe(source, sink)
    await source.sync(sink)
    source.publish(20, 1000)
    source.pub.publish(
        [
            BlockStored([7, 8], 6, list(range(2 * BS)), BS, medium="CPU", lora_name="ad"),
            BlockRemoved([7], medium="CPU"),
            AllBlocksCleared(),
        ]
    )
    await wait_until(lambda: len(sink.calls) >= len(source.published) + 2)
    # The probes sent before the subscription took hold came back by the late-join replay.
    assert sink.stored_ids()[:-1] == source.published
    assert sink.calls[-3:] == [
        # The adapter's key (router.block_hashing.extra_key): never equal to a bare salt's.
        ("stored", "r1", (7, 8), 6, tuple(range(2 * BS)), BS, "CPU", "ad\x00"),
        ("removed", "r1", (7,), "CPU"),
        ("clear", "r1"),
    ]
    assert sink.calls[0] == (
        "stored",
        "r1",
        (source.published[0],),
        None,
        (0,) * BS,
        BS,
        "GPU",
        None,
    )
    stats = sub.stats
    assert stats.last_seq == len(source.published)
    assert stats.batches == len(source.published) + 1
    assert stats.events == len(source.published) + 3
    assert stats.gaps == stats.resyncs == stats.malformed == 0
    assert stats.connected


async def test_gap_is_repaired_from_replay(sources, subscribe) -> None:
    source = sources()
    sink = Recorder()
    sub = subscribe(source, sink)
    await source.sync(sink)
    source.publish(3, 1000)
    await wait_until(lambda: len(sink.stored_ids()) == len(source.published))
    replayed_before = sub.stats.replayed_batches
    source.pub.paused = True  # these batches are buffered for replay but never sent live
    source.publish(5, 2000)
    source.pub.paused = False
    source.publish(30, 3000)
    await wait_until(lambda: len(sink.stored_ids()) >= len(source.published))
    await asyncio.sleep(0.05)  # let any duplicate that would wrongly arrive do so
    assert sink.stored_ids() == source.published  # every batch exactly once, in order
    assert not [c for c in sink.calls if c[0] == "clear"]
    assert sub.stats.gaps == 1 and sub.stats.resyncs == 0
    # The replay sent the 5 missing batches and whatever followed them up to its request.
    assert sub.stats.replayed_batches - replayed_before >= 5
    assert sub.stats.last_seq == len(source.published) - 1


async def test_ipc_endpoints_are_connected_to_and_replayed_from(
    sources, subscribe, tmp_path: Path
) -> None:
    # Launched replicas bind Unix sockets (vLLM always binds ipc://): the router must connect to
    # them; binding the same path would take it over from the replica and hear nothing.
    source = sources(ipc_dir=tmp_path)
    sink = Recorder()
    sub = subscribe(source, sink)
    await source.sync(sink)
    source.pub.paused = True  # buffered for replay, never sent live: a gap
    source.publish(3, 2000)
    source.pub.paused = False
    source.publish(5, 3000)
    await wait_until(lambda: len(sink.stored_ids()) >= len(source.published))
    assert sink.stored_ids() == source.published
    assert sub.stats.connected and sub.stats.gaps == 1 and sub.stats.replayed_batches >= 3


async def test_a_wildcard_tcp_endpoint_binds_only_the_replicas_host() -> None:
    # The emulated replica binds tcp://*:P on its --host, not on every interface.
    events_port, replay_port = free_ports(2)
    for bind_host, exposed in ((None, True), ("127.0.0.1", False)):
        pub = KVEventPublisher(
            f"tcp://*:{events_port}", f"tcp://*:{replay_port}", bind_host=bind_host
        )
        try:
            for port in (events_port, replay_port):
                with socket.socket() as other:  # another loopback address: in use if bound on *
                    try:
                        other.bind(("127.0.0.2", port))
                        bound_everywhere = False
                    except OSError:
                        bound_everywhere = True
                assert bound_everywhere == exposed, (bind_host, port)
        finally:
            await pub.close()


async def test_gap_without_replay_endpoint_resyncs(sources, subscribe) -> None:
    source = sources(replay=False)
    sink = Recorder()
    sub = subscribe(source, sink)
    await source.sync(sink)
    source.publish(2, 1000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [1001])
    source.pub.paused = True
    source.publish(3, 2000)
    source.pub.paused = False
    after = source.publish(4, 3000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [3003])
    assert sink.calls.count(("clear", "r1")) == 1
    assert sink.after_last_clear() == after
    assert 2000 not in sink.stored_ids()
    assert sub.stats.gaps == 1 and sub.stats.resyncs == 1
    assert sub.stats.last_seq == len(source.published) - 1


async def test_gap_older_than_the_replay_buffer_resyncs(sources, subscribe) -> None:
    source = sources(buffer_steps=3)
    sink = Recorder()
    sub = subscribe(source, sink)
    await source.sync(sink)
    source.publish(2, 1000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [1001])
    source.pub.paused = True
    source.publish(6, 2000)  # the ring buffer keeps only the last 3
    source.pub.paused = False
    after = source.publish(2, 3000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [3001])
    assert sink.calls.count(("clear", "r1")) == 1
    assert sink.after_last_clear() == after
    assert sub.stats.gaps == 1 and sub.stats.resyncs == 1


async def test_replay_timeout_resyncs(sources, subscribe) -> None:
    source = sources(replay=False)
    (silent,) = free_ports(1)  # nothing answers replays here
    sink = Recorder()
    sub = subscribe(source, sink, replay_endpoint=f"tcp://127.0.0.1:{silent}", replay_timeout_s=0.2)
    await source.sync(sink)
    source.publish(1, 1000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [1000])
    source.pub.paused = True
    source.publish(2, 2000)
    source.pub.paused = False
    source.publish(1, 3000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [3000])
    assert sink.after_last_clear() == [3000]
    assert sub.stats.resyncs == 1 and sub.stats.replay_timeouts >= 1


async def test_publisher_restart_clears_and_starts_over(sources, subscribe) -> None:
    source = sources()
    sink = Recorder()
    sub = subscribe(source, sink)
    await source.sync(sink)
    source.publish(30, 1000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [1029])
    assert sink.calls.count(("clear", "r1")) == 0
    await source.restart()  # a new publisher on the same ports counts from 0 again
    await source.sync(sink, base=500_000)
    source.publish(3, 5000)
    await wait_until(lambda: sink.stored_ids()[-1:] == [5002])
    assert sink.calls.count(("clear", "r1")) == 1
    # Everything the new publisher sent, from seq 0, including what the SUB missed while
    # reconnecting (the restart is handled like a late join: replay from 0).
    assert sink.after_last_clear() == source.published
    assert sub.stats.resyncs == 1 and sub.stats.last_seq == len(source.published) - 1


async def test_garbage_is_counted_and_skipped(subscribe) -> None:
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    (port,) = free_ports(1)
    pub.bind(f"tcp://*:{port}")
    source = Source.__new__(Source)  # only the addresses are used
    source.events_port, source.replay = port, False
    sink = Recorder()
    sub = subscribe(source, sink)
    seq = 0

    def send(frames: list[bytes]) -> None:
        pub.send_multipart(frames)

    def batch(block_id: int) -> list[bytes]:
        nonlocal seq
        frames = [b"", seq.to_bytes(8, "big"), encode_event_batch(0.0, [stored(block_id)], 0)]
        seq += 1
        return frames

    try:
        deadline = time.monotonic() + 5
        while not sink.calls:
            assert time.monotonic() < deadline
            send(batch(1))
            await asyncio.sleep(0.02)
        send([b"only one frame"])
        send([b"", b"1234", b"x", b"four"])
        send([b"", b"short", b"payload"])
        send([b"", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])  # consumes a seq
        seq += 1
        send([b"", seq.to_bytes(8, "big"), b"\x93\x01\x02"])  # msgpack, not a batch
        seq += 1
        send(batch(42))
        await wait_until(lambda: sink.stored_ids()[-1:] == [42])
        assert sub.stats.malformed == 5
        assert sub.stats.gaps == 0 and sub.stats.resyncs == 0
        assert sub.stats.last_seq == seq - 1
        assert not sub._tasks[0].done()
    finally:
        pub.close(linger=0)
        context.term()


async def test_late_join_replays_from_zero(sources, subscribe) -> None:
    source = sources()
    early = source.publish(5, 100)  # nobody listens: only the replay buffer has these
    sink = Recorder()
    sub = subscribe(source, sink)
    await source.sync(sink)
    await wait_until(lambda: len(sink.stored_ids()) == len(source.published))
    assert sink.stored_ids() == source.published
    assert sink.stored_ids()[:5] == early
    assert sub.stats.replayed_batches >= 5 and sub.stats.resyncs == 0


async def test_close_is_clean_even_during_a_replay(sources) -> None:
    source = sources(replay=False)
    (silent,) = free_ports(1)
    sink = Recorder()
    sub = KVEventSubscriber(
        "r1", source.endpoint, f"tcp://127.0.0.1:{silent}", sink, replay_timeout_s=30
    )
    # Published before the subscriber exists, so it is missed for sure: the first batch the
    # subscriber sees is a late join, which starts a 30 s replay on the silent endpoint.
    source.publish(1, 1)
    sub.start()
    deadline = time.monotonic() + 5
    while sub._dealer is None:  # a late join is waiting on the silent replay endpoint
        assert time.monotonic() < deadline
        source.publish(1, 1)
        await asyncio.sleep(0.02)
    tasks = list(sub._tasks)
    started = time.monotonic()
    await sub.close()
    assert time.monotonic() - started < 1
    assert all(t.done() for t in tasks)
    assert sub._sub is not None and sub._sub.closed and sub._dealer is None
    assert not sub.stats.connected
    await sub.close()  # twice is fine


async def test_subscribers_aggregate(sources) -> None:
    a, b = sources(), sources()
    sink = Recorder()
    fleet = KVEventSubscribers(sink)
    fleet.add("a", a.endpoint, a.replay_endpoint)
    fleet.add("b", b.endpoint, b.replay_endpoint)
    fleet.start_all()
    try:
        await a.sync(sink)
        await b.sync(sink, base=800_000)
        a.publish(3, 1000)
        b.publish(4, 2000)
        await wait_until(lambda: fleet.totals().batches == len(a.published) + len(b.published))
        per = fleet.stats_by_source()
        assert per[("a", a.endpoint)].batches == len(a.published)
        assert per[("b", b.endpoint)].batches == len(b.published)
        assert {c[1] for c in sink.calls} == {"a", "b"}
        await wait_until(lambda: fleet.totals().connected)
    finally:
        await fleet.close_all()
    assert not fleet.totals().connected


async def test_emulated_replica_feeds_the_sink(replica: Running) -> None:
    port = int(replica.url.rsplit(":", 1)[1])
    events_port = int(replica.events.rsplit(":", 1)[1])
    replay_port = int(replica.replay.rsplit(":", 1)[1])
    sink = Recorder()
    sub = KVEventSubscriber(
        "emu", f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}", sink
    )
    sub.start()
    try:
        prompt = "The quick brown fox jumps over the lazy dog. " * 20
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 10
            while sub.stats.batches == 0:
                assert time.monotonic() < deadline
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200
                prompt = "x" + prompt  # a new prefix: new blocks, new events
        # What the replica's replay buffer holds is what the sink must have seen, in order.
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        expected: list[tuple[Any, ...]] = []
        last_seq = -1
        async with asyncio.timeout(5):
            while True:
                _, _, seq, payload = await dealer.recv_multipart()
                if seq == END_SEQ:
                    break
                last_seq = int.from_bytes(seq, "big")
                for event in decode_event_batch(payload)[1]:
                    if isinstance(event, BlockStored):
                        expected.append(("stored", tuple(event.block_hashes)))
                    elif isinstance(event, BlockRemoved):
                        expected.append(("removed", tuple(event.block_hashes)))
        dealer.close(linger=0)
        context.term()
        await wait_until(lambda: (sub.stats.last_seq or -1) >= last_seq >= 0)
        got = [(c[0], c[2]) for c in sink.calls if c[0] in ("stored", "removed")]
        assert expected and got[: len(expected)] == expected
        assert any(c[4] for c in sink.calls if c[0] == "stored")  # token ids came through
        assert sub.stats.malformed == 0 and sub.stats.resyncs == 0
    finally:
        await sub.close()


async def test_garbage_in_a_replay_is_counted_and_skipped(subscribe) -> None:
    """A replay server that mixes bad frames into its answer: they are skipped, the rest used."""
    context = zmq.asyncio.Context()
    pub, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    events_port, replay_port = free_ports(2)
    pub.bind(f"tcp://*:{events_port}")
    router.bind(f"tcp://*:{replay_port}")
    # Three batches only the replay knows: the first live frame has seq >= 3 and starts one.
    sent = [encode_event_batch(0.0, [stored(100 + seq)], 0) for seq in range(3)]

    async def serve() -> None:
        while True:
            client, _, start = await router.recv_multipart()
            await router.send_multipart([client, b"", b"no seq"])  # 1 frame after b""
            await router.send_multipart([client, b"not empty", b"kv", b"12345678", b"x"])
            for seq in range(int.from_bytes(start, "big"), len(sent)):
                await router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), sent[seq]])
            await router.send_multipart([client, b"", b"", END_SEQ, b""])

    server = asyncio.create_task(serve())
    source = Source.__new__(Source)
    source.events_port, source.replay_port, source.replay = events_port, replay_port, True
    sink = Recorder()
    sub = subscribe(source, sink)
    try:
        deadline = time.monotonic() + 5
        while not sink.calls:
            assert time.monotonic() < deadline
            seq = len(sent)
            sent.append(encode_event_batch(0.0, [stored(100 + seq)], 0))
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), sent[-1]])
            await asyncio.sleep(0.02)
        await wait_until(lambda: len(sink.stored_ids()) == len(sent))
        assert sink.stored_ids() == [100 + i for i in range(len(sent))]
        assert sub.stats.replayed_batches >= 3
        assert sub.stats.malformed == 2 and sub.stats.resyncs == 0
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)
        context.term()


async def test_a_batch_larger_than_the_limit_is_never_held(subscribe) -> None:
    """A publisher sending a batch past max_message_bytes: ZMQ drops that connection before
    the message is held whole (ZMQ_MAXMSGSIZE), reconnects, and the batches after it are
    applied (the jump in seq is a gap like any other)."""
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    (port,) = free_ports(1)
    pub.bind(f"tcp://*:{port}")
    source = Source.__new__(Source)
    source.events_port, source.replay = port, False
    sink = Recorder()
    sub = subscribe(source, sink, max_message_bytes=1 << 20)
    seq = 0

    def batch(block_id: int, pad: int = 0) -> list[bytes]:
        nonlocal seq
        event = stored(block_id)
        if pad:
            event = BlockStored([block_id], None, [1] * pad, BS)
        frames = [b"", seq.to_bytes(8, "big"), encode_event_batch(0.0, [event], 0)]
        seq += 1
        return frames

    try:
        deadline = time.monotonic() + 5
        while not sink.calls:
            assert time.monotonic() < deadline
            pub.send_multipart(batch(1))
            await asyncio.sleep(0.02)
        giant = batch(666, pad=1 << 20)  # ~1 MB of token ids, plus framing: past 1 MiB
        assert len(giant[2]) > 1 << 20
        pub.send_multipart(giant)
        deadline = time.monotonic() + 10
        while 42 not in sink.stored_ids():  # ZMQ reconnects; batches sent meanwhile are lost
            assert time.monotonic() < deadline, "no batch applied after the giant one"
            pub.send_multipart(batch(42))
            await asyncio.sleep(0.02)
        assert 666 not in sink.stored_ids()
        assert not sub._tasks[0].done()
    finally:
        pub.close(linger=0)
        context.term()


@pytest.mark.parametrize("flood", ["batches", "garbage"])
async def test_a_replay_that_never_ends_is_abandoned(subscribe, flood: str) -> None:
    """A replay server answering with endless batches (or endless garbage) and no end marker:
    the subscriber stops after max_replay_batches messages, resyncs, and follows the live
    stream; what it held is let go."""
    context = zmq.asyncio.Context()
    pub, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    events_port, replay_port = free_ports(2)
    pub.bind(f"tcp://*:{events_port}")
    router.bind(f"tcp://*:{replay_port}")
    answered = 0

    async def serve() -> None:
        nonlocal answered
        while True:
            client, _, start = await router.recv_multipart()
            seq = int.from_bytes(start, "big")
            for i in range(1_000):  # far past the limit below, no END_SEQ
                answered += 1
                if flood == "batches":
                    payload = encode_event_batch(0.0, [stored(5000 + i)], 0)
                    frames = [client, b"", b"kv", (seq + i).to_bytes(8, "big"), payload]
                else:
                    frames = [client, b"", b"garbage"]
                await router.send_multipart(frames)

    server = asyncio.create_task(serve())
    source = Source.__new__(Source)
    source.events_port, source.replay_port, source.replay = events_port, replay_port, True
    sink = Recorder()
    sub = subscribe(source, sink, max_replay_batches=50, replay_timeout_s=5.0)
    try:
        deadline = time.monotonic() + 10
        live = 10  # the first live frame has seq > 0: the subscriber asks for a replay
        while not sub.stats.replay_overflows:
            assert time.monotonic() < deadline, "the replay was never abandoned"
            pub.send_multipart(
                [b"kv", live.to_bytes(8, "big"), encode_event_batch(0.0, [stored(live)], 0)]
            )
            live += 1
            await asyncio.sleep(0.02)
        # Nothing of the abandoned replay was applied; the live stream goes on.
        await wait_until(lambda: any(i < 5000 for i in sink.stored_ids()), timeout=10)
        assert all(i < 5000 for i in sink.stored_ids())
        assert sub.stats.replayed_batches == 0
        assert not sub._tasks[0].done()
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)
        context.term()


async def _resumed(source: Source, sink: Recorder, seq: int) -> KVEventSubscriber:
    sub = KVEventSubscriber("r1", source.endpoint, source.replay_endpoint, sink)
    sub.resume_from(seq)
    sub.start()
    return sub


async def test_resumed_from_a_snapshot_it_replays_only_what_came_after(sources) -> None:
    """A warm start: the sink holds batches 0-2 already (a snapshot); 3 and 4 came before the
    subscriber connected, and are replayed; none is applied twice, nothing is cleared."""
    source = sources()
    source.publish(5, 100)
    sink = Recorder()
    sub = await _resumed(source, sink, 2)
    try:
        await source.sync(sink)
        ids = sink.stored_ids()
        assert ids[:2] == [103, 104]
        assert not {100, 101, 102} & set(ids)
        assert ("clear", "r1") not in sink.calls
        assert sub.stats.gaps == 1 and sub.stats.replayed_batches >= 2
    finally:
        await sub.close()


async def test_a_publisher_restarted_since_the_snapshot_is_resynced(sources) -> None:
    """The snapshot says seq 50, the live stream is below it: the replica started over, so
    what the snapshot said of it is dropped and its history replayed from 0."""
    source = sources()
    source.publish(3, 100)
    sink = Recorder()
    sub = await _resumed(source, sink, 50)
    try:
        await source.sync(sink)
        assert sink.calls[0] == ("clear", "r1")
        assert sink.after_last_clear()[:3] == [100, 101, 102]
        assert sub.stats.resyncs == 1
    finally:
        await sub.close()
