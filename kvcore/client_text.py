"""A client's value quoted in an error message: at most ``limit`` characters of it, so an
answer (or a log line) never echoes a megabyte the client sent. Pure."""

from __future__ import annotations

SHOWN_CHARS = 200


def shown(value: object, limit: int = SHOWN_CHARS, *, quote: bool = True) -> str:
    """``value`` as an error quotes it (``repr``; ``quote=False``: as written), cut to
    ``limit`` characters with how long it was."""
    if isinstance(value, str):
        text, cut = value, value[:limit]
        out = repr(cut) if quote else cut
    else:
        text = repr(value) if quote else str(value)
        cut = out = text[:limit]
    return out if len(text) <= limit else f"{out}... ({len(text)} chars)"
