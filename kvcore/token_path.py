"""Tokens sent once: a tokenized request as vLLM's token-in request, its answer in the client's API.

With ``routing.send_tokens`` the router sends a request it has tokenized to the replica's
``/inference/v1/generate`` (vLLM 0.32, ``--enable-scale-out``) as the prompt's token ids and
resolved sampling parameters, so the replica neither renders nor tokenizes the conversation
again; the answer (``output_mode: text``) is written back as the API the client spoke: chat
completions, Anthropic Messages or OpenAI Responses, whole or streamed, as vLLM's own
endpoints write them for an answer of plain text.

Only what the generate path answers exactly goes that way. The replica's chat layer, which the
token path skips, also parses tool calls and reasoning, applies structured outputs, stores
Responses for ``previous_response_id`` and computes logprobs per API; a request that needs any
of that (or names a field this module does not map) goes as text, and ``blocker`` says why.

Pure: the caller passes the clock's ``created`` and the ids it wants in answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

GENERATE_PATH = "/inference/v1/generate"

# vLLM's neutral sampling defaults (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS), under the
# replica's own defaults (its model's generation config: ``replica_token_path``) and the
# client's values.
NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}

# Fields each API's token path maps exactly; a request with any other field goes as text.
# Rendering-only fields (messages, chat_template_kwargs, ...) the router has rendered already.
_CHAT_FIELDS = frozenset(
    {
        "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
        *NEUTRAL, "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens",
        "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
        "user", "cache_salt", "priority", "chat_template_kwargs", "add_generation_prompt",
        "continue_final_message", "n", "logprobs", "echo", "parallel_tool_calls", "metadata",
        "store", "service_tier",
    }
)  # fmt: skip
_MESSAGES_FIELDS = frozenset(
    {
        "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
        "stop_sequences", "stream", "metadata", "cache_salt", "chat_template_kwargs",
        "service_tier",
    }
)  # fmt: skip
_RESPONSES_FIELDS = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_k",
        "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stream",
        "store", "metadata", "user", "cache_salt", "priority", "seed", "stop",
        "parallel_tool_calls", "service_tier", "truncation", "chat_template_kwargs",
    }
)  # fmt: skip
_FIELDS = {"chat": _CHAT_FIELDS, "messages": _MESSAGES_FIELDS, "responses": _RESPONSES_FIELDS}
APIS = frozenset(_FIELDS)


def blocker(api: str, body: Mapping[str, Any]) -> str | None:
    """Why this request cannot go as tokens (it goes as text), or None."""
    fields = _FIELDS.get(api)
    if fields is None:
        return f"the {api} API"
    unmapped = sorted(k for k in body if k not in fields and body[k] is not None)
    if unmapped:
        return f"the field {unmapped[0]!r}"  # tools, response_format, thinking, ...
    if api == "chat":
        if body.get("n") not in (None, 1):
            return "n > 1"
        if body.get("logprobs") or body.get("echo"):
            return "logprobs or echo"
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("continuous_usage_stats"):
            return "continuous usage stats"
    if api == "responses" and body.get("store", True) is not False:
        # vLLM stores a response for previous_response_id in its chat layer only.
        return "a stored response (store is not false)"
    if api == "responses" and body.get("truncation") not in (None, "disabled"):
        return "truncation"
    return None


@dataclass(frozen=True)
class ReplicaTokenPath:
    """What a replica's token path needs to know of it, for one model."""

    max_model_len: int
    # Its sampling defaults (the model's generation config, or --override-generation-config),
    # where they differ from vLLM's neutral ones; max_tokens only from max_new_tokens.
    defaults: Mapping[str, Any] = field(default_factory=dict)


# What the probe asks the replica to render: a request that sets no sampling value.
PROBE_RENDER_PATH = "/v1/chat/completions/render"


# A short conversation with every role a template must place: the router renders it too, and
# a replica that renders it otherwise (a --chat-template of its own) is sent text only.
PROBE_MESSAGES = (
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "Name a colour."},
)


def probe_render_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [dict(m) for m in PROBE_MESSAGES]}


def replica_token_path(render: Mapping[str, Any], max_model_len: int) -> ReplicaTokenPath | None:
    """From the replica's render of ``probe_render_body`` (a GenerateRequest): its sampling
    defaults as it resolves them; None where it has a reasoning parser (its chat layer splits
    reasoning from content, which a generate answer does not) or the render is not one."""
    if render.get("reasoning_parser_kwargs") is not None:
        return None
    params, ids = render.get("sampling_params"), render.get("token_ids")
    if not isinstance(params, dict) or not isinstance(ids, list) or not ids:
        return None
    defaults = {k: params[k] for k, neutral in NEUTRAL.items() if params.get(k, neutral) != neutral}
    stop_ids = params.get("stop_token_ids")
    if isinstance(stop_ids, list) and stop_ids:  # a model's own (gpt-oss's </call>)
        defaults["stop_token_ids"] = stop_ids
    max_tokens = params.get("max_tokens")
    if isinstance(max_tokens, int) and max_tokens < max_model_len - len(ids):
        defaults["max_tokens"] = max_tokens  # the generation config's max_new_tokens
    return ReplicaTokenPath(max_model_len, defaults)


def asked_max_tokens(api: str, body: Mapping[str, Any]) -> int | None:
    """The output limit the client set, under each API's name for it."""
    if api == "messages":
        value = body.get("max_tokens")
    elif api == "responses":
        value = body.get("max_output_tokens")
    else:
        value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def sampling_params(
    api: str,
    body: Mapping[str, Any],
    defaults: Mapping[str, Any],
    prompt_tokens: int,
    max_model_len: int,
) -> dict[str, Any]:
    """The request's SamplingParams as vLLM's endpoint for ``api`` resolves them: the client's
    value, else the model's default, else vLLM's neutral one; ``max_tokens`` clamped to the
    context left (vLLM's get_max_tokens) and left out when no one set it (the generate
    endpoint then defaults it alike)."""
    if api == "messages":
        asked = {
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "top_k": body.get("top_k"),
            "stop": body.get("stop_sequences"),
            "max_tokens": body.get("max_tokens"),
        }
    elif api == "responses":
        asked = {k: body.get(k) for k in (*NEUTRAL, "seed", "stop")}
        asked["max_tokens"] = body.get("max_output_tokens")
    else:
        asked = {
            k: body.get(k)
            for k in (
                *NEUTRAL, "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens",
                "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output",
            )
        }  # fmt: skip
        asked["max_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens")
    params: dict[str, Any] = {
        name: asked[name] if asked.get(name) is not None else defaults.get(name, neutral)
        for name, neutral in NEUTRAL.items()
    }
    for name, value in asked.items():
        if name not in NEUTRAL and name != "max_tokens" and value is not None:
            params[name] = value
    stop = params.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    default_stop_ids = defaults.get("stop_token_ids")
    if default_stop_ids and api != "responses":  # chat (and Messages, through chat) merge them
        asked_ids = params.get("stop_token_ids") or []
        params["stop_token_ids"] = list(dict.fromkeys([*asked_ids, *default_stop_ids]))
    limit = asked["max_tokens"] if asked["max_tokens"] is not None else defaults.get("max_tokens")
    if limit is not None:
        params["max_tokens"] = min(int(limit), max(0, max_model_len - prompt_tokens))
    return params


# Content parts a chat message may carry on the token path: text only. An image (or audio,
# video, file) becomes multimodal features the generate request would have to carry.
_TEXT_PARTS = frozenset(("text", "input_text", "output_text", "refusal"))


def media_in(messages: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any message of a (chat) conversation carries a part that is not text."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                    return True
    return False


def generate_body(
    model: str,
    token_ids: list[int],
    params: Mapping[str, Any],
    *,
    stream: bool,
    cache_salt: str | None = None,
    priority: int | None = None,
) -> bytes:
    """The body of a POST to GENERATE_PATH: text out (the replica detokenizes, as it would
    for its chat endpoint), a stream's usage at its end."""
    body: dict[str, Any] = {
        "model": model,
        "token_ids": token_ids,
        "sampling_params": dict(params),
        "output_mode": "text",
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if priority:
        body["priority"] = priority
    return msgspec.json.encode(body)


# -- the answer, in the client's API ----------------------------------------------------------


@dataclass
class AnswerIds:
    """What the answer is called and when it was made (the caller's clock and ids)."""

    id: str  # chat: chatcmpl-..., Messages: msg_..., Responses: resp_...
    created: int
    item_id: str = ""  # Responses: the output message item's


@dataclass
class _Progress:
    """What the generate answer said so far."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None


def _anthropic_stop(finish_reason: str | None, stop_reason: Any) -> tuple[str | None, str | None]:
    """vLLM's (stop_reason, stop_sequence) for an answer without tool calls."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason != "stop":
        return None, None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _anthropic_usage(usage: Mapping[str, Any] | None) -> dict[str, int]:
    """vLLM's Messages usage: cache hits apart from input_tokens."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    out = {"input_tokens": prompt, "output_tokens": int(usage.get("completion_tokens") or 0)}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = int(details.get("cached_tokens") or 0)
        created = int(details.get("created_cache_tokens") or 0)
        out.update(
            input_tokens=max(0, prompt - cached - created),
            cache_creation_input_tokens=created,
            cache_read_input_tokens=cached,
        )
    return out


def responses_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """A ResponsesResponse's usage as vLLM 0.32 fills it."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + completion,
    }


def _responses_usage(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """``responses_usage`` from an OpenAI-style usage object (the generate answer's)."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details")
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    prompt = int(usage.get("prompt_tokens") or 0)
    return responses_usage(prompt, int(usage.get("completion_tokens") or 0), cached)


def _number(value: Any, default: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else default


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def output_message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The one output item of an answer of plain text (no content part when it is empty)."""
    return {
        "id": item_id,
        "content": [output_text(text, None)] if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response_object(
    response_id: str,
    created_at: int,
    body: Mapping[str, Any],
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    max_output_tokens: int | None,
) -> dict[str, Any]:
    """A ResponsesResponse as vLLM 0.32 fills it from the request ``body`` (tool_choice is
    "none" without tools, as its request model makes it)."""
    tools = body.get("tools") or []
    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": _number(body.get("temperature"), 1.0),
        "tool_choice": body.get("tool_choice", "auto") if tools else "none",
        "tools": tools,
        "top_p": _number(body.get("top_p"), 1.0),
        "background": False,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "status": status,
        "text": body.get("text"),
        "top_logprobs": None,
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "presence_penalty": _number(body.get("presence_penalty"), 0.0),
        "frequency_penalty": _number(body.get("frequency_penalty"), 0.0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def _sse(kind: str, obj: Mapping[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(obj) + b"\n\n"


def _data(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class Answer:
    """The generate endpoint's answer in, the client's API out: ``whole`` for a whole answer,
    ``feed``/``end`` for a stream (SSE bytes in any cut, whole events out)."""

    def __init__(
        self,
        api: str,
        body: Mapping[str, Any],
        ids: AnswerIds,
        *,
        prompt_tokens: int,
        max_tokens: int | None,
        error_event: Callable[[str, int], bytes],
    ) -> None:
        if api not in APIS:
            raise ValueError(f"no token path for the {api} API")
        self.api = api
        self.body = body
        self.ids = ids
        self.model = str(body.get("model") or "")
        self.prompt_tokens = prompt_tokens  # Messages: message_start's input_tokens
        self.max_tokens = max_tokens  # as resolved (Responses echoes it)
        # A stream's error in the API's shape: (message, the sequence number it takes).
        self._error_event = error_event
        self._pending = b""
        self._progress = _Progress()
        self._opened = False  # the stream's first events were written
        self._text_started = False
        self._closed = False
        self._sequence = 0  # Responses: the next sequence_number

    # -- a whole answer -----------------------------------------------------------------------

    def whole(self, data: bytes) -> bytes:
        """A whole generate answer's JSON in, the client API's JSON out; an answer that is not a
        generate answer comes back as it was (an error, relayed as the replica's)."""
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return data
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return data
        choice = choices[0]
        progress = self._progress
        progress.text = [str(choice.get("text") or "")]
        progress.finish_reason = choice.get("finish_reason") or "stop"
        progress.stop_reason = choice.get("stop_reason")
        usage = obj.get("usage")
        progress.usage = usage if isinstance(usage, dict) else None
        if self.api == "chat":
            return msgspec.json.encode(self._chat_completion())
        if self.api == "messages":
            return msgspec.json.encode(self._message())
        return msgspec.json.encode(self._response(self._status(), self._output()))

    def _chat_completion(self) -> dict[str, Any]:
        p = self._progress
        return {
            "id": self.ids.id,
            "object": "chat.completion",
            "created": self.ids.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "".join(p.text),
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": p.finish_reason,
                    "stop_reason": p.stop_reason,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": p.usage,
        }

    def _message(self) -> dict[str, Any]:
        p = self._progress
        stop, sequence = _anthropic_stop(p.finish_reason, p.stop_reason)
        text = "".join(p.text)
        return {
            "id": self.ids.id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}] if text else [],
            "model": self.model,
            "stop_reason": stop,
            "stop_sequence": sequence,
            "usage": _anthropic_usage(p.usage),
        }

    def _status(self) -> str:
        return "incomplete" if self._progress.finish_reason == "length" else "completed"

    def _output(self) -> list[dict[str, Any]]:
        text = "".join(self._progress.text)
        return [output_message(self.ids.item_id, text, "completed")] if text else []

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        usage = _responses_usage(self._progress.usage) if status != "in_progress" else None
        return response_object(
            self.ids.id, self.ids.created, self.body, self.model, status, output, usage,
            self.max_tokens,
        )  # fmt: skip

    # -- a stream -----------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """Generate SSE bytes in; the client API's whole events out."""
        self._pending += data
        out: list[bytes] = []
        while True:
            cut = self._pending.find(b"\n\n")
            if cut < 0:
                break
            event, self._pending = self._pending[:cut], self._pending[cut + 2 :]
            out.append(self._event(event))
        return b"".join(out)

    def end(self) -> bytes:
        """What is left once the replica's stream ended: an unterminated last event."""
        rest, self._pending = self._pending.strip(), b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        start = event.find(b"data:")
        if start < 0 or self._closed:
            return b""
        payload = event[start + 5 :].strip()
        if payload == b"[DONE]":
            return self._done()
        try:
            obj = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return self._error("The replica sent an event the router cannot read.")
        if not isinstance(obj, dict) or "error" in obj:
            error = obj.get("error") if isinstance(obj, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            return self._error(str(message or "The replica failed mid-stream."))
        out = self._open()
        progress = self._progress
        usage = obj.get("usage")
        if isinstance(usage, dict):
            progress.usage = usage
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            text = choice.get("text")
            finish = choice.get("finish_reason")
            if finish is not None:
                progress.finish_reason = finish
                progress.stop_reason = choice.get("stop_reason")
            text = text if isinstance(text, str) else ""
            if self.api == "chat":  # the last text and the finish in one chunk, as vLLM
                if text or finish is not None:
                    self._progress.text.append(text)
                    delta = {"content": text} if text else {}
                    out += self._chat_chunk(delta, finish, choice.get("stop_reason"))
            elif text:
                out += self._text_delta(text)
        if self.api == "chat" and isinstance(usage, dict) and not obj.get("choices"):
            out += _data(self._chunk_head([], usage=usage))
        return out

    def _open(self) -> bytes:
        if self._opened:
            return b""
        self._opened = True
        if self.api == "chat":
            return self._chat_chunk({"role": "assistant", "content": ""}, None)
        if self.api == "messages":
            message: dict[str, Any] = {
                "id": self.ids.id, "type": "message", "role": "assistant", "content": [],
                "model": self.model, "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
            }  # fmt: skip
            return _sse("message_start", {"type": "message_start", "message": message})
        response = self._response("in_progress", [])
        return self._responses_event("response.created", response=response) + (
            self._responses_event("response.in_progress", response=response)
        )

    def _text_delta(self, text: str) -> bytes:
        out = b""
        first = not self._text_started
        self._text_started = True
        self._progress.text.append(text)
        if self.api == "messages":
            if first:
                block = {"type": "text", "text": ""}
                start = {"type": "content_block_start", "content_block": block, "index": 0}
                out = _sse("content_block_start", start)
            delta = {"type": "content_block_delta",
                     "delta": {"type": "text_delta", "text": text}, "index": 0}  # fmt: skip
            return out + _sse("content_block_delta", delta)
        where = {"item_id": self.ids.item_id, "output_index": 0, "content_index": 0}
        if first:
            item = output_message(self.ids.item_id, "", "in_progress")
            out = self._responses_event(
                "response.output_item.added", item=item, output_index=0
            ) + self._responses_event(
                "response.content_part.added", part=output_text("", []), **where
            )
        return out + self._responses_event(
            "response.output_text.delta", delta=text, logprobs=[], **where
        )

    def _done(self) -> bytes:
        """The replica's [DONE]: the client API's closing events."""
        self._closed = True
        out = self._open()
        p = self._progress
        if self.api == "chat":
            return out + b"data: [DONE]\n\n"
        if self.api == "messages":
            if self._text_started:
                out += _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            stop, sequence = _anthropic_stop(p.finish_reason, p.stop_reason)
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": sequence},
                "usage": _anthropic_usage(p.usage),
            }
            return (
                out + _sse("message_delta", delta) + _sse("message_stop", {"type": "message_stop"})
            )
        text = "".join(p.text)
        if text:
            where = {"item_id": self.ids.item_id, "output_index": 0, "content_index": 0}
            item = output_message(self.ids.item_id, text, "completed")
            out += (
                self._responses_event("response.output_text.done", text=text, logprobs=[], **where)
                + self._responses_event(
                    "response.content_part.done", part=output_text(text, None), **where
                )
                + self._responses_event("response.output_item.done", item=item, output_index=0)
            )
        response = self._response(self._status(), self._output())
        return out + self._responses_event("response.completed", response=response)

    def _error(self, message: str) -> bytes:
        """The stream ends with the error in the client API's shape (after what was sent)."""
        self._closed = True
        sequence = self._sequence
        self._sequence += 1
        return self._error_event(message, sequence)

    def _chunk_head(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.ids.id,
            "object": "chat.completion.chunk",
            "created": self.ids.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _chat_chunk(
        self, delta: dict[str, Any], finish_reason: str | None, stop_reason: Any = None
    ) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return _data(self._chunk_head([choice]))

    def _responses_event(self, kind: str, **fields: Any) -> bytes:
        event = {**fields, "sequence_number": self._sequence, "type": kind}
        self._sequence += 1
        return _sse(kind, event)
