"""A scriptable stand-in for a vLLM replica, for API tests of the router.

Answers like vLLM's OpenAI server (completion and chat shapes, SSE chunks, /v1/models,
/health) and records what it received, so tests can assert what the replica saw. Special
prompts script its behaviour:
  "status:NNN"  answer with that status and an error body
  "slow"        stream a chunk every 50 ms for a long time (until the client goes away)
  "gate"        send one chunk, then wait for ``gate`` to be set before finishing
  "hold"        wait for ``gate`` before answering at all
  "break"       send two chunks, then drop the connection mid-stream
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    path: str
    headers: Mapping[str, str]
    body: dict[str, Any]


@dataclass
class FakeReplica:
    name: str
    models: tuple[str, ...] = ("tiny",)
    seen: list[Seen] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when a streaming handler notices its client (the router) went away.
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)
    first_chunk_sent: asyncio.Event = field(default_factory=asyncio.Event)
    healthy: bool = True
    # Health checks get no answer at all (a SIGKILLed vLLM whose listening socket lingers).
    mute: bool = False
    health_checks: int = 0
    # Answer every generation request with this status (an error body), whatever the prompt.
    fail_with: int | None = None
    running: int = 0
    # Whole (non-streamed) answers wait this long first, like a replica busy generating.
    delay_s: float = 0.0
    # Prompts of the whole answers it finished sending, and requests whose client went away.
    completed: list[str] = field(default_factory=list)
    aborted: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeReplica:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.mute:
            await asyncio.Event().wait()  # until the client gives up
        return web.json_response({}, status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "vllm"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, request.headers.copy(), body))
        chat = request.path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt = prompt if isinstance(prompt, str) else ""
        if prompt.startswith("status:") or self.fail_with is not None:
            status = self.fail_with or int(prompt.split(":")[1])
            error = {
                "object": "error",
                "message": f"scripted {status}",
                "type": "BadRequestError",
                "code": status,
            }
            return web.json_response(error, status=status)
        self.running += 1
        try:
            if prompt == "hold":
                await self.gate.wait()
            if body.get("stream"):
                return await self._stream(request, body, chat, prompt)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            text = f"hello from {self.name}"
            response = web.json_response(_full(body, chat, text, self.name))
            self.completed.append(prompt)
            return response
        except asyncio.CancelledError:
            self.aborted += 1
            self.client_gone.set()
            raise
        finally:
            self.running -= 1

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, prompt: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        pieces = ["hello", " from", f" {self.name}"]
        try:
            if prompt == "slow":
                for i in range(400):
                    await response.write(_sse(_chunk(body, chat, f" {i}")))
                    self.first_chunk_sent.set()
                    await asyncio.sleep(0.05)
            for i, piece in enumerate(pieces):
                await response.write(_sse(_chunk(body, chat, piece)))
                self.first_chunk_sent.set()
                if prompt == "gate" and i == 0:
                    await self.gate.wait()
                if prompt == "break" and i == 1:
                    assert request.transport is not None
                    request.transport.close()
                    return response
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                # vLLM's last event with include_usage: no choices, the whole answer's usage.
                await response.write(_sse(_usage_chunk(body, chat, len(pieces))))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.client_gone.set()
            raise
        return response


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


# The prompt tokens the fake says every request had (its usage; it tokenizes nothing).
FAKE_PROMPT_TOKENS = 3


def _full(body: dict[str, Any], chat: bool, text: str, name: str) -> dict[str, Any]:
    usage = {"prompt_tokens": FAKE_PROMPT_TOKENS, "completion_tokens": 3, "total_tokens": 6}
    if chat:
        return {
            "id": f"chatcmpl-{name}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
    return {
        "id": f"cmpl-{name}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
        "usage": usage,
    }


def _usage_chunk(body: dict[str, Any], chat: bool, completion_tokens: int) -> dict[str, Any]:
    prompt_tokens = FAKE_PROMPT_TOKENS
    return {
        "id": "chatcmpl-x" if chat else "cmpl-x",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": body["model"],
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _chunk(body: dict[str, Any], chat: bool, piece: str) -> dict[str, Any]:
    if chat:
        return {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
        }
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 0,
        "model": body["model"],
        "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}],
    }
