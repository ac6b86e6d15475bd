"""llm-d's tiered-cache benchmark as its load generator runs it: inference-perf's stages.

llm-d's published figures (issue 34) come from inference-perf's ``shared_prefix`` data and a
Poisson load in stages (the llm-d-benchmark profile ``guide_tiered-prefix-cache_1``), and that
protocol differs from a steady rate in ways that move the figures:

* 250 groups x 5 questions: 1,250 prompts (a 16,000-token system prompt per group, then a
  256-token question), shuffled once; every request asks for 256 tokens (``ignore_eos``).
* a stage sends ``rate x 60 s`` requests, the prompts in their shuffled order from the first
  again at every stage, at inference-perf's Poisson times: each second a Poisson count of
  requests, spread over that second by normalised exponential gaps;
* a stage ends when its last request has finished; the next starts 60 s later (``interval``),
  on the same fleet, whose caches stay warm;
* a stage's throughput is its requests' input and output tokens over its wall time, from its
  first request to its last finish (llm-d's "Throughput (tok/s)" column; inference-perf times a
  stage's requests the same way for its goodput).

The next stage's start depends on the previous stage's last finish, so the stages are simulated
one more at a time: the fleet is deterministic and a stage starts after the previous one has
drained, so adding a stage changes nothing before it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.kvcore.stats import percentile
from kvroute.simulator.fleet.results import SimResult
from kvroute.simulator.traces.blocks import BlockIdAllocator
from kvroute.simulator.traces.model import Trace, TraceRequest

GROUPS = 250
PROMPTS_PER_GROUP = 5
SYSTEM_TOKENS = 16_000
QUESTION_TOKENS = 256
OUTPUT_TOKENS = 256
BLOCK_TOKENS = 256  # the trace's prefix granularity (the engine's blocks stay 16 tokens)
STAGE_S = 60.0
INTERVAL_S = 60.0
# The prompts llm-d's run sent were longer than configured: inference-perf v0.4.0 (the version
# llm-d-benchmark pins) writes a prompt as the decoded text of random token ids, which the
# server tokenizes into more tokens (inference-perf issue #230, fixed by PR #383 after that
# run). Its 16,256-token prompts, re-tokenized with a Qwen BPE tokenizer, come to 17,000-17,188
# tokens (17,090 on average): this many times the configured lengths ("as-run").
AS_RUN_LENGTH_SCALE = 17_090 / (SYSTEM_TOKENS + QUESTION_TOKENS)

# llm-d's published total (input + output) tokens/s per stage: HBM-only, then GPU + CPU tiers
# (llm-d/llm-d, guides/tiered-prefix-cache/README.md, "CPU Offloading Benchmarking Results").
LLMD_TOTAL_TOK_S = {
    5.0: (74_638.5, 82_880.0),
    10.0: (122_387.7, 167_027.5),
    20.0: (114_663.2, 300_749.2),
    40.0: (115_645.0, 331_212.6),
}
LLMD_GAINS = {rate: cpu / hbm - 1 for rate, (hbm, cpu) in LLMD_TOTAL_TOK_S.items()}


@dataclass(frozen=True)
class Prompt:
    block_ids: tuple[int, ...]
    tokens: int


@dataclass(frozen=True)
class StageRow:
    rate: float
    arm: str
    requests: int
    wall_s: float  # stage start to its last finish
    total_tok_s: float  # input + output tokens of the stage's requests over wall_s
    output_tok_s: float
    ttft_mean_s: float
    ttft_p90_s: float
    e2e_mean_s: float
    hit_rate: float  # of the stage's prompt tokens looked up, found in a cache (any tier)


def shared_prefix_prompts(seed: int, length_scale: float = 1.0) -> list[Prompt]:
    """inference-perf's shared_prefix prompts: groups x questions, shuffled once; their lengths
    the configured ones times ``length_scale`` (``AS_RUN_LENGTH_SCALE``: as llm-d's run sent
    them)."""
    blocks = BlockIdAllocator(BLOCK_TOKENS)
    prompts: list[Prompt] = []
    system_tokens = round(SYSTEM_TOKENS * length_scale)
    question_tokens = round(QUESTION_TOKENS * length_scale)
    for group in range(GROUPS):
        system = blocks.empty().extend([(("system", group), system_tokens)])
        for question in range(PROMPTS_PER_GROUP):
            full = system.extend([(("question", group, question), question_tokens)])
            prompts.append(Prompt(full.block_ids(), full.tokens))
    random.Random(seed).shuffle(prompts)
    return prompts


def stage_times(rate: float, count: int, start_s: float, rng: random.Random) -> list[float]:
    """inference-perf's PoissonLoadTimer: second after second, a Poisson(rate) number of requests
    spread over that second by exponential gaps scaled to sum to it (an empty second is skipped
    whole); the first ``count`` of them."""
    times: list[float] = []
    t = start_s
    while len(times) < count:
        gaps = [rng.expovariate(1.0) for _ in range(_poisson(rate, rng))]
        if not gaps:
            t += 1.0
            continue
        scale = sum(gaps)
        for gap in gaps:
            t += gap / scale
            times.append(t)
    return times[:count]


def _poisson(mean: float, rng: random.Random) -> int:
    """A Poisson count: exponential gaps at ``mean`` per unit that fit in one unit."""
    count, t = 0, rng.expovariate(mean)
    while t < 1.0:
        count += 1
        t += rng.expovariate(mean)
    return count


def stage_requests(
    prompts: Sequence[Prompt], rate: float, stage_s: float, start_s: float, rng: random.Random
) -> list[TraceRequest]:
    """One stage: ``int(rate x stage_s)`` requests from ``start_s`` on, the prompts in order from
    the first (inference-perf numbers a stage's requests from 0)."""
    times = stage_times(rate, int(rate * stage_s), start_s, rng)
    chosen = (prompts[n % len(prompts)] for n in range(len(times)))
    return [
        TraceRequest(t, p.tokens, OUTPUT_TOKENS, p.block_ids)
        for t, p in zip(times, chosen, strict=True)
    ]


def run_stages(
    rates: Sequence[float],
    arm: str,
    simulate_trace: Callable[[Trace], SimResult],
    seed: int,
    stage_s: float = STAGE_S,
    interval_s: float = INTERVAL_S,
    length_scale: float = 1.0,
) -> list[StageRow]:
    """The stages one after another on one fleet (``simulate_trace`` replays a whole trace on a
    fresh fleet and policy); a row per stage."""
    prompts = shared_prefix_prompts(seed, length_scale)
    rng = random.Random(seed + 1)
    requests: list[TraceRequest] = []
    bounds: list[tuple[int, int]] = []  # per stage: its first request's index, its last's + 1
    start = 0.0
    result: SimResult | None = None
    for rate in rates:
        stage = stage_requests(prompts, rate, stage_s, start, rng)
        if not stage:
            raise ValueError(f"a {stage_s:g} s stage at {rate:g} QPS sends no request")
        bounds.append((len(requests), len(requests) + len(stage)))
        requests.extend(stage)
        result = simulate_trace(Trace("inference-perf-stages", BLOCK_TOKENS, tuple(requests)))
        first, end = bounds[-1]
        finishes = result.finish_s[first:end]
        if any(math.isnan(f) for f in finishes):
            raise RuntimeError(f"stage at {rate:g} QPS left requests unfinished ({arm})")
        start = max(finishes) + interval_s
    assert result is not None
    return [_row(rate, arm, result, b) for rate, b in zip(rates, bounds, strict=True)]


def _row(rate: float, arm: str, result: SimResult, bounds: tuple[int, int]) -> StageRow:
    first, end = bounds
    span = range(first, end)
    wall = max(result.finish_s[i] for i in span) - min(result.arrival_s[i] for i in span)
    output = sum(result.output_tokens[i] for i in span)
    total = output + sum(result.input_tokens[i] for i in span)
    ttfts = [result.first_token_s[i] - result.arrival_s[i] for i in span]
    e2e = [result.finish_s[i] - result.arrival_s[i] for i in span]
    queried = sum(result.queried_tokens[i] for i in span)
    hits = sum(result.hit_tokens[i] for i in span)
    return StageRow(
        rate=rate,
        arm=arm,
        requests=end - first,
        wall_s=wall,
        total_tok_s=total / wall,
        output_tok_s=output / wall,
        ttft_mean_s=sum(ttfts) / len(ttfts),
        ttft_p90_s=percentile(ttfts, 0.9),
        e2e_mean_s=sum(e2e) / len(e2e),
        hit_rate=hits / queried if queried else 0.0,
    )


def stage_table(rows: Sequence[StageRow], published: bool = True) -> list[str]:
    """Markdown rows: each arm's stage against gpu-only's, and llm-d's published figures
    (``published``: only where the run is llm-d's, 8 replicas and 60 s stages and intervals)."""
    base = {r.rate: r.total_tok_s for r in rows if r.arm == "gpu-only"}
    lines = [
        "| QPS | arm | requests | stage wall | total tok/s | vs gpu-only | llm-d's gain "
        "| llm-d tok/s (HBM-only / GPU+CPU) | output tok/s | TTFT mean | TTFT p90 | E2E mean "
        "| hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get(r.rate)
        gain = f"{r.total_tok_s / b - 1:+.1%}" if b and r.arm != "gpu-only" else "-"
        llmd = LLMD_TOTAL_TOK_S.get(r.rate) if published else None
        llmd_gain = f"{LLMD_GAINS[r.rate]:+.1%}" if llmd and r.arm != "gpu-only" else "-"
        llmd_tok = f"{llmd[0]:,.0f} / {llmd[1]:,.0f}" if llmd else "-"
        lines.append(
            f"| {r.rate:g} | {r.arm} | {r.requests:,} | {r.wall_s:.0f} s | {r.total_tok_s:,.0f} "
            f"| {gain} | {llmd_gain} | {llmd_tok} | {r.output_tok_s:,.0f} | {r.ttft_mean_s:.2f} s "
            f"| {r.ttft_p90_s:.2f} s | {r.e2e_mean_s:.2f} s | {r.hit_rate:.1%} |"
        )
    return lines


def gain_spread(by_seed: Sequence[Sequence[StageRow]], published: bool = True) -> list[str]:
    """Per rate and tiered arm, the gain over gpu-only across seeds: paired (the same seed's
    arrivals for both arms) and unpaired (one seed's arm against another seed's gpu-only, as two
    runs with unseeded arrivals compare, llm-d's among them), beside llm-d's one published gain."""
    totals = [{(r.rate, r.arm): r.total_tok_s for r in rows} for rows in by_seed]
    # In the order of the first seed's table (rates ascending, arms as asked).
    tiered = [(r.rate, r.arm) for r in by_seed[0] if r.arm != "gpu-only"]
    lines = [
        f"Gain over gpu-only across {len(by_seed)} seeds:",
        "",
        "| QPS | arm | paired: median (min to max) | unpaired: min to max | llm-d's gain |",
        "|---|---|---|---|---|",
    ]
    for rate, arm in tiered:
        own = [seed[rate, arm] for seed in totals]
        base = [seed[rate, "gpu-only"] for seed in totals]
        paired = sorted(o / b - 1 for o, b in zip(own, base, strict=True))
        unpaired = [o / b - 1 for i, o in enumerate(own) for j, b in enumerate(base) if i != j]
        llmd_gain = f"{LLMD_GAINS[rate]:+.1%}" if published and rate in LLMD_GAINS else "-"
        middle = percentile(paired, 0.5)
        spread = f"{min(unpaired):+.1%} to {max(unpaired):+.1%}" if unpaired else "-"
        lines.append(
            f"| {rate:g} | {arm} | {middle:+.1%} ({paired[0]:+.1%} to {paired[-1]:+.1%}) "
            f"| {spread} | {llmd_gain} |"
        )
    return lines
