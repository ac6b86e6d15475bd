"""Forward one request to one replica and relay its answer to the client.

Bodies go out as received and come back as received: non-streamed answers are read whole
(they are small JSON), streamed ones are relayed chunk by chunk as they arrive. Nothing is
re-serialised on the way through.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from .upstream_client import HOP_BY_HOP, UpstreamClient, UpstreamError, UpstreamResponse

_SSE_ERROR = (
    'data: {{"error": {{"message": "{message}", "type": "upstream_error", '
    '"param": null, "code": "stream_broken"}}}}\n\ndata: [DONE]\n\n'
)


class UpstreamUnavailable(Exception):
    """The replica failed before any byte reached the client; another replica may be tried."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(slots=True)
class Relayed:
    """What happened, for metrics."""

    response: web.StreamResponse
    status: int
    ttfb_s: float
    broken_stream: bool = False
    client_gone: bool = False


# The router's own X-Request-Id replaces the replica's.
_NOT_RELAYED = HOP_BY_HOP | {b"x-request-id"}


def _response_headers(upstream: UpstreamResponse, extra: list[tuple[str, str]]) -> CIMultiDict[str]:
    pairs = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in upstream.headers
        if name.lower() not in _NOT_RELAYED
    ]
    return CIMultiDict(pairs + extra)


async def relay(
    client: UpstreamClient,
    request: web.Request,
    base_url: str,
    body: bytes,
    extra_upstream_headers: bytes,
    extra_response_headers: list[tuple[str, str]],
    first_byte_timeout_s: float,
    idle_timeout_s: float,
    on_first_byte: Callable[[int], None] | None = None,
) -> Relayed:
    """Send ``body`` to the replica and relay the answer to ``request``'s client.

    ``on_first_byte(status)`` is called once the replica has answered: the first chunk of a
    stream (its first token: the prefill is done), or the headers of a whole response.
    Raises ``UpstreamUnavailable`` only while nothing has been sent to the client yet.
    """
    started = time.perf_counter()
    try:
        upstream = await client.post(
            base_url,
            request.raw_path.encode(),
            request.raw_headers,
            extra_upstream_headers,
            body,
            first_byte_timeout_s,
        )
    except UpstreamError as exc:
        raise UpstreamUnavailable(exc.kind, str(exc)) from None
    content_type = upstream.header(b"content-type") or b""
    streaming = content_type.startswith(b"text/event-stream")
    first = b""
    if streaming:
        # The first chunk must also arrive within the first-byte timeout.
        remaining_s = max(first_byte_timeout_s - (time.perf_counter() - started), 0.001)
        try:
            first = await upstream.read_chunk(remaining_s)
        except UpstreamError as exc:
            upstream.close()
            raise UpstreamUnavailable(exc.kind, str(exc)) from None
    if on_first_byte is not None:
        on_first_byte(upstream.status)

    try:
        headers = _response_headers(upstream, extra_response_headers)
        if not streaming:
            try:
                data = await upstream.read(idle_timeout_s)
            except UpstreamError as exc:
                raise UpstreamUnavailable(exc.kind, str(exc)) from None
            response = web.Response(body=data, status=upstream.status, headers=headers)
            return Relayed(response, upstream.status, time.perf_counter() - started)
        ttfb_s = time.perf_counter() - started
        stream = web.StreamResponse(status=upstream.status, headers=headers)
        await stream.prepare(request)
        return await _relay_stream(upstream, stream, first, ttfb_s, idle_timeout_s)
    finally:
        # Closing an unfinished response is how the replica learns the client has gone.
        upstream.close()


async def _relay_stream(
    upstream: UpstreamResponse,
    stream: web.StreamResponse,
    chunk: bytes,
    ttfb_s: float,
    idle_timeout_s: float,
) -> Relayed:
    status = upstream.status
    try:
        while chunk:
            await stream.write(chunk)
            chunk = await upstream.read_chunk(idle_timeout_s)
        await stream.write_eof()
    except UpstreamError as exc:
        # Too late to pick another replica: end the stream well-formed, never silently cut.
        message = str(exc).replace('"', "'")
        try:
            await stream.write(_SSE_ERROR.format(message=message).encode())
            await stream.write_eof()
        except ConnectionResetError:
            return Relayed(stream, status, ttfb_s, broken_stream=True, client_gone=True)
        return Relayed(stream, status, ttfb_s, broken_stream=True)
    except ConnectionResetError:
        return Relayed(stream, status, ttfb_s, client_gone=True)
    return Relayed(stream, status, ttfb_s)
