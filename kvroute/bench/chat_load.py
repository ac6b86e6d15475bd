"""Drive multi-turn chat conversations through an OpenAI endpoint and read what the replicas saw.

Shared by ``kvroute demo`` and ``kvroute bench prefix``. The client side measures what a user
sees (time to the first streamed token, the whole request), with the requests sent by
``kvroute.simulator.loadgen``; the replicas' own /metrics say what happened inside them
(prefix-cache queries and hits, requests finished, per replica), so routers that add no headers
are measured the same way as kvroute.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvroute.bench.harness.metrics import metrics_page
from kvroute.kvcore.stats import percentile
from kvroute.simulator import loadgen
from kvroute.simulator.loadgen import Outcome
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

    def record(self, outcome: Outcome) -> None:
        """One request's outcome: counted; its latency and TTFT kept when it succeeded."""
        self.requests += 1
        if not outcome.ok:
            self.errors += 1
            kind = outcome.error[:120]
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
            return
        if outcome.latency_s is not None:
            self.latencies.append(outcome.latency_s)
        if outcome.ttft_s is not None:
            self.ttfts.append(outcome.ttft_s)

    def ttft_s(self, q: float) -> float:
        """The ``q``-quantile of TTFT in seconds (NaN when no request succeeded)."""
        return percentile(self.ttfts, q, method="rank_above")

    def latency_s(self, q: float) -> float:
        """The ``q``-quantile of whole-request latency in seconds (NaN when none succeeded)."""
        return percentile(self.latencies, q, method="rank_above")

    @property
    def requests_per_s(self) -> float:
        """Requests answered per second of the run's wall time (closed loop: its throughput)."""
        return len(self.latencies) / self.wall_s if self.wall_s > 0 else float("nan")

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
    """Each replica's own counters, from its /metrics (``kvcore.stats.parse_metrics``)."""
    out = {}
    for url in urls:
        page = await metrics_page(http, url)
        out[url] = ReplicaCounters(
            queries=page.sum("vllm:prefix_cache_queries_total"),
            hits=page.sum("vllm:prefix_cache_hits_total"),
            finished=page.sum("vllm:request_success_total"),
        )
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
    api: str = "chat",
) -> None:
    """Every conversation turn by turn (several conversations in flight), streamed, recorded in
    ``result``; sent in ``api`` by ``kvroute.simulator.loadgen.run_conversations`` (see there)."""
    total = sum(len(c.user_turns) for c in conversations)
    started = time.monotonic()

    def done(outcome: Outcome) -> None:
        result.record(outcome)
        if progress and sys.stderr.isatty():
            line = f"\r  {result.label:<18} {result.requests}/{total} requests"
            print(line, end="", file=sys.stderr, flush=True)

    try:
        await loadgen.run_conversations(
            http,
            url_for_tenant,
            conversations,
            concurrency=concurrency,
            max_tokens=max_tokens,
            model=model,
            scripted_replies=scripted_replies,
            on_done=done,
            api=api,
        )
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


async def measured_run(
    http: aiohttp.ClientSession,
    replicas: dict[str, str],
    url: str,
    label: str,
    conversations: Sequence[Conversation],
    *,
    concurrency: int,
    max_tokens: int,
    api: str = "chat",
) -> RunResult:
    """The conversations through ``url`` on freshly reset prefix caches, sent in ``api``
    (chat, messages or responses), with what the replicas (URL -> name) counted themselves:
    one row of ``kvroute demo``'s table."""
    urls = list(replicas)
    await reset_prefix_caches(http, urls)
    before = await replica_counters(http, urls)
    result = RunResult(label)
    await run_conversations(
        http,
        lambda tenant: url,
        conversations,
        result,
        concurrency=concurrency,
        max_tokens=max_tokens,
        scripted_replies=False,
        api=api,
    )
    record_counters(result, replicas, before, await replica_counters(http, urls))
    return result
