"""``kvroute bench ...`` subcommands."""

from __future__ import annotations

import argparse
import sys

from kvroute.bench.argtypes import (
    add_report_args,
    add_startup_timeout,
    non_negative_int,
    positive_int,
)
from kvroute.bench.batch_lane import add_batch_bench
from kvroute.bench.budgets import add_budgets_bench
from kvroute.bench.bus_cost import add_bus_cost_bench
from kvroute.bench.dp import add_dp_bench
from kvroute.bench.epp import add_epp_bench
from kvroute.bench.fairness import add_fairness_bench
from kvroute.bench.h2_attacks import add_h2_attacks_bench
from kvroute.bench.index_bench import add_index_bench
from kvroute.bench.mixed import add_mixed_bench
from kvroute.bench.prefix import add_prefix_bench
from kvroute.bench.programs import add_programs_bench
from kvroute.bench.routers import add_routers_bench
from kvroute.bench.send_tokens import add_send_tokens_bench
from kvroute.bench.servers import add_servers_bench
from kvroute.bench.soak_cli import add_soak_bench
from kvroute.bench.status_ab import add_status_bench
from kvroute.bench.streams import add_streams_bench
from kvroute.bench.tiers import add_tiers_bench
from kvroute.bench.tokenize_bench import add_tokenize_bench


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="Benchmarks (results go to BENCHMARKS.md).")
    bench_sub = p.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    _add_overhead(bench_sub)
    add_index_bench(bench_sub)
    add_prefix_bench(bench_sub)
    add_dp_bench(bench_sub)
    add_tokenize_bench(bench_sub)
    add_epp_bench(bench_sub)
    add_h2_attacks_bench(bench_sub)
    add_soak_bench(bench_sub)
    add_streams_bench(bench_sub)
    add_servers_bench(bench_sub)
    add_fairness_bench(bench_sub)
    add_programs_bench(bench_sub)
    add_mixed_bench(bench_sub)
    add_routers_bench(bench_sub)
    add_bus_cost_bench(bench_sub)
    add_budgets_bench(bench_sub)
    add_status_bench(bench_sub)
    add_batch_bench(bench_sub)
    add_send_tokens_bench(bench_sub)
    add_tiers_bench(bench_sub)
    from kvroute.bench.fidelity import add_fidelity_bench
    from kvroute.simulator.cli_replay import add_replay_bench

    add_replay_bench(bench_sub)
    add_fidelity_bench(bench_sub)


def _target_list(text: str) -> tuple[str, ...]:
    from kvroute.bench.overhead import TARGETS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown target(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from: {', '.join(TARGETS)}"
        )
    return names


def _add_overhead(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvroute.bench.overhead import DEFAULT_TARGETS, TARGETS

    p = sub.add_parser(
        "overhead",
        help="The router's own overhead vs direct access and peer routers (one run).",
        description=(
            "Start N instant-answer stub upstreams, then measure, one after another with the "
            "same load: direct access to the first stub, kvroute (round_robin and its default "
            "policy), vllm-router (round_robin, cache_aware) and smg (cache_aware). Prints "
            "requests/s, p50/p99 latency, errors and the ratios to direct; appends the table "
            "and the command that reproduces it to BENCHMARKS.md. Compare ratios within a run: "
            "absolute numbers depend on the machine and whatever else runs on it. Peers come "
            "from `pip install -e '.[bench]'`; a missing one is skipped."
        ),
    )
    p.add_argument(
        "--concurrency", type=positive_int, default=32, help="Open connections (default 32)."
    )
    p.add_argument(
        "--duration",
        type=positive_int,
        default=10,
        help="Measured seconds per target, after warmup (default 10).",
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=2,
        help="Unmeasured seconds of the same load before each target's measurement (default 2).",
    )
    p.add_argument(
        "--upstreams", type=positive_int, default=2, help="Stub upstreams to start (default 2)."
    )
    p.add_argument(
        "--targets",
        type=_target_list,
        default=tuple(DEFAULT_TARGETS),
        help=f"Comma list of targets to run, in order (default {','.join(DEFAULT_TARGETS)}; "
        f"all: {','.join(TARGETS)}).",
    )
    p.add_argument("--stream", action="store_true", help="Send streaming requests (SSE).")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="Run the targets this many times, in reverse order every other round, and report "
        "each target's median round and the median of the per-round ratios of kvroute to its "
        "peer (kv_aware to smg cache_aware, round robin to vllm-router round robin): steadier "
        "than one run's ratio on a shared box (default 1).",
    )
    p.add_argument(
        "--workload",
        choices=["fixed", "agent", "agent-plain", "agent-cold", "chat-1k"],
        default="fixed",
        help="fixed (default): one small completion, over and over. agent: chat conversations "
        "that start with --start-kb of history and grow by --turn-kb a request, like a coding "
        "agent's; kvroute tokenizes them exactly (--tokenizer, default the tiny test model's), "
        "the built-in client sends them. agent-plain: the same with a chat template that emits "
        "no special token (role: content lines, over --tokenizer's files). agent-cold: every "
        "request a new conversation of --start-kb (nothing cached: a first turn each time). "
        "chat-1k: short chat completions, a ~1 KB user message each request's own, through wrk "
        "like fixed; kvroute renders the chat template and tokenizes each.",
    )
    p.add_argument(
        "--conversations",
        type=positive_int,
        default=32,
        help="agent: conversations in the run, spread over the connections (default 32).",
    )
    p.add_argument(
        "--start-kb", type=positive_int, default=220, help="agent: history to start with (220)."
    )
    p.add_argument(
        "--turn-kb", type=float, default=2.0, help="agent: KB each request adds (default 2)."
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="The tokenizer kvroute routes with (default: the tiny test model's).",
    )
    p.add_argument(
        "--loadgen",
        choices=["auto", "wrk", "builtin"],
        default="auto",
        help="Load generator: wrk if installed (auto, the default), wrk, or the built-in "
        "asyncio client.",
    )
    p.add_argument("--threads", type=positive_int, default=2, help="wrk threads (default 2).")
    p.add_argument(
        "--model", default="stub-model", help="Model name the stubs serve and requests ask for."
    )
    add_startup_timeout(p, float)
    p.add_argument(
        "--peer-bin-dir",
        metavar="DIR",
        help="Where vllm-router and smg are installed (searched before this Python's bin "
        "directory and PATH).",
    )
    add_report_args(p)
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="Record each router with py-spy over its measured window (raw stacks in DIR) and "
        "add its top frames to the report.",
    )
    p.set_defaults(func=_cmd_overhead)


def _cmd_overhead(args: argparse.Namespace) -> int:
    from kvroute.bench.harness.processes import exit_status
    from kvroute.bench.loadgen import LoadError
    from kvroute.bench.overhead import Options, run_overhead
    from kvroute.bench.profiling import prepare_profile

    options = Options(
        concurrency=args.concurrency,
        duration_s=args.duration,
        warmup_s=args.warmup,
        upstreams=args.upstreams,
        targets=args.targets,
        stream=args.stream,
        model=args.model,
        loadgen=args.loadgen,
        threads=args.threads,
        startup_timeout_s=args.startup_timeout,
        peer_bin_dir=args.peer_bin_dir,
        output_md=args.output_md,
        record=not args.no_record,
        workload=args.workload,
        conversations=args.conversations,
        start_kb=args.start_kb,
        turn_kb=args.turn_kb,
        tokenizer=args.tokenizer,
        profile_dir=args.profile,
        rounds=args.rounds,
    )
    if args.profile and args.rounds > 1:
        print(
            "kvroute bench overhead: --profile records one round; leave out --rounds",
            file=sys.stderr,
        )
        return 2
    if not prepare_profile("overhead", args.profile):
        return 2
    return exit_status("overhead", lambda: run_overhead(options, sys.argv[1:]), LoadError)
