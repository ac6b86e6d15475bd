"""Forward one request to one replica and relay its answer.

Bodies go out as received and come back as received: non-streamed answers are read whole
(they are small JSON), streamed ones are relayed chunk by chunk as they arrive. Nothing is
re-serialised on the way through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

# Headers that describe one hop, not the message; never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

SSE_ERROR_TEMPLATE = (
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
    ttfb_s: float | None
    broken_stream: bool = False
    client_gone: bool = False


def upstream_request_headers(headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in HOP_BY_HOP:
            out.add(key, value)
    out["X-Request-Id"] = request_id
    return out


def client_response_headers(
    upstream: aiohttp.ClientResponse, extra: Mapping[str, str]
) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in upstream.headers.items():
        if key.lower() not in HOP_BY_HOP:
            out.add(key, value)
    out.update(extra)
    return out


async def relay(
    session: aiohttp.ClientSession,
    client_request: web.Request,
    url: str,
    body: bytes,
    headers: CIMultiDict[str],
    extra_response_headers: Mapping[str, str],
    first_byte_timeout_s: float,
) -> Relayed:
    """Send ``body`` to ``url`` and relay the answer to ``client_request``.

    Raises ``UpstreamUnavailable`` only while nothing has been sent to the client yet.
    """
    started = time.perf_counter()
    try:
        async with asyncio.timeout(first_byte_timeout_s):
            upstream = await session.post(url, data=body, headers=headers)
            streaming = upstream.content_type == "text/event-stream"
            first_chunk = await upstream.content.readany() if streaming else b""
    except TimeoutError:
        raise UpstreamUnavailable(
            "timeout", f"no first byte within {first_byte_timeout_s}s"
        ) from None
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnavailable("connect", str(exc)) from None
    except aiohttp.ClientError as exc:
        raise UpstreamUnavailable("protocol", str(exc) or type(exc).__name__) from None

    complete = False
    try:
        response_headers = client_response_headers(upstream, extra_response_headers)
        if not streaming:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise UpstreamUnavailable("protocol", str(exc) or type(exc).__name__) from None
            complete = True
            ttfb = time.perf_counter() - started
            return Relayed(
                web.Response(body=data, status=upstream.status, headers=response_headers),
                upstream.status,
                ttfb,
            )
        ttfb = time.perf_counter() - started
        response = web.StreamResponse(status=upstream.status, headers=response_headers)
        await response.prepare(client_request)
        chunk = first_chunk
        try:
            while chunk:
                await response.write(chunk)
                chunk = await upstream.content.readany()
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as exc:
            # Too late to pick another replica: end the stream well-formed, never silently cut.
            message = (str(exc) or type(exc).__name__).replace('"', "'")
            await response.write(SSE_ERROR_TEMPLATE.format(message=message).encode())
            await response.write_eof()
            return Relayed(response, upstream.status, ttfb, broken_stream=True)
        except ConnectionResetError:
            # The client went away; the finally below closes the upstream connection.
            return Relayed(response, upstream.status, ttfb, client_gone=True)
        complete = True
        await response.write_eof()
        return Relayed(response, upstream.status, ttfb)
    finally:
        if not complete:
            # Closing the connection is how the replica learns the client has gone.
            upstream.close()
