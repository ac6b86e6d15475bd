"""Mid-stream failover for the agent APIs: a Messages or Responses stream resumed elsewhere.

Like ``resume.StreamTranscript`` for chat, an ``AgentStreamTranscript`` sits between the
replica's stream and the client, forwards whole events only and remembers the text sent. When
the replica fails mid-stream, the stream is continued on another replica through its chat
completions endpoint: the conversation as vLLM converted it (``ParsedRequest.messages``) with
the partial answer as the assistant message to continue (vLLM does not continue a trailing
assistant message in either agent API, its chat endpoint does). The continuation's chat chunks
are written into the client's stream as the client's API's own events: more text deltas in the
open content block (Messages) or output text part (Responses), then the closing events with
the whole answer's usage (``message_delta`` + ``message_stop``; ``response.completed`` with
the response, its text whole). Numbering is kept: the same block index, item id and the next
``sequence_number``. One well-formed stream, nothing repeated, nothing lost.

Only text is resumed: a stream that has sent a tool call or reasoning, or that asked for
structured output, is ended with an error event in its API's shape as before. Pure: no I/O.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec

from .openai_request import ParsedRequest
from .sse import sse_error, whole_events

_decode = msgspec.json.decode
_encode = msgspec.json.encode
CONTINUATION_PATH = "/v1/chat/completions"
# Chat finish reasons as each API names them.
_MESSAGES_STOP = {"stop": "end_turn", "length": "max_tokens"}
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "cache_salt")


def agent_resume_blocker(body: dict[str, Any], api: str) -> str | None:
    """Why a streamed agent request could not be continued elsewhere, or None."""
    if not body.get("stream"):
        return "not streamed"
    if api == "messages":
        config = body.get("output_config")
        if isinstance(config, dict) and config.get("format") is not None:
            return "structured output (output_config.format)"
        return None
    if body.get("previous_response_id"):
        return "its history is stored on the replica (previous_response_id)"
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "structured output (text.format)"
    return None


def agent_continuation_body(
    body: dict[str, Any],
    parsed: ParsedRequest,
    transcript: AgentStreamTranscript,
    messages: list[dict[str, Any]],
) -> bytes | None:
    """The chat request that continues ``transcript`` elsewhere, ``messages`` being the
    conversation as the replica rendered it (``prompt_keys.rendered_messages``); None when
    every token the request asked for was sent."""
    sent = transcript.generated_tokens
    limit = body.get("max_tokens" if parsed.api == "messages" else "max_output_tokens")
    new: dict[str, Any] = {"model": parsed.model}
    if isinstance(limit, int) and not isinstance(limit, bool):
        if limit - sent < 1:
            return None
        new["max_tokens"] = limit - sent
    options = parsed.chat_options or {}
    messages = list(messages)
    generated = transcript.generated_text
    last = messages[-1] if messages else None
    if options.get("continue_final_message") and isinstance(last, dict):
        messages[-1] = {**last, "content": (last.get("content") or "") + generated}
    else:
        messages.append({"role": "assistant", "content": generated})
    new["messages"] = messages
    new.update(continue_final_message=True, add_generation_prompt=False, stream=True)
    new["stream_options"] = {"include_usage": True}
    new["add_special_tokens"] = parsed.add_special_tokens
    if options.get("tools"):
        # Rendered as the first replica rendered them; text only from here (no tool parsing).
        new["tools"], new["tool_choice"] = options["tools"], "none"
    for key in ("chat_template_kwargs", "reasoning_effort"):
        if options.get(key) is not None:
            new[key] = options[key]
    for key in _SAMPLING:
        if body.get(key) is not None:
            new[key] = body[key]
    if parsed.api == "messages" and body.get("stop_sequences"):
        new["stop"] = body["stop_sequences"]
    return _encode(new)


class AgentStreamTranscript:
    """The client's view of one streamed Messages or Responses answer, across replicas."""

    def __init__(self, api: str) -> None:
        self.api = api
        self._pending = b""
        self._text: list[str] = []
        self.events = 0  # text deltas forwarded (vLLM sends one per engine step)
        self.finished = False  # the answer's last events were forwarded
        self.done = False
        self.blocker: str | None = None
        self.resumes = 0
        self._continuing = False
        self._tokens_before_resume = 0
        self._finish_reason: str | None = None
        self._continuation_usage: dict[str, Any] | None = None
        # What the client's stream holds open, to continue in or close.
        self._head: dict[str, Any] | None = None  # message_start's message / the response
        self._block: int | None = None  # Messages: the open text block's index
        self._blocks = 0  # Messages: content blocks started
        self._item: dict[str, Any] | None = None  # Responses: the open message item
        self._part_open = False  # Responses: its output_text part is open
        self._sequence = -1  # Responses: the last sequence_number sent
        self.usage: dict[str, Any] | None = None  # the whole answer's, as the client got it

    @property
    def generated_text(self) -> str:
        return "".join(self._text)

    @property
    def generated_tokens(self) -> int:
        return self.events

    def feed(self, data: bytes) -> bytes:
        """Bytes from the replica in; the whole events to send to the client out."""
        events, self._pending = whole_events(self._pending, data)
        out = []
        for event in events:
            if event.strip():
                forwarded = self._continued(event) if self._continuing else self._observed(event)
                if forwarded:
                    out.append(forwarded)
        return b"".join(out)

    def end(self) -> bytes:
        rest, self._pending = self._pending.rstrip(b"\r\n"), b""
        return self.feed(rest + b"\n\n") if rest.strip() else b""

    def start_continuation(self) -> None:
        self._pending = b""
        self._continuing = True
        self._tokens_before_resume = self.events
        self._finish_reason = None
        self._continuation_usage = None
        self.resumes += 1

    def resumable(self) -> bool:
        return (
            self.blocker is None and self._head is not None and not self.finished and not self.done
        )

    @property
    def response_id(self) -> str | None:
        """A Responses stream's id, from its whole response.created event."""
        found = (self._head or {}).get("id") if self.api == "responses" else None
        return found if isinstance(found, str) else None

    def closing(self) -> bytes:
        """A Messages stream that sent its message_delta gets the message_stop it lacks; a
        Responses stream whose text was done but not its response an error event (its
        response.completed cannot be rebuilt from what was seen)."""
        if self.api == "messages" and self.finished:
            self.done = True
            return self._event("message_stop")
        return self.error_event("The replica ended the stream before its last event.")

    def error_event(self, message: str) -> bytes:
        """This stream's end with an error: its API's error event, numbered after its own."""
        self.done = True
        self._sequence += 1
        return sse_error(message, api=self.api, sequence_number=self._sequence)

    def length_finish(self) -> bytes:
        """The closing events of a stream that reached its token limit."""
        self._finish_reason = "length"
        return self._close()

    # -- the first replica's events: observed, forwarded untouched ------------------------

    def _observed(self, event: bytes) -> bytes:
        obj = _data(event)
        if obj is None:
            return event + b"\n\n"
        kind = obj.get("type")
        if self.api == "messages":
            self._observe_message_event(kind, obj)
        else:
            self._observe_response_event(kind, obj)
        return event + b"\n\n"

    def _observe_message_event(self, kind: Any, obj: dict[str, Any]) -> None:
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            self._head = obj["message"]
        elif kind == "content_block_start":
            self._blocks += 1
            block = obj.get("content_block")
            if not isinstance(block, dict) or block.get("type") != "text":
                self.blocker = "tool use or thinking in the stream"
            self._block = obj.get("index") if isinstance(obj.get("index"), int) else None
        elif kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                self._add_text(delta.get("text"))
        elif kind == "content_block_stop":
            self._block = None
        elif kind in ("message_delta", "message_stop"):
            self.finished = True
            self.done = self.done or kind == "message_stop"
            if kind == "message_delta" and isinstance(obj.get("usage"), dict):
                self.usage = _openai_usage(obj["usage"])
        elif kind == "error":
            self.blocker = "the replica sent an error"

    def _observe_response_event(self, kind: Any, obj: dict[str, Any]) -> None:
        sequence = obj.get("sequence_number")
        if isinstance(sequence, int):
            self._sequence = sequence
        if kind == "response.created" and isinstance(obj.get("response"), dict):
            self._head = obj["response"]
        elif kind == "response.output_item.added":
            item = obj.get("item")
            if not isinstance(item, dict) or item.get("type") != "message":
                self.blocker = "a tool call or reasoning in the stream"
            self._item = item if isinstance(item, dict) else None
        elif kind == "response.content_part.added":
            self._part_open = True
        elif kind == "response.output_text.delta":
            self._add_text(obj.get("delta"))
        elif kind in ("response.output_text.done", "response.completed"):
            self.finished = True  # the text is whole: nothing left to continue
            self.done = self.done or kind == "response.completed"
            if kind == "response.completed":
                response = obj.get("response")
                usage = response.get("usage") if isinstance(response, dict) else None
                if isinstance(usage, dict):
                    self.usage = _openai_usage(usage)
        elif kind in ("error", "response.failed", "response.incomplete"):
            self.blocker = "the replica sent an error"

    def _add_text(self, text: Any) -> None:
        if isinstance(text, str) and text:
            self._text.append(text)
            self.events += 1

    # -- a continuation's chat chunks: written as the client's API's events ---------------

    def _continued(self, event: bytes) -> bytes:
        if not event.startswith(b"data:"):
            return b""
        payload = event[5:].strip()
        if self.done:
            return b""  # ended already (an error, below): nothing more reaches the client
        if payload == b"[DONE]":
            return self._close()
        try:
            obj = _decode(payload)
        except msgspec.DecodeError:
            self.blocker = "an event the router cannot read"
            return b""
        if not isinstance(obj, dict) or "error" in obj:
            # Not a finish: the client's stream ends with the error, not a closing event.
            self.blocker = "the replica sent an error"
            return self.error_event("The replica resuming this stream failed.")
        if isinstance(obj.get("usage"), dict):
            self._continuation_usage = obj["usage"]
        out = []
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                self.blocker = "tool calls or reasoning in the continuation"
            text = delta.get("content")
            if isinstance(text, str) and text:
                out.append(self._text_delta(text))
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _text_delta(self, text: str) -> bytes:
        opening = self._open()
        self._add_text(text)
        if self.api == "messages":
            delta = {"type": "text_delta", "text": text}
            return opening + self._event("content_block_delta", index=self._block, delta=delta)
        item_id = self._item_id()
        return opening + self._event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open(self) -> bytes:
        """The events that open a text block (part) when the first replica had not yet."""
        if self.api == "messages":
            if self._block is not None:
                return b""
            self._block = self._blocks
            self._blocks += 1
            block = {"type": "text", "text": ""}
            return self._event("content_block_start", index=self._block, content_block=block)
        out = b""
        if self._item is None:
            self._item = {"type": "message", "id": f"msg_{self._response_id()}", "role": "assistant",
                          "content": [], "status": "in_progress"}  # fmt: skip
            out += self._event("response.output_item.added", output_index=0, item=self._item)
        if not self._part_open:
            self._part_open = True
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added",
                item_id=self._item_id(),
                output_index=0,
                content_index=0,
                part=part,
            )
        return out

    def _close(self) -> bytes:
        """The answer's closing events, with the whole answer's usage."""
        opening = self._open()
        self.finished = self.done = True
        usage = self._whole_usage()
        if self.api == "messages":
            head = self._head or {}
            input_tokens = (head.get("usage") or {}).get("input_tokens", usage["prompt_tokens"])
            stop = _MESSAGES_STOP.get(self._finish_reason or "stop", "end_turn")
            totals = {"input_tokens": input_tokens, "output_tokens": usage["completion_tokens"]}
            self.usage = {
                "prompt_tokens": input_tokens,
                "completion_tokens": totals["output_tokens"],
            }
            return b"".join(
                (
                    opening,
                    self._event("content_block_stop", index=self._block),
                    self._event(
                        "message_delta",
                        delta={"stop_reason": stop, "stop_sequence": None},
                        usage=totals,
                    ),
                    self._event("message_stop"),
                )
            )
        text = self.generated_text
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = {**(self._item or {}), "status": "completed", "content": [part]}
        response = copy.deepcopy(self._head or {})
        length = self._finish_reason == "length"
        response.update(
            status="incomplete" if length else "completed",
            incomplete_details={"reason": "max_output_tokens"} if length else None,
            output=[item],
            usage={
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            },
        )
        self.usage = usage
        item_id = self._item_id()
        return b"".join(
            (
                opening,
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                ),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.completed", response=response),
            )
        )

    def _whole_usage(self) -> dict[str, int]:
        """The answer's usage as the client sees it: the continuation's prompt held the text
        sent before it, which the client counts as output."""
        before = self._tokens_before_resume
        usage = self._continuation_usage or {}
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        added = completion if isinstance(completion, int) else self.events - before
        return {
            "prompt_tokens": max(0, prompt - before) if isinstance(prompt, int) else 0,
            "completion_tokens": before + added,
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj: dict[str, Any] = {"type": kind, **fields}
        if self.api == "responses":
            self._sequence += 1
            obj["sequence_number"] = self._sequence
        return b"event: " + kind.encode() + b"\ndata: " + _encode(obj) + b"\n\n"

    def _item_id(self) -> str:
        item_id = (self._item or {}).get("id")
        return item_id if isinstance(item_id, str) else ""

    def _response_id(self) -> str:
        found = (self._head or {}).get("id")
        return found if isinstance(found, str) else "resumed"


def _data(event: bytes) -> dict[str, Any] | None:
    """The JSON object of an SSE event's data line, or None."""
    start = event.find(b"data:")
    if start < 0:
        return None
    try:
        obj = _decode(event[start + 5 :].strip())
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _openai_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """An agent API's usage in the names the router's accounting reads."""
    read = usage.get("cache_read_input_tokens") or 0
    created = usage.get("cache_creation_input_tokens") or 0
    return {
        "prompt_tokens": (usage.get("input_tokens") or 0) + read + created,
        "completion_tokens": usage.get("output_tokens") or 0,
    }
