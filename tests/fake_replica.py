"""A scriptable stand-in for a vLLM replica, for API tests of the router.

Answers like vLLM's OpenAI server (completion, chat, Anthropic Messages and OpenAI Responses
shapes, their streams' events, /v1/models, /health) and records what it received, so tests can assert what the replica saw. Special
prompts script its behaviour:
  "status:NNN"  answer with that status and an error body
  "slow"        stream a chunk every 50 ms for a long time (until the client goes away)
  "gate"        send one chunk, then wait for ``gate`` to be set before finishing
  "hold"        wait for ``gate`` before answering at all
  "break"       send two chunks, then drop the connection mid-stream
  "break-tool"  (Messages, Responses) start a tool call, then drop the connection
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
    # The Responses ids it answered with (a follow-up may name them as previous_response_id).
    stored: set[str] = field(default_factory=set)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeReplica:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/messages", self._generate)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/v1/responses", self._generate)
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

    async def _count_tokens(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(Seen(request.path, request.headers.copy(), body))
        return web.json_response({"input_tokens": FAKE_PROMPT_TOKENS})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, request.headers.copy(), body))
        api = _API_OF_PATH[request.path]
        chat = api != "completions"
        prompt = _prompt_of(body, api)
        if prompt.startswith("status:") or self.fail_with is not None:
            status = self.fail_with or int(prompt.split(":")[1])
            error = {
                "object": "error",
                "message": f"scripted {status}",
                "type": "BadRequestError",
                "code": status,
            }
            if api == "messages":  # vLLM's Messages errors: Anthropic's envelope, its own types
                error = {
                    "type": "error",
                    "error": {"type": "BadRequestError", "message": error["message"]},
                }
            return web.json_response(error, status=status)
        previous = body.get("previous_response_id") if api == "responses" else None
        if previous is not None and previous not in self.stored:
            error = {"message": f"Response with id '{previous}' not found.",
                     "type": "invalid_request_error", "param": "response_id", "code": 404}  # fmt: skip
            return web.json_response({"error": error}, status=404)
        if api != "chat" and api != "completions":
            return await self._agent(request, body, api, prompt)
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

    async def _agent(
        self, request: web.Request, body: dict[str, Any], api: str, prompt: str
    ) -> web.StreamResponse:
        """A Messages or Responses answer, whole or streamed in that API's events."""
        self.running += 1
        try:
            response_id = f"resp_{self.name}_{len(self.seen)}"
            if api == "responses":
                self.stored.add(response_id)
            if not body.get("stream"):
                if prompt == "hold":
                    await self.gate.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                text = f"hello from {self.name}"
                whole = (
                    _message(body, text)
                    if api == "messages"
                    else _response(body, text, response_id)
                )
                response = web.json_response(whole)
                self.completed.append(prompt)
                return response
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            events = _AgentEvents(api, body, response_id)
            pieces = ["hello", " from", f" {self.name}"]
            await stream.write(events.start())
            if prompt == "break-tool":  # a tool call under way when the connection breaks
                await stream.write(events.tool_call_started())
                assert request.transport is not None
                request.transport.close()
                return stream
            for i, piece in enumerate(pieces):
                await stream.write(events.delta(piece))
                self.first_chunk_sent.set()
                if prompt == "gate" and i == 0:
                    await self.gate.wait()
                if prompt == "break" and i == 1:
                    assert request.transport is not None
                    request.transport.close()
                    return stream
            await stream.write(events.end("".join(pieces), len(pieces)))
            await stream.write_eof()
            return stream
        except (asyncio.CancelledError, ConnectionResetError):
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


_API_OF_PATH = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}


def _prompt_of(body: dict[str, Any], api: str) -> str:
    """The text that scripts the fake: the last message's (its first text block's)."""
    if api == "completions":
        prompt = body["prompt"]
    elif api == "responses":
        items = body["input"]
        prompt = items if isinstance(items, str) else items[-1].get("content")
    else:
        prompt = body["messages"][-1]["content"]
    if isinstance(prompt, list):
        texts = [p.get("text") for p in prompt if isinstance(p, dict) and "text" in p]
        prompt = texts[0] if texts else ""
    return prompt if isinstance(prompt, str) else ""


def _message(body: dict[str, Any], text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": FAKE_PROMPT_TOKENS, "output_tokens": 3},
    }


def _response(
    body: dict[str, Any], text: str, response_id: str, done: bool = True
) -> dict[str, Any]:
    output = [{"type": "message", "id": "msg_fake", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]  # fmt: skip
    usage = {"input_tokens": FAKE_PROMPT_TOKENS, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6}  # fmt: skip
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed" if done else "in_progress",
        "model": body["model"],
        "output": output if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "previous_response_id": body.get("previous_response_id"),
        "instructions": body.get("instructions"),  # vLLM echoes the request's
        "usage": usage if done else None,
    }


class _AgentEvents:
    """A Messages or Responses stream's events, as vLLM sends them (``event:`` lines)."""

    def __init__(self, api: str, body: dict[str, Any], response_id: str) -> None:
        self.api, self.body, self.response_id = api, body, response_id
        self.sequence = 0

    def _event(self, kind: str, obj: dict[str, Any]) -> bytes:
        obj = {"type": kind, **obj}
        if self.api == "responses":
            obj["sequence_number"] = self.sequence
            self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(obj)}\n\n".encode()

    def start(self) -> bytes:
        if self.api == "messages":
            message = {**_message(self.body, ""), "content": [], "stop_reason": None}
            message["usage"] = {"input_tokens": FAKE_PROMPT_TOKENS, "output_tokens": 0}
            return self._event("message_start", {"message": message}) + self._event(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            )
        response = _response(self.body, "", self.response_id, done=False)
        item = {
            "type": "message",
            "id": "msg_fake",
            "role": "assistant",
            "content": [],
            "status": "in_progress",
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return b"".join(
            (
                self._event("response.created", {"response": response}),
                self._event("response.in_progress", {"response": response}),
                self._event("response.output_item.added", {"output_index": 0, "item": item}),
                self._event(
                    "response.content_part.added",
                    {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "part": part},
                ),
            )
        )

    def tool_call_started(self) -> bytes:
        """A tool call's first events (Messages: a tool_use block after the open text one)."""
        if self.api == "messages":
            block = {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}}
            delta = {"type": "input_json_delta", "partial_json": '{"pa'}
            return b"".join(
                (
                    self._event("content_block_stop", {"index": 0}),
                    self._event("content_block_start", {"index": 1, "content_block": block}),
                    self._event("content_block_delta", {"index": 1, "delta": delta}),
                )
            )
        item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "read_file",
                "arguments": "", "status": "in_progress"}  # fmt: skip
        return self._event("response.output_item.added", {"output_index": 1, "item": item})

    def delta(self, piece: str) -> bytes:
        if self.api == "messages":
            return self._event(
                "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}}
            )
        return self._event("response.output_text.delta", {"item_id": "msg_fake", "output_index": 0,
                           "content_index": 0, "delta": piece, "logprobs": []})  # fmt: skip

    def end(self, text: str, tokens: int) -> bytes:
        if self.api == "messages":
            usage = {"input_tokens": FAKE_PROMPT_TOKENS, "output_tokens": tokens}
            return b"".join(
                (
                    self._event("content_block_stop", {"index": 0}),
                    self._event(
                        "message_delta",
                        {
                            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                            "usage": usage,
                        },
                    ),
                    self._event("message_stop", {}),
                )
            )
        response = _response(self.body, text, self.response_id)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return b"".join(
            (
                self._event(
                    "response.output_text.done",
                    {
                        "item_id": "msg_fake",
                        "output_index": 0,
                        "content_index": 0,
                        "text": text,
                        "logprobs": [],
                    },
                ),
                self._event(
                    "response.content_part.done",
                    {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "part": part},
                ),
                self._event(
                    "response.output_item.done", {"output_index": 0, "item": response["output"][0]}
                ),
                self._event("response.completed", {"response": response}),
            )
        )
