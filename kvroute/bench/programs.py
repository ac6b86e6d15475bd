"""``kvroute bench programs``: program-aware fairness measured live, FCFS against
``fairness.by: program``, under saturation and below it.

Emulated replicas (``kvroute replica``: the roofline latency model, KV events on) behind a
router (``kvroute serve``) whose ``limits.max_concurrent_requests`` decides who goes next. The
Claude Code sessions (the committed excerpt by default, or the WEKA trace with ``--trace``) are
replayed through it as ``kvroute replay --live URL --closed-loop --api messages`` does
(simulator/traces/live.py): each session's next turn its recorded tool-call gap (time-scaled)
after its previous answer, each request naming its session as Claude Code does, so the router
finds the programs (a session and its sub-agents). Prompts are scaled down for the emulated
replicas (``--tokens-per-block``, ``--max-prompt-tokens``, ``--max-output-tokens``).

Four runs, each on a fleet started for it (so no run inherits another's cache):

* saturated, FCFS: a small admission limit (``--saturated-slots``), ``fairness.by: tenant``
  with the one tenant every request belongs to, no locality and no reserved slots: arrival
  order;
* saturated, program: the same limit, ``fairness.by: program`` (least attained service first,
  waits bounded by ``--program-max-wait-s``);
* both again below saturation (``--unsaturated-slots``, above the sessions in flight).

Reported per program class (short: at or below the median program size in trace tokens;
long: the rest; simulator/fleet/programs.py): TTFT mean, p50, p99 (from when each request was
due), and the mean program completion time, FCFS and program side by side with their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import (
    add_report_args,
    add_startup_timeout,
    positive_float,
    positive_int,
)
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import (
    Launch,
    kvroute_cli,
    serve_argv,
    start_emulated_with_events,
    start_router,
)
from kvroute.bench.harness.host import machine_line, record
from kvroute.bench.harness.report import reproduce_command

# The committed excerpt (10 sessions, 8 sub-agents, 1,316 requests), in a checkout.
EXCERPT = Path(__file__).resolve().parents[2] / "tests" / "data" / "claude_code_sessions_10.tar.xz"
CLASSES = ("short", "long", "all")
MODEL = "tiny"


@dataclass
class Options:
    trace: str = str(EXCERPT)
    replicas: int = 2
    saturated_slots: int = 2
    unsaturated_slots: int = 64
    time_scale: float = 1e-4
    tokens_per_block: int = 8
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 16
    max_requests: int | None = None
    program_max_wait_s: float = 30.0
    preset: str = "llama-3.1-8b-h100"
    num_blocks: int = 8192
    startup_timeout_s: float = 60.0
    output_md: str = "BENCHMARKS.md"
    no_record: bool = False


@dataclass(frozen=True)
class Run:
    load: str  # "saturated" or "below saturation"
    slots: int
    fairness: str  # "fcfs" or "program"


@dataclass
class Measured:
    run: Run
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def programs(self) -> dict[str, Any]:
        return self.summary.get("programs") or {}


def runs(options: Options) -> list[Run]:
    return [
        Run(load, slots, fairness)
        for load, slots in (
            ("saturated", options.saturated_slots),
            ("below saturation", options.unsaturated_slots),
        )
        for fairness in ("fcfs", "program")
    ]


# -- the fleet -----------------------------------------------------------------------------


def router_config(entries: list[dict[str, str]], run: Run, options: Options) -> dict[str, Any]:
    fairness: dict[str, Any] = {"reserved_slots": 0}
    if run.fairness == "fcfs":  # one tenant, arrival order: no locality to bend it
        fairness.update(by="tenant", locality_bound_tokens=0.0)
    else:
        fairness.update(by="program", program_max_wait_s=options.program_max_wait_s)
    return {
        "replicas": entries,
        "routing": {"tokenizer": "builtin", "block_size": 16},
        "limits": {
            "max_concurrent_requests": run.slots,
            "max_queued_requests": 100_000,
            "queue_timeout_s": 3600.0,
        },
        "fairness": fairness,
        "health": {"interval_s": 0.5},
    }


@contextlib.contextmanager
def fleet(options: Options, run: Run, log_dir: Path) -> Iterator[str]:
    """The replicas and the router in front of them, for one run: the router's URL."""
    cli, timeout_s = kvroute_cli(), options.startup_timeout_s
    with contextlib.ExitStack() as stack:
        (port,) = free_ports(1)
        flags = [
            "--preset", options.preset, "--block-size", "16",
            "--num-gpu-blocks-override", str(options.num_blocks), "--max-num-seqs", "64",
        ]  # fmt: skip
        names = [f"r{i}" for i in range(options.replicas)]
        entries = start_emulated_with_events(
            stack, names, lambda _: flags, MODEL, log_dir, timeout_s
        )
        name = f"router-{run.slots}-{run.fairness}"
        config = log_dir / f"{name}.yaml"
        config.write_text(json.dumps(router_config(entries, run, options)))  # JSON is YAML
        serve = Launch(serve_argv(port, (), "--config", str(config), cli=cli), "/ready")
        url, _ = start_router(stack, name, serve, port, log_dir, timeout_s)
        yield url


def load(options: Options) -> Any:
    from kvroute.simulator.traces import load_trace

    return load_trace(options.trace, "claude-code", max_requests=options.max_requests, seed=0)


def measure(options: Options, echo: Any = print) -> list[Measured]:
    from kvroute.simulator.traces.live import replay_live_async

    trace = load(options)
    measured = []
    with processes.session("kvroute-bench-programs-") as logs:
        for run in runs(options):
            with fleet(options, run, logs) as url:
                summary = asyncio.run(
                    replay_live_async(
                        trace,
                        url,
                        model=MODEL,
                        time_scale=options.time_scale,
                        tokens_per_block=options.tokens_per_block,
                        max_prompt_tokens=options.max_prompt_tokens,
                        max_output_tokens=options.max_output_tokens,
                        concurrency=4096,  # the router's limit is the bottleneck, not the client
                        api="messages",
                        closed_loop=True,
                        echo=None,
                    )
                )
            measured.append(Measured(run, summary))
            if echo:
                echo(
                    f"{run.load}, {run.slots} slots, {run.fairness}: {summary['ok']} ok, "
                    f"{summary['failed']} failed, {summary['wall_s']:.0f} s"
                )
    return measured


# -- the report ----------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _x(fcfs: float | None, program: float | None) -> str:
    if fcfs is None or program is None or program <= 0:
        return "-"
    return f"{fcfs / program:.2f}x"


KEYS = (
    ("TTFT mean", "ttft_mean_s"),
    ("TTFT p50", "ttft_p50_s"),
    ("TTFT p99", "ttft_p99_s"),
    ("completion mean", "completion_mean_s"),
)


def report(measured: list[Measured], options: Options, command: str) -> str:
    by = {(m.run.load, m.run.fairness): m for m in measured}
    first = measured[0].summary
    programs = measured[0].programs
    lines = [
        f"## Program-aware fairness, live on emulated replicas ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        f"{first['trace']} ({first['requests']:,} requests, {programs.get('programs', 0)} "
        f"programs; short = up to {programs.get('short_max_tokens', 0):,} trace tokens) replayed "
        f"in closed loop through `kvroute serve` with Anthropic Messages requests naming "
        f"their sessions as Claude Code does (metadata.user_id), time x{options.time_scale:g} "
        f"(tool-call gaps and session starts), prompts at {options.tokens_per_block} tokens "
        f"per {first['trace_block_tokens']}-token block capped at {options.max_prompt_tokens}, "
        f"at most {options.max_output_tokens} output tokens; {options.replicas} emulated "
        f"replicas (`kvroute replica`, {options.preset} latency model). FCFS: "
        f"fairness.by tenant, one tenant, no locality; program: fairness.by program, "
        f"program_max_wait_s {options.program_max_wait_s:g}. Saturated: "
        f"limits.max_concurrent_requests {options.saturated_slots}; below saturation: "
        f"{options.unsaturated_slots}. Each run on a fleet of its own. Seconds; ratio = FCFS / "
        f"program (above 1: program faster). {machine_line()}.",
        "",
        "| load | class | measure | FCFS | program | FCFS / program |",
        "|---|---|---|---:|---:|---:|",
    ]
    for load in ("saturated", "below saturation"):
        fcfs, program = by[(load, "fcfs")].programs, by[(load, "program")].programs
        for label in CLASSES:
            for name, key in KEYS:
                a, b = fcfs.get(label, {}).get(key), program.get(label, {}).get(key)
                lines.append(f"| {load} | {label} | {name} | {_s(a)} | {_s(b)} | {_x(a, b)} |")
    lines.append("")
    walls = ", ".join(
        f"{m.run.load} {m.run.fairness} {m.summary['wall_s']:.0f} s ({m.summary['failed']} failed)"
        for m in measured
    )
    sat = by[("saturated", "fcfs")].summary.get("ttft_p99_s")
    below = by[("below saturation", "fcfs")].summary.get("ttft_p99_s")
    loaded = f"{sat / below:.1f}x" if sat and below else "-"
    lines += [
        f"Runs: {walls}. FCFS's TTFT p99 over every request, saturated against below "
        f"saturation: {loaded}.",
        "",
    ]
    return "\n".join(lines)


def add_programs_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "programs",
        help="Program-aware fairness live: short and long programs' TTFT and completion, "
        "FCFS vs fairness.by program, saturated and below.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        metavar="PATH",
        default=str(EXCERPT),
        help="Claude Code sessions in the kv-cache-tester (WEKA) format: a tar archive, a "
        "directory or a file (default: the committed 10-session excerpt).",
    )
    p.add_argument(
        "--max-requests",
        type=positive_int,
        metavar="N",
        help="Replay only the trace's first N requests (default all).",
    )
    p.add_argument(
        "--replicas", type=positive_int, default=2, help="Emulated replicas (default 2)."
    )
    p.add_argument(
        "--saturated-slots",
        type=positive_int,
        default=2,
        metavar="N",
        help="limits.max_concurrent_requests of the saturated runs (default 2).",
    )
    p.add_argument(
        "--unsaturated-slots",
        type=positive_int,
        default=64,
        metavar="N",
        help="limits.max_concurrent_requests below saturation (default 64: above the "
        "sessions in flight); more than --saturated-slots.",
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=1e-4,
        metavar="X",
        help="Multiply the trace's session starts and tool-call gaps by X (default 0.0001: "
        "the excerpt's 5 days of sessions in about a minute).",
    )
    p.add_argument(
        "--tokens-per-block",
        type=positive_int,
        default=8,
        metavar="N",
        help="Prompt tokens per trace block (512 tokens) sent (default 8).",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=4096,
        metavar="N",
        help="Cut prompts to N tokens (default 4096; a prefix stays a prefix).",
    )
    p.add_argument(
        "--max-output-tokens",
        type=positive_int,
        default=16,
        metavar="N",
        help="Ask for at most N output tokens per request (default 16).",
    )
    p.add_argument(
        "--program-max-wait-s",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="fairness.program_max_wait_s of the program runs (default 30).",
    )
    add_startup_timeout(p)
    add_report_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if args.unsaturated_slots <= args.saturated_slots:
        print(
            "kvroute bench programs: --unsaturated-slots must be more than --saturated-slots",
            file=sys.stderr,
        )
        return 2
    if not Path(args.trace).exists():
        print(f"kvroute bench programs: no trace at {args.trace} (give --trace)", file=sys.stderr)
        return 2
    options = Options(
        trace=args.trace,
        replicas=args.replicas,
        saturated_slots=args.saturated_slots,
        unsaturated_slots=args.unsaturated_slots,
        time_scale=args.time_scale,
        tokens_per_block=args.tokens_per_block,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_requests=args.max_requests,
        program_max_wait_s=args.program_max_wait_s,
        startup_timeout_s=args.startup_timeout,
        output_md=args.output_md,
        no_record=args.no_record,
    )
    measured = measure(options, echo=lambda line: print(line, flush=True))
    text = report(measured, options, reproduce_command(sys.argv, "programs"))
    print(text)
    if not options.no_record:
        record(Path(options.output_md), text)
    return 0
