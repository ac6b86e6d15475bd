"""The picker's own HTTP/2 gRPC server (router/epp/h2_grpc.py), as clients see it.

Two kinds of client: gRPC's C core (``grpcio``, the same HTTP/2 stack as Envoy's
``google_grpc``; Envoy's own client is covered by tests/test_epp_envoy.py), and a raw HTTP/2
client written here that sends what those clients may send but rarely do (CONTINUATION,
padding, tiny windows, resets, compressed messages) and reads every frame back.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import hpack
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.router.epp import h2_grpc as h2
from kvroute.router.epp.h2_grpc import GrpcServer, Stream
from kvroute.router.epp.health_service import HealthBoard

ECHO = "/test.Echo/Echo"


class _Echo:
    """Echoes each message; ends OK when the client's side ends."""

    def __init__(self, stream: Stream, log: list[str]) -> None:
        self.stream = stream
        self.log = log

    def on_message(self, message: bytes) -> None:
        self.log.append(f"message {len(message)}")
        self.stream.send(message)

    def on_half_close(self) -> None:
        self.log.append("half close")
        self.stream.finish()

    def on_cancel(self) -> None:
        self.log.append("cancel")


@dataclass
class Served:
    server: GrpcServer
    port: int
    board: HealthBoard
    log: list[str] = field(default_factory=list)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    board = HealthBoard()
    board.set("readiness", True)
    log: list[str] = []
    server = GrpcServer(
        {**board.handlers(), ECHO: lambda stream: _Echo(stream, log)}, max_message_bytes=1 << 16
    )
    port = await server.start("127.0.0.1", 0)
    yield Served(server, port, board, log)
    await server.stop(1.0)


# -- gRPC's C core as the client ----------------------------------------------------------


async def test_health_check_and_watch_with_grpcs_own_client(served: Served) -> None:
    async with aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(aio.AioRpcError) as unknown:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        served.board.set("readiness", False)
        second = await asyncio.wait_for(watch.read(), 5)
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


async def test_streams_echo_in_order_and_unknown_methods_are_unimplemented(
    served: Served,
) -> None:
    async with aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        echo = channel.stream_stream(ECHO)
        sizes = [0, 1, 5, 40_000, 60_000]  # split over frames and windows
        call = echo(iter([bytes([n % 251]) * n for n in sizes]))
        answers = [answer async for answer in call]
        assert [len(a) for a in answers] == sizes
        assert all(a == bytes([len(a) % 251]) * len(a) for a in answers)
        assert await call.code() == grpc.StatusCode.OK

        with pytest.raises(aio.AioRpcError) as missing:
            await channel.unary_unary("/test.Echo/Missing")(b"x")
        assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/test.Echo/Missing" in (missing.value.details() or "")

        with pytest.raises(aio.AioRpcError) as too_big:
            await channel.unary_unary(ECHO)(b"x" * (1 << 17))
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_many_concurrent_calls_on_one_connection(served: Served) -> None:
    async with aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        echo = channel.unary_unary(ECHO)
        answers = await asyncio.gather(*(echo(str(i).encode() * 100) for i in range(200)))
    assert answers == [str(i).encode() * 100 for i in range(200)]


# -- a raw HTTP/2 client ------------------------------------------------------------------


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    @classmethod
    async def connect(cls, port: int, settings: bytes = b"") -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        writer.write(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, settings))
        return client

    def send(self, kind: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        self.writer.write(h2.frame(kind, flags, stream_id, payload))

    def headers_block(self, path: str) -> bytes:
        return bytes(
            self.encoder.encode(
                [
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", path),
                    (":authority", "picker"),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                ]
            )
        )

    async def frame(self) -> tuple[int, int, int, bytes]:
        head = await asyncio.wait_for(self.reader.readexactly(9), 5)
        hi, lo, kind, flags, stream_id = h2.FRAME.unpack(head)
        payload = await self.reader.readexactly((hi << 16) | lo)
        return kind, flags, stream_id, payload

    async def until(self, kind: int, stream_id: int | None = None) -> tuple[int, bytes]:
        """Frames up to the first of ``kind`` (on ``stream_id``): its flags and payload;
        SETTINGS are acknowledged on the way."""
        while True:
            k, flags, sid, payload = await self.frame()
            if k == h2.SETTINGS and not flags & h2.ACK:
                self.send(h2.SETTINGS, h2.ACK, 0)
            if k == kind and (stream_id is None or sid == stream_id):
                return flags, payload

    async def response(self, stream_id: int) -> tuple[bytes, dict[str, str], list[int]]:
        """The stream's message bytes, its trailers, and the DATA frames' sizes."""
        data = b""
        sizes: list[int] = []
        while True:
            kind, flags, sid, payload = await self.frame()
            if kind == h2.SETTINGS and not flags & h2.ACK:
                self.send(h2.SETTINGS, h2.ACK, 0)
            if sid != stream_id:
                continue
            if kind == h2.DATA:
                data += payload
                sizes.append(len(payload))
            elif kind == h2.HEADERS:
                fields = {str(k): str(v) for k, v in self.decoder.decode(payload)}
                if flags & h2.END_STREAM:
                    return data, fields, sizes

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def grpc_message(body: bytes, compressed: int = 0) -> bytes:
    return h2.GRPC_PREFIX.pack(compressed, len(body)) + body


async def test_continuation_padding_and_a_message_split_across_frames(served: Served) -> None:
    client = await RawClient.connect(served.port)
    block = client.headers_block(ECHO)
    client.send(h2.HEADERS, 0, 1, block[:5])
    client.send(h2.CONTINUATION, h2.END_HEADERS, 1, block[5:])
    message = grpc_message(b"hello, picker")
    pad = 7
    client.send(h2.DATA, h2.PADDED, 1, bytes([pad]) + message[:8] + b"\x00" * pad)
    client.send(h2.PING, 0, 0, b"12345678")
    client.send(h2.DATA, h2.END_STREAM, 1, message[8:])
    flags, payload = await client.until(h2.PING)
    assert flags & h2.ACK and payload == b"12345678"
    data, trailers, _ = await client.response(1)
    assert data == message
    assert trailers["grpc-status"] == "0"
    assert served.log == ["message 13", "half close"]
    await client.close()


async def test_sending_waits_for_the_clients_window(served: Served) -> None:
    # The client allows 10 bytes per stream until it says more.
    client = await RawClient.connect(served.port, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, 10))
    client.send(h2.HEADERS, h2.END_HEADERS, 1, client.headers_block(ECHO))
    body = bytes(range(100))
    client.send(h2.DATA, h2.END_STREAM, 1, grpc_message(body))
    _flags, first = await client.until(h2.DATA, 1)
    assert len(first) == 10  # the window, not a byte more
    client.send(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 1000))
    rest, trailers, _sizes = await client.response(1)
    assert first + rest == grpc_message(body)
    assert trailers["grpc-status"] == "0"
    await client.close()


async def test_compressed_messages_and_resets(served: Served) -> None:
    client = await RawClient.connect(served.port)
    client.send(h2.HEADERS, h2.END_HEADERS, 1, client.headers_block(ECHO))
    client.send(h2.DATA, 0, 1, grpc_message(b"zz", compressed=1))
    _, trailers, _ = await client.response(1)
    assert trailers["grpc-status"] == str(h2.UNIMPLEMENTED)

    client.send(h2.HEADERS, h2.END_HEADERS, 3, client.headers_block(ECHO))
    client.send(h2.DATA, 0, 3, grpc_message(b"one"))
    await client.until(h2.DATA, 3)
    client.send(h2.RST_STREAM, 0, 3, struct.pack(">I", h2.CANCEL))
    # The reset reached the call: a PING after it comes back once the reset was read.
    client.send(h2.PING, 0, 0, b"after-rs")
    await client.until(h2.PING)
    assert served.log[-1] == "cancel"
    await client.close()


async def test_not_http2_is_refused_with_goaway() -> None:
    server = GrpcServer({})
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = await asyncio.wait_for(reader.read(), 5)  # until the server closes
        frames = []
        while len(received) >= 9:
            hi, lo, kind, _, _ = h2.FRAME.unpack_from(received)
            length = (hi << 16) | lo
            frames.append((kind, received[9 : 9 + length]))
            received = received[9 + length :]
        goaways = [payload for kind, payload in frames if kind == h2.GOAWAY]
        assert goaways and struct.unpack(">I", goaways[0][4:8])[0] == h2.PROTOCOL_ERROR
        writer.close()
    finally:
        await server.stop(0)


async def test_stop_lets_open_calls_finish_then_closes(served: Served) -> None:
    client = await RawClient.connect(served.port)
    client.send(h2.HEADERS, h2.END_HEADERS, 1, client.headers_block(ECHO))
    client.send(h2.DATA, 0, 1, grpc_message(b"before"))
    await client.until(h2.DATA, 1)
    stopping = asyncio.create_task(served.server.stop(5.0))
    _, payload = await client.until(h2.GOAWAY)
    last_stream, code = struct.unpack(">II", payload[:8])
    assert (last_stream, code) == (1, h2.NO_ERROR)
    # A new stream after GOAWAY is refused; the open one still completes.
    client.send(h2.HEADERS, h2.END_HEADERS, 3, client.headers_block(ECHO))
    _flags, payload = await client.until(h2.RST_STREAM, 3)
    assert struct.unpack(">I", payload)[0] == h2.REFUSED_STREAM
    client.send(h2.DATA, h2.END_STREAM, 1, grpc_message(b"after"))
    data, trailers, _ = await client.response(1)
    assert data == grpc_message(b"after") and trailers["grpc-status"] == "0"
    await asyncio.wait_for(stopping, 5)
    assert await asyncio.wait_for(client.reader.read(), 5) == b""  # closed by the server
    await client.close()


async def test_odd_headers_fail_one_stream_not_the_connection(served: Served) -> None:
    """A latin-1 header value, and an unknown path whose error message outgrows one HPACK
    length byte, each get their own stream's answer; the connection carries on."""
    client = await RawClient.connect(served.port)
    block = bytes(
        client.encoder.encode(
            [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", ECHO.encode()),
                (b":authority", b"picker"),
                (b"content-type", b"application/grpc"),
                (b"x-note", b"caf\xe9"),
            ]
        )
    )
    client.send(h2.HEADERS, h2.END_HEADERS, 1, block)
    client.send(h2.DATA, h2.END_STREAM, 1, grpc_message(b"latin"))
    data, trailers, _ = await client.response(1)
    assert data == grpc_message(b"latin") and trailers["grpc-status"] == "0"

    client.send(
        h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 3, client.headers_block("/x/" + "%" * 60)
    )
    _, trailers, _ = await client.response(3)
    assert trailers["grpc-status"] == str(h2.UNIMPLEMENTED)
    assert "%25%25" in trailers["grpc-message"]

    client.send(h2.HEADERS, h2.END_HEADERS, 5, client.headers_block(ECHO))
    client.send(h2.DATA, h2.END_STREAM, 5, grpc_message(b"still here"))
    data, trailers, _ = await client.response(5)
    assert data == grpc_message(b"still here")
    await client.close()


async def test_a_smaller_header_table_is_acknowledged_in_the_next_header_block(
    served: Served,
) -> None:
    client = await RawClient.connect(served.port, struct.pack(">HI", h2.S_HEADER_TABLE_SIZE, 0))
    client.decoder.max_allowed_table_size = 0  # the decoder now requires the encoder's update
    await client.until(h2.SETTINGS)  # the server's own settings
    await client.until(h2.SETTINGS)  # its acknowledgement of ours
    client.send(h2.HEADERS, h2.END_HEADERS, 1, client.headers_block(ECHO))
    client.send(h2.DATA, h2.END_STREAM, 1, grpc_message(b"table"))
    data, trailers, _ = await client.response(1)
    assert data == grpc_message(b"table") and trailers["grpc-status"] == "0"
    await client.close()


class _CountingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


async def test_answers_sent_outside_a_read_leave_in_one_write() -> None:
    """A pick finishes in a task, outside any read: its answers (the response headers and
    two messages) go to the peer in one write, not one each."""
    conn = h2.GrpcConnection(GrpcServer({}))
    transport = _CountingTransport()
    conn.connection_made(transport)
    transport.writes.clear()  # the server's SETTINGS
    stream = Stream(1, conn, {})
    stream.send_all([b"headers answer", b"body answer"])
    (written,) = transport.writes
    frames = []
    while written:
        hi, lo, kind, _, stream_id = h2.FRAME.unpack(written[:9])
        size = (hi << 16) | lo
        frames.append((kind, stream_id, written[9 : 9 + size]))
        written = written[9 + size :]
    assert [(kind, sid) for kind, sid, _ in frames] == [(h2.HEADERS, 1), (h2.DATA, 1), (h2.DATA, 1)]
    assert [payload[5:] for _, _, payload in frames[1:]] == [b"headers answer", b"body answer"]
    # A lone send outside a read still goes out at once.
    stream.send(b"more")
    assert len(transport.writes) == 2


class _AnswerThenFinish:
    """Answers each message, with work to run once that answer is written; ends the stream
    when the client does."""

    def __init__(self, stream: Stream, transport: _CountingTransport, ran: list[str]) -> None:
        self.stream = stream
        self.transport = transport
        self.ran = ran

    def on_message(self, message: bytes) -> None:
        self.stream.send(b"answer to " + message)
        self.stream.after_write(lambda: self.ran.append(f"work ({len(self.transport.writes)})"))

    def on_half_close(self) -> None:
        self.stream.finish()
        self.stream.after_write(lambda: self.ran.append("close"))

    def on_cancel(self) -> None:
        pass


async def test_a_reads_answers_and_trailers_leave_in_one_write_before_its_work_runs() -> None:
    """The last response message and the end of the stream in one read: the answer and the
    trailers go in one write, and the bookkeeping runs after it, in the order it was asked
    for (the request's, then the stream's close)."""
    ran: list[str] = []
    transport = _CountingTransport()
    handlers = {ECHO: lambda stream: _AnswerThenFinish(stream, transport, ran)}
    conn = h2.GrpcConnection(GrpcServer(handlers))
    conn.connection_made(transport)
    conn.data_received(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b""))
    transport.writes.clear()
    block = hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", ECHO),
            (":authority", "x"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )
    conn.data_received(
        h2.frame(h2.HEADERS, h2.END_HEADERS, 1, bytes(block))
        + h2.frame(h2.DATA, h2.END_STREAM, 1, grpc_message(b"last"))
    )
    assert ran == ["work (1)", "close"]
    (written,) = transport.writes
    kinds = []
    while written:
        hi, lo, kind, flags, _ = h2.FRAME.unpack(written[:9])
        kinds.append((kind, bool(flags & h2.END_STREAM)))
        written = written[9 + ((hi << 16) | lo) :]
    # Response headers, the answer, the trailers that end the stream.
    assert kinds == [(h2.HEADERS, False), (h2.DATA, False), (h2.HEADERS, True)]
    # Outside a read, the work runs at once, after the write.
    stream = Stream(3, conn, {})
    stream.send(b"late")
    stream.after_write(lambda: ran.append(f"late, {len(conn.out)} unwritten"))
    assert ran[-1] == "late, 0 unwritten"


@pytest.mark.parametrize(
    ("block", "neutral"),
    [
        (b"\x82\x87", True),  # indexed (static)
        (b"\x04\x02/x", True),  # literal not indexed, indexed name
        (b"\x10\x03x-a\x011", True),  # never indexed, literal name
        (b"\xff\x00", True),  # an index in two bytes (127)
        (b"\x40\x03x-a\x011", False),  # added to the table
        (b"\x3f\xe1\x1f", False),  # a table size update
        (b"\x04\x05/x", False),  # a value longer than the block
        (b"\xff", False),  # an integer cut short
    ],
)
def test_which_header_blocks_leave_the_decoders_table_as_it_was(
    block: bytes, neutral: bool
) -> None:
    assert h2._table_neutral(block) is neutral


async def test_a_remembered_header_block_means_what_the_table_now_says() -> None:
    """The same indexed bytes name another field once a block has added one to the table:
    remembered decodes are forgotten then, and a decode handed out is the caller's own."""
    conn = h2.GrpcConnection(GrpcServer({}))
    path = b"\x04\x02/x"  # :path /x, not indexed
    assert conn._decode_header_block(b"\x83" + path) == {":method": "POST", ":path": "/x"}
    conn._decode_header_block(b"\x40\x03x-a\x011")  # x-a: 1 is entry 62 now
    first = conn._decode_header_block(b"\xbe" + path)  # index 62
    assert first == {"x-a": "1", ":path": "/x"}
    first["x-a"] = "changed"
    assert conn._decode_header_block(b"\xbe" + path)["x-a"] == "1"
    conn._decode_header_block(b"\x40\x03x-b\x012")  # x-b: 2 is entry 62, x-a 63
    assert conn._decode_header_block(b"\xbe" + path) == {"x-b": "2", ":path": "/x"}
