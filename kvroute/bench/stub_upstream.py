"""A replica stand-in that answers at once, for measuring the router's own overhead.

A raw asyncio protocol on uvloop (no framework) so that the upstream costs as little CPU
as possible and the benchmark measures the proxies, not the replicas. It speaks just
enough of vLLM's HTTP surface for routers to accept it: /health, /v1/models, and
/v1/completions and /v1/chat/completions (streamed when the body asks for it).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import msgspec
import uvloop

_COMPLETION_TOKENS = 8


def _completion(model: str) -> bytes:
    return msgspec.json.encode(
        {
            "id": "cmpl-stub",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {"index": 0, "text": " ok" * _COMPLETION_TOKENS, "finish_reason": "length"}
            ],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": _COMPLETION_TOKENS,
                "total_tokens": 16,
            },
        }
    )


def _chat(model: str) -> bytes:
    return msgspec.json.encode(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " ok" * _COMPLETION_TOKENS},
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": _COMPLETION_TOKENS,
                "total_tokens": 16,
            },
        }
    )


def _stream(model: str) -> bytes:
    chunks = []
    for _ in range(_COMPLETION_TOKENS):
        chunk = {
            "id": "cmpl-stub",
            "object": "text_completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "text": " ok", "finish_reason": None}],
        }
        chunks.append(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks) + b"0\r\n\r\n"


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: " + content_type
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


class _Answers:
    def __init__(self, model: str) -> None:
        models = msgspec.json.encode(
            {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": 0, "owned_by": "stub"}],
            }
        )
        self.health = _response("200 OK", b"{}")
        self.models = _response("200 OK", models)
        self.completion = _response("200 OK", _completion(model))
        self.chat = _response("200 OK", _chat(model))
        self.stream = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + _stream(model)
        )
        self.not_found = _response("404 Not Found", b'{"detail":"Not Found"}')
        event = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": model,
                 "choices": [{"index": 0, "text": " ok", "finish_reason": None}]}  # fmt: skip
        self.stream_event = _chunk(b"data: " + msgspec.json.encode(event) + b"\n\n")


def _dechunk(buffer: bytes, start: int) -> tuple[bytes, int] | None:
    """A chunked body that starts at ``start``: (the body, where it ends), None if incomplete."""
    pieces: list[bytes] = []
    pos = start
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(buffer[pos:eol].split(b";", 1)[0], 16)
        if size == 0:
            end = buffer.find(b"\r\n\r\n", eol)  # after the trailers, if any
            return None if end < 0 else (b"".join(pieces), end + 4)
        data = eol + 2
        if len(buffer) < data + size + 2:
            return None
        pieces.append(buffer[data : data + size])
        pos = data + size + 2


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@dataclass(frozen=True)
class Pace:
    """Streams at a steady pace instead of at once: ``tokens`` events, one every ``interval_s``
    (what ``kvroute bench servers`` holds open to measure memory per stream)."""

    tokens: int
    interval_s: float


class _Protocol(asyncio.Protocol):
    def __init__(self, answers: _Answers, pace: Pace | None = None) -> None:
        self._answers = answers
        self._pace = pace
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end]
            length = 0
            chunked = False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
            if chunked:
                # Envoy forwards bodies an ext_proc filter streamed (FULL_DUPLEX_STREAMED)
                # chunked, as vLLM's server accepts.
                found = _dechunk(self._buffer, end + 4)
                if found is None:
                    return
                body, total = found
            else:
                total = end + 4 + length
                if len(self._buffer) < total:
                    return
                body = self._buffer[end + 4 : total]
            self._buffer = self._buffer[total:]
            assert self._transport is not None
            answer = self._answer(head.split(b" ", 2), body)
            if answer is self._answers.stream and self._pace is not None:
                self._transport.write(answer[: answer.index(b"\r\n\r\n") + 4])
                self._paced(self._pace.tokens)
            else:
                self._transport.write(answer)

    def _paced(self, left: int) -> None:
        """The next event of a paced stream, the rest scheduled; [DONE] after the last."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if left == 0:
            transport.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return
        transport.write(self._answers.stream_event)
        assert self._pace is not None
        asyncio.get_running_loop().call_later(self._pace.interval_s, self._paced, left - 1)

    def _answer(self, request_line: list[bytes], body: bytes) -> bytes:
        method, path = request_line[0], request_line[1]
        a = self._answers
        if method == b"GET":
            if path.startswith(b"/v1/models"):
                return a.models
            return a.health  # /health, /ready and whatever else a router may poll
        if b'"stream":true' in body.replace(b" ", b""):
            return a.stream
        if path == b"/v1/completions":
            return a.completion
        if path == b"/v1/chat/completions":
            return a.chat
        return a.not_found


async def serve(host: str, port: int, model: str, pace: Pace | None = None) -> None:
    loop = asyncio.get_running_loop()
    answers = _Answers(model)
    server = await loop.create_server(lambda: _Protocol(answers, pace), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description="An instant-answer replica stand-in.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="stub-model")
    parser.add_argument(
        "--paced-tokens", type=int, default=0, help="Stream this many events, paced (0: at once)."
    )
    parser.add_argument("--token-interval", type=float, default=1.0, help="Seconds between them.")
    args = parser.parse_args()
    pace = Pace(args.paced_tokens, args.token_interval) if args.paced_tokens > 0 else None
    uvloop.run(serve(args.host, args.port, args.model, pace))


if __name__ == "__main__":
    main()
