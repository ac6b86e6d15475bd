"""Sessions detected end to end: two Claude Code sessions of one account, through the router
with the real ``anthropic`` client on emulated replicas, each kept on its own replica by
kv_aware, and counted on /metrics by the rule that found them."""

from __future__ import annotations

import aiohttp
import anthropic
import openai

from kvroute.kvcore.stats import parse_metrics

from .conftest import RunningRouter, StartEmulated, StartRouter
from .helpers import replica_source

ACCOUNT = "0f9a1c2e-4b6d-4e8f-a1b3-c5d7e9f1a2b4"
DEVICE = "7" * 64
SESSIONS = ("57a121ec-f78c-48c3-a745-e3036a3ecc33", "54c1eb09-bc4c-4d2f-98eb-6d2ab2d5e2fe")
PROJECTS = ("alpha", "beta")


def _user_id(session: str) -> str:
    """Claude Code's metadata.user_id (before 2.1.78): the device, the account, the session."""
    return f"user_{DEVICE}_account_{ACCOUNT}_session_{session}"


def _system(project: str) -> str:
    # Claude Code's system prompt names the session's working directory and its git state;
    # here it leads, so that the two sessions share no block and the ring places each.
    return f"~/code/{project}: you are Claude Code, working here. " + " ".join(
        f"Rule {i}: read before editing {project}/src/module_{i}.py." for i in range(12)
    )


async def _two_sessions(
    start_emulated: StartEmulated, start_router: StartRouter
) -> tuple[RunningRouter, dict[str, list[tuple[str, str]]]]:
    """Three turns of each session, interleaved: each turn's (replica, reason)."""
    replicas = [await start_emulated(num_blocks=256) for _ in range(4)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    assert r.router.policy.name == "kv_aware"
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="x", max_retries=0, timeout=20)
    conversations: dict[str, list[anthropic.types.MessageParam]] = {s: [] for s in SESSIONS}
    seen: dict[str, list[tuple[str, str]]] = {s: [] for s in SESSIONS}
    try:
        for turn in range(3):
            for session, project in zip(SESSIONS, PROJECTS, strict=True):
                conversation = conversations[session]
                conversation.append({"role": "user", "content": f"Step {turn}: fix {project}."})
                raw = await client.messages.with_raw_response.create(
                    model="tiny",
                    max_tokens=4,
                    system=_system(project),
                    messages=conversation,
                    metadata={"user_id": _user_id(session)},
                )
                answer = await raw.parse()
                text = "".join(b.text for b in answer.content if b.type == "text")
                conversation.append({"role": "assistant", "content": text or "ok"})
                seen[session].append(
                    (raw.headers["x-kvroute-replica"], raw.headers["x-kvroute-reason"])
                )
    finally:
        await client.close()
    return r, seen


async def _detected(r: RunningRouter) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return {
        s.labels["source"]: s.value
        for s in parse_metrics(text).samples
        if s.name == "kvroute_sessions_detected_total"
    }


async def test_two_claude_code_sessions_of_one_account_each_keep_their_replica(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    r, seen = await _two_sessions(start_emulated, start_router)
    homes = {session: {replica for replica, _ in turns} for session, turns in seen.items()}
    assert all(len(replicas_seen) == 1 for replicas_seen in homes.values()), seen
    first, second = (next(iter(homes[s])) for s in SESSIONS)
    assert first != second, seen  # one account, two sessions: two homes
    counts = await _detected(r)
    assert counts["claude_code"] == 6
    assert sum(counts.values()) == 6


async def test_codex_conversations_are_sessions_by_their_session_id_header(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """Codex sends neither X-Session-ID nor ``user``: its conversation id comes as the
    ``session_id`` header (and as ``prompt_cache_key``), and is its session."""
    replicas = [await start_emulated(num_blocks=256) for _ in range(2)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=20)
    conversation = "0199f3a2-5d1e-7c40-9a61-2f0e8b7c4d11"
    try:
        for turn in range(2):
            raw = await client.responses.with_raw_response.create(
                model="tiny",
                instructions=_system("gamma"),
                input=f"Step {turn}: run the tests.",
                max_output_tokens=4,
                store=False,
                prompt_cache_key=conversation,
                extra_headers={"session_id": conversation, "originator": "codex_cli_rs"},
            )
            assert raw.http_response.status_code == 200
    finally:
        await client.close()
    counts = await _detected(r)
    assert counts["codex"] == 2
    assert sum(counts.values()) == 2
