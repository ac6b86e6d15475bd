"""``kvroute bench prefix --saturate``: output tokens/s and TTFT with every replica's queue full.

The number operators compare: how much a fleet serves once the load exceeds it, and how long
users then wait for the first token. The same fleet and multi-tenant chat workload as
``kvroute bench prefix``; the same targets, one after another, with the replicas' prefix caches
reset and their queues drained in between.

Closed loop, not open: a fixed number of conversations in flight (``closed_loop``). A chat turn
cannot be sent before the previous one is answered, so conversations are closed loops anyway;
and past saturation an open loop's queues grow for as long as the run lasts, so its TTFT would
measure the run's length more than the router. With a fixed number in flight, the queues stay
as long as that number makes them, the same for every target, and the router that makes the
fleet serve more completes more in the same window.

The load point is found first: a short ramp through the tenant-pinning oracle (no router, the
fleet's best case: its cache hits keep queues shortest) at 1, 2, 4, 8 and 16 conversations in
flight per replica, stopping at the first level where every replica had requests waiting in at
least SATURATED_SHARE of the readings.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvroute.backends.launcher import LaunchedReplica, ensure_tiny_model
from kvroute.bench.chat_load import reset_prefix_caches
from kvroute.bench.closed_loop import WindowResult, measure_window, wait_idle
from kvroute.bench.harness.host import machine_line
from kvroute.bench.harness.report import first_line, ms, ratio
from kvroute.bench.prefix import (
    RUN_ERRORS,
    TARGETS,
    Options,
    Target,
    fleet_line,
    kv_blocks_for,
    peers_line,
    running_router,
    start_fleet,
    verdict,
)
from kvroute.simulator.workload import Conversation, multi_tenant_chat

# A replica is saturated when it has requests waiting most of the time (in this share of the
# readings; the hit-rate leaders queue least, so the bar is met last by the oracle).
SATURATED_SHARE = 0.5
RAMP_PER_REPLICA = (1, 2, 4, 8, 16)
_BATCH = 10  # conversations per tenant generated at a time

# Issue 17's targets: kv_aware's output tokens/s against the oracle's and every peer's.
TARGET_VS_ORACLE = 0.95
TARGET_VS_PEER = 1.0  # ahead: strictly more
PEERS = ("vllm-router", "smg")


@dataclass
class Row:
    target: Target
    result: WindowResult | None = None
    error: str | None = None


@dataclass
class Outcome:
    concurrency: int
    ramp: list[WindowResult] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    kv_blocks: int = 0
    prompt_tokens: int = 0
    machine: str = field(default_factory=machine_line)


def workload(options: Options, seed: int) -> Iterator[Conversation]:
    """An endless supply of conversations, the same for a seed: each tenant keeps its one
    system prompt; batch after batch brings new user turns."""

    def batch(seed: int) -> list[Conversation]:
        return multi_tenant_chat(
            options.tenants, _BATCH, options.turns, options.system_words, options.user_words, seed
        )

    prompts = {c.tenant: c.system_prompt for c in batch(seed)}
    for n in itertools.count(1):
        for c in batch(seed + n):
            yield Conversation(c.tenant, prompts[c.tenant], c.user_turns)


def choose_concurrency(ramp: Sequence[WindowResult]) -> int:
    """The first level at which every replica queued; the highest tried if none did."""
    for step in ramp:
        if step.min_queued_share >= SATURATED_SHARE:
            return step.concurrency
    return ramp[-1].concurrency


async def _ramp(
    http: aiohttp.ClientSession, replicas: list[LaunchedReplica], options: Options
) -> list[WindowResult]:
    urls = [r.url for r in replicas]
    names = {r.url: r.name for r in replicas}
    steps: list[WindowResult] = []
    await wait_idle(http, urls)
    await reset_prefix_caches(http, urls)
    for per_replica in RAMP_PER_REPLICA:
        concurrency = per_replica * len(replicas)
        await wait_idle(http, urls)
        step = await measure_window(
            http,
            f"ramp {concurrency}",
            lambda tenant: urls[tenant % len(urls)],
            names,
            workload(options, options.seed + 1000 + concurrency),
            concurrency=concurrency,
            max_tokens=options.max_tokens,
            # Long enough that the first wave (every conversation's first turn, sent at once)
            # has mostly ended before the readings start.
            warmup_s=options.ramp_step_s / 2,
            duration_s=options.ramp_step_s,
        )
        steps.append(step)
        print(
            f"  ramp: {concurrency} in flight: {step.tokens_per_s:.1f} output tokens/s, "
            f"every replica queued in {step.min_queued_share:.0%} of readings",
            file=sys.stderr,
            flush=True,
        )
        if step.min_queued_share >= SATURATED_SHARE:
            break
    return steps


async def _measure(
    http: aiohttp.ClientSession,
    target: Target,
    base: str | None,
    replicas: list[LaunchedReplica],
    conversations: Iterable[Conversation],
    options: Options,
    concurrency: int,
) -> WindowResult:
    urls = [r.url for r in replicas]
    await wait_idle(http, urls)
    await reset_prefix_caches(http, urls)
    result = await measure_window(
        http,
        target.name,
        lambda tenant: base if base is not None else urls[tenant % len(urls)],
        {r.url: r.name for r in replicas},
        conversations,
        concurrency=concurrency,
        max_tokens=options.max_tokens,
        warmup_s=options.warmup_s,
        duration_s=options.duration_s,
    )
    print(
        f"  {target.name:<18} {result.tokens_per_s:.1f} output tokens/s, "
        f"{result.completed} requests in {result.window_s:g} s",
        file=sys.stderr,
        flush=True,
    )
    return result


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300))


def _run_window(
    target: Target,
    replicas: list[LaunchedReplica],
    options: Options,
    concurrency: int,
    log_dir: Path,
) -> WindowResult:
    """One measured window of ``target``, its router started for it and stopped after."""
    with running_router(target, replicas, options, log_dir) as base:

        async def go() -> WindowResult:
            async with _session() as http:
                conversations = workload(options, options.seed)
                return await _measure(
                    http, target, base, replicas, conversations, options, concurrency
                )

        return asyncio.run(go())


def _run_rounds(
    replicas: list[LaunchedReplica], options: Options, concurrency: int, log_dir: Path
) -> list[Row]:
    """Every target once per round, the order reversed every other round: a machine that gets
    busier or quieter during the run (other people's jobs) then weighs on every target alike."""
    windows: dict[str, list[WindowResult]] = {name: [] for name in options.targets}
    errors: dict[str, str] = {}
    for k in range(options.rounds):
        order = options.targets if k % 2 == 0 else options.targets[::-1]
        for name in order:
            if name in errors:
                continue
            try:
                windows[name].append(
                    _run_window(TARGETS[name], replicas, options, concurrency, log_dir)
                )
            except RUN_ERRORS as exc:
                errors[name] = first_line(exc)
                print(f"  {name}: {errors[name]}", file=sys.stderr)
    return [
        Row(TARGETS[name], error=errors[name])
        if name in errors
        else Row(TARGETS[name], WindowResult.combined(windows[name]))
        for name in options.targets
    ]


def run_saturate(options: Options) -> Outcome:
    from kvroute.kvcore.tokenizer import HFTokenizerFiles

    tokenizer = HFTokenizerFiles(ensure_tiny_model())
    first = next(workload(options, options.seed))
    prompt_tokens = len(tokenizer.encode(first.system_prompt))
    kv_blocks = kv_blocks_for(options, prompt_tokens)
    outcome = Outcome(options.saturate_concurrency or 0, kv_blocks=kv_blocks)
    outcome.prompt_tokens = prompt_tokens
    with contextlib.ExitStack() as stack:
        log_dir, replicas = start_fleet(
            stack, options, kv_blocks, "kvroute bench prefix --saturate"
        )
        if not outcome.concurrency:

            async def ramp() -> list[WindowResult]:
                async with _session() as http:
                    return await _ramp(http, replicas, options)

            outcome.ramp = asyncio.run(ramp())
            outcome.concurrency = choose_concurrency(outcome.ramp)
        outcome.rows = _run_rounds(replicas, options, outcome.concurrency, log_dir)
    return outcome


# ---------------------------------------------------------------- report


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        "| target | output tok/s | kv_aware ÷ this | TTFT p50 ms | TTFT p90 ms | requests "
        "| errors | hit rate | queued % per replica | load max/mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    kv = next((r.result for r in rows if r.target.name == "kvroute-kv" and r.result), None)
    for row in rows:
        res = row.result
        if res is None:
            lines.append(f"| {row.target.name} | {row.error} | | | | | | | | |")
            continue
        kv_over = ratio(kv.tokens_per_s if kv else None, res.tokens_per_s)
        lines.append(
            f"| {row.target.name} | {res.tokens_per_s:.1f} | {kv_over} "
            f"| {ms(res.run.ttft_s(0.5))} | {ms(res.run.ttft_s(0.9))} | {res.completed} "
            f"| {res.run.errors} | {res.run.hit_rate:.1%} | {_shares(res)} "
            f"| {res.run.load_imbalance:.2f} |"
        )
    return "\n".join(lines)


def _shares(result: WindowResult) -> str:
    return "/".join(f"{result.queued_share(r) * 100:.0f}" for r in sorted(result.waiting))


def format_ramp(ramp: Sequence[WindowResult], chosen: int) -> str:
    lines = [
        "| in flight | output tok/s | TTFT p90 ms | queued (least replica) |",
        "|---|---|---|---|",
    ]
    for step in ramp:
        mark = " (chosen)" if step.concurrency == chosen else ""
        lines.append(
            f"| {step.concurrency}{mark} | {step.tokens_per_s:.1f} "
            f"| {ms(step.run.ttft_s(0.9))} | {step.min_queued_share:.0%} |"
        )
    return "\n".join(lines)


def ratios(rows: Sequence[Row]) -> list[tuple[str, float]]:
    """(other target, kv_aware's output tokens/s over its), for every other measured target."""
    measured = {r.target.name: r.result for r in rows if r.result is not None}
    kv = measured.get("kvroute-kv")
    if kv is None:
        return []
    return [
        (name, kv.tokens_per_s / res.tokens_per_s)
        for name, res in measured.items()
        if name != "kvroute-kv" and res.tokens_per_s > 0
    ]


def verdict_lines(rows: Sequence[Row]) -> list[str]:
    lines = []
    for name, kv_over in ratios(rows):
        what = f"kv_aware output tokens/s vs {name}'s"
        if name == "oracle":
            lines.append(verdict(what, kv_over, TARGET_VS_ORACLE, ">="))
        elif TARGETS[name].router in PEERS:
            lines.append(verdict(what, kv_over, TARGET_VS_PEER, ">"))
        else:
            lines.append(f"- {what}: {kv_over:.2f}")
    return lines


def report(outcome: Outcome, options: Options) -> str:
    threshold = f"every replica queued in >= {SATURATED_SHARE:.0%} of readings"
    if not outcome.ramp:
        how = "given by --saturate-concurrency"
    elif outcome.ramp[-1].min_queued_share >= SATURATED_SHARE:
        how = f"the ramp's first level with {threshold}"
    else:
        how = f"the ramp's highest level; at none was {threshold}"
    parts = [format_table(outcome.rows), "", *verdict_lines(outcome.rows), ""]
    parts += [
        f"- load: closed loop, {outcome.concurrency} conversations in flight ({how}); "
        f"per target and round {options.warmup_s:g} s warmup then {options.duration_s:g} s "
        f"measured, {options.rounds} rounds (order reversed every other round); "
        "output tok/s = output tokens of the requests that ended in the window / window; "
        "queued = share of once-a-second readings in which a replica had requests waiting",
        f"- workload: {options.tenants} tenants, conversations of {options.turns} turns, system "
        f"prompt {outcome.prompt_tokens} tokens, {options.max_tokens} tokens per reply "
        "(ignore_eos), streamed",
        fleet_line(options, outcome.kv_blocks),
        peers_line(),
        f"- {outcome.machine}",
    ]
    if outcome.ramp:
        parts += [
            "",
            "Ramp (oracle; windows shorter than a request at the top levels, so its tokens/s "
            "are indicative only: the level is chosen by the queues):",
            "",
            format_ramp(outcome.ramp, outcome.concurrency),
        ]
    return "\n".join(parts)
