"""A client's own word on how long its prompt's cache should be kept.

Anthropic Messages marks cache breakpoints with ``cache_control: {"type": "ephemeral",
"ttl": "5m" | "1h"}`` on blocks of ``system``, ``tools`` and the messages' ``content``; without
``ttl`` the cache lives 5 minutes, and each use refreshes it. Sources: Anthropic's prompt caching
guide (https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching, "1-hour cache
duration") and its SDKs' ``CacheControlEphemeral`` type (``ttl: "5m" | "1h"``, e.g.
https://www.rubydoc.info/gems/anthropic/Anthropic/Models/CacheControlEphemeral).

kv_aware reads the longest ttl a request names as the least time its session is expected back
within (policies/kv_aware.py, ``RouteRequest.cache_ttl_s``). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

DEFAULT_TTL_S = 300.0  # an ephemeral breakpoint without ``ttl``: 5 minutes
_TTL = re.compile(r"(\d{1,6})([smh])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def ttl_of(cache_control: Any) -> float | None:
    """Seconds a ``cache_control`` object asks for; None when it is not one. "5m" and "1h"
    are Anthropic's values; any ``<n>s|m|h`` is read alike, an unreadable ttl as the default."""
    if not isinstance(cache_control, Mapping) or cache_control.get("type") != "ephemeral":
        return None
    ttl = cache_control.get("ttl")
    if isinstance(ttl, str) and (m := _TTL.fullmatch(ttl.strip())):
        return int(m.group(1)) * _UNIT_S[m.group(2)]
    return DEFAULT_TTL_S


def cache_ttl_s(request: Mapping[str, Any]) -> float | None:
    """The longest ttl the ``cache_control`` marks of a Messages body name (the top level's,
    ``system``'s, ``tools``' and the messages' content blocks', tool results' inner blocks
    included), in seconds; None when it has none."""
    best: float | None = None

    def see(block: Any) -> None:
        nonlocal best
        if isinstance(block, Mapping):
            ttl = ttl_of(block.get("cache_control"))
            if ttl is not None and (best is None or ttl > best):
                best = ttl

    see(request)
    for field in ("system", "tools"):
        blocks = request.get(field)
        if isinstance(blocks, list):
            for block in blocks:
                see(block)
    messages = request.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list):
                continue
            for block in content:
                see(block)
                inner = block.get("content") if isinstance(block, Mapping) else None
                if isinstance(inner, list):  # a tool_result's own blocks
                    for part in inner:
                        see(part)
    return best
