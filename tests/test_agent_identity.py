"""Session and program identity (kvcore/agent_identity.py) on what agents really send, and
"program = session" measured on the committed Claude Code excerpt's ground truth."""

from __future__ import annotations

import json
import tarfile
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from kvroute.kvcore.agent_identity import (
    CLAUDE_CODE,
    CODEX,
    CONFIGURED_HEADER,
    MAX_KEY_CHARS,
    NONE,
    OPENCODE,
    PROMPT_CACHE_KEY,
    SOURCES,
    USER,
    VLLM,
    X_SESSION_ID,
    Identity,
    detect,
)
from kvroute.router.agent_request import parse_messages, parse_responses
from kvroute.router.openai_request import parse_chat, parse_completion
from kvroute.router.sessions import identify

DATA = Path(__file__).parent / "data"
SESSION_A = "57a121ec-f78c-48c3-a745-e3036a3ecc33"
SESSION_B = "54c1eb09-bc4c-4d2f-98eb-6d2ab2d5e2fe"
ACCOUNT = "0f9a1c2e-4b6d-4e8f-a1b3-c5d7e9f1a2b4"
DEVICE = "9" * 64


def _corpus() -> dict[str, Any]:
    corpus: dict[str, Any] = json.loads((DATA / "agent_sessions.json").read_text())
    return corpus


def _headers(**pairs: str) -> CIMultiDict[str]:
    return CIMultiDict(pairs)


def _legacy_user_id(session: str, account: str = ACCOUNT) -> str:
    return f"user_{DEVICE}_account_{account}_session_{session}"


def _json_user_id(session: str) -> str:
    return json.dumps({"device_id": DEVICE, "account_uuid": ACCOUNT, "session_id": session})


def test_claude_code_messages_bodies_of_the_corpus_give_the_session_part() -> None:
    bodies = [e["body"] for e in _corpus()["messages"] if e["id"].startswith("messages/fix-test")]
    assert len(bodies) == 6
    found = {detect(_headers(), body) for body in bodies}
    # user_5f2a_account__session_0b6e9d: an empty account (a key, not OAuth), one session.
    assert found == {Identity("0b6e9d", "0b6e9d", CLAUDE_CODE)}


@pytest.mark.parametrize("user_id", [_legacy_user_id(SESSION_A), _json_user_id(SESSION_A)])
def test_claude_code_user_id_in_both_formats_gives_the_session_not_the_account(
    user_id: str,
) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [], "metadata": {"user_id": user_id}}
    assert detect(_headers(), body) == Identity(SESSION_A, SESSION_A, CLAUDE_CODE)
    other = {**body, "metadata": {"user_id": user_id.replace(SESSION_A, SESSION_B)}}
    assert detect(_headers(), other).session == SESSION_B  # same account, its own session


def test_claude_code_session_header_of_newer_versions() -> None:
    headers = _headers(**{"X-Claude-Code-Session-Id": SESSION_A})
    body = {"metadata": {"user_id": _json_user_id(SESSION_B)}}
    assert detect(headers, body) == Identity(SESSION_A, SESSION_A, CLAUDE_CODE)


def test_a_messages_user_id_that_is_not_claude_codes_is_the_session_whole() -> None:
    assert detect(_headers(), {"metadata": {"user_id": "alice"}}) == Identity(
        "alice", "alice", USER
    )
    # Not JSON after all, or JSON without a session: whole.
    assert detect(_headers(), {"metadata": {"user_id": "{nope"}}).source == USER
    assert detect(_headers(), {"metadata": {"user_id": '{"a": 1}'}}).source == USER


def test_codex_responses_request_with_its_headers() -> None:
    body = next(e["body"] for e in _corpus()["responses"] if e["id"] == "responses/codex/0")
    conversation = body["prompt_cache_key"]
    # Codex sends its conversation id as the session_id header and as prompt_cache_key.
    headers = _headers(session_id=conversation, originator="codex_cli_rs")
    assert detect(headers, body) == Identity(conversation, conversation, CODEX)
    # Through a proxy that drops the header: prompt_cache_key still finds the same session.
    assert detect(_headers(), body) == Identity(conversation, conversation, PROMPT_CACHE_KEY)
    parsed = parse_responses(json.dumps(body).encode())
    assert identify(headers, parsed, None).session == conversation


def test_opencode_headers_and_a_sub_agents_program() -> None:
    parent, child = "ses_parent0001", "ses_child0002"
    assert detect(_headers(**{"x-opencode-session": parent}), {}) == Identity(
        parent, parent, OPENCODE
    )
    # To other providers OpenCode sends X-Session-Id too: vLLM's header, taken first.
    headers = _headers(**{"x-session-affinity": child, "X-Session-Id": child})
    assert detect(headers, {}) == Identity(child, child, X_SESSION_ID)
    assert detect(_headers(**{"x-session-affinity": child}), {}).source == OPENCODE
    # A task tool's child session names its parent: the program is the parent's.
    headers.add("x-parent-session-id", parent)
    assert detect(headers, {}) == Identity(child, parent, X_SESSION_ID)


def test_prompt_cache_key_user_and_vllm_session_in_chat_and_completions() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    parsed = parse_chat(json.dumps({**chat, "prompt_cache_key": "k1", "user": "u"}).encode())
    assert identify(_headers(), parsed, None) == Identity("k1", "k1", PROMPT_CACHE_KEY)
    parsed = parse_chat(json.dumps({**chat, "user": "u"}).encode())
    assert identify(_headers(), parsed, None) == Identity("u", "u", USER)
    completion = {"model": "m", "prompt": "hi", "vllm_xargs": {"session_id": "v1"}}
    parsed = parse_completion(json.dumps(completion).encode())
    assert identify(_headers(), parsed, None) == Identity("v1", "v1", VLLM)
    parsed = parse_completion(json.dumps({**completion, "session_id": "v0"}).encode())
    assert identify(_headers(), parsed, None).session == "v0"
    # Wrong types are skipped, not refused.
    odd = {**chat, "prompt_cache_key": 3, "vllm_xargs": "x", "metadata": [1]}
    assert identify(_headers(), parse_chat(json.dumps(odd).encode()), None).source == NONE


def test_the_configured_header_comes_first_then_x_session_id() -> None:
    body = {"metadata": {"user_id": _legacy_user_id(SESSION_A)}, "prompt_cache_key": "k"}
    headers = _headers(**{"X-Gateway-Session": "gw", "X-Session-ID": "xs", "session_id": "cx"})
    assert detect(headers, body, "x-gateway-session") == Identity("gw", "gw", CONFIGURED_HEADER)
    assert detect(headers, body, "X-Other") == Identity("xs", "xs", X_SESSION_ID)
    assert detect(headers, body) == Identity("xs", "xs", X_SESSION_ID)
    del headers["X-Session-ID"]
    assert detect(headers, body).source == CODEX
    del headers["session_id"]
    assert detect(headers, body) == Identity(SESSION_A, SESSION_A, CLAUDE_CODE)
    # Lower-case names (HTTP/2, the endpoint picker's) find a configured header of any case.
    assert detect({"x-gateway-session": "gw"}, {}, "X-Gateway-Session").session == "gw"


def test_empty_or_huge_values_are_no_session() -> None:
    assert detect(_headers(**{"X-Session-ID": ""}), {"user": " "}) == Identity(None, None, NONE)
    huge = "x" * (MAX_KEY_CHARS + 1)
    assert detect(_headers(**{"X-Session-ID": huge}), {"user": "u"}).source == USER
    assert {detect(_headers(), {}).source} <= set(SOURCES)


def test_messages_parse_keeps_the_fields_identity_reads() -> None:
    body = next(e["body"] for e in _corpus()["messages"] if e["id"] == "messages/fix-test/0")
    parsed = parse_messages(json.dumps(body).encode())
    assert parsed.user is None  # metadata.user_id is no longer the key whole
    assert identify(_headers(), parsed, None).session == "0b6e9d"


# -- "program = session" against the committed Claude Code excerpt's ground truth ------------


def _trace_requests() -> Iterator[tuple[str, int]]:
    """Every request of the excerpt: (its session file, its first block, scoped to the file)
    in arrival order within its session, a sub-agent's inside its parent's."""
    with tarfile.open(DATA / "claude_code_sessions_10.tar.xz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            handle = tar.extractfile(member)
            assert handle is not None
            trace = json.load(handle)
            for request in trace["requests"]:
                for r in request["requests"] if request["type"] == "subagent" else [request]:
                    yield member.name, r["hash_ids"][0]


def _pairwise(truth: Sequence[Hashable], predicted: Sequence[Hashable]) -> tuple[float, float]:
    """Pairwise precision and recall of a clustering: over pairs of requests put in one
    program, the share that truly are one (precision), and of true pairs, the share found."""

    def pairs(labels: Sequence[Hashable]) -> int:
        return sum(n * (n - 1) // 2 for n in Counter(labels).values())

    both = pairs(list(zip(truth, predicted, strict=True)))
    return both / pairs(predicted), both / pairs(truth)


def test_program_is_session_recovers_every_program_of_the_claude_code_excerpt() -> None:
    requests = list(_trace_requests())
    assert len(requests) == 1316
    truth = [session for session, _ in requests]
    # What Claude Code sends: one session per process, its sub-agents' requests included.
    # Each request as a Messages body with that session in metadata.user_id, detected.
    uuids = {name: f"{i:08d}-0000-4000-8000-000000000000" for i, name in enumerate(set(truth))}
    detected = [
        detect({}, {"metadata": {"user_id": _legacy_user_id(uuids[s])}}).program for s in truth
    ]
    assert _pairwise(truth, detected) == (1.0, 1.0)
    assert len(set(detected)) == 10
    # The other rule, a shared prefix (here: the same first block): sub-agents start from
    # their own system prompt and model, so each is split off its parent.
    by_prefix = [(session, first) for session, first in requests]
    precision, recall = _pairwise(truth, by_prefix)
    assert precision == 1.0  # block ids are scoped to their session file: no collisions
    assert round(recall, 3) == 0.894
    assert len(set(by_prefix)) == 13
