"""Mid-stream failover: what a broken stream already sent, and the request that continues it.

A ``StreamTranscript`` sits between a replica's SSE stream and the client. It forwards only
whole events (so a stream cut mid-event never reaches the client half-written), and remembers
the text generated so far. When the replica fails mid-stream, ``continuation_body`` builds the
request that continues it on another replica: for completions the prompt plus the generated
text; for chat the partial assistant message continued (vLLM's ``continue_final_message`` with
``add_generation_prompt`` false); ``max_tokens`` less what was sent. The continuation's events
pass through the same transcript, which splices them into the client's stream: the first
stream's id, no second role chunk, usage that counts the whole answer.

Pure: no I/O. Re-tokenising ``prompt + generated text`` may split tokens differently from the
first replica's sampling; that is inherent to resuming from text, and the client still gets one
well-formed stream.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from .sse import sse_error, whole_events

_DONE = b"[DONE]"
_decode = msgspec.json.decode
_encode = msgspec.json.encode
# The text sent so far is kept joined: a token's text alone costs ~50 bytes of object header for
# a few characters, which made the transcript most of a long stream's router memory. Every
# _JOIN pieces become one run, every _JOIN runs one string: about a byte per character, and
# each character copied once per _JOIN * _JOIN tokens.
_JOIN = 16

# Request fields that make a continuation from text wrong or impossible.
_STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class Transcript(Protocol):
    """A stream that may be resumed: what the relay and the pipeline ask of it (chat's and
    completions' ``StreamTranscript``; the agent APIs' ``agent_resume.AgentStreamTranscript``)."""

    resumes: int
    blocker: str | None
    finished: bool
    done: bool
    usage: dict[str, Any] | None

    @property
    def response_id(self) -> str | None:
        """A Responses stream's id (its response.created's); None for other APIs."""
        ...

    @property
    def generated_tokens(self) -> int: ...

    def feed(self, data: bytes) -> bytes: ...

    def end(self) -> bytes: ...

    def start_continuation(self) -> None: ...

    def resumable(self) -> bool: ...

    def length_finish(self) -> bytes: ...

    def closing(self) -> bytes:
        """What a stream that finished without its last event still owes the client."""
        ...

    def error_event(self, message: str) -> bytes:
        """The event that ends this stream with an error (b"": the API's plain one)."""
        ...


def resume_blocker(body: dict[str, Any], chat: bool) -> str | None:
    """Why a streamed request could not be continued elsewhere, or None when it can."""
    if not body.get("stream"):
        return "not streamed"
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            return f"{key} > 1"
    if body.get("echo"):
        return "echo"
    for key in _STRUCTURED:
        value = body.get(key)
        if value is None:
            continue
        if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        return f"structured output ({key})"
    if body.get("structured_outputs") is not None:
        return "structured output"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return "prompt is not one string"
    return None


class StreamTranscript:
    """The client's view of one streamed answer, across the replicas that produced it."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._pending = b""
        # The text sent so far: joined runs, then the newest pieces (see _JOIN).
        self._text_runs: list[str] = []
        self._text_tail: list[str] = []
        self.events = (
            0  # content events forwarded: an upper bound on tokens is not known, see below
        )
        self.finished = False  # a finish_reason was forwarded
        self.done = False  # [DONE] was forwarded
        self.blocker: str | None = None  # set when what was streamed cannot be continued
        self.resumes = 0
        self._id: str | None = None
        self._tokens_before_resume = 0
        self._continuing = False
        # The last usage the client got (a continuation's counting the whole answer).
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None  # chat and completions have none to pin

    @property
    def generated_text(self) -> str:
        return "".join(self._text_runs) + "".join(self._text_tail)

    @property
    def generated_tokens(self) -> int:
        """Tokens sent so far, counted as events with output (vLLM sends one per step)."""
        return self.events

    def feed(self, data: bytes) -> bytes:
        """Bytes from the replica in; the whole events to send to the client out."""
        events, self._pending = whole_events(self._pending, data)
        out = []
        for event in events:
            if not event:
                continue
            forwarded = self._event(event)
            if forwarded is not None:
                out.append(forwarded + b"\n\n")
        return b"".join(out)

    def end(self) -> bytes:
        """The replica ended its stream: a last event without its blank line still counts."""
        rest, self._pending = self._pending.rstrip(b"\r\n"), b""
        return self.feed(rest + b"\n\n") if rest.strip() else b""

    def start_continuation(self) -> None:
        """The next bytes fed come from a continuation on another replica."""
        self._pending = b""
        self._continuing = True
        self._tokens_before_resume = self.events
        self.resumes += 1

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data:"):
            return event  # comments and other fields pass through untouched
        payload = event[5:].strip()
        if payload == _DONE:
            self.done = True
            return event
        try:
            obj = _decode(payload)
        except msgspec.DecodeError:
            self.blocker = "an event the router cannot read"
            return event
        if not isinstance(obj, dict):
            return event
        if "error" in obj:
            self.blocker = "the replica sent an error"
            return event
        if self._id is None and isinstance(obj.get("id"), str):
            self._id = obj["id"]
        rewritten = self._observe(obj)
        if not self._continuing:
            return event
        if rewritten is None:
            return None
        if self._id is not None:
            obj["id"] = self._id
        return b"data: " + _encode(obj)

    def _observe(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Track one chunk; None when a continuation's chunk must not reach the client."""
        usage = obj.get("usage")
        if self._continuing and isinstance(usage, dict):
            before = self._tokens_before_resume
            if isinstance(usage.get("completion_tokens"), int):
                usage["completion_tokens"] += before
            if isinstance(usage.get("prompt_tokens"), int):
                usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - before)
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return obj
        keep = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.blocker = "more than one choice"
            if self.chat:
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(delta, dict) and (
                    delta.get("tool_calls") or delta.get("reasoning_content")
                ):
                    self.blocker = "tool calls or reasoning in the stream"
                role_only = isinstance(delta, dict) and "role" in delta and not text
                if self._continuing and role_only and not choice.get("finish_reason"):
                    continue  # the client already has the role chunk
                if self._continuing and isinstance(delta, dict):
                    delta.pop("role", None)
            else:
                text = choice.get("text")
            keep = True
            if isinstance(text, str) and text:
                tail = self._text_tail
                tail.append(text)
                if len(tail) >= _JOIN:
                    runs = self._text_runs
                    runs.append("".join(tail))
                    tail.clear()
                    if len(runs) >= _JOIN:
                        runs[:] = ["".join(runs)]
                self.events += 1
            if choice.get("finish_reason"):
                self.finished = True
        if not keep and not isinstance(usage, dict):
            return None
        return obj

    def length_finish(self) -> bytes:
        """The last event and [DONE] of a stream that reached its max_tokens."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.chat:
            choice["delta"] = {}
            kind = "chat.completion.chunk"
        else:
            choice["text"] = ""
            kind = "text_completion"
        obj = {"id": self._id, "object": kind, "choices": [choice]}
        return b"data: " + _encode(obj) + b"\n\ndata: [DONE]\n\n"

    def resumable(self) -> bool:
        return self.blocker is None and not self.finished and not self.done

    def closing(self) -> bytes:
        return b""  # a finish_reason without [DONE] is whole enough for OpenAI's clients

    def error_event(self, message: str) -> bytes:
        return sse_error(message)


def continuation_body(
    body: dict[str, Any], chat: bool, transcript: StreamTranscript
) -> bytes | None:
    """The request that continues ``transcript`` elsewhere; None when nothing is left to do."""
    generated = transcript.generated_text
    sent = transcript.generated_tokens
    new = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - sent < 1:
                return None
            new[key] = limit - sent
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        new["min_tokens"] = max(0, min_tokens - sent)
    if chat:
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict):
            messages[-1] = _extend_message(last, generated)
        else:
            messages.append({"role": "assistant", "content": generated})
        new["messages"] = messages
        new["continue_final_message"] = True
        new["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            prompt = prompt[0]
        new["prompt"] = prompt + generated
    return _encode(new)


def _extend_message(message: dict[str, Any], text: str) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [*content, {"type": "text", "text": text}]}
    return {**message, "content": (content or "") + text}
