"""Anthropic Messages and OpenAI Responses on the emulated replica, as vLLM 0.32 serves them.

POST /v1/messages (streamed and not), POST /v1/messages/count_tokens, POST /v1/responses
(streamed and not) and GET /v1/responses/{id}. A request becomes a chat conversation by the
router's own conversion (``kvcore.agent_apis``, vLLM's steps), is rendered with the replica's
chat template and tokenized as vLLM tokenizes it (without special tokens for Messages, with
them for Responses), then takes the engine path chat takes (faults, queue, metrics, KV
events, abort on disconnect, the ``drop_after_chunks`` fault on streams).

As vLLM without a tool parser: the emulator finds no tool calls, so answers are text; a
Messages request with tools and a tool choice other than ``none`` is refused unless the
replica runs with ``--enable-auto-tool-choice`` (then tools are rendered). Responses never
checks. The engine runs every request to its token limit, so Messages answers stop with
``max_tokens`` and responses are ``incomplete`` (``max_output_tokens``), as vLLM answers a
request that hits its limit (a response without ``max_output_tokens`` gets the chat default,
256, where vLLM allows the rest of the context). Usage reports prompt-cache hits (vLLM's
``--enable-prompt-tokens-details``, which the emulator's chat answers always show too).

Responses keeps no state unless ``responses_store`` (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1):
then stored responses and their chat messages serve ``previous_response_id`` (the stored
conversation without its system messages, then the previous answer's text, then the new
input) and GET /v1/responses/{id}; without it ``store`` is ignored and both answer 404.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvroute.kvcore import token_path
from kvroute.kvcore.agent_apis import (
    AgentRequestError,
    ChatConversion,
    check_messages_request,
    check_responses_request,
    messages_to_chat,
    needs_system_first,
    responses_to_chat,
)
from kvroute.kvcore.tokenizer import ChatTemplateError, render_chat
from kvroute.simulator.engine import RequestOutput

from .server import BadRequest

if TYPE_CHECKING:
    from .server import EmulatedReplica, Run

# Keeps a finished response (the replica's store), or None.
Keep = Callable[[dict[str, Any]], None] | None


def openai_error(exc: BadRequest) -> web.Response:
    body = {"error": {"message": str(exc), "type": exc.error_type, "param": exc.param,
                      "code": exc.status}}  # fmt: skip
    return web.json_response(body, status=exc.status)


def anthropic_error(exc: BadRequest) -> web.Response:
    """vLLM's translation of a Messages handler's error (vLLM's type names, not Anthropic's)."""
    body = {"type": "error", "error": {"type": exc.error_type, "message": str(exc)}}
    return web.json_response(body, status=exc.status)


def _invalid(exc: AgentRequestError) -> BadRequest:
    # vLLM's request-model validation failure: 400, OpenAI-shaped on every route.
    param = f"body.{exc.param}" if exc.param else None
    return BadRequest(f"1 validation error:\n  {exc}", 400, "Bad Request", param)


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One ``event:`` + ``data:`` frame, as vLLM writes both APIs' streams."""
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def stop_reason(finish_reason: str | None) -> str:
    """vLLM's Anthropic stop reason for a finish reason (no tool calls, no stop strings)."""
    return "max_tokens" if finish_reason == "length" else "end_turn"


def anthropic_usage(output: RequestOutput, output_tokens: int) -> dict[str, int]:
    """vLLM's Messages usage with prompt-token details: cache hits apart from input_tokens."""
    cached = output.num_cached_tokens
    return {
        "input_tokens": max(0, output.num_prompt_tokens - cached),
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
    }


def responses_usage(output: RequestOutput, output_tokens: int) -> dict[str, Any]:
    return token_path.responses_usage(
        output.num_prompt_tokens, output_tokens, output.num_cached_tokens
    )


output_text = token_path.output_text
output_message = token_path.output_message


class AgentAPIs:
    """The replica's Messages and Responses endpoints (``routes`` adds them to its app)."""

    def __init__(self, replica: EmulatedReplica) -> None:
        self.replica = replica
        # id -> (response, the chat messages its prompt was rendered from), newest last.
        self.stored: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        # vLLM merges inline system messages into the first when its probe of the template
        # fails, or there is no template (the built-in tokenizer's case), as the router does.
        self.merge_inline_system = needs_system_first(
            getattr(replica.tokenizer, "chat_template", None)
        )

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.get_response)

    # -- shared ------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise BadRequest(f"JSON decode error: {exc}", 400, "Bad Request") from None
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.", 400, "Bad Request")
        return body

    def _prompt(self, conversion: ChatConversion, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation rendered and tokenized as vLLM does for this API."""
        tokenizer = self.replica.tokenizer
        try:
            text = render_chat(tokenizer, messages, conversion.chat_options())
        except ChatTemplateError as exc:
            raise BadRequest(str(exc)) from None
        return tokenizer.encode(text, add_special_tokens=conversion.add_special_tokens)

    async def _run(
        self, request_id: str, prompt_ids: list[int], max_tokens: int, body: dict[str, Any]
    ) -> Run:
        replica = self.replica
        try:
            return await replica.start(
                request_id, prompt_ids, max_tokens, body, replica.lora_name(body)
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    # -- Anthropic Messages ------------------------------------------------------------

    def _messages_prompt(self, body: dict[str, Any]) -> list[int]:
        """A checked Messages body's prompt tokens (BadRequest: vLLM's handler refuses it)."""
        self.replica.check_model(body["model"])
        self._check_tool_choice(body)
        try:
            conversion = messages_to_chat(body)
        except AgentRequestError as exc:
            raise BadRequest(str(exc)) from None
        messages = conversion.messages
        if self.merge_inline_system and conversion.merged_messages is not None:
            messages = conversion.merged_messages
        return self._prompt(conversion, messages)

    def _check_tool_choice(self, body: dict[str, Any]) -> None:
        """vLLM's refusal of tool choices it cannot parse (tools alone mean "auto")."""
        choice: dict[str, Any] = body.get("tool_choice") or {}
        kind = choice["type"] if choice else ("auto" if body.get("tools") else None)
        if kind in (None, "none") or self.replica.options.enable_auto_tool_choice:
            return
        if kind == "auto":
            raise BadRequest(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        described = f'function "{choice["name"]}"' if kind == "tool" else '"required"'
        raise BadRequest(f"tool_choice={described} requires --tool-call-parser to be set")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        replica = self.replica
        try:
            await replica.admit()
        except BadRequest as exc:
            return anthropic_error(exc)
        try:
            body = await self._body(request)
            check_messages_request(body)
        except BadRequest as exc:
            return openai_error(exc)
        except AgentRequestError as exc:
            return openai_error(_invalid(exc))
        try:
            prompt_ids = self._messages_prompt(body)
            max_tokens = replica.max_tokens(prompt_ids, body["max_tokens"])
            run = await self._run(
                replica.request_id("chatcmpl", request), prompt_ids, max_tokens, body
            )
        except BadRequest as exc:
            return anthropic_error(exc)
        model = replica.lora_name(body) or replica.options.served_model_name
        if body.get("stream"):
            frames = MessagesFrames(run.request_id, model)
            return await replica.answer(run, replica.relay(request, run, frames))
        return await replica.answer(run, self._message(run, model))

    async def _message(self, run: Run, model: str) -> web.Response:
        last, token_ids = await self.replica.collect(run)
        message = {
            "id": run.request_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": self.replica.tokenizer.decode(token_ids)}],
            "model": model,
            "stop_reason": stop_reason(last.finish_reason),
            "usage": anthropic_usage(last, len(token_ids)),
        }
        return web.Response(body=msgspec.json.encode(message), content_type="application/json")

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            check_messages_request(body, count_tokens=True)
        except BadRequest as exc:
            return openai_error(exc)
        except AgentRequestError as exc:
            return openai_error(_invalid(exc))
        try:
            count = len(self._messages_prompt(body))
        except BadRequest as exc:
            return anthropic_error(exc)
        return web.json_response(
            {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        )

    # -- OpenAI Responses --------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        replica = self.replica
        try:
            await replica.admit()
            body = await self._body(request)
            if body.get("model") is None:  # vLLM serves a Responses request without a model
                body = {**body, "model": replica.options.served_model_name}
            try:
                check_responses_request(body)
            except AgentRequestError as exc:
                raise _invalid(exc) from None
            replica.check_model(body["model"])
            store = self._check_store(body)
            messages, conversion = self._responses_messages(body)
            prompt_ids = self._prompt(conversion, messages)
            max_tokens = replica.max_tokens(
                prompt_ids, body.get("max_output_tokens"), param="max_output_tokens"
            )
            request_id = body.get("request_id")
            if not isinstance(request_id, str) or not request_id:
                request_id = f"resp_{uuid.uuid4().hex}"
            run = await self._run(request_id, prompt_ids, max_tokens, body)
        except BadRequest as exc:
            return openai_error(exc)
        shape = ResponseShape(
            request_id,
            body,
            replica.lora_name(body) or replica.options.served_model_name,
            max_tokens,
        )
        keep: Keep = (lambda response: self._store(response, messages)) if store else None
        if body.get("stream"):
            frames = ResponsesFrames(shape, keep)
            return await replica.answer(run, replica.relay(request, run, frames))
        return await replica.answer(run, self._response(run, shape, keep))

    def _check_store(self, body: dict[str, Any]) -> bool:
        """Whether this response is kept (vLLM ignores ``store`` without its store)."""
        store = body.get("store") is not False
        enabled = self.replica.options.responses_store
        if body.get("background") and store and not enabled:
            raise BadRequest(
                "This vLLM engine does not support `store=True` and therefore does not support "
                "the background mode. To enable these features, set the environment variable "
                "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                400,
                "invalid_request_error",
                "background",
            )
        if body.get("background"):
            raise BadRequest(
                "The emulated replica does not run background responses.",
                501,
                "NotImplementedError",
                "background",
            )
        return store and enabled

    def _responses_messages(
        self, body: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], ChatConversion]:
        """The chat messages of a Responses request, a previous response's conversation
        first (vLLM's ``construct_input_messages``)."""
        previous_id = body.get("previous_response_id")
        previous = None
        if previous_id is not None:
            previous = self.stored.get(previous_id)
            if previous is None:
                raise BadRequest(
                    f"Response with id '{previous_id}' not found.",
                    404,
                    "invalid_request_error",
                    "response_id",
                )
        try:
            conversion = responses_to_chat(body)
        except AgentRequestError as exc:
            raise BadRequest(str(exc), param=exc.param) from None
        messages = conversion.messages
        if previous is not None:
            response, earlier = previous
            history = [copy.deepcopy(m) for m in earlier if m.get("role") != "system"]
            for item in response["output"]:
                if item.get("type") == "message":
                    history += [{"role": "assistant", "content": part["text"]}
                                for part in item["content"]]  # fmt: skip
            first = 1 if body.get("instructions") else 0  # the new instructions stay first
            messages = messages[:first] + history + messages[first:]
        return messages, conversion

    def _store(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.stored[response["id"]] = (response, copy.deepcopy(messages))
        self.stored.move_to_end(response["id"])
        while len(self.stored) > self.replica.options.responses_store_size:
            self.stored.popitem(last=False)

    async def _response(self, run: Run, shape: ResponseShape, keep: Keep) -> web.Response:
        last, token_ids = await self.replica.collect(run)
        text = self.replica.tokenizer.decode(token_ids)
        item = output_message(f"msg_{uuid.uuid4().hex}", text)
        response = shape.response(_status(last), [item], responses_usage(last, len(token_ids)))
        if keep is not None:
            keep(response)
        return web.Response(body=msgspec.json.encode(response), content_type="application/json")

    async def get_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        found = self.stored.get(response_id)
        if found is None:
            return openai_error(
                BadRequest(
                    f"Response with id '{response_id}' not found.",
                    404,
                    "invalid_request_error",
                    "response_id",
                )
            )
        return web.json_response(found[0])


def _status(last: RequestOutput) -> str:
    return "incomplete" if last.finish_reason == "length" else "completed"


class ResponseShape:
    """The fields of a ResponsesResponse that come from the request, as vLLM fills them."""

    def __init__(self, response_id: str, body: dict[str, Any], model: str, max_tokens: int):
        self.id, self.body, self.model, self.max_tokens = response_id, body, model, max_tokens
        self.created_at = int(time.time())

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        return token_path.response_object(
            self.id, self.created_at, self.body, self.model, status, output, usage,
            self.max_tokens,
        )  # fmt: skip


class MessagesFrames:
    """vLLM's Messages stream: message_start with the first engine result, one text block
    (started with the first text), message_delta and message_stop. No ping, no [DONE]."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.started = False

    def head(self) -> bytes:
        return b""

    def opening(self, first: RequestOutput) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            # From vLLM's first chat chunk, whose usage has no cache details yet.
            "usage": {"input_tokens": first.num_prompt_tokens, "output_tokens": 0},
        }
        return sse("message_start", {"type": "message_start", "message": message})

    def step(self, text: str, output: RequestOutput) -> bytes:
        if not text:
            return b""
        frames = b""
        if not self.started:
            self.started = True
            block = {"type": "text", "text": ""}
            start = {"type": "content_block_start", "index": 0, "content_block": block}
            frames = sse("content_block_start", start)
        delta = {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": text}}  # fmt: skip
        return frames + sse("content_block_delta", delta)

    def closing(self, last: RequestOutput, generated: int) -> bytes:
        frames = b""
        if self.started:
            frames = sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(last.finish_reason), "stop_sequence": None},
            "usage": anthropic_usage(last, generated),
        }
        return frames + sse("message_delta", delta) + sse("message_stop", {"type": "message_stop"})


class ResponsesFrames:
    """vLLM's Responses stream: response.created and response.in_progress at once, the
    message item opened with the first text, a delta per engine step, the item closed, then
    response.completed with the whole response; sequence numbers from 0. No [DONE]."""

    def __init__(self, shape: ResponseShape, keep: Keep) -> None:
        self.shape, self.keep = shape, keep
        self.sequence = 0
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {**fields, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        return sse(kind, event)

    def head(self) -> bytes:
        response = self.shape.response("in_progress", [], None)
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def opening(self, first: RequestOutput) -> bytes:
        return b""

    def step(self, text: str, output: RequestOutput) -> bytes:
        if not text:
            return b""
        frames = b""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if not self.text:
            item = output_message(self.item_id, "", "in_progress")
            frames = self._event(
                "response.output_item.added", item=item, output_index=0
            ) + self._event("response.content_part.added", part=output_text("", []), **where)
        self.text.append(text)
        return frames + self._event("response.output_text.delta", delta=text, logprobs=[], **where)

    def closing(self, last: RequestOutput, generated: int) -> bytes:
        text = "".join(self.text)
        frames = b""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        output = []
        if text:
            item = output_message(self.item_id, text)
            frames = (
                self._event("response.output_text.done", text=text, logprobs=[], **where)
                + self._event("response.content_part.done", part=output_text(text, None), **where)
                + self._event("response.output_item.done", item=item, output_index=0)
            )
            output = [item]
        response = self.shape.response(_status(last), output, responses_usage(last, generated))
        if self.keep is not None:
            self.keep(response)
        return frames + self._event("response.completed", response=response)
