"""The one proxy handler ``kvroute bench servers`` serves on each HTTP server it compares.

Read the JSON body, pick an upstream round robin, forward with the router's own upstream client
(router/upstream_client.py), relay the answer: whole, or chunk by chunk when the body asks for a
stream. Nothing else of the router (no tokenizer, no policy, no ledger), so what differs from one
server to the next is the server. The same ``Relay`` behind each server's interface: aiohttp's
web server (what ``kvroute serve`` runs), a raw ASGI app (uvicorn with httptools, granian) and
granian's own RSGI.

Run as ``python -m kvroute.bench.server_app --server NAME --port P --upstream URL...``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
import uvloop
from aiohttp import web

from kvroute.router.upstream_client import UpstreamClient, UpstreamError, UpstreamResponse

SERVERS = ("aiohttp", "uvicorn", "granian-asgi", "granian-rsgi")
# granian imports the app by name in its worker process: the upstreams travel in the environment.
UPSTREAMS_ENV = "KVROUTE_BENCH_UPSTREAMS"
TIMEOUT_S = 60.0
JSON_HEADER = b"Content-Type: application/json\r\n"
BAD_BODY = b'{"error": {"message": "the body is not a JSON object", "type": "invalid_request"}}'
BAD_GATEWAY = b'{"error": {"message": "upstream failed", "type": "upstream_error"}}'


class BadRequest(ValueError):
    """The body is not a JSON object."""


class Relay:
    """The upstreams in turn, and the router's upstream client (made on the serving loop)."""

    def __init__(self, upstreams: list[str]) -> None:
        self._turn = itertools.cycle(upstreams)
        self._client: UpstreamClient | None = None

    async def open(self, path: str, body: bytes) -> tuple[UpstreamResponse, bool]:
        """Forward ``body`` to the next upstream; its response and whether it is a stream."""
        try:
            request = msgspec.json.decode(body)  # the router decodes every body: so does this
        except msgspec.DecodeError:
            raise BadRequest from None
        if not isinstance(request, dict):
            raise BadRequest
        if self._client is None:
            self._client = UpstreamClient(connect_timeout_s=10.0)
        upstream = await self._client.post(
            next(self._turn), path.encode(), (), JSON_HEADER, body, TIMEOUT_S
        )
        upstream.started()
        return upstream, request.get("stream") is True


_relay: Relay | None = None


def relay() -> Relay:
    global _relay
    if _relay is None:
        _relay = Relay([u for u in os.environ.get(UPSTREAMS_ENV, "").split(",") if u])
    return _relay


# ------------------------------------------------------------------------- aiohttp


async def aiohttp_handler(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    try:
        upstream, stream = await relay().open(request.path, body)
    except BadRequest:
        return web.Response(status=400, body=BAD_BODY, content_type="application/json")
    except UpstreamError:
        return web.Response(status=502, body=BAD_GATEWAY, content_type="application/json")
    try:
        if not stream:
            data = await upstream.read(TIMEOUT_S)
            return web.Response(status=upstream.status, body=data, content_type="application/json")
        out = web.StreamResponse(status=upstream.status)
        out.content_type = "text/event-stream"
        await out.prepare(request)
        while chunk := await upstream.read_chunk(TIMEOUT_S):
            await out.write(chunk)
        await out.write_eof()
        return out
    finally:
        upstream.close()


async def aiohttp_ready(request: web.Request) -> web.Response:
    return web.Response(body=b"{}", content_type="application/json")


def aiohttp_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/health", aiohttp_ready)
    app.router.add_post("/v1/completions", aiohttp_handler)
    app.router.add_post("/v1/chat/completions", aiohttp_handler)
    return app


async def serve_aiohttp(host: str, port: int) -> None:
    # kvroute serve's runner settings (router/runner.py), less the config-driven timeouts.
    runner = web.AppRunner(aiohttp_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=2048).start()
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------- ASGI

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]


async def _asgi_answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON})
    await send({"type": "http.response.body", "body": body})


async def asgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":
        await _asgi_answer(send, 200, b"{}")
        return
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    try:
        upstream, stream = await relay().open(scope["path"], b"".join(parts))
    except BadRequest:
        await _asgi_answer(send, 400, BAD_BODY)
        return
    except UpstreamError:
        await _asgi_answer(send, 502, BAD_GATEWAY)
        return
    try:
        if not stream:
            await _asgi_answer(send, upstream.status, await upstream.read(TIMEOUT_S))
            return
        await send({"type": "http.response.start", "status": upstream.status, "headers": SSE})
        while chunk := await upstream.read_chunk(TIMEOUT_S):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        upstream.close()


# ---------------------------------------------------------------------------- RSGI

RSGI_JSON = [("content-type", "application/json")]
RSGI_SSE = [("content-type", "text/event-stream")]


async def rsgi_app(scope: Any, protocol: Any) -> None:
    """granian's own interface (RSGI): the same relay, without ASGI's message dicts."""
    if scope.proto != "http":
        return
    if scope.method == "GET":
        protocol.response_bytes(200, RSGI_JSON, b"{}")
        return
    try:
        upstream, stream = await relay().open(scope.path, await protocol())
    except BadRequest:
        protocol.response_bytes(400, RSGI_JSON, BAD_BODY)
        return
    except UpstreamError:
        protocol.response_bytes(502, RSGI_JSON, BAD_GATEWAY)
        return
    try:
        if not stream:
            protocol.response_bytes(upstream.status, RSGI_JSON, await upstream.read(TIMEOUT_S))
            return
        transport = protocol.response_stream(upstream.status, RSGI_SSE)
        while chunk := await upstream.read_chunk(TIMEOUT_S):
            await transport.send_bytes(chunk)
    finally:
        upstream.close()


# ---------------------------------------------------------------------------- main


def serve(server: str, host: str, port: int) -> None:
    """Serve the relay on ``server`` until killed (one process, one event loop: uvloop)."""
    if server == "aiohttp":
        uvloop.run(serve_aiohttp(host, port))
    elif server == "uvicorn":
        import uvicorn

        config = uvicorn.Config(
            asgi_app, host=host, port=port, http="httptools", loop="uvloop", lifespan="off",
            access_log=False, log_level="warning", backlog=2048,
        )  # fmt: skip
        uvicorn.Server(config).run()
    else:
        from granian import Granian
        from granian.constants import HTTPModes, Interfaces, Loops

        asgi = server == "granian-asgi"
        Granian(
            f"{__name__}:{'asgi_app' if asgi else 'rsgi_app'}",
            address=host, port=port, interface=Interfaces.ASGI if asgi else Interfaces.RSGI,
            workers=1, loop=Loops.uvloop, http=HTTPModes.http1, websockets=False,
            backlog=2048, log_enabled=False,
            # Its default (the backlog) holds connections past 2,048 unserved until others end.
            backpressure=1 << 16,
        ).serve()  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="The relay of `kvroute bench servers`.")
    parser.add_argument("--server", choices=SERVERS, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True)
    args = parser.parse_args()
    os.environ[UPSTREAMS_ENV] = ",".join(args.upstream)
    serve(args.server, args.host, args.port)


if __name__ == "__main__":
    main()
