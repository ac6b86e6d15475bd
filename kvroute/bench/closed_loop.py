"""A closed loop of chat conversations with a measured window, the replicas' queues sampled.

``kvroute bench prefix --saturate`` drives the fleet with it. ``concurrency`` conversations are
in flight at all times: each sends its next turn when the previous one is answered, and a
finished conversation is replaced by the next one of the list, so every router is offered the
same requests in the same order. A warmup fills the caches and the queues; then only requests
that end inside the measured window count; the supply of conversations should outlast it. At its end the requests still in flight are
abandoned (their connections closed, so routers and vLLM abort them).

While the window runs, every replica's ``vllm:num_requests_waiting`` is read once a second:
the share of readings with a queue says whether the fleet really was saturated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.bench.chat_load import RunResult, record_counters, replica_counters
from kvroute.bench.harness.metrics import metrics_page
from kvroute.simulator import loadgen
from kvroute.simulator.workload import Conversation

SAMPLE_EVERY_S = 1.0
_QUEUE_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running")


@dataclass
class WindowResult:
    """What one target did inside the measured window."""

    run: RunResult  # requests that ended in the window; hit rate and load from the replicas
    concurrency: int
    window_s: float
    output_tokens: int = 0  # of the requests that succeeded in the window
    # Replica name -> its vllm:num_requests_waiting, read every SAMPLE_EVERY_S.
    waiting: dict[str, list[float]] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.window_s if self.window_s > 0 else 0.0

    @property
    def completed(self) -> int:
        return self.run.requests - self.run.errors

    @classmethod
    def combined(cls, windows: Sequence[WindowResult]) -> WindowResult:
        """Several windows of one target as one: summed, the hit rate their mean."""
        run = RunResult(windows[0].run.label)
        out = cls(run, windows[0].concurrency, 0.0)
        for w in windows:
            run.requests += w.run.requests
            run.errors += w.run.errors
            run.ttfts += w.run.ttfts
            run.latencies += w.run.latencies
            for kind, n in w.run.error_kinds.items():
                run.error_kinds[kind] = run.error_kinds.get(kind, 0) + n
            for name, finished in w.run.per_replica.items():
                run.per_replica[name] = run.per_replica.get(name, 0.0) + finished
            for name, samples in w.waiting.items():
                out.waiting.setdefault(name, []).extend(samples)
            run.wall_s += w.run.wall_s
            out.window_s += w.window_s
            out.output_tokens += w.output_tokens
        run.hit_rate = sum(w.run.hit_rate for w in windows) / len(windows)
        return out

    def queued_share(self, replica: str) -> float:
        """The share of readings in which ``replica`` had requests waiting."""
        samples = self.waiting.get(replica) or []
        return sum(1 for w in samples if w > 0) / len(samples) if samples else 0.0

    @property
    def min_queued_share(self) -> float:
        """The least-queued replica's share: saturation means every replica queues."""
        return min((self.queued_share(r) for r in self.waiting), default=0.0)


def chat_body(messages: list[dict[str, str]], tenant: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        # Every reply is max_tokens long, so tokens/s counts the fleet's capacity, not where a
        # random model happened to sample its end of sequence.
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": f"tenant-{tenant}",
    }


class ClosedLoop:
    """``concurrency`` workers, each taking the next conversation of one shared supply."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url_for_tenant: Callable[[int], str],
        conversations: Iterable[Conversation],
        result: WindowResult,
        *,
        max_tokens: int,
        measure_from: float,
        stop_at: float,
    ) -> None:
        self.http = http
        self.url_for_tenant = url_for_tenant
        self.pool: Iterator[Conversation] = iter(conversations)
        self.result = result
        self.max_tokens = max_tokens
        self.measure_from = measure_from
        self.stop_at = stop_at

    async def worker(self) -> None:
        while time.monotonic() < self.stop_at:
            conversation = next(self.pool, None)
            if conversation is None:  # a finite supply ran dry: this worker is done
                return
            await self.converse(conversation)

    async def converse(self, conversation: Conversation) -> None:
        url = self.url_for_tenant(conversation.tenant) + "/v1/chat/completions"
        messages = [{"role": "system", "content": conversation.system_prompt}]
        for turn, text in enumerate(conversation.user_turns):
            if time.monotonic() >= self.stop_at:
                return
            messages.append({"role": "user", "content": text})
            body = chat_body(messages, conversation.tenant, self.max_tokens)
            outcome = await loadgen.send(self.http, url, body)
            self.count(outcome, time.monotonic())
            # A fixed reply, as ``loadgen.run_conversations`` sends: the same prompts for all.
            reply = f"Reply {turn} to tenant {conversation.tenant}: noted, " + text[:80]
            messages.append({"role": "assistant", "content": reply})

    def count(self, outcome: loadgen.Outcome, ended: float) -> None:
        if not self.measure_from <= ended <= self.stop_at:
            return
        self.result.run.record(outcome)
        if outcome.ok:
            self.result.output_tokens += outcome.tokens


async def queue_depths(
    http: aiohttp.ClientSession, urls: Sequence[str]
) -> list[tuple[float, float]]:
    """(waiting, running) of each replica, from its /metrics."""

    async def one(url: str) -> tuple[float, float]:
        page = await metrics_page(http, url, only=_QUEUE_METRICS)
        return page.sum(_QUEUE_METRICS[0]), page.sum(_QUEUE_METRICS[1])

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def wait_idle(
    http: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float = 120.0
) -> None:
    """Poll until no replica has a request waiting or running (abandoned ones are aborted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        depths = await queue_depths(http, urls)
        if all(w == 0 and r == 0 for w, r in depths):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas still busy after {timeout_s:g} s: {depths}")
        await asyncio.sleep(0.2)


async def _sample_queues(
    http: aiohttp.ClientSession, names: dict[str, str], result: WindowResult, stop_at: float
) -> None:
    urls = list(names)
    result.waiting = {names[u]: [] for u in urls}
    while time.monotonic() < stop_at:
        tick = time.monotonic()
        for url, (waiting, _) in zip(urls, await queue_depths(http, urls), strict=True):
            result.waiting[names[url]].append(waiting)
        await asyncio.sleep(max(0.0, tick + SAMPLE_EVERY_S - time.monotonic()))


async def measure_window(
    http: aiohttp.ClientSession,
    label: str,
    url_for_tenant: Callable[[int], str],
    names: dict[str, str],
    conversations: Iterable[Conversation],
    *,
    concurrency: int,
    max_tokens: int,
    warmup_s: float,
    duration_s: float,
) -> WindowResult:
    """Run the closed loop for ``warmup_s`` then ``duration_s``; count the second part only.

    ``names`` maps each replica's URL to its name; their /metrics give the window's hit rate,
    the requests each finished and the queue readings.
    """
    result = WindowResult(RunResult(label), concurrency, duration_s)
    start = time.monotonic()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    loop = ClosedLoop(
        http,
        url_for_tenant,
        conversations,
        result,
        max_tokens=max_tokens,
        measure_from=measure_from,
        stop_at=stop_at,
    )
    workers = [asyncio.create_task(loop.worker()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(max(0.0, measure_from - time.monotonic()))
        urls = list(names)
        before = await replica_counters(http, urls)
        await _sample_queues(http, names, result, stop_at)
        after = await replica_counters(http, urls)
        record_counters(result.run, names, before, after)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    result.run.wall_s = duration_s
    return result
