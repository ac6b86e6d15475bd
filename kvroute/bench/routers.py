"""``kvroute bench routers``: the cost of several routers, live, and what sharing wins back.

N ``kvroute serve`` routers in front of the same emulated replicas (``kvroute replica``: the
roofline latency model, KV events on), request i of the trace sent to router i % N (spread
evenly, as a round-robin load balancer does; a session's turns land on different routers).
Every router follows every replica's KV events, so they agree on the prefix index; what each
lacks without a bus is the others' in-flight requests and predictions. With ``--share bus``
they publish them over NATS (``routing.ledger_bus``; ``nats-server`` on PATH) and replay each
other's. The simulator's ``kvroute replay --routers N --share bus`` models the same.

Each (N, share) runs on a fleet started for it, so no run inherits another's cache. Reported:
the fleet's prefix-cache hit rate (the replicas' own counters), TTFT p50 and p99, each against
one router's. With ``--rounds K`` the set-ups take turns K times and each is judged by the
median over rounds of its ratio to the same round's one router: a light load's p99 is a few
requests, and the box's load moves it more than the routers do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import add_report_args, add_startup_timeout, positive_float
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import (
    Launch,
    kvroute_cli,
    serve_argv,
    start_emulated_with_events,
    start_router,
)
from kvroute.bench.harness.host import machine_line, record
from kvroute.bench.harness.nats import nats_server
from kvroute.bench.harness.procs import process_cpu_s
from kvroute.bench.harness.report import reproduce_command
from kvroute.bench.programs import EXCERPT, MODEL
from kvroute.simulator.engine.latency import latency_preset

SHARES = ("none", "bus")


@dataclass
class Options:
    trace: str = str(EXCERPT)
    replicas: int = 4
    routers: tuple[int, ...] = (1, 2, 4)
    shares: tuple[str, ...] = SHARES
    time_scale: float = 2e-4
    tokens_per_block: int = 8
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 16
    max_requests: int | None = None
    concurrency: int = 4096  # requests in flight at most (the client's connections)
    preset: str = "llama-3.1-8b-h100"
    num_blocks: int = 2048
    startup_timeout_s: float = 60.0
    output_md: str = "BENCHMARKS.md"
    no_record: bool = False
    rounds: int = 1


@dataclass(frozen=True)
class Run:
    routers: int
    share: str  # "none" or "bus"; one router shares nothing


def runs(options: Options) -> list[Run]:
    out = []
    for n in options.routers:
        for share in options.shares if n > 1 else ("none",):
            out.append(Run(n, share))
    return out


@contextlib.contextmanager
def fleet(options: Options, run: Run, log_dir: Path) -> Iterator[list[tuple[str, int]]]:
    """The replicas, a NATS server for a bus, and the routers: the routers' URLs and pids."""
    cli, timeout_s = kvroute_cli(), options.startup_timeout_s
    with contextlib.ExitStack() as stack:
        bus = stack.enter_context(nats_server(log_dir)) if run.share == "bus" else None
        router_ports = free_ports(run.routers)
        flags = [
            "--preset", options.preset, "--block-size", "16",
            "--num-gpu-blocks-override", str(options.num_blocks), "--max-num-seqs", "64",
        ]  # fmt: skip
        names = [f"r{i}" for i in range(options.replicas)]
        entries = start_emulated_with_events(
            stack, names, lambda _: flags, MODEL, log_dir, timeout_s
        )
        routing: dict[str, Any] = {"tokenizer": "builtin", "block_size": 16}
        if bus is not None:
            routing["ledger_bus"] = bus
        config = log_dir / f"router-{run.routers}-{run.share}.yaml"
        body = {"replicas": entries, "routing": routing, "health": {"interval_s": 0.5}}
        config.write_text(json.dumps(body))  # JSON is YAML
        routers = []
        for k, port in enumerate(router_ports):
            serve = Launch(serve_argv(port, (), "--config", str(config), cli=cli), "/ready")
            url, child = start_router(stack, f"router-{k}", serve, port, log_dir, timeout_s)
            routers.append((url, child.pid))
        yield routers


@dataclass
class Measured:
    run: Run
    summary: dict[str, Any]
    round: int = 0


def measure(options: Options, echo: Any = print) -> list[Measured]:
    from kvroute.simulator.traces import load_trace
    from kvroute.simulator.traces.live import replay_live_async

    trace = load_trace(options.trace, "claude-code", max_requests=options.max_requests, seed=0)
    measured = []
    with processes.session("kvroute-bench-routers-") as logs:
        for round_, run in ((k, r) for k in range(options.rounds) for r in runs(options)):
            with fleet(options, run, logs) as routers:
                urls = [url for url, _ in routers]
                cpu_before = sum(process_cpu_s(pid) for _, pid in routers)
                summary = asyncio.run(
                    replay_live_async(
                        trace,
                        urls[0],
                        model=MODEL,
                        time_scale=options.time_scale,
                        tokens_per_block=options.tokens_per_block,
                        max_prompt_tokens=options.max_prompt_tokens,
                        max_output_tokens=options.max_output_tokens,
                        concurrency=options.concurrency,
                        api="messages",
                        closed_loop=True,
                        echo=None,
                        also=urls[1:],
                    )
                )
                # The routers' own CPU over the replay (all of them): what a bus adds.
                summary["routers_cpu_s"] = (
                    sum(process_cpu_s(pid) for _, pid in routers) - cpu_before
                )
            measured.append(Measured(run, summary, round_))
            if echo:
                echo(
                    f"round {round_ + 1}: {run.routers} routers, share {run.share}: "
                    f"{summary['ok']} ok, "
                    f"{summary['failed']} failed, hit rate {summary.get('prefix_hit_rate')}, "
                    f"TTFT p99 {summary.get('ttft_p99_s')}, routers' CPU "
                    f"{summary['routers_cpu_s']:.1f} s, {summary['wall_s']:.0f} s"
                )
    return measured


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def report(measured: list[Measured], options: Options, command: str) -> str:
    first = measured[0].summary
    lines = [
        f"## Several routers, live on emulated replicas ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        f"{first['trace']} ({first['requests']:,} requests) replayed in closed loop (each "
        f"session's next turn its recorded tool-call gap after the last answer, time "
        f"x{options.time_scale:g}) as Anthropic Messages requests, request i to router i % N; "
        f"prompts at {options.tokens_per_block} tokens per {first['trace_block_tokens']}-token "
        f"block capped at {options.max_prompt_tokens}, at most {options.max_output_tokens} "
        f"output tokens, at most {options.concurrency} requests in flight; {options.replicas} emulated replicas ({options.preset} latency model, "
        f"{options.num_blocks} KV blocks of 16 tokens each), `kvroute serve` routers with "
        f"kv_aware; share bus = routing.ledger_bus on one nats-server. Each run on a fleet of "
        f"its own. {machine_line()}.",
        "",
        "| round | routers | share | hit rate | vs 1 router | TTFT p50 s | TTFT p99 s "
        "| p99 vs 1 router | routers' CPU ms/request | failed |",
        "|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    ones = {m.round: m.summary for m in measured if m.run.routers == 1}
    for m in measured:
        one = ones.get(m.round)
        s = m.summary
        hit, p50, p99 = s.get("prefix_hit_rate"), s.get("ttft_p50_s"), s.get("ttft_p99_s")
        base_hit = one.get("prefix_hit_rate") if one else None
        base_p99 = one.get("ttft_p99_s") if one else None
        lines.append(
            f"| {m.round + 1} | {m.run.routers} | {m.run.share if m.run.routers > 1 else '-'} | "
            f"{'-' if hit is None else f'{hit * 100:.1f}%'} | {_ratio(hit, base_hit)} | "
            f"{'-' if p50 is None else f'{p50:.3f}'} | {'-' if p99 is None else f'{p99:.3f}'} | "
            f"{_ratio(p99, base_p99)} | {_cpu_per_request(s)} | {s['failed']} |"
        )
    if options.rounds > 1 and ones:
        lines += ["", *_medians(measured, ones)]
    lines.append("")
    return "\n".join(lines)


def _medians(measured: list[Measured], ones: dict[int, dict[str, Any]]) -> list[str]:
    """Per set-up, the median over rounds of its ratios to the same round's one router."""
    lines = [
        "Median over rounds of each round's ratio to that round's one router:",
        "",
        "| routers | share | hit rate vs 1 router | TTFT p50 vs 1 router | TTFT p99 vs 1 router |",
        "|--:|---|--:|--:|--:|",
    ]
    for run in dict.fromkeys(m.run for m in measured if m.run.routers > 1):
        cells = []
        for key in ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s"):
            ratios = [
                m.summary[key] / ones[m.round][key]
                for m in measured
                if m.run == run
                and m.round in ones
                and m.summary.get(key) is not None
                and ones[m.round].get(key)
            ]
            cells.append(f"{statistics.median(ratios):.2f}x" if ratios else "-")
        lines.append(f"| {run.routers} | {run.share} | {' | '.join(cells)} |")
    return lines


def _cpu_per_request(summary: dict[str, Any]) -> str:
    cpu, requests = summary.get("routers_cpu_s"), summary.get("ok", 0) + summary.get("failed", 0)
    return "-" if cpu is None or not requests else f"{cpu / requests * 1e3:.2f}"


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"router counts must be at least 1, got {text!r}")
    return counts


def _shares(text: str) -> tuple[str, ...]:
    shares = tuple(part.strip() for part in text.split(","))
    bad = [s for s in shares if s not in SHARES]
    if bad:
        raise argparse.ArgumentTypeError(f"--share takes {', '.join(SHARES)}; got {bad[0]!r}")
    return shares


def add_routers_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "routers",
        help="Several kvroute serve routers in front of one fleet, requests spread evenly: "
        "hit rate and TTFT against one router, sharing nothing or over a NATS bus.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        metavar="PATH",
        default=str(EXCERPT),
        help="Claude Code sessions in the kv-cache-tester (WEKA) format (default: the committed "
        "10-session excerpt).",
    )
    p.add_argument("--max-requests", type=int, metavar="N", help="The trace's first N requests.")
    p.add_argument("--replicas", type=int, default=4, help="Emulated replicas (default 4).")
    p.add_argument(
        "--routers",
        type=_counts,
        default=(1, 2, 4),
        metavar="N,N,...",
        help="Router counts to measure (default 1,2,4).",
    )
    p.add_argument(
        "--share",
        type=_shares,
        default=SHARES,
        metavar="MODE,...",
        help="What several routers share: none, bus (default both).",
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=2e-4,
        metavar="X",
        help="Multiply the trace's session starts and tool-call gaps by X (default 0.0002).",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="Cap each prompt at N tokens (default 4096). Longer prompts: more prefill per "
        "request, and longer block hash lists on the bus.",
    )
    p.add_argument(
        "--preset",
        default="llama-3.1-8b-h100",
        metavar="NAME[@SPEED]",
        help="The emulated replicas' latency model (default llama-3.1-8b-h100; @0.25: a quarter "
        "of its speed, so the replicas, not the box's CPU, saturate first).",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=4096,
        metavar="N",
        help="Requests in flight at most (default 4096: the trace's own). With a trace of many "
        "sessions and a small --time-scale, the load nears saturation; this caps it.",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="K",
        help="Times the set-ups take turns (default 1); with more, each is judged by the median "
        "of its per-round ratios to one router.",
    )
    add_startup_timeout(p)
    add_report_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if not Path(args.trace).exists():
        print(f"kvroute bench routers: no trace at {args.trace} (give --trace)", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("kvroute bench routers: --replicas must be at least 1", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("kvroute bench routers: --rounds must be at least 1", file=sys.stderr)
        return 2
    if args.concurrency < 1 or args.max_prompt_tokens < 16:
        print(
            "kvroute bench routers: --concurrency must be at least 1, --max-prompt-tokens 16",
            file=sys.stderr,
        )
        return 2
    try:
        latency_preset(args.preset)
    except ValueError as exc:
        print(f"kvroute bench routers: --preset: {exc}", file=sys.stderr)
        return 2
    options = Options(
        trace=args.trace,
        concurrency=args.concurrency,
        preset=args.preset,
        max_prompt_tokens=args.max_prompt_tokens,
        replicas=args.replicas,
        routers=args.routers,
        shares=args.share,
        time_scale=args.time_scale,
        max_requests=args.max_requests,
        startup_timeout_s=args.startup_timeout,
        output_md=args.output_md,
        no_record=args.no_record,
        rounds=args.rounds,
    )
    try:
        measured = measure(options, echo=lambda line: print(line, flush=True))
    except processes.StartError as exc:
        print(f"kvroute bench routers: {exc}", file=sys.stderr)
        return 1
    text = report(measured, options, reproduce_command(sys.argv, "routers"))
    print(text)
    if not options.no_record:
        record(Path(options.output_md), text)
    return 0
