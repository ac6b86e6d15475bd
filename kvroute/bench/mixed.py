"""``kvroute bench mixed``: a mixed pool live, fast and slow emulated replicas side by side.

Emulated replicas (``kvroute replica``: the roofline latency model, KV events on) behind
``kvroute serve``: ``--replicas`` of ``--preset`` and as many of it at ``--slow-speed`` times
its pace (``NAME@SPEED``), against a pool of twice ``--replicas`` all at the average speed. A
trace (Mooncake's conversations by default: the committed excerpt) is replayed through each as
``kvroute replay --live URL`` does (simulator/traces/live.py), its prompts scaled down for the
emulators (``--tokens-per-block``, ``--max-prompt-tokens``) and its arrivals sped up
(``--time-scale``).

Runs, each on a fleet started for it (so none inherits another's cache): the mixed pool with
kv_aware's cost in time (``cost_unit: time``), the same with each replica's speed told the
router (``replicas[].speed``: ``time-told``), in relative speed (``speed``), in tokens,
least_loaded and power_of_two; the
pool of average replicas with kv_aware (its replicas alike: the time cost equals the token one
there). Reported: TTFT p50/p99, the share of requests the fast replicas served, failures.
Targets (issue 34): the mixed pool's TTFT p99 no worse than the average pool's, and better
than load-only routing's; with ``--rounds K`` the runs take turns K times and each target is
judged by the median of its per-round ratios.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.backends.launcher import preset_speed
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

EXCERPT = Path(__file__).resolve().parents[2] / "tests" / "data" / "mooncake_conversation_600.jsonl"
MODEL = "tiny"


@dataclass
class Options:
    trace: str = str(EXCERPT)
    replicas: int = 2  # of each kind; the average pool has twice as many
    preset: str = "llama-3.1-70b-4xh100"
    slow_speed: float = 0.5
    time_scale: float = 0.25
    tokens_per_block: int = 64
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 32
    max_requests: int | None = None
    num_blocks: int = 4096
    startup_timeout_s: float = 60.0
    output_md: str = "BENCHMARKS.md"
    no_record: bool = False
    rounds: int = 1
    runs: tuple[Run, ...] = ()  # () : every one of RUNS

    @property
    def average_speed(self) -> float:
        return (1.0 + self.slow_speed) / 2


@dataclass(frozen=True)
class Run:
    pool: str  # "mixed" or "average"
    policy: str
    cost_unit: str | None = None  # kv_aware's
    # The router told each replica's speed (``replicas[].speed``), as an operator who knows
    # its cards would: its lines start there instead of all at the same prior.
    told: bool = False

    @property
    def label(self) -> str:
        told = ", speeds told" if self.told else ""
        return self.policy + (f" ({self.cost_unit}{told})" if self.cost_unit else "")

    @property
    def key(self) -> str:
        """Its name in ``--policies``."""
        return (self.cost_unit or self.policy) + ("-told" if self.told else "")


RUNS = (
    Run("mixed", "kv_aware", "time"),
    Run("mixed", "kv_aware", "time", told=True),
    Run("mixed", "kv_aware", "speed"),
    Run("mixed", "kv_aware", "tokens"),
    Run("mixed", "least_loaded"),
    Run("mixed", "power_of_two"),
    Run("average", "kv_aware", "tokens"),
)


# --policies names each of RUNS by its cost unit or policy; the average pool always runs.
POLICY_NAMES = {r.key: r for r in RUNS if r.pool == "mixed"}


@dataclass
class Measured:
    run: Run
    fast: frozenset[str]
    summary: dict[str, Any] = field(default_factory=dict)
    # Per replica, kv_aware's learnt TTFT line at the end (base s, s per token); {} without.
    lines: dict[str, tuple[float, float]] = field(default_factory=dict)
    round: int = 0

    @property
    def fast_share(self) -> float | None:
        served: dict[str, int] = self.summary.get("requests_per_replica") or {}
        total = sum(served.values())
        if not total or not self.fast:
            return None
        return float(sum(n for name, n in served.items() if name in self.fast)) / total


def presets(options: Options, pool: str) -> list[str]:
    """Each replica's preset, fast and slow interleaved in the mixed pool."""
    n = options.replicas
    if pool == "average":
        return [f"{options.preset}@{options.average_speed:g}"] * (2 * n)
    slow = f"{options.preset}@{options.slow_speed:g}"
    return [name for _ in range(n) for name in (options.preset, slow)]


def router_config(
    entries: list[dict[str, Any]], run: Run, speeds: list[float] | None = None
) -> dict[str, Any]:
    """``speeds``: each replica's, told the router when ``run.told``."""
    if run.told and speeds is not None:
        entries = [{**e, "speed": speed} for e, speed in zip(entries, speeds, strict=True)]
    policy: dict[str, Any] = {"name": run.policy}
    if run.cost_unit:
        policy["params"] = {"cost_unit": run.cost_unit}
    return {
        "replicas": entries,
        "routing": {"tokenizer": "builtin", "block_size": 16},
        "policy": policy,
        "health": {"interval_s": 0.5},
    }


@contextlib.contextmanager
def fleet(options: Options, run: Run, log_dir: Path) -> Iterator[tuple[str, frozenset[str]]]:
    """The replicas and the router for one run: its URL and the fast replicas' names."""
    cli, timeout_s = kvroute_cli(), options.startup_timeout_s
    kinds = presets(options, run.pool)
    with contextlib.ExitStack() as stack:
        (port,) = free_ports(1)

        def flags(i: int) -> list[str]:
            return [
                "--preset", kinds[i], "--block-size", "16",
                "--num-gpu-blocks-override", str(options.num_blocks), "--max-num-seqs", "64",
            ]  # fmt: skip

        names = [
            f"{'fast' if kind == options.preset else 'slow'}-{i}" for i, kind in enumerate(kinds)
        ]
        entries = start_emulated_with_events(stack, names, flags, MODEL, log_dir, timeout_s)
        label = f"router-{run.pool}-{run.key}"
        config = log_dir / f"{label}.yaml"
        speeds = [preset_speed(kind) for kind in kinds]
        config.write_text(json.dumps(router_config(entries, run, speeds)))  # JSON is YAML
        serve = Launch(serve_argv(port, (), "--config", str(config), cli=cli), "/ready")
        url, _ = start_router(stack, label, serve, port, log_dir, timeout_s)
        fast = frozenset(n for n in names if n.startswith("fast")) if run.pool == "mixed" else None
        yield url, fast or frozenset()


async def learnt_lines(url: str) -> dict[str, tuple[float, float]]:
    """The router's learnt TTFT line per replica (its /admin/replicas, open on loopback)."""
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"{url}/admin/replicas") as resp:
        body = await resp.json()
    return {
        row["name"]: (row["latency"]["ttft_base_s"], row["latency"]["prefill_s_per_token"])
        for row in body.get("replicas", [])
        if row.get("latency")
    }


def measure(options: Options, echo: Any = print) -> list[Measured]:
    from kvroute.simulator.traces import load_trace
    from kvroute.simulator.traces.live import replay_live_async

    trace = load_trace(options.trace, None, max_requests=options.max_requests, seed=0)
    measured = []
    runs = options.runs or RUNS
    with processes.session("kvroute-bench-mixed-") as logs:
        for round_, run in ((k, r) for k in range(options.rounds) for r in runs):
            with fleet(options, run, logs) as (url, fast):
                summary = asyncio.run(
                    replay_live_async(
                        trace,
                        url,
                        model=MODEL,
                        time_scale=options.time_scale,
                        tokens_per_block=options.tokens_per_block,
                        max_prompt_tokens=options.max_prompt_tokens,
                        max_output_tokens=options.max_output_tokens,
                        concurrency=4096,
                        echo=None,
                    )
                )
                lines = asyncio.run(learnt_lines(url))
            m = Measured(run, fast, summary, lines, round_)
            measured.append(m)
            if echo:
                echo(
                    f"round {round_ + 1}: {run.pool} {run.label}: TTFT p99 {_s(summary.get('ttft_p99_s'))} s, "
                    f"{summary['ok']} ok, {summary['failed']} failed, {summary['wall_s']:.0f} s"
                )
    return measured


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report(measured: list[Measured], options: Options, command: str) -> str:
    first = measured[0].summary
    n = options.replicas
    lines = [
        f"## Mixed pools, live on emulated replicas ({time.strftime('%Y-%m-%d %H:%M UTC')})",
        "",
        f"`{command}`",
        "",
        f"{first['trace']} ({first['requests']:,} requests) replayed through `kvroute serve` "
        f"(`kvroute replay --live`), arrivals x{options.time_scale:g} in time, prompts at "
        f"{options.tokens_per_block} tokens per {first['trace_block_tokens']}-token block capped "
        f"at {options.max_prompt_tokens}, at most {options.max_output_tokens} output tokens. "
        f"Mixed pool: {n} x {options.preset} and {n} x {options.preset}@{options.slow_speed:g}; "
        f"average pool: {2 * n} x {options.preset}@{options.average_speed:g}. Emulated "
        f"replicas, {options.num_blocks} KV blocks of 16 each; a fleet per run. {machine_line()}.",
        "",
        "| round | pool | policy | TTFT p50 s | TTFT p99 s | p99 vs average pool "
        "| fast replicas' share | failed |",
        "|--:|---|---|---:|---:|---:|---:|---:|",
    ]
    averages = {m.round: m for m in measured if m.run.pool == "average"}
    for m in measured:
        average = averages.get(m.round)
        base = average.summary.get("ttft_p99_s") if average else None
        p99 = m.summary.get("ttft_p99_s")
        ratio = f"{p99 / base:.2f}x" if p99 and base else "-"
        share = m.fast_share
        lines.append(
            f"| {m.round + 1} | {m.run.pool} | {m.run.label} | {_s(m.summary.get('ttft_p50_s'))} "
            f"| {_s(p99)} | {ratio} | {'-' if share is None else f'{share:.0%}'} "
            f"| {m.summary['failed']} |"
        )
    lines += ["", *verdicts(measured)]
    learnt = [m for m in measured if m.lines]
    if learnt:
        lines.append("")
        lines.append(
            "kv_aware's learnt TTFT lines at the end of each run (base ms + us per token):"
        )
        for m in learnt:
            each = ", ".join(
                f"{name} {base * 1e3:.0f} + {slope * 1e6:.0f}"
                for name, (base, slope) in sorted(m.lines.items())
            )
            lines.append(f"- {m.run.pool} {m.run.label}: {each}")
    lines.append("")
    return "\n".join(lines)


def verdicts(measured: list[Measured]) -> list[str]:
    """The targets, each judged by its ratio in every round (the median, with more rounds:
    the p99 of a few hundred requests moves with the box's load more than with the policy)."""
    rounds = sorted({m.round for m in measured})
    by = {(m.round, m.run.pool, m.run.label): m.summary.get("ttft_p99_s") for m in measured}
    ratios: dict[tuple[str, str], list[float]] = {}
    for k in rounds:
        average = by.get((k, "average", "kv_aware (tokens)"))
        load_only = [by.get((k, "mixed", p)) for p in ("least_loaded", "power_of_two")]
        best = min((v for v in load_only if v), default=None)
        for unit in ("time", "time, speeds told", "speed"):
            mine = by.get((k, "mixed", f"kv_aware ({unit})"))
            if mine and average:
                ratios.setdefault((unit, "average"), []).append(mine / average)
            if mine and best:
                ratios.setdefault((unit, "load-only"), []).append(mine / best)
    lines = []
    for (unit, against), values in ratios.items():
        value = statistics.median(values)
        if against == "average":
            what, met = "average pool's", value <= 1
            target = "<= 1"
        else:
            what, met = "the better load-only policy's", value < 1
            target = "< 1"
        each = f" (median of {len(values)} rounds: {', '.join(f'{v:.2f}' for v in values)})"
        lines.append(
            f"- mixed pool, kv_aware ({unit}), TTFT p99 / {what}: {value:.2f}"
            f"{each if len(values) > 1 else ''} (target {target}): "
            f"{'met' if met else 'NOT met'}"
        )
    return lines


def add_mixed_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mixed",
        help="A mixed pool live: fast and half-speed emulated replicas, kv_aware's time cost "
        "against its token cost, load-only routing and a pool of the average speed.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        metavar="PATH",
        default=str(EXCERPT),
        help="A trace (Mooncake, Azure, ...; default: the committed 600-request Mooncake excerpt).",
    )
    p.add_argument("--max-requests", type=positive_int, metavar="N", help="The first N only.")
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=2,
        help="Replicas of each kind (default 2: 2 fast + 2 slow, against 4 average).",
    )
    p.add_argument(
        "--preset",
        default="llama-3.1-70b-4xh100",
        metavar="NAME",
        help="The fast replicas' latency preset (default llama-3.1-70b-4xh100).",
    )
    p.add_argument(
        "--slow-speed",
        type=positive_float,
        default=0.5,
        metavar="X",
        help="The slow replicas' pace, a share of the fast ones' (default 0.5).",
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=0.25,
        metavar="X",
        help="Multiply the trace's arrival times by X (default 0.25: 4x its rate).",
    )
    p.add_argument(
        "--tokens-per-block",
        type=positive_int,
        default=64,
        metavar="N",
        help="Prompt tokens sent per trace block (default 64).",
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
        default=32,
        metavar="N",
        help="Ask for at most N output tokens per request (default 32).",
    )
    p.add_argument(
        "--policies",
        metavar="NAME,...",
        help=f"The mixed pool's runs, of {', '.join(POLICY_NAMES)} (default all; the average "
        "pool always runs).",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        metavar="K",
        help="Times the runs take turns (default 1); the targets are judged by the median of "
        "the per-round ratios.",
    )
    add_startup_timeout(p)
    add_report_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if not Path(args.trace).exists():
        print(f"kvroute bench mixed: no trace at {args.trace} (give --trace)", file=sys.stderr)
        return 2
    if args.slow_speed >= 1:
        print("kvroute bench mixed: --slow-speed must be below 1", file=sys.stderr)
        return 2
    runs: tuple[Run, ...] = ()
    if args.policies:
        names = [name.strip() for name in args.policies.split(",")]
        unknown = [name for name in names if name not in POLICY_NAMES]
        if unknown:
            print(
                f"kvroute bench mixed: --policies takes {', '.join(POLICY_NAMES)}; "
                f"got {unknown[0]!r}",
                file=sys.stderr,
            )
            return 2
        runs = (*(POLICY_NAMES[name] for name in names), RUNS[-1])
    options = Options(
        trace=args.trace,
        replicas=args.replicas,
        preset=args.preset,
        slow_speed=args.slow_speed,
        time_scale=args.time_scale,
        tokens_per_block=args.tokens_per_block,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_requests=args.max_requests,
        startup_timeout_s=args.startup_timeout,
        output_md=args.output_md,
        no_record=args.no_record,
        rounds=args.rounds,
        runs=runs,
    )
    measured = measure(options, echo=lambda line: print(line, flush=True))
    text = report(measured, options, reproduce_command(sys.argv, "mixed"))
    print(text)
    if not options.no_record:
        record(Path(options.output_md), text)
    return 0
