"""A lean HTTP/1.1 client for the hot path: pooled keep-alive connections to replicas.

Why not aiohttp's client here (a measured departure from the design's default): in a bare
proxy on this machine kind, aiohttp server + aiohttp client relayed 1,960 requests/s on one
core, while aiohttp server + this client (asyncio protocol + httptools' llhttp parser)
relayed 5,955/s; aiohttp's server alone answered 7,900/s. The client spent ~380 us of the
~510 us per request. The router only ever sends one kind of request (a POST with a body it
already holds) to replicas it knows, so the client can stay small:

- one ``transport.write`` per request, with the client's raw header bytes passed through;
- responses parsed by llhttp (chunked decoding included), body chunks buffered per response
  with back-pressure (reading pauses when the client is slower than the replica);
- connections return to a per-replica idle pool when a response completes with keep-alive;
  a request that finds its reused connection closed by the replica retries once on a new one.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import httptools

# Buffered response bytes above which reading from the replica pauses.
_HIGH_WATER = 1 << 20
_LOW_WATER = 1 << 18
# A response's status line and headers, together: vLLM's are a few hundred bytes. A replica
# that sends more (endless headers, one endless header value) fails the request at once
# instead of filling the router's memory until the first-byte timeout.
MAX_RESPONSE_HEAD_BYTES = 64 << 10
# A non-streamed answer, held whole to be relayed (streams are relayed chunk by chunk): a
# completion with prompt logprobs of a long prompt is tens of MB; a replica sending more, or a
# body that never ends, fails the attempt instead of filling the router's memory.
MAX_RESPONSE_BODY_BYTES = 256 << 20

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)


# The router sets its own X-Request-Id (the client's, or a new one) on every upstream request.
# Content-Encoding: the server has already decoded the body the router passes on. Expect: the
# router answered the client's 100-continue itself and sends the whole body at once; passed on,
# it has the replica send an interim "100 Continue" the client would get as the answer.
# The rank of a data-parallel replica is the router's pick (router/dp_ranks.py), not the client's.
_NOT_FORWARDED = HOP_BY_HOP | {
    b"x-request-id",
    b"content-encoding",
    b"expect",
    b"x-data-parallel-rank",
}


class UpstreamError(Exception):
    """A failure talking to a replica; ``kind`` is a metrics label."""

    kind = "protocol"


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamTimeout(UpstreamError):
    kind = "timeout"


class UpstreamAbandoned(UpstreamError):
    """The router gave up waiting on a replica it has just taken out of rotation."""

    kind = "ejected"


class UpstreamDrained(UpstreamError):
    """The router cut the response because its replica is being drained (router/drain.py):
    the caller continues it elsewhere."""

    kind = "drained"


class UpstreamResponse:
    """One response: status and headers once they arrive, then body chunks."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_error",
        "_headers_ready",
        "_waiter",
        "buffered",
        "complete",
        "headers",
        "movable",
        "status",
    )

    def __init__(self, conn: _Connection, headers_ready: asyncio.Future[None]) -> None:
        self._conn = conn
        self._headers_ready = headers_ready
        # A list, not a deque: a deque allocates a 64-slot block (~0.7 KiB) for each open stream;
        # read back-pressure keeps the list short, so pop(0) stays cheap.
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self.buffered = 0
        self.complete = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # Set by the relay once the answer is under way: whether cutting it now (a drain) would
        # still let the router finish it elsewhere (retry or resume). None: it would not.
        self.movable: Callable[[], bool] | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def read_chunk(self, idle_timeout_s: float) -> bytes:
        """The next piece of body as it arrived; b'' at the end."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            waiter = self._waiter = self._conn.loop.create_future()
            timer = self._conn.loop.call_later(idle_timeout_s, _expire, waiter, idle_timeout_s)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        chunk = self._chunks.pop(0)
        self.buffered -= len(chunk)
        if self._conn.paused and self.buffered < _LOW_WATER:
            self._conn.resume()
        return chunk

    async def read(self, idle_timeout_s: float, max_bytes: int = MAX_RESPONSE_BODY_BYTES) -> bytes:
        """The whole body (a non-streamed answer); UpstreamError past ``max_bytes``."""
        parts = []
        size = 0
        while chunk := await self.read_chunk(idle_timeout_s):
            size += len(chunk)
            if size > max_bytes:
                self._conn.abort()
                raise UpstreamError(f"response body larger than {max_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def started(self) -> None:
        """The replica has started answering: no longer abandoned when it is ejected."""
        pool = self._conn.pool
        pool.waiting.discard(self)
        pool.active.add(self)

    def close(self) -> None:
        """Abandon the response; an unfinished one closes its connection (the replica sees it)."""
        pool = self._conn.pool
        pool.waiting.discard(self)
        pool.active.discard(self)
        if not self.complete:
            self._conn.abort()

    # -- fed by the connection ---------------------------------------------------------

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self.buffered += len(chunk)
        if self.buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if (
            self._error is None
        ):  # the first cause wins (an abandon is followed by a lost connection)
            self._error = error
        if not self._headers_ready.done():
            self._headers_ready.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _expire(waiter: asyncio.Future[None], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout(f"no response within {timeout_s:g}s"))


def _close_delimited(response: UpstreamResponse) -> bool:
    return (
        response.header(b"content-length") is None and response.header(b"transfer-encoding") is None
    )


class _Connection(asyncio.Protocol):
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.paused = False
        self.used = False
        self.head_bytes = 0  # bytes of the current response before its headers ended

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            # Bytes nobody asked for (on an idle keep-alive connection, or after a complete
            # response): the connection's framing can no longer be trusted.
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lost(UpstreamError(f"malformed response from replica: {exc}"))
            self.abort()
            return
        if not response.status and self.response is response:
            # Still inside the status line and headers: all of it is held by the parser.
            self.head_bytes += len(data)
            if self.head_bytes > MAX_RESPONSE_HEAD_BYTES:
                self._lost(
                    UpstreamError(
                        f"response status line and headers larger than "
                        f"{MAX_RESPONSE_HEAD_BYTES} bytes"
                    )
                )
                self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is None or response.complete:
            return
        if response.status and _close_delimited(response):
            # No length and not chunked: the body ends when the connection does.
            self.response = None
            response._finish()
        else:
            self._lost(UpstreamError("replica closed the connection mid-response"))

    # -- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        if not response._headers_ready.done():
            response._headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        keep_alive = self.parser.should_keep_alive()
        self.response = None
        response._finish()
        if keep_alive and not self.closed:
            if self.paused:
                self.resume()
            self.pool.release(self)
        else:
            self.abort()

    # -- used by the pool and the response ---------------------------------------------

    def send(self, data: bytes, response: UpstreamResponse) -> None:
        assert self.transport is not None
        self.response = response
        self.used = True
        self.head_bytes = 0
        self.transport.write(data)

    def _lost(self, error: UpstreamError) -> None:
        response, self.response = self.response, None
        if response is not None:
            response._fail(error)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Pool:
    """Idle keep-alive connections to one replica."""

    def __init__(self, base_url: str, connect_timeout_s: float) -> None:
        parts = urlsplit(base_url)
        self.loop = asyncio.get_running_loop()
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None
        )
        default_port = (parts.scheme == "https" and self.port == 443) or self.port == 80
        self.host_header = (self.host if default_port else f"{self.host}:{self.port}").encode()
        self.connect_timeout_s = connect_timeout_s
        self.idle: deque[_Connection] = deque()
        # Responses the replica has not started answering yet (see UpstreamClient.abandon_waiting).
        self.waiting: set[UpstreamResponse] = set()
        # Responses being relayed (started, not yet closed): what a drain may cut.
        self.active: set[UpstreamResponse] = set()

    async def acquire(self) -> _Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return await self.connect()

    async def connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect timed out after {self.connect_timeout_s}s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(
                f"cannot connect to {self.host}:{self.port}: {exc}"
            ) from None
        return conn

    def release(self, conn: _Connection) -> None:
        self.idle.append(conn)

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()


async def _exchange(conn: _Connection, data: bytes, timeout_s: float) -> UpstreamResponse:
    headers_ready: asyncio.Future[None] = conn.loop.create_future()
    response = UpstreamResponse(conn, headers_ready)
    conn.pool.waiting.add(response)
    conn.send(data, response)
    timer = conn.loop.call_later(timeout_s, _expire, headers_ready, timeout_s)
    try:
        await headers_ready
    except BaseException:
        response.close()
        raise
    finally:
        timer.cancel()
    return response


class UpstreamClient:
    """Sends requests to replicas over pooled connections."""

    def __init__(self, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._pools: dict[str, _Pool] = {}

    def _pool(self, base_url: str) -> _Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = _Pool(base_url, self._connect_timeout_s)
        return pool

    async def post(
        self,
        base_url: str,
        path: bytes,
        raw_headers: Iterable[tuple[bytes, bytes]],
        extra_headers: bytes,
        body: bytes,
        timeout_s: float,
    ) -> UpstreamResponse:
        """Send a POST and wait (at most ``timeout_s``) for the response's status and headers.

        ``raw_headers`` are the client's, passed through without hop-by-hop ones;
        ``extra_headers`` are complete ``Name: value\\r\\n`` lines added after them.
        """
        pool = self._pool(base_url)
        head = [b"POST ", path, b" HTTP/1.1\r\nHost: ", pool.host_header]
        head.append(b"\r\nContent-Length: %d\r\n" % len(body))
        for name, value in raw_headers:
            if name.lower() not in _NOT_FORWARDED:
                head += (name, b": ", value, b"\r\n")
        head += (extra_headers, b"\r\n", body)
        data = b"".join(head)

        conn = await pool.acquire()
        reused = conn.used
        try:
            return await _exchange(conn, data, timeout_s)
        except (UpstreamTimeout, UpstreamAbandoned):
            raise
        except UpstreamError:
            if not reused:
                raise
        # The replica closed an idle keep-alive connection as we reused it: one fresh try.
        return await _exchange(await pool.connect(), data, timeout_s)

    def abandon_waiting(self, base_url: str, reason: str) -> int:
        """Fail every request to ``base_url`` still waiting for its answer to start.

        Used when a replica is ejected: nothing has reached those clients yet, so the router
        can send their requests elsewhere instead of waiting out the timeout.
        """
        pool = self._pools.get(base_url)
        if pool is None:
            return 0
        waiting, pool.waiting = pool.waiting, set()
        for response in waiting:
            response._fail(UpstreamAbandoned(reason))
            response._conn.abort()
        return len(waiting)

    def cut_movable(self, base_url: str, reason: str) -> tuple[int, int]:
        """Break every response from ``base_url`` that the router can still finish elsewhere:
        those not started yet (retried) and those whose relay says they are movable (resumed
        streams, retried whole answers). Returns (cut, left): ``left`` could not be moved.

        Used by a drain: what the replica did not finish within its drain time continues on
        another replica instead of dying with the process.
        """
        pool = self._pools.get(base_url)
        if pool is None:
            return 0, 0
        waiting, pool.waiting = pool.waiting, set()
        cut = [*waiting]
        left = 0
        for response in list(pool.active):
            movable = response.movable
            if movable is not None and movable():
                pool.active.discard(response)
                cut.append(response)
            else:
                left += 1
        for response in cut:
            response._fail(UpstreamDrained(reason))
            conn = response._conn
            if conn.response is response:
                conn.response = None  # a close-delimited body must not read as complete
            conn.abort()
        return len(cut), left

    def unmovable(self, base_url: str) -> int:
        """Responses from ``base_url`` being relayed that a cut would lose (see cut_movable)."""
        pool = self._pools.get(base_url)
        if pool is None:
            return 0
        return sum(1 for r in pool.active if r.movable is None or not r.movable())

    def in_flight(self, base_url: str) -> int:
        """Responses from ``base_url`` waiting or being relayed now."""
        pool = self._pools.get(base_url)
        return len(pool.waiting) + len(pool.active) if pool is not None else 0

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
