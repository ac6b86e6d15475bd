"""``kvroute bench tiers``: KV tiers in the simulator, on llm-d's tiered-cache benchmark.

llm-d's published benchmark (issue 34): 8 replicas of Qwen3-32B TP2 on 16 H100, 250 groups x 5
prompts behind 16K-token system prompts, 256 tokens in and out, 5 to 40 QPS; a working set of
4.64M tokens against 2.38M of GPU KV and 10.5M of CPU. Here the same shape runs through the
simulated fleet (the router's own kv_aware and prefix index, the fast engine model with vLLM's
offloading semantics) several ways:

* ``gpu-only``: no offload tier (the baseline llm-d compares against);
* ``cpu-flat``: a CPU tier, the router counting a block on CPU as on the GPU;
* ``cpu-weights``: a CPU tier, fixed tier weights (llm-d's GPU 1.0 / CPU 0.8);
* ``cpu-time``: a CPU tier, the cost in time (load at PCIe speed vs prefill, kvroute's default);
* ``disk-weights``/``disk-time`` (on request): a CPU tier a quarter of llm-d's, under the working
  set, then the node's NVMe: fixed weights (disk 0.25) against the cost in time.

Two protocols (``--protocol``):

* ``inference-perf`` (the default): llm-d's own, as its load generator runs it
  (``tiers_stages``): the rates are 60 s stages one after another on one fleet, each ending when
  its last request has finished; throughput is a stage's input and output tokens over its wall
  time, beside llm-d's published figures. ``--seeds N`` repeats it over N arrival draws and
  reports how far the gain moves with the draw alone.
* ``steady``: ``--duration`` of arrivals at each rate on a cold fleet, the workload drawn by the
  ``multi-tenant`` generator (lengths uniform around their means); output tokens/s over the
  makespan.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.argtypes import (
    add_report_args,
    non_negative_float,
    positive_float,
    positive_int,
)
from kvroute.bench.harness.host import machine_line, record
from kvroute.kvcore.stats import percentile
from kvroute.simulator.fleet.results import SimResult
from kvroute.simulator.traces.model import Trace

from . import tiers_stages

CPU_TOKENS_TOTAL = 10_500_000  # llm-d's CPU tier over the 8 replicas
PRESET = "qwen3-32b-2xh100"
ARMS = ("gpu-only", "cpu-flat", "cpu-weights", "cpu-time", "disk-weights", "disk-time")
DEFAULT_ARMS = ARMS[:4]
# The disk arms: a CPU tier a quarter of llm-d's (2.6M tokens, under the 4.64M working set),
# then local NVMe (the node preset): part of the working set lives only on disk.
DISK_CPU_SHARE = 0.25


@dataclass(frozen=True)
class Row:
    rate: float
    arm: str
    throughput: float  # output tokens/s
    ttft_p50_s: float
    ttft_p99_s: float
    hit_rate: float
    loaded_share: float  # of prompt tokens, loaded from an offload tier


def workload(rate: float, duration_s: float) -> str:
    return (
        f"multi-tenant:tenants=250,questions=5,rate={rate:g},duration={duration_s:g},"
        "system_tokens=16384,prompt_tokens=256,output_tokens=256,zipf=0,block_tokens=256"
    )


def arm_simulator(arm: str, replicas: int, seed: int) -> Callable[[Trace], SimResult]:
    """Replays a trace through a fresh fleet of ``arm``'s shape and a fresh kv_aware."""
    from kvroute.simulator.cli_replay import fleet_defaults, policy_object
    from kvroute.simulator.engine.latency import latency_preset
    from kvroute.simulator.engine.offload import offload_tiers
    from kvroute.simulator.fleet.config import FleetConfig, engine_config
    from kvroute.simulator.fleet.fleet import simulate
    from kvroute.simulator.fleet.units import prepare

    latency = latency_preset(PRESET)
    tiers = "none" if arm == "gpu-only" else "cpu+disk" if arm.startswith("disk") else "cpu"
    cpu_tokens = CPU_TOKENS_TOTAL // replicas
    if arm.startswith("disk"):
        cpu_tokens = int(cpu_tokens * DISK_CPU_SHARE)
    offload = offload_tiers(tiers, latency, 16, cpu_tokens=cpu_tokens)
    config = FleetConfig(
        replicas=replicas, engine=engine_config(latency, seed=seed, offload=offload)
    )
    mode = arm.split("-", 1)[1] if arm != "gpu-only" else "time"
    # llm-d's load generator sends no session key: no live-session routing here either.
    params = [("tier_mode", mode), ("session_ttl_s", 0.0)]

    def replay(trace: Trace) -> SimResult:
        policy = policy_object("kv_aware", seed, params, fleet_defaults(config))
        return simulate(prepare(trace), policy, config)

    return replay


def run_arm(rate: float, arm: str, duration_s: float, replicas: int, seed: int) -> Row:
    """The steady protocol: ``duration_s`` of Poisson arrivals at ``rate`` on a cold fleet."""
    from kvroute.simulator.traces.loader import load_trace

    trace = load_trace(workload(rate, duration_s), "synthetic", seed=seed)
    return _row(rate, arm, arm_simulator(arm, replicas, seed)(trace))


def _row(rate: float, arm: str, result: SimResult) -> Row:
    span = result.makespan_s()
    ttfts = result.ttfts()
    queried = sum(result.queried_tokens)
    return Row(
        rate,
        arm,
        sum(result.output_tokens) / span if span else 0.0,
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        result.hit_rate(),
        sum(result.loaded_tokens.values()) / queried if queried else 0.0,
    )


def table(rows: Sequence[Row]) -> list[str]:
    base = {r.rate: r.throughput for r in rows if r.arm == "gpu-only"}
    lines = [
        "| QPS | arm | output tok/s | vs gpu-only | llm-d's gain | TTFT p50 | TTFT p99 | hit rate "
        "| loaded from tiers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get(r.rate)
        gain = f"{r.throughput / b - 1:+.0%}" if b and r.arm != "gpu-only" else "-"
        gains = tiers_stages.LLMD_GAINS
        llmd = f"{gains[r.rate]:+.0%}" if r.rate in gains and r.arm != "gpu-only" else "-"
        lines.append(
            f"| {r.rate:g} | {r.arm} | {r.throughput:,.0f} | {gain} | {llmd} | "
            f"{r.ttft_p50_s:.2f} s | {r.ttft_p99_s:.2f} s | {r.hit_rate:.1%} | "
            f"{r.loaded_share:.1%} |"
        )
    return lines


def command(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every setting spelt out."""
    rates = ",".join(f"{r:g}" for r in args.rates)
    common = f"--arms {','.join(args.arms)} --replicas {args.replicas} --seed {args.seed}"
    if args.protocol == "steady":
        return (
            f"kvroute bench tiers --protocol steady --rates {rates} --duration {args.duration:g} "
            f"{common}"
        )
    return (
        f"kvroute bench tiers --protocol inference-perf --rates {rates} --stage-s "
        f"{args.stage_s:g} --interval-s {args.interval_s:g} --seeds {args.seeds} "
        f"--prompt-lengths {args.prompt_lengths} {common}"
    )


def run(args: argparse.Namespace) -> int:
    if args.protocol == "inference-perf":
        empty = [r for r in args.rates if int(r * args.stage_s) < 1]
        if empty:
            print(
                f"kvroute bench tiers: a {args.stage_s:g} s stage at {empty[0]:g} QPS sends no "
                "request (--rates x --stage-s must be at least 1)",
                file=sys.stderr,
            )
            return 2
    machine = machine_line()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    wall = time.perf_counter()
    if args.protocol == "steady":
        body = _run_steady(args)
        title = "llm-d's tiered workload in the simulator"
        shape = (
            f"trace `{workload(0, args.duration).replace('rate=0,', 'rate=R,')}`, seed "
            f"{args.seed}; throughput is output tokens/s over the makespan, from a cold fleet."
        )
    else:
        body = _run_stages(args)
        title = "llm-d's tiered benchmark as inference-perf runs it, in the simulator"
        scale = _length_scale(args)
        lengths = (
            f"the configured lengths x {scale:.3f}, as inference-perf v0.4.0 sent them: "
            if args.prompt_lengths == "as-run"
            else ""
        )
        shape = (
            f"inference-perf's protocol (kvroute/bench/tiers_stages.py): "
            f"{tiers_stages.GROUPS} groups x {tiers_stages.PROMPTS_PER_GROUP} prompts "
            f"({lengths}{round(tiers_stages.SYSTEM_TOKENS * scale):,}-token system prompt, "
            f"{round(tiers_stages.QUESTION_TOKENS * scale)}-token question, "
            f"{tiers_stages.OUTPUT_TOKENS} tokens out), stages of {args.stage_s:g} s one after another on one fleet, each "
            f"ending when its last request has finished, {args.interval_s:g} s between them; "
            "total (input + output) tokens/s from a stage's first request to its last finish."
        )
    lines = [
        f"## KV tiers: {title} ({started})",
        "",
        f"Command: `{command(args)}`",
        f"Machine: {machine}; wall {time.perf_counter() - wall:,.0f} s. Simulated: {args.replicas} "
        f"replicas of {PRESET} (GPU KV from the preset), CPU tier {CPU_TOKENS_TOTAL:,} tokens "
        f"over the fleet (disk arms: {DISK_CPU_SHARE:g} of it, then the node preset's NVMe), "
        f"loads at the node preset's speeds; {shape}",
        "",
        *body,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record(Path(args.output_md), text)
    return 0


def _run_steady(args: argparse.Namespace) -> list[str]:
    rows: list[Row] = []
    for rate in args.rates:
        for arm in args.arms:
            rows.append(run_arm(rate, arm, args.duration, args.replicas, args.seed))
            print(table(rows)[-1], file=sys.stderr)
    return table(rows)


def _run_stages(args: argparse.Namespace) -> list[str]:
    """Each seed's stages for every arm (the arms of a seed share its arrivals): the first seed's
    table, and with several seeds the spread of the gains over all of them."""
    by_seed: list[list[tiers_stages.StageRow]] = []
    body: list[str] = []
    # llm-d's figures sit beside only a run of llm-d's own shape.
    published = (args.replicas, args.stage_s, args.interval_s) == (8, 60.0, 60.0)
    for seed in range(args.seed, args.seed + args.seeds):
        rows: list[tiers_stages.StageRow] = []
        for arm in args.arms:
            replay = arm_simulator(arm, args.replicas, seed)
            stage_rows = tiers_stages.run_stages(
                args.rates, arm, replay, seed, args.stage_s, args.interval_s, _length_scale(args)
            )
            rows.extend(stage_rows)
            print(f"seed {seed} {arm}: done", file=sys.stderr)
        rows.sort(key=lambda r: (r.rate, args.arms.index(r.arm)))
        by_seed.append(rows)
    # The first seed's stages in full; with more seeds, the spread of their gains after it.
    if args.seeds > 1:
        body += [f"Seed {args.seed} (the other seeds' gains are in the spread below):", ""]
    body += [*tiers_stages.stage_table(by_seed[0], published), ""]
    if args.seeds > 1:
        body += tiers_stages.gain_spread(by_seed, published)
    return body


def _length_scale(args: argparse.Namespace) -> float:
    return tiers_stages.AS_RUN_LENGTH_SCALE if args.prompt_lengths == "as-run" else 1.0


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 5,10,20, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return values


def _arm_list(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if "gpu-only" not in arms:
        raise argparse.ArgumentTypeError("gpu-only is the baseline the gains are against: keep it")
    return arms


def add_tiers_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "tiers",
        help="KV tiers in the simulator: llm-d's tiered workload, GPU-only vs GPU+CPU routing.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rates", type=_float_list, default=[5.0, 10.0, 20.0, 40.0], help="QPS (5,10,20,40)."
    )
    p.add_argument(
        "--arms",
        type=_arm_list,
        default=list(DEFAULT_ARMS),
        help=f"Which to run (default {','.join(DEFAULT_ARMS)}; all: {','.join(ARMS)}).",
    )
    p.add_argument(
        "--protocol",
        choices=("inference-perf", "steady"),
        default="inference-perf",
        help="inference-perf (default): llm-d's published protocol, the rates as stages one "
        "after another on one fleet (tiers_stages.py); steady: --duration of arrivals per rate, "
        "each rate on a cold fleet.",
    )
    p.add_argument(
        "--stage-s",
        type=positive_float,
        default=60.0,
        help="inference-perf: seconds per stage (60).",
    )
    p.add_argument(
        "--interval-s",
        type=non_negative_float,
        default=60.0,
        help="inference-perf: seconds between a stage's last finish and the next stage (60).",
    )
    p.add_argument(
        "--seeds",
        type=positive_int,
        default=1,
        help="inference-perf: seeds to run from --seed on (1); with more, the spread of the gains "
        "over them, the arms of a seed paired on its arrivals and unpaired across seeds.",
    )
    p.add_argument(
        "--prompt-lengths",
        choices=("as-run", "configured"),
        default="as-run",
        help="inference-perf: as-run (default): prompts as long as llm-d's run sent them, "
        "about 5%% over the configured 16,000 + 256 tokens (inference-perf v0.4.0 writes random "
        "token ids as text, which tokenizes into more; its issue #230); configured: 16,000 + 256.",
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        default=300.0,
        help="steady: seconds of arrivals per rate (300).",
    )
    p.add_argument("--replicas", type=positive_int, default=8, help="Replicas (8).")
    p.add_argument("--seed", type=int, default=0, help="Trace and policy seed (0).")
    add_report_args(p)
    p.set_defaults(func=run)
