"""The emulated replica's token-in endpoints, as vLLM 0.32 serves them with --enable-scale-out.

``POST /v1/chat/completions/render`` renders a chat request to the GenerateRequest vLLM would
run (token ids and resolved sampling parameters); ``POST /inference/v1/generate`` runs token
ids and answers in generate's own shape (text with ``output_mode: text``; a stream of
``data:`` chunks, the usage in a chunk with no choices when asked, then ``[DONE]``). The
router's tokens sent once (``routing.send_tokens``) sends requests here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvroute.simulator.engine import RequestOutput

from .server import DEFAULT_CHAT_MAX_TOKENS, BadRequest, _error, _json_body, _usage

if TYPE_CHECKING:
    from .server import EmulatedReplica, Run

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"


def _ids(value: Any) -> list[int] | None:
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )
    return list(value) if ok else None


class ScaleOutAPIs:
    """The replica's render and generate endpoints (``routes`` adds them to its app)."""

    def __init__(self, replica: EmulatedReplica) -> None:
        self.replica = replica

    def routes(self, app: web.Application) -> None:
        app.router.add_post(RENDER_PATH, self.render)
        app.router.add_post(GENERATE_PATH, self.generate)

    async def render(self, request: web.Request) -> web.Response:
        replica = self.replica
        try:
            body = await _json_body(request)
            replica.check_model(body.get("model"))
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", param="messages")
            ids = replica.chat_prompt(messages, body)
            asked = body.get("max_completion_tokens", body.get("max_tokens"))
            max_tokens = replica.max_tokens(ids, asked, DEFAULT_CHAT_MAX_TOKENS)
        except BadRequest as exc:
            return _error(str(exc), exc.status, exc.error_type, exc.param)
        temperature = body.get("temperature")
        params: dict[str, Any] = {
            "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0,
            "max_tokens": max_tokens,
            "stop": [],
            "stop_token_ids": [],
        }
        rendered = {
            "request_id": replica.request_id("chatcmpl", request),
            "token_ids": ids,
            "sampling_params": params,
            "model": body.get("model"),
            "reasoning_ended": None,
            "reasoning_parser_kwargs": None,  # the emulated model has no reasoning parser
            "output_mode": "tokens",
            "stream": bool(body.get("stream")),
            "cache_salt": body.get("cache_salt"),
            "priority": 0,
        }
        return web.Response(body=msgspec.json.encode(rendered), content_type="application/json")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        replica = self.replica
        try:
            await replica.admit()
            body = await _json_body(request)
            if body.get("model") is not None:
                replica.check_model(body.get("model"))
            ids = _ids(body.get("token_ids"))
            if ids is None:
                raise BadRequest("token_ids must be a non-empty list of token ids")
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise BadRequest("sampling_params must be an object", param="sampling_params")
            # vLLM's generate defaults an unset max_tokens to the context left.
            default = max(1, replica.options.engine.max_model_len - len(ids))
            max_tokens = replica.max_tokens(ids, params.get("max_tokens"), default)
        except BadRequest as exc:
            return _error(str(exc), exc.status, exc.error_type, exc.param)
        request_id = replica.request_id("generate-tokens", request)
        engine_body = {
            "temperature": params.get("temperature"),
            "cache_salt": body.get("cache_salt"),
        }
        try:
            run = await replica.start(request_id, ids, max_tokens, engine_body, None)
        except ValueError as exc:
            return _error(str(exc), 400, "BadRequestError")
        text_mode = body.get("output_mode") == "text"
        if body.get("stream"):
            options = body.get("stream_options") or {}
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            frames = _GenerateFrames(request_id, text_mode, usage)
            return await replica.answer(run, replica.relay(request, run, frames))
        return await replica.answer(run, self._whole(run, request_id, text_mode))

    async def _whole(self, run: Run, request_id: str, text_mode: bool) -> web.Response:
        replica = self.replica
        last, token_ids = await replica.collect(run)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": last.finish_reason or "stop",
            "stop_reason": None,
            "token_ids": token_ids,
        }
        if text_mode:
            choice["text"] = replica.tokenizer.decode(token_ids)
        answer = {
            "request_id": request_id,
            "model": replica.options.served_model_name,
            "created": int(time.time()),
            "usage": _usage(last, len(token_ids)),
            "output_mode": "text" if text_mode else "tokens",
            "choices": [choice],
        }
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")


class _GenerateFrames:
    """Generate's stream: a chunk per engine step, the usage chunk when asked, [DONE]."""

    def __init__(self, request_id: str, text_mode: bool, include_usage: bool) -> None:
        self.request_id, self.text_mode, self.include_usage = request_id, text_mode, include_usage
        self.mode = "text" if text_mode else "tokens"

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        obj = {"request_id": self.request_id, "usage": usage, "output_mode": self.mode,
               "choices": choices}  # fmt: skip
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    def head(self) -> bytes:
        return b""

    def opening(self, first: RequestOutput) -> bytes:
        return b""

    def step(self, text: str, output: RequestOutput) -> bytes:
        finish = output.finish_reason if output.finished else None
        if not output.new_token_ids and finish is None:
            return b""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": None,
                                  "token_ids": list(output.new_token_ids)}  # fmt: skip
        if self.text_mode:
            choice["text"] = text
        return self._chunk([choice])

    def closing(self, last: RequestOutput, generated: int) -> bytes:
        usage = self._chunk([], _usage(last, generated)) if self.include_usage else b""
        return usage + b"data: [DONE]\n\n"
