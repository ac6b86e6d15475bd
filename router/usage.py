"""The token usage a replica reports in its response: a JSON body's, or a stream's last one.

vLLM puts ``usage`` in a non-streamed answer always, and in a stream only as its last event
when the client asked for ``stream_options.include_usage``; ``prompt_tokens_details.
cached_tokens`` (the prefix-cache hit) only with ``--enable-prompt-tokens-details``. The router
and the endpoint picker both read it here.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The most bytes a usage object may take from its key to its closing brace (a few hundred in
# practice); ``_last_usage_object`` matches braces that far.
USAGE_SPAN = 4096
_KEY = b'"usage"'


class _Usage(msgspec.Struct):
    # Chat and completions.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None
    # Anthropic Messages (input_tokens less what was read from or written to the cache) and
    # OpenAI Responses (input_tokens all of the prompt, the cached part in its details).
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    input_tokens_details: dict[str, Any] | None = None


_usage_decoder = msgspec.json.Decoder(_Usage)
_USAGE_KEYS = (b'"usage":{', b'"usage": {')


def usage_of(data: bytes, sse: bool) -> dict[str, int] | None:
    """Token usage from a JSON response, or from the last SSE event that carries one:
    ``prompt``, ``completion`` and, when reported, ``cached`` tokens. Every API's shape:
    chat's and completions' usage, a Messages stream's ``message_delta``, a Responses
    stream's ``response.completed`` (whose usage is inside its response). The last usage
    object in ``data`` is read, so a stream's tail that starts mid-event still has it."""
    raw = _last_usage_object(data)
    if raw is None:
        return None
    try:
        usage = _usage_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    if usage.input_tokens is None and usage.output_tokens is None:
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        cached = (usage.prompt_tokens_details or {}).get("cached_tokens")
    else:  # an agent API's
        read, created = usage.cache_read_input_tokens, usage.cache_creation_input_tokens
        prompt = (usage.input_tokens or 0) + (read or 0) + (created or 0)
        completion = usage.output_tokens or 0
        details = usage.input_tokens_details or {}
        cached = read if read is not None else details.get("cached_tokens")
    out = {"prompt": prompt, "completion": completion}
    if isinstance(cached, int) and not isinstance(cached, bool):
        out["cached"] = cached
    return out


def _last_usage_object(data: bytes) -> bytes | None:
    """The bytes of the last ``"usage": {...}`` object in ``data`` (braces matched; a usage
    object holds no strings with braces), or None."""
    start = max(data.rfind(key) for key in _USAGE_KEYS)
    if start < 0:
        return None
    start = data.index(b"{", start)
    depth = 0
    for end in range(start, min(len(data), start + USAGE_SPAN)):
        byte = data[end]
        if byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return data[start : end + 1]
    return None


def cached_tokens_of(data: bytes, sse: bool) -> int | None:
    """The prompt tokens the engine reused from its prefix cache, if the response says."""
    usage = usage_of(data, sse)
    return usage.get("cached") if usage else None


class StreamTail:
    """A stream's last usage object, found as its chunks pass; nothing else of the stream is
    kept. Per open stream that is a few hundred bytes at most, where keeping the stream's last
    KiB (the usage event and what follows it) cost ~10 KiB of chunk objects (issue 39)."""

    __slots__ = ("_carry", "_last", "_open")

    def __init__(self) -> None:
        self._last: bytes | None = None  # the last complete usage object
        self._open = b""  # from the last usage key on, while its object is not closed yet
        self._carry = b""  # the stream's last bytes: a key may straddle two chunks

    def add(self, chunk: bytes) -> None:
        # Searched where it lies, not copied: a chunk is copied only from a usage key on.
        tail = len(_KEY) - 1
        found = chunk.rfind(_KEY)
        if found >= 0:
            self._open = chunk[found : found + USAGE_SPAN]
        else:
            # A key cut between the last chunk and this one.
            junction = self._carry + chunk[:tail]
            cut = junction.find(_KEY) if self._carry else -1
            if cut >= 0:
                self._open = (junction[cut:] + chunk[tail:])[:USAGE_SPAN]
            elif self._open:
                self._open = (self._open + chunk)[:USAGE_SPAN]
        self._carry = chunk[-tail:] if len(chunk) >= tail else (self._carry + chunk)[-tail:]
        if self._open:
            self._close()

    def _close(self) -> None:
        """Keep the open usage object once its braces match; drop a key that opens none
        (``"usage": null``) or an object past ``USAGE_SPAN``."""
        opened = self._open
        head = opened[len(_KEY) :].lstrip(b": \t\r\n")
        if not head:
            return  # the value has not arrived yet
        if head[:1] != b"{":
            self._open = b""
            return
        obj = _last_usage_object(opened)
        if obj is not None:
            self._last, self._open = obj, b""
        elif len(opened) >= USAGE_SPAN:
            self._open = b""

    def cached_tokens(self) -> int | None:
        usage = self.usage()
        return usage.get("cached") if usage else None

    def usage(self) -> dict[str, int] | None:
        return usage_of(b'"usage":' + self._last, sse=True) if self._last else None


_ASK_USAGE = b',"stream_options":{"include_usage":true}}'


def asking_usage(body: bytes, client_asked: bool) -> tuple[bytes, bool]:
    """A streamed request's body as sent upstream: always asking for the usage chunk (tenants
    are charged the replica's own counts), and whether the client did not ask for it (then the
    router strips it from what the client gets)."""
    if client_asked:
        return body, False
    if b'"stream_options"' not in body:
        # Spliced in, not re-encoded: the body is a JSON object with at least "model" in it.
        stripped = body.rstrip()
        if stripped.endswith(b"}"):
            return stripped[:-1] + _ASK_USAGE, True
    obj = msgspec.json.decode(body)
    options = obj.get("stream_options")
    obj["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return msgspec.json.encode(obj), True


def _usage_only(event: bytes) -> bool:
    """vLLM's usage chunk: ``"choices": []`` with ``usage`` (what include_usage adds)."""
    if not event.startswith(b"data:") or b'"usage"' not in event:
        return False
    try:
        obj = msgspec.json.decode(event[5:].strip())
    except msgspec.DecodeError:
        return False
    return isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict)


def strip_usage_events(events: bytes) -> bytes:
    """Whole SSE events without the usage-only one (cheap when there is none)."""
    if b'"usage"' not in events:
        return events
    kept = [e for e in events.split(b"\n\n") if e and not _usage_only(e)]
    return b"".join(e + b"\n\n" for e in kept)


class UsageStripper:
    """Relays a raw stream as whole events, less the usage chunk the client did not ask for."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        buffer = self._pending + data if self._pending else data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._pending = buffer
            return b""
        self._pending = buffer[end + 2 :]
        return strip_usage_events(buffer[: end + 2])

    def end(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest
