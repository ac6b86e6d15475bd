"""The token usage a replica reports in its response: a JSON body's, or a stream's last one.

vLLM puts ``usage`` in a non-streamed answer always, and in a stream only as its last event
when the client asked for ``stream_options.include_usage``; ``prompt_tokens_details.
cached_tokens`` (the prefix-cache hit) only with ``--enable-prompt-tokens-details``. The router
and the endpoint picker both read it here.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

# A stream's tail kept to find its usage event in: that event is ~300 bytes, then [DONE].
STREAM_TAIL_BYTES = 8 << 10


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)


def usage_of(data: bytes, sse: bool) -> dict[str, int] | None:
    """Token usage from a JSON response, or from the last SSE event that carries one:
    ``prompt``, ``completion`` and, when reported, ``cached`` tokens."""
    try:
        if not sse:
            usage = _usage_decoder.decode(data).usage
        else:
            usage = None
            for line in reversed(data.split(b"\n")):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = _usage_decoder.decode(line[6:]).usage
                    if usage is not None:
                        break
    except msgspec.DecodeError:
        return None
    if usage is None:
        return None
    out = {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens}
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens")
    if isinstance(cached, int) and not isinstance(cached, bool):
        out["cached"] = cached
    return out


def cached_tokens_of(data: bytes, sse: bool) -> int | None:
    """The prompt tokens the engine reused from its prefix cache, if the response says."""
    usage = usage_of(data, sse)
    return usage.get("cached") if usage else None


class StreamTail:
    """The last few KiB of a stream, kept by reference (no copy per chunk) to read its usage
    from once it ends."""

    __slots__ = ("_chunks", "_size")

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._size = 0

    def add(self, chunk: bytes) -> None:
        chunks = self._chunks
        chunks.append(chunk)
        self._size += len(chunk)
        while len(chunks) > 1 and self._size - len(chunks[0]) >= STREAM_TAIL_BYTES:
            self._size -= len(chunks.popleft())

    def cached_tokens(self) -> int | None:
        return cached_tokens_of(b"".join(self._chunks), sse=True)

    def usage(self) -> dict[str, int] | None:
        return usage_of(b"".join(self._chunks), sse=True)


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
