"""Server-sent events as the router relays them: cutting a stream into whole events, and the
error event that ends a stream which cannot go on, in each API's own shape."""

from __future__ import annotations

import msgspec

from .errors import anthropic_error_body


def whole_events(pending: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """The whole SSE events (each ended by a blank line, without it; some may be empty) of
    ``pending + data``, and the bytes of the event not whole yet."""
    buffer = pending + data
    end = buffer.rfind(b"\n\n")
    if end < 0:
        return [], buffer
    return buffer[:end].split(b"\n\n"), buffer[end + 2 :]


def sse_error(
    message: str, code: str = "stream_broken", api: str = "chat", sequence_number: int = 0
) -> bytes:
    """How a stream that cannot go on ends, in its API's events: for chat and completions an
    OpenAI-shaped error event, then [DONE]; for Messages Anthropic's ``error`` event; for
    Responses its ``error`` event, numbered after the events sent (neither has [DONE])."""
    if api == "messages":
        return b"event: error\ndata: " + anthropic_error_body(502, message) + b"\n\n"
    if api == "responses":
        event = {"type": "error", "code": code, "message": message, "param": None,
                 "sequence_number": sequence_number}  # fmt: skip
        return b"event: error\ndata: " + msgspec.json.encode(event) + b"\n\n"
    error = {"message": message, "type": "upstream_error", "param": None, "code": code}
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\ndata: [DONE]\n\n"
