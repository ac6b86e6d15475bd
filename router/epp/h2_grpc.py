"""A gRPC server over HTTP/2 that carries the picker's own services, and nothing more.

Why not ``grpc.aio``: measured on the picker (BENCHMARKS.md, "Endpoint picker: CPU per request
trimmed"), a grpc.aio servicer that answers Envoy's four ext_proc messages with constants costs
1.3-1.8 ms of CPU per stream, above the picker's whole 1 ms latency budget before it decides
anything: each message crosses gRPC's completion queue, its polling thread and several
coroutine layers. Here a frame is parsed where it arrives, in the event loop's own callback, and
a stream's answers leave in the same write.

What it speaks (RFC 9113 and gRPC's HTTP/2 protocol, server side): h2c with prior knowledge
and h2 over TLS (ALPN ``h2``); SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY, CONTINUATION
and padding; flow control both ways (large receive windows, the peer's windows respected when
sending); HPACK decoding with the ``hpack`` library (responses use no dynamic table: the few
header blocks it sends are constant bytes); uncompressed length-prefixed messages; unknown
methods answered ``UNIMPLEMENTED``. Not spoken: server push, priorities (ignored, as RFC 9113
allows), message compression (a compressed message is refused with ``UNIMPLEMENTED``).

Limits (``H2Limits``, from the picker's ``epp:`` config; SECURITY.md lists them): streams per
connection (advertised in SETTINGS; more are refused with ``REFUSED_STREAM``), connections,
header list size (through CONTINUATION frames), bytes held per connection and overall (partial
messages and answers waiting for the peer's window), client stream resets per second (rapid
reset), PING and SETTINGS frames per read (fixed: ``MAX_CONTROL_FRAMES_PER_READ``), and timeouts for the handshake, for a frame or header block once started, and for an
idle connection. A peer past a limit gets ``GOAWAY`` with ``ENHANCE_YOUR_CALM`` and is closed;
``GrpcServer.counts`` says how often each limit was hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Protocol, cast
from urllib.parse import quote

import hpack

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# Error codes (section 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11
# Settings (section 6.5.2).
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6
# gRPC status codes.
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, NOT_FOUND = 0, 1, 2, 3, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

FRAME = struct.Struct(">BHBBI")  # length (24 bits, as 8 + 16), type, flags, stream id
GRPC_PREFIX = struct.Struct(">BI")  # compressed flag, message length
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
# What this server asks of its peer: frames up to 1 MiB (a 220 KB body in one frame, not 14),
# and windows large enough that a stream never waits on us.
RECEIVE_FRAME_BYTES = 1 << 20
RECEIVE_WINDOW = 1 << 24
MAX_NEUTRAL_BLOCKS = 64  # distinct table-neutral header blocks remembered per connection
MAX_HEADER_LIST_BYTES = 64 << 10
# PING and SETTINGS frames in one read, each asking for an answer: past this the peer is
# flooding (CVE-2019-9512/-9515) and the connection ends. A flood reads 256 KB at a time,
# 17,000 SETTINGS; handling them all held the event loop (every other client's picks) for
# tens of ms of CPU per read. A real peer sends a few per read (gRPC's BDP pings); Envoy's
# own cap on queued control frames is 1,000.
MAX_CONTROL_FRAMES_PER_READ = 1000


@dataclass(frozen=True, slots=True)
class H2Limits:
    """What one peer may make this server hold or do (the ``epp:`` config's ``h2_*`` keys)."""

    # Open streams per connection, advertised as SETTINGS_MAX_CONCURRENT_STREAMS; a stream
    # opened past it is refused with RST_STREAM REFUSED_STREAM (the client may retry it).
    max_concurrent_streams: int = 1024
    # Connections at once; one more is answered GOAWAY and closed.
    max_connections: int = 1024
    # A request's header list, decoded (RFC 7541 4.1 sizes), and its encoded block however
    # many CONTINUATION frames carry it; advertised as SETTINGS_MAX_HEADER_LIST_SIZE.
    max_header_list_bytes: int = MAX_HEADER_LIST_BYTES
    # Bytes held for one connection (partial messages, answers waiting for the peer's window,
    # unread input, the transport's unsent output), and for all connections together.
    max_connection_bytes: int = 64 << 20
    max_total_bytes: int = 512 << 20
    # Streams the client resets (or opens past the limit) per second, with a burst of twice
    # max_concurrent_streams: past it, the rapid-reset attack (CVE-2023-44487).
    max_resets_per_s: float = 1000.0
    # The client preface and its SETTINGS (and TLS handshake) must arrive within this.
    handshake_timeout_s: float = 10.0
    # A frame or header block, once started, must be complete within this (slowloris), and
    # a peer must read what this side sends within it (a peer that stops reading).
    frame_timeout_s: float = 30.0
    # A connection without open streams and without a frame for this long is closed.
    idle_timeout_s: float = 600.0

    def problems(self, prefix: str = "") -> list[str]:
        """What is wrong with these limits, each naming its key."""
        out = []
        for key in ("max_concurrent_streams", "max_connections"):
            if getattr(self, key) < 1:
                out.append(f"{prefix}{key}: must be >= 1, got {getattr(self, key)}")
        if self.max_header_list_bytes < 4096:
            out.append(
                f"{prefix}max_header_list_bytes: must be >= 4096, got {self.max_header_list_bytes}"
            )
        if self.max_connection_bytes < 1 << 20:
            out.append(
                f"{prefix}max_connection_bytes: must be >= 1048576 (1 MiB), "
                f"got {self.max_connection_bytes}"
            )
        if self.max_total_bytes < self.max_connection_bytes:
            out.append(
                f"{prefix}max_total_bytes: must be >= max_connection_bytes, "
                f"got {self.max_total_bytes}"
            )
        for key in ("max_resets_per_s", "handshake_timeout_s", "frame_timeout_s", "idle_timeout_s"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                out.append(f"{prefix}{key}: must be a number > 0, got {value}")
        return out

    def settings(self) -> bytes:
        """This server's SETTINGS frame payload."""
        return b"".join(
            struct.pack(">HI", key, value)
            for key, value in (
                (S_ENABLE_PUSH, 0),
                (S_MAX_CONCURRENT_STREAMS, self.max_concurrent_streams),
                (S_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW),
                (S_MAX_FRAME_SIZE, RECEIVE_FRAME_BYTES),
                (S_MAX_HEADER_LIST_SIZE, self.max_header_list_bytes),
            )
        )


# What GrpcServer.counts counts: each limit a peer ran into.
LIMIT_EVENTS = (
    "refused_streams",  # opened past max_concurrent_streams
    "refused_connections",  # past max_connections
    "header_lists_too_large",
    "memory",  # past max_connection_bytes or max_total_bytes
    "rapid_resets",  # past max_resets_per_s
    "control_floods",  # past MAX_CONTROL_FRAMES_PER_READ PINGs and SETTINGS in one read
    "handshake_timeouts",
    "frame_timeouts",
    "idle_closed",
    "protocol_errors",  # connections ended for a malformed or forbidden frame
)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK "literal header field without indexing, new name", no Huffman: the decoder's
    table is never touched, so these blocks are constant bytes."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _hpack_int(n: int, prefix_bits: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with the prefix's other bits 0."""
    top = (1 << prefix_bits) - 1
    if n < top:
        return bytes([n])
    out = bytearray([top])
    n -= top
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# "The dynamic table is 0 bytes" (RFC 7541 6.3): said at the start of the next header block
# after the peer changes SETTINGS_HEADER_TABLE_SIZE, as the encoder must; this one never
# inserts, so 0 is always within what the peer allows.
TABLE_SIZE_ZERO = b"\x20"


# ":status: 200" is the static table's entry 8; the rest are literals.
RESPONSE_HEADERS = b"\x88" + _literal(b"content-type", b"application/grpc")


# Printable ASCII but "%" stands as it is in grpc-message; everything else is %XX.
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)


def _trailers(status: int, message: str = "") -> bytes:
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        # grpc-message is percent-encoded UTF-8 (gRPC's HTTP/2 protocol); kept short.
        encoded = quote(message[:100], safe=_GRPC_MESSAGE_SAFE)
        block += _literal(b"grpc-message", encoded.encode())
    return block


class Call(Protocol):
    """One gRPC call on a stream, told what the client sends, in order."""

    def on_message(self, message: bytes) -> None: ...

    def on_half_close(self) -> None: ...

    def on_cancel(self) -> None: ...


# A method's handler: makes the call object for a new stream.
Handler = Callable[["Stream"], Call]


class Stream:
    """The server's side of one call: ``send`` messages, then ``finish`` once."""

    __slots__ = (
        "call",
        "conn",
        "finished",
        "headers",
        "headers_sent",
        "id",
        "pending",
        "reassembly",
        "remote_closed",
        "send_window",
        "trailers",
        "unacked",
    )

    def __init__(self, stream_id: int, conn: GrpcConnection, headers: dict[str, str]) -> None:
        self.id = stream_id
        self.conn = conn
        self.headers = headers
        self.call: Call | None = None
        self.send_window = conn.peer_initial_window
        self.unacked = 0  # bytes received and not yet given back with WINDOW_UPDATE
        self.pending = bytearray()  # message bytes waiting for the peer's window
        self.trailers: bytes | None = None  # sent once ``pending`` is out
        self.headers_sent = False
        self.remote_closed = False
        self.finished = False
        self.reassembly = bytearray()  # a message split across DATA frames

    def send(self, message: bytes) -> None:
        if self.finished:
            return
        conn = self.conn
        if not self.headers_sent:
            self.headers_sent = True
            conn.emit(frame(HEADERS, END_HEADERS, self.id, conn.outgoing_headers(RESPONSE_HEADERS)))
        size = 5 + len(message)
        if not self.pending and size <= self.send_window and size <= conn.send_window:
            # Both windows open (Envoy's are large): framed straight from the message.
            self.send_window -= size
            conn.send_message(self.id, message, size)
            return
        self.pending += GRPC_PREFIX.pack(0, len(message))
        self.pending += message
        conn.pump(self)
        if self.pending:
            # The peer's window holds answers back: measured, like messages arriving, once
            # per 1/16 of the limit queued (measuring each time would cost O(streams) a send).
            conn.unmeasured += size
            if conn.unmeasured >= conn.measure_every:
                conn.check_memory()

    def send_all(self, messages: Iterable[bytes]) -> None:
        """Send these messages in one write (outside a read, each ``send`` is its own write:
        on loopback every write also costs the peer's receive and wake-up)."""
        conn = self.conn
        corked = conn.corked
        conn.corked = True
        try:
            for message in messages:
                self.send(message)
        finally:
            conn.corked = corked
        if not corked:
            conn.flush()

    def after_write(self, work: Callable[[], None]) -> None:
        """Run ``work`` once what was sent so far is written: at the end of the read being
        handled (its answers, and whatever else that read leads to, such as the stream's
        trailers, leave in one write), or now outside a read."""
        self.conn.after_write(work)

    def finish(self, status: int = OK, message: str = "") -> None:
        if self.finished:
            return
        block = _trailers(status, message)
        self.finished = True
        if not self.headers_sent:
            # "Trailers-Only": one HEADERS frame with the status and the end of the stream.
            self.headers_sent = True
            block = RESPONSE_HEADERS + block
        self.trailers = block
        self.conn.pump(self)


def _read_hpack_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer (RFC 7541 5.1) at ``pos`` with a ``prefix_bits`` prefix: its value
    and the position after it; IndexError past the block."""
    mask = (1 << prefix_bits) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _table_neutral(block: bytes) -> bool:
    """Whether a header block leaves the decoder's dynamic table as it was: indexed fields
    and literals not indexed (RFC 7541 6.1, 6.2.2, 6.2.3) only, no literal that is added to
    the table (6.2.1) and no size update (6.3). Envoy's blocks for new ext_proc streams are
    such, and the same bytes each time."""
    pos, size = 0, len(block)
    try:
        while pos < size:
            first = block[pos]
            if first & 0x80:
                _, pos = _read_hpack_int(block, pos, 7)
                continue
            if first & 0xE0:  # 01xxxxxx (added to the table) or 001xxxxx (size update)
                return False
            name, pos = _read_hpack_int(block, pos, 4)
            strings = 1 if name else 2  # a literal name before the value
            for _ in range(strings):
                length, pos = _read_hpack_int(block, pos, 7)
                pos += length
                if pos > size:
                    return False
    except IndexError:
        return False
    return True


def _run_logged(work: Callable[[], None]) -> None:
    try:
        work()
    except Exception:
        log.exception("work after a write failed")


class GrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection from a gRPC client (Envoy)."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.limits = limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface_seen = False
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = limits.max_header_list_bytes
        self.streams: dict[int, Stream] = {}
        self.last_stream_id = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_frame_bytes = 16_384
        self.send_window = DEFAULT_WINDOW
        self.unacked = 0
        self.blocked: dict[int, Stream] = {}  # streams waiting for the connection's window
        self.written: list[Callable[[], None]] = []  # to run once this read's write is out
        self.neutral_blocks: dict[bytes, dict[str, str]] = {}  # see _decode_header_block
        # A header block still being received (HEADERS then CONTINUATION frames).
        self.header_stream = 0
        self.header_flags = 0
        self.header_block = bytearray()
        self.out: list[bytes | memoryview] = []
        self.table_size_changed = False
        self.corked = False  # writes wait for flush(): during a read, or send_all
        self.going_away = False
        loop = asyncio.get_running_loop()
        self.closed = loop.create_future()
        # For the timeouts (GrpcServer's sweep): when it connected, the last complete frame,
        # and since when a frame or header block has been incomplete (None: none is).
        self.made_at = self.last_frame_at = loop.time()
        self.partial_since: float | None = None
        self.settings_seen = False  # the client's first SETTINGS (ends the handshake)
        # Rapid reset: a budget of client resets, refilled at max_resets_per_s.
        self.reset_burst = 2.0 * limits.max_concurrent_streams
        self.reset_budget = self.reset_burst
        self.reset_at = self.made_at
        self.held = 0  # bytes held, as last measured by check_memory
        self.unmeasured = 0  # bytes received or queued for the peer since then
        self.measure_every = max(1, limits.max_connection_bytes // 16)
        # Not read while the peer does not read our answers (pause_writing), since paused_at.
        self.reading_paused = False
        self.paused_at = 0.0
        self.control_frames = 0  # PINGs and SETTINGS answered in the read being handled

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        server = self.server
        if len(server.connections) >= self.limits.max_connections:
            server.count("refused_connections")
            self.go_away(ENHANCE_YOUR_CALM, "too many connections")
            self.transport.close()
            return
        server.connections.add(self)
        self.emit(frame(SETTINGS, 0, 0, server.settings_payload))
        self.emit(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", RECEIVE_WINDOW - DEFAULT_WINDOW)))
        self.flush()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # closed for a limit: what is still in flight is not read
        self.buffer += data
        self.corked = True
        self.control_frames = 0
        try:
            progressed = self._parse()
            if self.buffer or self.header_stream:
                # A frame (or header block) is incomplete: its clock starts with this read,
                # unless it started before and nothing completed since (slowloris).
                if progressed or self.partial_since is None:
                    self.partial_since = asyncio.get_running_loop().time()
            else:
                self.partial_since = None
        except _ConnectionError as exc:
            self.server.count(exc.event)
            self.go_away(exc.code, str(exc))
        except Exception:
            log.exception("HTTP/2 connection failed")
            self.go_away(INTERNAL_ERROR, "internal error")
        finally:
            self.corked = False
            self.flush()
            if self.written:
                self._run_written()

    def pause_writing(self) -> None:
        """The peer does not read what this side writes: stop reading what it sends (PING and
        SETTINGS floods, CVE-2019-9512/-9515, cannot pile up answers), until it reads again."""
        if self.transport is not None and not self.reading_paused:
            self.reading_paused = True
            self.paused_at = asyncio.get_running_loop().time()
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and self.reading_paused:
            self.reading_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def usage(self) -> int:
        """Bytes this connection holds now: input not yet parsed, a header block, partial
        messages and unsent answers of its streams, the transport's unsent output."""
        held = len(self.buffer) + len(self.header_block)
        for stream in self.streams.values():
            held += len(stream.reassembly) + len(stream.pending)
        if self.transport is not None:
            held += self.transport.get_write_buffer_size()
        return held

    def check_memory(self) -> None:
        """Measure what this connection holds, where it may have grown past a frame's worth;
        past its limit, or the server's overall, the connection is closed at once (its
        streams cancelled, whatever it holds let go)."""
        if self.transport is None or self.transport.is_closing():
            return
        self.held = self.usage()
        self.unmeasured = 0
        limits = self.limits
        if self.held > limits.max_connection_bytes:
            why = f"holds {self.held} bytes, over {limits.max_connection_bytes}"
        elif self.server.held() > limits.max_total_bytes:
            why = f"the server holds over {limits.max_total_bytes} bytes"
        else:
            return
        self.server.count("memory")
        log.warning("HTTP/2 connection closed: %s", why)
        self.go_away(ENHANCE_YOUR_CALM, why)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.held = 0
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    # -- output --------------------------------------------------------------------------

    def emit(self, data: bytes | memoryview) -> None:
        self.out.append(data)
        if not self.corked:
            self.flush()

    def after_write(self, work: Callable[[], None]) -> None:
        if self.corked:
            self.written.append(work)
            return
        self.flush()
        _run_logged(work)

    def _run_written(self) -> None:
        written = self.written
        self.written = []
        for work in written:
            _run_logged(work)

    def flush(self) -> None:
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out) if len(self.out) > 1 else self.out[0])
        self.out.clear()

    def send_message(self, stream_id: int, message: bytes, size: int) -> None:
        """One length-prefixed message in DATA frames of the peer's size; the caller checked
        both windows and took it from the stream's."""
        self.send_window -= size
        limit = self.peer_frame_bytes
        out = self.out
        first = min(size, limit)
        out.append(FRAME.pack(first >> 16, first & 0xFFFF, DATA, 0, stream_id))
        out.append(GRPC_PREFIX.pack(0, size - 5))
        if size <= limit:
            out.append(message)
        else:
            view = memoryview(message)
            out.append(view[: first - 5])
            for start in range(first - 5, size - 5, limit):
                part = view[start : start + limit]
                n = len(part)
                out.append(FRAME.pack(n >> 16, n & 0xFFFF, DATA, 0, stream_id))
                out.append(part)
        if not self.corked:
            self.flush()

    def pump(self, stream: Stream) -> None:
        """Send what the stream has queued, as far as both flow-control windows allow."""
        pending = stream.pending
        while pending:
            n = min(len(pending), self.send_window, stream.send_window, self.peer_frame_bytes)
            if n <= 0:
                if self.send_window <= 0:
                    self.blocked[stream.id] = stream
                return
            self.emit(frame(DATA, 0, stream.id, bytes(pending[:n])))
            del pending[:n]
            self.send_window -= n
            stream.send_window -= n
        if stream.trailers is not None and stream.id in self.streams:
            block = self.outgoing_headers(stream.trailers)
            self.emit(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, block))
            stream.trailers = None
            if not stream.remote_closed:
                # The answer is complete: the client need not send the rest (RFC 9113 8.1).
                self.emit(frame(RST_STREAM, 0, stream.id, struct.pack(">I", NO_ERROR)))
            self._forget(stream)

    def outgoing_headers(self, block: bytes) -> bytes:
        if self.table_size_changed:
            self.table_size_changed = False
            return TABLE_SIZE_ZERO + block
        return block

    def go_away(self, code: int, why: str = "") -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.emit(
            frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, code) + why.encode()[:200])
        )
        self.flush()
        if code != NO_ERROR:
            self.transport.close()
            if self.transport.get_write_buffer_size():
                self.transport.abort()  # a peer that does not read holds nothing of ours

    def drain(self) -> None:
        """The server stops: no new streams; open ones finish; the connection closes after."""
        self.going_away = True
        self.go_away(NO_ERROR, "server stopping")
        if not self.streams and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- input ---------------------------------------------------------------------------

    def _parse(self) -> bool:
        """Handle every complete frame buffered; whether there was one."""
        buf = self.buffer
        pos = 0
        if not self.preface_seen:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return False
            if buf[: len(PREFACE)] != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface_seen = True
            pos = len(PREFACE)
        view = memoryview(buf)
        try:
            size = len(buf)
            while size - pos >= 9:
                hi, lo, kind, flags, stream_id = FRAME.unpack_from(buf, pos)
                length = (hi << 16) | lo
                if length > RECEIVE_FRAME_BYTES:
                    raise _ConnectionError(FRAME_SIZE_ERROR, "frame larger than advertised")
                end = pos + 9 + length
                if end > size:
                    break
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, view[pos + 9 : end])
                pos = end
                if self.transport is not None and self.transport.is_closing():
                    break  # closed for a limit: the rest is not read
        finally:
            view.release()
        if pos:
            self.last_frame_at = asyncio.get_running_loop().time()
            # A new buffer rather than ``del buf[:pos]``: a slice of this one still held
            # (a logged traceback's frame) would make resizing it fail.
            self.buffer = buf[pos:]
        return pos > 0

    def _frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self.header_stream and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            if stream_id != self.header_stream or not stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            self.header_block += payload
            if len(self.header_block) > self.limits.max_header_list_bytes:
                # CONTINUATION flood (CVE-2024-27316): the block is bounded however it comes.
                raise _ConnectionError(
                    ENHANCE_YOUR_CALM, "header block too large", "header_lists_too_large"
                )
            if flags & END_HEADERS:
                self._header_block_done()
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise _ConnectionError(FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._count_control_frame()
                self.emit(frame(PING, ACK, 0, bytes(payload)))
        elif kind == RST_STREAM:
            if len(payload) != 4 or not stream_id:
                raise _ConnectionError(
                    FRAME_SIZE_ERROR if stream_id else PROTOCOL_ERROR, "bad RST_STREAM"
                )
            stream = self.streams.get(stream_id)
            if stream is not None:
                if not stream.finished:
                    self._spend_reset()  # reset before it was answered: rapid reset's unit
                self._cancel(stream)
                self._forget(stream)
        elif kind == GOAWAY:
            self.going_away = True  # the client opens no more streams here
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5, 5.3.2).

    def _unpad(self, flags: int, payload: memoryview) -> memoryview:
        if not flags & PADDED:
            return payload
        if not payload:
            raise _ConnectionError(PROTOCOL_ERROR, "padding without its length")
        pad = payload[0]
        if pad >= len(payload):
            raise _ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - pad]

    def _data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        # Flow control counts the whole frame, padding included, stream open or not.
        self.unacked += len(payload)
        self.unmeasured += len(payload)
        if self.unacked >= RECEIVE_WINDOW // 2:
            self.emit(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacked)))
            self.unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream already answered or reset: its late data is dropped
        if stream.remote_closed:
            self._reset(stream, STREAM_CLOSED)
            return
        stream.unacked += len(payload)
        data = self._unpad(flags, payload)
        if stream.call is not None and data:
            self._messages(stream, data)
        if stream.unacked >= RECEIVE_WINDOW // 2 and not flags & END_STREAM:
            self.emit(frame(WINDOW_UPDATE, 0, stream.id, struct.pack(">I", stream.unacked)))
            stream.unacked = 0
        if flags & END_STREAM:
            self._remote_closed(stream)

    def _messages(self, stream: Stream, data: memoryview) -> None:
        """Split gRPC's length-prefixed messages out of a DATA payload."""
        call = stream.call
        assert call is not None
        held = stream.reassembly
        if held:
            held += data
            source: bytes | bytearray | memoryview = held
        else:
            source = data
        pos, size = 0, len(source)
        limit = self.server.max_message_bytes
        while size - pos >= 5 and not stream.finished:
            compressed, length = GRPC_PREFIX.unpack_from(source, pos)
            if compressed:
                stream.reassembly = bytearray()
                self._fail(stream, UNIMPLEMENTED, "compressed messages are not accepted")
                return
            if length > limit:
                stream.reassembly = bytearray()
                self._fail(stream, RESOURCE_EXHAUSTED, f"message larger than {limit} bytes")
                return
            if size - pos - 5 < length:
                break
            message = bytes(source[pos + 5 : pos + 5 + length])
            pos += 5 + length
            self._deliver(stream, call.on_message, message)
            if stream.finished or stream.call is None:
                return
        if source is held:
            del held[:pos]
        else:
            stream.reassembly = bytearray(source[pos:])
        if stream.reassembly and self.unmeasured >= self.measure_every:
            # Messages still arriving: measured once per 1/16 of the limit received (held
            # bytes grow no faster than that), so a 200 KB body in 16 KB frames costs one
            # O(streams) measurement, not one per frame.
            self.check_memory()

    def _headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            block = block[5:]
        if len(block) > self.limits.max_header_list_bytes:
            raise _ConnectionError(
                ENHANCE_YOUR_CALM, "header block too large", "header_lists_too_large"
            )
        self.header_stream = stream_id
        self.header_flags = flags
        self.header_block = bytearray(block)
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        stream_id, flags, block = self.header_stream, self.header_flags, bytes(self.header_block)
        self.header_stream = 0
        self.header_block = bytearray()
        fields = self._decode_header_block(block)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: its side is done
            if stream.remote_closed:
                self._reset(stream, STREAM_CLOSED)
            elif flags & END_STREAM:
                self._remote_closed(stream)
            return
        if not stream_id % 2:
            raise _ConnectionError(PROTOCOL_ERROR, "an even stream id from a client")
        if stream_id <= self.last_stream_id:
            return  # the client's trailers on a stream this side already closed
        self.last_stream_id = stream_id
        if len(self.streams) >= self.limits.max_concurrent_streams:
            # Past the limit this side advertised: refused, never started (RFC 9113 5.1.2).
            self.server.count("refused_streams")
            self.emit(frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
            self._spend_reset()
            return
        stream = Stream(stream_id, self, fields)
        self.streams[stream_id] = stream
        if self.going_away:
            self._reset(stream, REFUSED_STREAM)
            return
        handler = self.server.handlers.get(fields.get(":path", ""))
        refused = ""
        if fields.get(":method") != "POST" or not fields.get("content-type", "").startswith(
            "application/grpc"
        ):
            refused = "not a gRPC request"
        elif handler is None:
            refused = f"unknown method {fields.get(':path', '')}"
        if refused:
            stream.remote_closed = bool(flags & END_STREAM)  # then no RST after the answer
            stream.finish(UNIMPLEMENTED, refused)
            return
        self._deliver(stream, None, None, handler)
        if flags & END_STREAM and stream_id in self.streams:
            self._remote_closed(stream)

    def _decode_header_block(self, block: bytes) -> dict[str, str]:
        """A header block's fields. A block that leaves the decoder's table as it was means
        the same each time until one that changes the table is decoded, and Envoy sends
        each new stream the same one: it is decoded once."""
        known = self.neutral_blocks.get(block)
        if known is not None:
            return dict(known)
        try:
            headers = self.decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError as exc:
            # An HPACK bomb, or just too many headers: the table may be half-updated, so the
            # connection ends (RFC 9113 4.3).
            raise _ConnectionError(
                COMPRESSION_ERROR, f"header list too large: {exc}", "header_lists_too_large"
            ) from exc
        except hpack.HPACKError as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"bad header block: {exc}") from exc
        # Field values may be any octets (latin-1), not only UTF-8.
        fields = {bytes(k).decode("latin-1"): bytes(v).decode("latin-1") for k, v in headers}
        if _table_neutral(block):
            if len(self.neutral_blocks) >= MAX_NEUTRAL_BLOCKS:
                self.neutral_blocks.clear()
            self.neutral_blocks[block] = fields
            return dict(fields)
        self.neutral_blocks.clear()  # the table changed: what an index means too
        return fields

    def _deliver(
        self,
        stream: Stream,
        method: Callable[[bytes], None] | None,
        message: bytes | None,
        handler: Handler | None = None,
    ) -> None:
        """A call's handler, run so that its bug fails its stream, not the connection."""
        try:
            if handler is not None:
                stream.call = handler(stream)
            elif method is not None and message is not None:
                method(message)
        except Exception:
            log.exception("gRPC handler failed")
            self._fail(stream, INTERNAL, "internal error")

    def _remote_closed(self, stream: Stream) -> None:
        stream.remote_closed = True
        if stream.reassembly:
            stream.reassembly = bytearray()
            self._fail(stream, INTERNAL, "the stream ended inside a message")
            return
        call = stream.call
        if call is not None and not stream.finished:
            try:
                call.on_half_close()
            except Exception:
                log.exception("gRPC handler failed")
                self._fail(stream, INTERNAL, "internal error")

    def _settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS of a wrong length")
        self._count_control_frame()
        self.settings_seen = True
        for pos in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, pos)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "window too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value < 1 << 24:
                    raise _ConnectionError(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self.peer_frame_bytes = value
            elif key == S_HEADER_TABLE_SIZE:
                self.table_size_changed = True
            elif key == S_ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
        self.emit(frame(SETTINGS, ACK, 0))
        for stream in list(self.streams.values()):
            if stream.pending:
                self.pump(stream)

    def _window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise _ConnectionError(PROTOCOL_ERROR, "zero WINDOW_UPDATE")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "window overflow")
            blocked, self.blocked = self.blocked, {}
            for waiting in blocked.values():
                if waiting.id in self.streams:
                    self.pump(waiting)
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if not increment:
            self._reset(stream, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._reset(stream, FLOW_CONTROL_ERROR)
            return
        if stream.pending or stream.trailers is not None:
            self.pump(stream)

    def _count_control_frame(self) -> None:
        self.control_frames += 1
        if self.control_frames > MAX_CONTROL_FRAMES_PER_READ:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "PING or SETTINGS flood", "control_floods")

    def _spend_reset(self) -> None:
        """One stream reset by the client before its answer (or refused): past the budget,
        the connection is a rapid-reset attack (CVE-2023-44487) and ends."""
        now = asyncio.get_running_loop().time()
        rate = self.limits.max_resets_per_s
        self.reset_budget = min(self.reset_burst, self.reset_budget + (now - self.reset_at) * rate)
        self.reset_at = now
        self.reset_budget -= 1.0
        if self.reset_budget < 0:
            raise _ConnectionError(
                ENHANCE_YOUR_CALM, "too many streams reset or refused", "rapid_resets"
            )

    def overdue(self, now: float) -> str | None:
        """Which timeout this connection is past (GrpcServer's sweep), if any."""
        limits = self.limits
        if not (self.preface_seen and self.settings_seen):
            if now - self.made_at > limits.handshake_timeout_s:
                return "handshake_timeouts"
        elif self.partial_since is not None and now - self.partial_since > limits.frame_timeout_s:
            return "frame_timeouts"
        elif self.reading_paused and now - self.paused_at > limits.frame_timeout_s:
            return "frame_timeouts"  # the peer has not read our answers for that long
        elif not self.streams and now - self.last_frame_at > limits.idle_timeout_s:
            return "idle_closed"
        return None

    # -- stream endings ------------------------------------------------------------------

    def _fail(self, stream: Stream, status: int, message: str) -> None:
        """End the call with an error status; its handler is told it is cancelled."""
        if stream.finished:
            return
        stream.pending.clear()
        call, stream.call = stream.call, None
        stream.finish(status, message)
        if call is not None:
            try:
                call.on_cancel()
            except Exception:
                log.exception("gRPC handler failed on cancel")

    def _reset(self, stream: Stream, code: int) -> None:
        self.emit(frame(RST_STREAM, 0, stream.id, struct.pack(">I", code)))
        self._cancel(stream)
        self._forget(stream)

    def _cancel(self, stream: Stream) -> None:
        call, stream.call = stream.call, None
        stream.finished = True
        if call is not None:
            try:
                call.on_cancel()
            except Exception:
                log.exception("gRPC handler failed on cancel")

    def _forget(self, stream: Stream) -> None:
        self.streams.pop(stream.id, None)
        self.blocked.pop(stream.id, None)
        if self.going_away and not self.streams and self.transport is not None:
            self.flush()
            self.transport.close()


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str, event: str = "protocol_errors") -> None:
        super().__init__(message)
        self.code = code
        self.event = event  # which of GrpcServer.counts it adds to


class GrpcServer:
    """Listens on one port; ``handlers`` maps a method's path (``/pkg.Service/Method``) to
    its call factory."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        *,
        max_message_bytes: int = 4 << 20,
        limits: H2Limits | None = None,
    ) -> None:
        self.handlers = handlers
        self.max_message_bytes = max_message_bytes
        self.limits = limits = limits if limits is not None else H2Limits()
        self.settings_payload = limits.settings()
        self.connections: set[GrpcConnection] = set()
        # How often peers ran into each limit (LIMIT_EVENTS), for tests and logs.
        self.counts: dict[str, int] = dict.fromkeys(LIMIT_EVENTS, 0)
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def count(self, event: str) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1

    def held(self) -> int:
        """Bytes held for all connections, as each last measured (``check_memory``)."""
        return sum(conn.held for conn in self.connections)

    def usage(self) -> int:
        """Bytes held for all connections, measured now."""
        return sum(conn.usage() for conn in self.connections)

    async def start(self, host: str, port: int, ssl: SSLContext | None = None) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: GrpcConnection(self),
            host,
            port,
            ssl=ssl,
            reuse_address=True,
            ssl_handshake_timeout=self.limits.handshake_timeout_s if ssl is not None else None,
        )
        self._sweeper = asyncio.create_task(self._sweep(), name="kvroute-h2-timeouts")
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1])

    async def _sweep(self) -> None:
        """Close connections past a timeout: a few times per shortest timeout, O(connections)."""
        limits = self.limits
        shortest = min(limits.handshake_timeout_s, limits.frame_timeout_s, limits.idle_timeout_s)
        every = min(1.0, shortest / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            for conn in list(self.connections):
                event = conn.overdue(now)
                if event is not None:
                    self.count(event)
                    code = NO_ERROR if event == "idle_closed" else ENHANCE_YOUR_CALM
                    conn.go_away(code, event.replace("_", " "))
                    if conn.transport is not None:
                        conn.transport.close()

    async def stop(self, grace_s: float) -> None:
        """No new connections or streams; open streams get ``grace_s`` to finish."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.drain()
        waits = [conn.closed for conn in self.connections]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace_s)
            if pending:
                for conn in list(self.connections):
                    conn.abort()
                await asyncio.wait(pending, timeout=1.0)
        if self._server is not None:
            await self._server.wait_closed()
