"""Drive multi-turn chat conversations through an OpenAI endpoint and read what the replicas saw.

Shared by ``kvroute demo`` and ``kvroute bench prefix``. The client side measures what a user
sees (time to the first streamed token, the whole request); the replicas' own /metrics say
what happened inside them (prefix-cache queries and hits, requests finished, per replica), so
routers that add no headers are measured the same way as kvroute.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.simulator.workload import Conversation


@dataclass
class RunResult:
    label: str
    requests: int = 0
    errors: int = 0
    ttfts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)
    # Requests each replica finished during the run (from its own vllm:request_success).
    per_replica: dict[str, float] = field(default_factory=dict)
    hit_rate: float = 0.0
    wall_s: float = 0.0

    @property
    def load_imbalance(self) -> float:
        """max / mean of the requests each replica served (1.0 is perfectly even)."""
        counts = list(self.per_replica.values())
        if not counts or not sum(counts):
            return float("nan")
        return max(counts) / (sum(counts) / len(counts))


@dataclass(frozen=True)
class ReplicaCounters:
    queries: float  # prefix-cache lookups, in tokens
    hits: float  # of those, tokens found cached
    finished: float  # requests finished


async def replica_counters(
    http: aiohttp.ClientSession, urls: Sequence[str]
) -> dict[str, ReplicaCounters]:
    """Each replica's own counters, parsed from its /metrics with prometheus-client."""
    out = {}
    for url in urls:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        sums = {"queries": 0.0, "hits": 0.0, "finished": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_queries_total":
                    sums["queries"] += sample.value
                elif sample.name == "vllm:prefix_cache_hits_total":
                    sums["hits"] += sample.value
                elif sample.name == "vllm:request_success_total":
                    sums["finished"] += sample.value
        out[url] = ReplicaCounters(**sums)
    return out


async def reset_prefix_caches(
    http: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float = 60.0
) -> None:
    """POST /reset_prefix_cache on every replica; vLLM refuses while requests run, so retry."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            async with http.post(url + "/reset_prefix_cache") as resp:
                body = await resp.text()
                if resp.status == 200 and "false" not in body.lower():
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not reset its prefix cache: {resp.status} {body}")
            await asyncio.sleep(0.2)


def record_counters(
    result: RunResult,
    names: dict[str, str],
    before: dict[str, ReplicaCounters],
    after: dict[str, ReplicaCounters],
) -> None:
    queries = sum(after[u].queries - before[u].queries for u in before)
    hits = sum(after[u].hits - before[u].hits for u in before)
    result.hit_rate = hits / queries if queries else 0.0
    result.per_replica = {names[u]: after[u].finished - before[u].finished for u in before}


async def run_conversations(
    http: aiohttp.ClientSession,
    url_for_tenant: Callable[[int], str],
    conversations: Sequence[Conversation],
    result: RunResult,
    *,
    concurrency: int,
    max_tokens: int,
    model: str = "tiny",
    scripted_replies: bool = True,
    progress: bool = True,
) -> None:
    """Every conversation turn by turn (several conversations in flight), streamed.

    With ``scripted_replies`` the assistant turns sent back are fixed text, so every router
    sees the very same prompts; otherwise the model's own replies are sent back, as a chat
    client would.
    """
    semaphore = asyncio.Semaphore(concurrency)
    total = sum(len(c.user_turns) for c in conversations)
    started = time.monotonic()

    async def converse(conversation: Conversation) -> None:
        async with semaphore:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": conversation.system_prompt}
            ]
            url = url_for_tenant(conversation.tenant) + "/v1/chat/completions"
            for turn, text in enumerate(conversation.user_turns):
                messages.append({"role": "user", "content": text})
                reply = await one_chat_request(
                    http, url, messages, model, max_tokens, f"tenant-{conversation.tenant}", result
                )
                if scripted_replies:
                    reply = f"Reply {turn} to tenant {conversation.tenant}: noted, " + text[:80]
                messages.append({"role": "assistant", "content": reply})
                if progress and sys.stderr.isatty():
                    line = f"\r  {result.label:<18} {result.requests}/{total} requests"
                    print(line, end="", file=sys.stderr, flush=True)

    try:
        await asyncio.gather(*(converse(c) for c in conversations))
    finally:
        result.wall_s = time.monotonic() - started
        if progress:
            end = "\n" if sys.stderr.isatty() else ""
            print(
                f"{end}  {result.label:<18} {result.requests}/{total} requests "
                f"in {result.wall_s:.1f}s",
                file=sys.stderr,
                flush=True,
            )


async def one_chat_request(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, Any]],
    model: str,
    max_tokens: int,
    user: str,
    result: RunResult,
) -> str:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "user": user,
    }
    sent = time.monotonic()
    first: float | None = None
    pieces: list[str] = []
    try:
        async with http.post(url, json=body) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:200]
                raise RuntimeError(f"HTTP {resp.status}: {detail}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if first is None:
                    first = time.monotonic()
                for choice in chunk.get("choices", []):
                    pieces.append((choice.get("delta") or {}).get("content") or "")
    except (aiohttp.ClientError, RuntimeError, ValueError) as exc:
        kind = str(exc)[:120] or type(exc).__name__
        result.error_kinds[kind] = result.error_kinds.get(kind, 0) + 1
        result.errors += 1
        result.requests += 1
        return ""
    result.requests += 1
    result.latencies.append(time.monotonic() - sent)
    if first is not None:
        result.ttfts.append(first - sent)
    return "".join(pieces)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
