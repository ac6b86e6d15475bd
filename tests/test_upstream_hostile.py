"""The HTTP/1.1 client to the replicas (router/upstream_client.py) against hostile or broken
replicas: each case ends the request with a clean ``UpstreamError`` (which the router retries
or reports, and counts against the replica's breaker) well before the timeouts, holding
bounded memory (issue 37, item 3)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import openai
import pytest

from kvroute.router.upstream_client import (
    MAX_RESPONSE_HEAD_BYTES,
    UpstreamClient,
    UpstreamError,
)

from .conftest import StartReplica, StartRouter
from .helpers import wait_until

Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT_S = 10.0  # the test's first-byte timeout: every case must end long before it
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)


class Replica:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.sent = 0  # bytes the hostile replica wrote
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.behaviour(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up on us: what it should do
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def replica() -> AsyncIterator[Callable[[Behaviour], Awaitable[Replica]]]:
    made: list[Replica] = []

    async def make(behaviour: Behaviour) -> Replica:
        r = Replica(behaviour)
        r.server = await asyncio.start_server(r.handle, "127.0.0.1", 0)
        made.append(r)
        return r

    yield make
    for r in made:
        assert r.server is not None
        r.server.close()


async def post(client: UpstreamClient, url: str) -> bytes:
    response = await client.post(url, b"/v1/completions", [], b"", b"{}", TIMEOUT_S)
    try:
        return await response.read(TIMEOUT_S)
    finally:
        response.close()


async def fails(client: UpstreamClient, url: str, match: str) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(UpstreamError, match=match):
        await post(client, url)
    assert loop.time() - started < TIMEOUT_S / 2, "ended by the timeout, not by the check"


async def test_endless_headers_fail_the_request_at_the_head_limit(replica) -> None:
    async def endless_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(100_000):
            writer.write(b"X-Filler-%d: %s\r\n" % (i, b"a" * 100))
            await writer.drain()
            r.sent += 120

    r = await replica(endless_headers)
    client = UpstreamClient(5.0)
    await fails(client, r.url, "headers larger than")
    assert r.sent < 100_000 * 120  # cut off, not read to the end


async def test_one_endless_header_value_fails_at_the_head_limit(replica) -> None:
    async def endless_value(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        while True:
            writer.write(b"v" * 4096)
            await writer.drain()

    r = await replica(endless_value)
    await fails(UpstreamClient(5.0), r.url, "headers larger than")


async def test_a_large_body_in_the_first_read_is_not_taken_for_a_large_head(replica) -> None:
    body = b"[" + b"1," * (MAX_RESPONSE_HEAD_BYTES * 2) + b"1]"

    async def big_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    r = await replica(big_body)
    assert await post(UpstreamClient(5.0), r.url) == body


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        pytest.param(b"HTTP/1.1 abc OK\r\n\r\n", "malformed", id="bad status code"),
        pytest.param(b"SMTP ready\r\n\r\n", "malformed", id="not HTTP"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n",
            "malformed",
            id="bad chunk size",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdefgh\r\n0\r\n\r\n",
            "malformed",
            id="chunk longer than its size",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nabcde",
            "malformed",
            id="two lengths",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nonly part",
            "closed the connection mid-response",
            id="closed mid-chunk",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
            "closed the connection mid-response",
            id="closed before its length",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nX-Half",
            "closed the connection mid-response",
            id="closed in the head",
        ),
    ],
)
async def test_broken_answers_fail_cleanly(replica, answer: bytes, match: str) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    r = await replica(broken)
    await fails(UpstreamClient(5.0), r.url, match)


async def test_bytes_on_an_idle_connection_drop_it_and_the_next_request_is_served(
    replica,
) -> None:
    """A replica that writes after its answer, before any new request: the pooled connection
    is dropped, and the next request goes out on a new one."""

    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlies")  # unasked
        await writer.drain()
        await read_request(reader)  # never comes: the client dropped this connection
        writer.write(OK)

    r = await replica(chatty)
    client = UpstreamClient(5.0)
    assert await post(client, r.url) == b"{}"
    pool = client._pool(r.url)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not all(conn.closed for conn in pool.idle):
        assert loop.time() < deadline, "the idle connection that got unasked bytes is kept"
        await asyncio.sleep(0.005)
    assert await post(client, r.url) == b"{}"
    assert r.connections == 2


async def test_garbage_after_a_complete_answer_in_the_same_read_is_not_a_next_answer(
    replica,
) -> None:
    async def pipelined_lie(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK + b"HTTP/1.1 500 Lies\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 500 Lies\r\nContent-Length: 0\r\n\r\n")

    r = await replica(pipelined_lie)
    client = UpstreamClient(5.0)
    assert await post(client, r.url) == b"{}"
    # The next request must not read the lie queued on the old connection as its answer
    # (an empty 500): it goes out on a new connection and gets that one's answer.
    assert await post(client, r.url) == b"{}"
    assert r.connections == 2


async def test_through_the_router_a_hostile_replica_costs_a_retry_and_counts_against_it(
    replica, start_replica: StartReplica, start_router: StartRouter
) -> None:
    """The client sees an answer (retried on the good replica); the hostile one's failure is
    counted (kvroute_upstream_errors, its breaker)."""

    async def endless_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        if request.startswith(b"GET"):  # health checks and /v1/models: look like a replica
            body = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
            if b"/metrics" in request:
                body = b""
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 OK\r\n")
        while True:
            writer.write(b"X-Filler: " + b"a" * 1000 + b"\r\n")
            await writer.drain()

    hostile = await replica(endless_headers)
    good = await start_replica("good")
    r = await start_router(
        [{"url": hostile.url, "name": "hostile"}, good],
        policy={"name": "round_robin"},
        health={"interval_s": 0.2},
    )
    await wait_until(lambda: r.router.registry.in_rotation() == 2, what="both in rotation")
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
    served = set()
    for i in range(4):  # round robin: at least one goes to the hostile replica first
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=f"hi {i}", max_tokens=2
        )
        served.add(raw.headers["X-Kvroute-Replica"])
    await client.close()
    assert served == {"good"}
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'kvroute_upstream_errors_total{kind="protocol",replica="hostile"}' in metrics
    failures = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvroute_upstream_errors_total") and 'replica="hostile"' in line
    ]
    assert failures and float(failures[0].rsplit(" ", 1)[1]) >= 1


async def test_a_body_that_never_ends_fails_at_the_body_limit(replica) -> None:
    async def endless_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"1000\r\n" + b"b" * 4096 + b"\r\n")
            await writer.drain()

    r = await replica(endless_body)
    client = UpstreamClient(5.0)
    response = await client.post(r.url, b"/v1/completions", [], b"", b"{}", TIMEOUT_S)
    with pytest.raises(UpstreamError, match="body larger than"):
        await response.read(TIMEOUT_S, max_bytes=1 << 20)
    assert response._conn.closed  # the replica is cut off, not read on


async def test_a_head_dripped_a_byte_at_a_time_ends_at_the_first_byte_timeout(replica) -> None:
    from kvroute.router.upstream_client import UpstreamTimeout

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"s" * 10_000:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.01)  # the hostile replica's pace, not the test's sync

    r = await replica(drip)
    client = UpstreamClient(5.0)
    with pytest.raises(UpstreamTimeout):
        await client.post(r.url, b"/v1/completions", [], b"", b"{}", 0.3)
