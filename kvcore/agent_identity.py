"""Which session and which program a request belongs to, from what agents really send.

Pure: a request's headers (a case-insensitive mapping, as aiohttp's) and its decoded top-level
body fields in, an ``Identity`` out. No I/O, no clock. The rules, first match wins:

1. ``routing.session_header``: a header the operator names (none by default).
2. ``X-Session-ID``: vLLM's own session header (vllm/entrypoints/generate/base/serving.py,
   ``SESSION_ID_HEADER``, vLLM 0.32), which OpenCode also sends to OpenAI-compatible providers.
3. An agent's own way of saying it, header or field (each rule's source is cited beside it).
4. ``prompt_cache_key``: OpenAI's cache-routing key (Chat Completions and Responses), which
   Codex sets to its conversation id.
5. ``user`` (OpenAI), or Messages' ``metadata.user_id`` when it is not Claude Code's: whole.

A program is a session and its sub-agents. Where the agent says so (OpenCode's
``x-parent-session-id``) the program is the parent session; otherwise the program is the
session. Claude Code's sub-agents (the Task tool) run in the parent's process and send the
parent's session id: "parallel subagents ... share the same session ID and have no agent-level
identifier" in their API requests (anthropics/claude-code issue #49207,
https://github.com/anthropics/claude-code/issues/49207; for hooks, issue #7881). The
committed Claude Code excerpt
(tests/data/claude_code_sessions_10.tar.xz, 1,316 requests, 8 sub-agents in 10 sessions)
nests each sub-agent under its parent's session and shares no KV block with it (its own
model, system prompt and tools), so "same prefix within a time window" would split every
sub-agent off (pairwise recall 0.894) where "program = session" recovers all 10 programs
(precision and recall 1.0): docs/agents.md "Sessions and programs", tests/test_agent_identity.py.

``source`` names the rule that matched, one of ``SOURCES``: a bounded label for metrics.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The rule that matched (kvroute_sessions_detected_total's ``source``).
CONFIGURED_HEADER = "configured_header"
X_SESSION_ID = "x_session_id"
CLAUDE_CODE = "claude_code"
OPENCODE = "opencode"
CODEX = "codex"
VLLM = "vllm"
PROMPT_CACHE_KEY = "prompt_cache_key"
USER = "user"
NONE = "none"
SOURCES = (
    CONFIGURED_HEADER,
    X_SESSION_ID,
    CLAUDE_CODE,
    OPENCODE,
    CODEX,
    VLLM,
    PROMPT_CACHE_KEY,
    USER,
    NONE,
)

X_SESSION_ID_HEADER = "x-session-id"
# Claude Code >= 2.1.86 sends its session uuid as a header of its own (coder/aibridge pull
# request #241, https://github.com/coder/aibridge/pull/241, session.go).
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
# OpenCode (sst/opencode, packages/opencode/src/session/llm/request.ts, ``prepare``): to its
# own gateway ``x-opencode-session``; to other providers ``x-session-affinity`` and
# ``X-Session-Id``, each the session id; a sub-agent's (task tool's) child session adds its
# parent's as ``x-parent-session-id``.
OPENCODE_SESSION_HEADERS = ("x-opencode-session", "x-session-affinity")
OPENCODE_PARENT_HEADER = "x-parent-session-id"
# Codex CLI (openai/codex, codex-rs/codex-api/src/requests/headers.rs,
# ``build_conversation_headers``): its conversation id as the ``session_id`` header.
CODEX_SESSION_HEADER = "session_id"
# Claude Code's ``metadata.user_id``: before 2.1.78 ``user_<sha256>_account_<uuid or
# empty>_session_<uuid>``; from 2.1.78 a JSON string ``{"device_id": ..., "account_uuid": ...,
# "session_id": ...}`` (ding113/claude-code-hub pull request #939,
# https://github.com/ding113/claude-code-hub/pull/939; coder/aibridge pull request #241). The
# account part is shared by every session of an account: only the session part is the session.
_LEGACY_SESSION_MARK = "_session_"

# A key longer than this is not an id (kept off the routing tables).
MAX_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class Identity:
    session: str | None
    program: str | None
    source: str


_ANONYMOUS = Identity(None, None, NONE)


def detect(
    headers: Mapping[str, str],
    fields: Mapping[str, Any],
    configured_header: str | None = None,
) -> Identity:
    """The request's session and program, and the rule that found them (``SOURCES``).

    ``headers`` must look names up case-insensitively (aiohttp's request headers do), or
    hold lower-case names (HTTP/2's, as the endpoint picker gets them). ``fields``: the body's top-level fields, decoded (a field
    absent or of the wrong type is skipped)."""
    if configured_header:
        found = _key(headers.get(configured_header.lower()))
        if found is not None:
            return _identity(found, headers, CONFIGURED_HEADER)
    found = _key(headers.get(X_SESSION_ID_HEADER))
    if found is not None:
        return _identity(found, headers, X_SESSION_ID)
    found = _key(headers.get(CLAUDE_CODE_SESSION_HEADER))
    if found is not None:
        return _identity(found, headers, CLAUDE_CODE)
    for name in OPENCODE_SESSION_HEADERS:
        found = _key(headers.get(name))
        if found is not None:
            return _identity(found, headers, OPENCODE)
    found = _key(headers.get(CODEX_SESSION_HEADER))
    if found is not None:
        return _identity(found, headers, CODEX)
    user_id = _user_id(fields)
    found = _claude_code_session(user_id) if user_id is not None else None
    if found is not None:
        return _identity(found, headers, CLAUDE_CODE)
    found = _vllm_session(fields)
    if found is not None:
        return _identity(found, headers, VLLM)
    found = _key(fields.get("prompt_cache_key"))
    if found is not None:
        return _identity(found, headers, PROMPT_CACHE_KEY)
    found = _key(fields.get("user")) or user_id
    if found is not None:
        return _identity(found, headers, USER)
    return _ANONYMOUS


def _identity(session: str, headers: Mapping[str, str], source: str) -> Identity:
    parent = _key(headers.get(OPENCODE_PARENT_HEADER))
    return Identity(session, parent if parent is not None else session, source)


def _key(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_KEY_CHARS and not value.isspace():
        return value
    return None


def _user_id(fields: Mapping[str, Any]) -> str | None:
    metadata = fields.get("metadata")
    if not isinstance(metadata, Mapping):
        return None
    return _key(metadata.get("user_id"))


def _claude_code_session(user_id: str) -> str | None:
    """The session part of Claude Code's ``metadata.user_id`` (either format), else None."""
    if user_id.startswith("{"):
        try:
            decoded = json.loads(user_id)
        except ValueError:
            return None
        return _key(decoded.get("session_id")) if isinstance(decoded, dict) else None
    if user_id.startswith("user_"):
        at = user_id.rfind(_LEGACY_SESSION_MARK)
        if at >= 0:
            return _key(user_id[at + len(_LEGACY_SESSION_MARK) :])
    return None


def _vllm_session(fields: Mapping[str, Any]) -> str | None:
    """vLLM 0.32's own session: the body's ``session_id``, else ``vllm_xargs.session_id``
    (vllm/entrypoints/generate/base/serving.py, ``_get_session_id``; the field in
    vllm/entrypoints/openai/chat_completion/protocol.py and responses/protocol.py). vLLM 0.32
    has no ``vllm_xargs.agentic_context`` (its values are scalars or lists, never objects)."""
    found = _key(fields.get("session_id"))
    if found is not None:
        return found
    xargs = fields.get("vllm_xargs")
    return _key(xargs.get("session_id")) if isinstance(xargs, Mapping) else None
