"""Replay a trace against a running kvroute router in real time (``kvroute replay --live URL``).

Each request is sent at its (time-scaled) arrival as a streamed ``/v1/completions`` call whose
prompt reproduces the trace's prefix structure (``prompts.PromptBuilder``), with
``max_tokens`` = its output tokens and ``ignore_eos`` so real vLLM generates them all; with
``api`` chat, messages or responses the same prompt is the one user message of that API's
request (``loadgen.request_body``). At most
``concurrency`` requests are in flight: a request due while all slots are busy waits, and the
summary reports how late requests went out.

With ``closed_loop`` the agents wait for their answers, as the simulated replay's
``--closed-loop``: a session's next request goes out its recorded ``gap_s`` (time-scaled)
after its previous response ends; a session's first request, and a sub-agent's first, at
its recorded time (``model.next_turns``). With ``api`` messages each request names its
session as Claude Code does (``metadata.user_id``, ``claude_code_user_id``): the session part
a uuid of the trace's session up to its first "/", so a sub-agent sends its parent's, as
Claude Code's do, and the router finds the program (kvcore/agent_identity.py). The summary's
``programs`` gives TTFT and completion time of short and long programs
(simulator/fleet/programs.py, as the simulated replay's ``summary.json``), each request's
TTFT counted from when it was due. Memory is bounded by the concurrency plus a few
floats per request. The sending is ``simulator.loadgen``'s (the drill and the demo's too): a
request is ok when its answer is whole (status 200, no error event, a finish_reason and
[DONE]) and carried tokens.

The replicas' prefix hit rate comes from their own ``vllm:prefix_cache_*`` counters (found
through the router's /admin/replicas), read before and after the replay; when the replicas are
not reachable that way, from the router's /metrics copy of them (which lags by one scrape).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.kvcore.stats import parse_metrics, percentile
from kvroute.simulator.fleet.admission import program_of
from kvroute.simulator.fleet.programs import class_lines, summarize
from kvroute.simulator.loadgen import (
    Outcome,
    Planned,
    request_body,
    run_closed_loop,
    run_open_loop,
)

from .model import Trace, next_turns
from .prompts import PromptBuilder

Progress = Callable[[int, int], None]  # (requests finished, requests in the trace)


class LiveReplayError(RuntimeError):
    """The replay could not start (router unreachable, no model): one readable line."""


_SESSIONS = uuid.UUID("6f1c2a8e-3b0d-4c55-9a7e-2d4b8f0c1e93")  # the namespace of replayed ones


def claude_code_user_id(program: str) -> str:
    """Claude Code's ``metadata.user_id`` (the format before 2.1.78, cited in
    kvcore/agent_identity.py: ``user_<sha256 hex>_account_<uuid or empty>_session_<uuid>``) for
    a replayed program: one device, no account, the session a uuid derived from ``program``."""
    device = hashlib.sha256(b"kvroute replay").hexdigest()
    return f"user_{device}_account__session_{uuid.uuid5(_SESSIONS, program)}"


@dataclass
class _Results:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    late_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    replicas: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    finished: int = 0
    ok: int = 0
    prompt_words: int = 0
    output_tokens: int = 0
    # Per request, seconds after the start: when it was due, its first token, its end (NaN:
    # not sent, or failed).
    due_s: list[float] = field(default_factory=list)
    first_s: list[float] = field(default_factory=list)
    end_s: list[float] = field(default_factory=list)

    def record(self, index: int, outcome: Outcome) -> None:
        """A few numbers of a finished request (the outcome itself is not kept)."""
        self.finished += 1
        self.due_s[index] = outcome.sent_at - outcome.late_s
        if outcome.ok and outcome.ttft_s is not None and outcome.latency_s is not None:
            self.first_s[index] = outcome.sent_at + outcome.ttft_s
            self.end_s[index] = outcome.sent_at + outcome.latency_s
        self.late_s.append(outcome.late_s)
        if not outcome.ok or outcome.ttft_s is None:
            self.errors[outcome.error_kind or "no tokens"] += 1
            return
        self.ok += 1
        if outcome.replica:
            self.replicas[outcome.replica] += 1
        self.output_tokens += outcome.tokens
        self.ttft_s.append(outcome.ttft_s)
        tpot = outcome.tpot_s
        if tpot is not None:
            self.tpot_s.append(tpot)


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
    api: str = "completions",
    closed_loop: bool = False,
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
            api=api,
            closed_loop=closed_loop,
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
    api: str = "completions",
    closed_loop: bool = False,
    also: Sequence[str] = (),
) -> dict[str, Any]:
    """``replay_live`` inside a running event loop.

    ``tokens_per_block`` (default: the trace's block size) scales prompts down for small models,
    ``max_prompt_tokens`` and ``max_output_tokens`` cap them; see ``prompts`` for how the text
    keeps the prefix structure. ``also``: more routers in front of the same fleet; request i
    goes to router i % (1 + len(also)), ``url`` first (several routers, spread evenly).
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
    bases = [base, *(u.rstrip("/") for u in also)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as http:
        model = model or await _first_model(http, base)
        counters_before = await _prefix_counters(http, base)
        started = time.monotonic()
        results = await _replay(
            http,
            bases,
            model,
            trace,
            builder,
            time_scale,
            concurrency,
            max_output_tokens,
            progress,
            api,
            closed_loop,
        )
        wall_s = time.monotonic() - started
        counters_after = await _prefix_counters(http, base)
    summary = _summary(trace, results, builder, time_scale, wall_s, model, base)
    summary["closed_loop"] = closed_loop
    summary.update(_hit_rate(counters_before, counters_after))
    summary["programs"] = _programs(trace, results)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "live_summary.json"), "w") as file:
            json.dump(summary, file, indent=2)
    if echo:
        echo(format_summary(summary))
    return summary


async def _replay(
    http: aiohttp.ClientSession,
    bases: Sequence[str],
    model: str,
    trace: Trace,
    builder: PromptBuilder,
    time_scale: float,
    concurrency: int,
    max_output_tokens: int | None,
    progress: Progress | None,
    api: str = "completions",
    closed_loop: bool = False,
) -> _Results:
    requests = trace.requests
    nan = [math.nan] * len(requests)
    results = _Results(due_s=list(nan), first_s=list(nan), end_s=list(nan))
    first = requests[0].arrival_s if requests else 0.0

    def build(index: int) -> tuple[str, dict[str, Any]]:
        # Each prompt is built just before its request goes out.
        request = requests[index]
        output_tokens = max(1, request.output_tokens)
        if max_output_tokens:
            output_tokens = min(output_tokens, max_output_tokens)
        prompt = builder.prompt(request, salt=index)
        if api == "completions":
            path = "/v1/completions"
            body = {"model": model, "prompt": prompt, "max_tokens": output_tokens,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        else:
            turns = [{"role": "user", "content": prompt}]
            session = None
            if api == "messages" and request.session_id:
                session = claude_code_user_id(program_of(request.session_id, index))
            path, body = request_body(api, model, None, turns, output_tokens, session=session)
        if api in ("completions", "chat", "responses"):
            body["ignore_eos"] = True  # a vLLM extra the Messages API does not take
        if api == "chat":
            body["stream_options"] = {"include_usage": True}
        results.sent += 1
        results.prompt_words += builder.words(request)
        return bases[index % len(bases)] + path, body

    def at(index: int) -> float:
        return (requests[index].arrival_s - first) * time_scale

    def done(index: int, outcome: Outcome) -> None:
        results.record(index, outcome)
        if progress:
            progress(results.finished, len(requests))

    if closed_loop:
        following = next_turns(requests)
        held = set(following.values())
        starts = ((i, at(i)) for i in range(len(requests)) if i not in held)

        def gap(index: int) -> float:
            return (requests[index].gap_s or 0.0) * time_scale

        await run_closed_loop(
            http, starts, following, gap, build, concurrency=concurrency, on_done=done
        )
        return results

    def plan() -> Iterator[Planned]:
        for index in range(len(requests)):
            url, body = build(index)
            yield Planned(at(index), url, body)

    await run_open_loop(http, plan(), concurrency=concurrency, on_done=done)
    return results


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
    try:
        page = parse_metrics(text)
    except ValueError:
        return None
    if not all(name in page for name in names):
        return None
    return page.sum(names[0]), page.sum(names[1])


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
    """Measured latencies: the nearest-rank percentile; None (JSON null) when there are none."""
    return percentile(values, q, method="nearest_rank") if values else None


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


def _programs(trace: Trace, results: _Results) -> dict[str, Any] | None:
    """TTFT and completion per program class (simulator/fleet/programs.py), a program being
    a session and its sub-agents; None for a trace without sessions. A request's size is the
    trace's tokens (prompt plus output, before any scaling)."""
    requests = trace.requests
    if not any(r.session_id for r in requests):
        return None
    return summarize(
        [program_of(r.session_id, i) for i, r in enumerate(requests)],
        [r.input_tokens + r.output_tokens for r in requests],
        results.due_s,
        results.first_s,
        results.end_s,
    )


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
            *_program_lines(summary),
        ]
    )


def _program_lines(summary: dict[str, Any]) -> list[str]:
    programs = summary.get("programs")
    if not programs:
        return []
    loop = "closed loop" if summary.get("closed_loop") else "open loop"
    head = (
        f"programs ({loop}): {programs['programs']}, short = up to "
        f"{programs['short_max_tokens']:,} trace tokens"
    )
    return [head, *class_lines(programs)]
