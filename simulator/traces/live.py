"""Replay a trace against a running kvroute router in real time (``kvroute replay --live URL``).

Each request is sent at its (time-scaled) arrival as a streamed ``/v1/completions`` call whose
prompt reproduces the trace's prefix structure (``prompts.PromptBuilder``), with
``max_tokens`` = its output tokens and ``ignore_eos`` so real vLLM generates them all. At most
``concurrency`` requests are in flight: a request due while all slots are busy waits, and the
summary reports how late requests went out. Memory is bounded by the concurrency plus a few
floats per request.

The replicas' prefix hit rate comes from their own ``vllm:prefix_cache_*`` counters (found
through the router's /admin/replicas), read before and after the replay; when the replicas are
not reachable that way, from the router's /metrics copy of them (which lags by one scrape).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .model import Trace
from .prompts import PromptBuilder

Progress = Callable[[int, int], None]  # (requests finished, requests in the trace)


class LiveReplayError(RuntimeError):
    """The replay could not start (router unreachable, no model): one readable line."""


@dataclass
class _Results:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    late_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    replicas: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    ok: int = 0
    prompt_words: int = 0
    output_tokens: int = 0


def replay_live(
    trace: Trace,
    url: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
    time_scale: float = 1.0,
    out_dir: str | None = None,
    tokens_per_block: int | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    concurrency: int = 64,
    progress: Progress | None = None,
    echo: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Replay ``trace`` against the router at ``url``; return (and echo) the summary."""
    return asyncio.run(
        replay_live_async(
            trace,
            url,
            model=model,
            api_key=api_key,
            time_scale=time_scale,
            out_dir=out_dir,
            tokens_per_block=tokens_per_block,
            max_prompt_tokens=max_prompt_tokens,
            max_output_tokens=max_output_tokens,
            concurrency=concurrency,
            progress=progress,
            echo=echo,
        )
    )


async def replay_live_async(
    trace: Trace,
    url: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
    time_scale: float = 1.0,
    out_dir: str | None = None,
    tokens_per_block: int | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    concurrency: int = 64,
    progress: Progress | None = None,
    echo: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """``replay_live`` inside a running event loop.

    ``tokens_per_block`` (default: the trace's block size) scales prompts down for small models,
    ``max_prompt_tokens`` and ``max_output_tokens`` cap them; see ``prompts`` for how the text
    keeps the prefix structure.
    """
    if not (0 < time_scale < math.inf):
        raise LiveReplayError(f"time_scale must be a positive number, got {time_scale!r}")
    if concurrency < 1:
        raise LiveReplayError(f"concurrency must be at least 1, got {concurrency!r}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise LiveReplayError(f"max_output_tokens must be at least 1, got {max_output_tokens!r}")
    try:
        builder = PromptBuilder(
            trace.block_tokens, tokens_per_block or trace.block_tokens, max_prompt_tokens
        )
    except ValueError as error:
        raise LiveReplayError(str(error)) from None
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as http:
        model = model or await _first_model(http, base)
        counters_before = await _prefix_counters(http, base)
        started = time.monotonic()
        results = await _replay(
            http, base, model, trace, builder, time_scale, concurrency, max_output_tokens, progress
        )
        wall_s = time.monotonic() - started
        counters_after = await _prefix_counters(http, base)
    summary = _summary(trace, results, builder, time_scale, wall_s, model, base)
    summary.update(_hit_rate(counters_before, counters_after))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "live_summary.json"), "w") as file:
            json.dump(summary, file, indent=2)
    if echo:
        echo(format_summary(summary))
    return summary


async def _replay(
    http: aiohttp.ClientSession,
    base: str,
    model: str,
    trace: Trace,
    builder: PromptBuilder,
    time_scale: float,
    concurrency: int,
    max_output_tokens: int | None,
    progress: Progress | None,
) -> _Results:
    results = _Results()
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    start = loop.time()
    first = trace.requests[0].arrival_s if trace.requests else 0.0
    finished = 0

    def done(task: asyncio.Task[None]) -> None:
        nonlocal finished
        running.discard(task)
        slots.release()
        finished += 1
        if progress:
            progress(finished, len(trace.requests))

    for index, request in enumerate(trace.requests):
        due = start + (request.arrival_s - first) * time_scale
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await slots.acquire()
        results.late_s.append(max(0.0, loop.time() - due))
        output_tokens = max(1, request.output_tokens)
        if max_output_tokens:
            output_tokens = min(output_tokens, max_output_tokens)
        body = {
            "model": model,
            "prompt": builder.prompt(request, salt=index),
            "max_tokens": output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        results.sent += 1
        results.prompt_words += builder.words(request)
        task = asyncio.create_task(_send(http, base, body, results))
        running.add(task)
        task.add_done_callback(done)
    if running:
        await asyncio.gather(*running)
    return results


async def _send(
    http: aiohttp.ClientSession, base: str, body: dict[str, Any], results: _Results
) -> None:
    sent = time.monotonic()
    first: float | None = None
    last = sent
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with http.post(base + "/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                results.errors[f"HTTP {response.status}"] += 1
                return
            replica = response.headers.get("x-kvroute-replica")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if any(choice.get("text") for choice in event.get("choices") or ()):
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        results.errors[type(error).__name__] += 1
        return
    if first is None:
        results.errors["no tokens"] += 1
        return
    results.ok += 1
    if replica:
        results.replicas[replica] += 1
    tokens = usage_tokens or chunks
    results.output_tokens += tokens
    results.ttft_s.append(first - sent)
    if tokens > 1:
        results.tpot_s.append((last - first) / (tokens - 1))


async def _first_model(http: aiohttp.ClientSession, base: str) -> str:
    try:
        async with http.get(base + "/v1/models") as response:
            if response.status != 200:
                raise LiveReplayError(f"{base}/v1/models answered HTTP {response.status}")
            data = (await response.json()).get("data") or []
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        raise LiveReplayError(f"cannot reach the router at {base} ({error})") from None
    if not data:
        raise LiveReplayError(f"{base}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


_QUERIES, _HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
_ROUTER_QUERIES = "kvroute_replica_prefix_cache_queries_tokens"
_ROUTER_HITS = "kvroute_replica_prefix_cache_hits_tokens"


async def _prefix_counters(
    http: aiohttp.ClientSession, base: str
) -> tuple[str, float, float] | None:
    """(source, queried tokens, hit tokens) summed over the fleet, or None if unavailable."""
    replica_urls = await _replica_urls(http, base)
    if replica_urls:
        totals = [await _metric_sums(http, u, (_QUERIES, _HITS)) for u in replica_urls]
        if all(t is not None for t in totals):
            queries = sum(t[0] for t in totals if t is not None)
            hits = sum(t[1] for t in totals if t is not None)
            return "replicas", queries, hits
    totals_router = await _metric_sums(http, base, (_ROUTER_QUERIES, _ROUTER_HITS))
    if totals_router is None:
        return None
    return "router", totals_router[0], totals_router[1]


async def _replica_urls(http: aiohttp.ClientSession, base: str) -> list[str]:
    try:
        async with http.get(base + "/admin/replicas") as response:
            if response.status != 200:
                return []
            rows = (await response.json()).get("replicas") or []
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
        return []
    return [str(row["url"]).rstrip("/") for row in rows if isinstance(row, dict) and row.get("url")]


async def _metric_sums(
    http: aiohttp.ClientSession, base: str, names: tuple[str, str]
) -> tuple[float, float] | None:
    """The two metrics (counters or gauges, all label sets summed) from ``base``/metrics."""
    try:
        async with http.get(base + "/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError):
        return None
    sums = dict.fromkeys(names, 0.0)
    found = set()
    try:
        for family in text_string_to_metric_families(text):
            if family.name in sums:
                found.add(family.name)
                sums[family.name] += sum(
                    s.value
                    for s in family.samples
                    if s.name in (family.name, family.name + "_total")
                )
    except ValueError:
        return None
    if found != set(names):
        return None
    return sums[names[0]], sums[names[1]]


def _hit_rate(
    before: tuple[str, float, float] | None, after: tuple[str, float, float] | None
) -> dict[str, Any]:
    if before is None or after is None or before[0] != after[0]:
        return {"prefix_hit_rate": None, "prefix_hit_rate_source": None}
    queried, hit = after[1] - before[1], after[2] - before[2]
    return {
        "prefix_hit_rate": hit / queried if queried > 0 else None,
        "prefix_hit_rate_source": after[0],
        "prefix_queried_tokens": queried,
        "prefix_hit_tokens": hit,
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _summary(
    trace: Trace,
    results: _Results,
    builder: PromptBuilder,
    time_scale: float,
    wall_s: float,
    model: str,
    url: str,
) -> dict[str, Any]:
    return {
        "trace": trace.name,
        "url": url,
        "model": model,
        "requests": len(trace.requests),
        "sent": results.sent,
        "ok": results.ok,
        "failed": results.sent - results.ok,
        "errors": dict(results.errors.most_common()),
        "requests_per_replica": dict(sorted(results.replicas.items())),
        "time_scale": time_scale,
        "trace_block_tokens": trace.block_tokens,
        "tokens_per_block": builder.tokens_per_block,
        "max_prompt_tokens": builder.max_prompt_tokens,
        "prompt_tokens_sent": results.prompt_words,
        "output_tokens_received": results.output_tokens,
        "ttft_p50_s": _percentile(results.ttft_s, 0.5),
        "ttft_p90_s": _percentile(results.ttft_s, 0.9),
        "ttft_p99_s": _percentile(results.ttft_s, 0.99),
        "tpot_p50_s": _percentile(results.tpot_s, 0.5),
        "tpot_p90_s": _percentile(results.tpot_s, 0.9),
        "tpot_p99_s": _percentile(results.tpot_s, 0.99),
        "send_late_p99_s": _percentile(results.late_s, 0.99),
        "wall_s": wall_s,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few readable lines."""

    def seconds(key: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value * 1000:.1f} ms"

    hit = summary.get("prefix_hit_rate")
    hit_text = "n/a" if hit is None else f"{hit:.1%} (from the {summary['prefix_hit_rate_source']})"
    scale = ""
    if summary["tokens_per_block"] != summary["trace_block_tokens"] or summary["max_prompt_tokens"]:
        scale = (
            f"; prompts scaled to {summary['tokens_per_block']} tokens per "
            f"{summary['trace_block_tokens']}-token block"
        )
        if summary["max_prompt_tokens"]:
            scale += f", capped at {summary['max_prompt_tokens']} tokens"
    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()) or "none"
    return "\n".join(
        [
            f"live replay of {summary['trace']} against {summary['url']} ({summary['model']}), "
            f"time x{summary['time_scale']:g}{scale}",
            f"requests: {summary['sent']} sent, {summary['ok']} ok, {summary['failed']} failed "
            f"(errors: {errors}); wall {summary['wall_s']:.1f} s",
            f"TTFT p50 {seconds('ttft_p50_s')}, p99 {seconds('ttft_p99_s')}; "
            f"TPOT p50 {seconds('tpot_p50_s')}, p99 {seconds('tpot_p99_s')}; "
            f"send lateness p99 {seconds('send_late_p99_s')}",
            f"replicas' prefix cache hit rate: {hit_text}",
        ]
    )
