"""``kvroute bench soak``'s command line: flags, their checks, and the run."""

from __future__ import annotations

import argparse
import math
import sys

from kvroute.bench.argtypes import add_report_args
from kvroute.bench.harness.processes import exit_status
from kvroute.bench.soak import (
    BLOCK_SIZE,
    SoakOptions,
    cycle_samples,
    measured_samples,
    run_soak,
)
from kvroute.bench.soak_measure import MIN_WINDOW_SAMPLES, window_size
from kvroute.bench.soak_traffic import MIN_BLOCKS


def _positive(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _period(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: never), got {text}")
    return value


def add_soak_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "soak",
        help="Hours of mixed traffic with faults: do RSS, fds, index and in-flight stay flat?",
        description=(
            "Start one kvroute serve that launches and supervises emulated replicas (KV events "
            "on, caches small enough to fill and evict), routing with kv_aware. Send mixed "
            "traffic (chat and completions, streamed and not, multi-turn conversations) for "
            "--duration seconds while killing replicas (SIGKILL; serve restarts them), hanging "
            "up streams after a few chunks and sending bad input (which must get 4xx). Sample "
            "the router's RSS, open fds, prefix index entries and in-flight gauges every "
            "--sample-interval seconds. PASS when, after --warmup, the median of the last "
            "window of samples is within 5% of the median of the first (each window a fifth of "
            "the samples and at least one kill cycle: every replica killed once), the in-flight "
            "counters return to 0 once the traffic stops, no request failed unexpectedly and "
            "every killed replica came back. Appends the table and the command to "
            "--output-md. Exits 0 on PASS, 1 on FAIL, 2 when it cannot run."
        ),
    )
    p.add_argument("--duration", type=_positive, default=3600.0, metavar="S",
                   help="Seconds of traffic (default 3600).")  # fmt: skip
    p.add_argument("--warmup", type=float, default=300.0, metavar="S",
                   help="Seconds before growth is measured: caches fill, pools grow (default 300).")  # fmt: skip
    p.add_argument("--rate", type=_positive, default=4.0, metavar="RPS",
                   help="Normal requests per second (default 4).")  # fmt: skip
    p.add_argument("--sample-interval", type=_positive, default=5.0, metavar="S",
                   help="Seconds between samples (default 5).")  # fmt: skip
    p.add_argument("--replicas", type=int, default=3, help="Emulated replicas (default 3).")
    p.add_argument("--blocks", type=int, default=256, metavar="N",
                   help="KV blocks per replica: the index plateaus at about replicas x N (default 256).")  # fmt: skip
    p.add_argument("--kill-every", type=_period, default=60.0, metavar="S",
                   help="Kill a replica every S seconds, in turn (default 60; 0: never).")  # fmt: skip
    p.add_argument("--hang-up-every", type=_period, default=2.0, metavar="S",
                   help="A client hangs up a stream every S seconds (default 2; 0: never).")  # fmt: skip
    p.add_argument("--bad-input-every", type=_period, default=2.0, metavar="S",
                   help="Send bad input every S seconds (default 2; 0: never).")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="Seed of the traffic (default 0).")
    p.add_argument("--startup-timeout", type=_positive, default=120.0, metavar="S",
                   help="Seconds the router and replicas may take to start (default 120).")  # fmt: skip
    add_report_args(p)
    p.set_defaults(func=_cmd_soak)


def _usage_error(args: argparse.Namespace) -> str | None:
    if args.replicas < 1:
        return "--replicas must be at least 1"
    if args.blocks < MIN_BLOCKS:
        return (
            f"--blocks must be at least {MIN_BLOCKS}: the longest conversation's last turn and "
            f"its answer need about 75 KV blocks of {BLOCK_SIZE} tokens, got {args.blocks}"
        )
    if not 0 <= args.warmup < args.duration:
        return f"--warmup must be within [0, --duration), got {args.warmup:g}"
    measured = measured_samples(args.duration, args.warmup, args.sample_interval)
    cycle = cycle_samples(args.kill_every, args.replicas, args.sample_interval)
    if measured < 2 * window_size(measured, cycle):
        return (
            f"only {measured} samples after the warm-up: growth needs two windows of at least "
            f"{max(MIN_WINDOW_SAMPLES, cycle)} (each spans a kill cycle, {args.replicas} "
            f"replicas x --kill-every {args.kill_every:g} s): lengthen --duration, or shorten "
            "--warmup, --kill-every or --sample-interval"
        )
    return None


def _cmd_soak(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem:
        print(f"kvroute bench soak: {problem}", file=sys.stderr)
        return 2
    options = SoakOptions(
        duration_s=args.duration,
        warmup_s=args.warmup,
        rate=args.rate,
        sample_interval_s=args.sample_interval,
        replicas=args.replicas,
        blocks=args.blocks,
        kill_every_s=args.kill_every,
        hang_up_every_s=args.hang_up_every,
        bad_input_every_s=args.bad_input_every,
        seed=args.seed,
        startup_timeout_s=args.startup_timeout,
        output_md=args.output_md,
        record=not args.no_record,
    )
    return exit_status("soak", lambda: run_soak(options, sys.argv[1:]))
