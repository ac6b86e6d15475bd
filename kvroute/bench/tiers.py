"""``kvroute bench tiers``: KV tiers in the simulator, on llm-d's tiered-cache workload shape.

llm-d's published benchmark (issue 34): 8 replicas of Qwen3-32B TP2 on 16 H100, 250 groups x 5
prompts behind 16K-token system prompts, 256 tokens in and out, 5 to 40 QPS; a working set of
4.64M tokens against 2.38M of GPU KV and 10.5M of CPU. Here the same shape runs through the
simulated fleet (the router's own kv_aware and prefix index, the fast engine model with vLLM's
offloading semantics) four ways at each rate, on one trace:

* ``gpu-only``: no offload tier (the baseline llm-d compares against);
* ``cpu-flat``: a CPU tier, the router counting a block on CPU as on the GPU;
* ``cpu-weights``: a CPU tier, fixed tier weights (llm-d's GPU 1.0 / CPU 0.8);
* ``cpu-time``: a CPU tier, the cost in time (load at PCIe speed vs prefill, kvroute's default);
* ``disk-weights``/``disk-time`` (on request): a CPU tier a quarter of llm-d's, under the working
  set, then the node's NVMe: fixed weights (disk 0.25) against the cost in time.

Throughput is output tokens per second over the makespan (llm-d's measure), its gain against
``gpu-only`` at the same rate; TTFT and the hit rate (tokens from any tier) beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.argtypes import add_report_args, positive_int
from kvroute.bench.harness.host import machine_line, record
from kvroute.kvcore.stats import percentile
from kvroute.simulator.fleet.results import SimResult

# llm-d's published gains of GPU+CPU over GPU-only, by QPS.
LLMD_GAINS = {5.0: 0.11, 10.0: 0.36, 20.0: 1.62, 40.0: 1.86}
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


def run_arm(rate: float, arm: str, duration_s: float, replicas: int, seed: int) -> Row:
    from kvroute.simulator.cli_replay import fleet_defaults, policy_object
    from kvroute.simulator.engine.latency import latency_preset
    from kvroute.simulator.engine.offload import offload_tiers
    from kvroute.simulator.fleet.config import FleetConfig, engine_config
    from kvroute.simulator.fleet.fleet import simulate
    from kvroute.simulator.fleet.units import prepare
    from kvroute.simulator.traces.loader import load_trace

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
    policy = policy_object("kv_aware", seed, params, fleet_defaults(config))
    units = prepare(load_trace(workload(rate, duration_s), "synthetic", seed=seed))
    return _row(rate, arm, simulate(units, policy, config))


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
        llmd = f"{LLMD_GAINS[r.rate]:+.0%}" if r.rate in LLMD_GAINS and r.arm != "gpu-only" else "-"
        lines.append(
            f"| {r.rate:g} | {r.arm} | {r.throughput:,.0f} | {gain} | {llmd} | "
            f"{r.ttft_p50_s:.2f} s | {r.ttft_p99_s:.2f} s | {r.hit_rate:.1%} | "
            f"{r.loaded_share:.1%} |"
        )
    return lines


def command(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every setting spelt out."""
    return (
        f"kvroute bench tiers --rates {','.join(f'{r:g}' for r in args.rates)} "
        f"--arms {','.join(args.arms)} --duration {args.duration:g} --replicas {args.replicas} "
        f"--seed {args.seed}"
    )


def run(args: argparse.Namespace) -> int:
    machine = machine_line()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    wall = time.perf_counter()
    rows: list[Row] = []
    for rate in args.rates:
        for arm in args.arms:
            rows.append(run_arm(rate, arm, args.duration, args.replicas, args.seed))
            print(table(rows)[-1], file=sys.stderr)
    lines = [
        f"## KV tiers: llm-d's tiered workload in the simulator ({started})",
        "",
        f"Command: `{command(args)}`",
        f"Machine: {machine}; wall {time.perf_counter() - wall:,.0f} s. Simulated: {args.replicas} "
        f"replicas of {PRESET} (GPU KV from the preset), CPU tier {CPU_TOKENS_TOTAL:,} tokens "
        f"over the fleet (disk arms: {DISK_CPU_SHARE:g} of it, then the node preset's NVMe), "
        "loads at the node preset's speeds; trace "
        f"`{workload(0, args.duration).replace('rate=0,', 'rate=R,')}`, seed {args.seed}.",
        "",
        *table(rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record(Path(args.output_md), text)
    return 0


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
        "--duration", type=float, default=300.0, help="Seconds of arrivals per rate (300)."
    )
    p.add_argument("--replicas", type=positive_int, default=8, help="Replicas (8).")
    p.add_argument("--seed", type=int, default=0, help="Trace and policy seed (0).")
    add_report_args(p)
    p.set_defaults(func=run)
