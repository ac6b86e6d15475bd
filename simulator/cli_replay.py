"""``kvroute replay`` and ``kvroute plan``: replay traces through simulated fleets.

``replay`` simulates one policy (or several with ``--compare``) on a fleet of engine models,
prints a summary table and writes ``summary.json``, ``report.md`` and PNG plots to ``--out``;
with ``--live URL`` it replays the trace against a running router instead. ``plan`` finds the
smallest fleet that meets an SLO at the trace's rate and at multiples of it, with its cost.
Bad flags or input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import textwrap
import time
from dataclasses import replace
from typing import Any, cast

from kvroute.kvcore.autoscale import AutoscaleSettings
from kvroute.kvcore.fair_queue import FairnessParams
from kvroute.kvcore.pd import DisaggregationRule, Mode, link_bytes_per_s
from kvroute.kvcore.stats import percentile
from kvroute.policies import DEFAULT_POLICY, POLICIES, PolicyConfigError, build_policy
from kvroute.policies.registry import policy_parameters
from kvroute.simulator import capacity
from kvroute.simulator.batch_cli import (
    BATCH_HELP,
    DIP_HELP,
    batch_report_lines,
    batch_spec,
    batch_summary,
    dip_spec,
)
from kvroute.simulator.engine.latency import (
    DEFAULT_PRESET,
    PRESETS,
    latency_preset,
)
from kvroute.simulator.engine.offload import (
    HOST_BYTES_PER_NODE,
    PCIE_BYTES_PER_S,
    TIER_PRESETS,
    offload_tiers,
)
from kvroute.simulator.fleet import (
    ENGINE_MODELS,
    RANK_ROUTINGS,
    SHARE_MODES,
    FleetConfig,
    SimResult,
    Slo,
    UnitTrace,
    engine_config,
    infinite_cache_hit_rate,
    pooled_lru_hit_rate,
    prepare,
    simulate,
)
from kvroute.simulator.fleet.admission import FAIRNESS, AdmissionSpec, program_of
from kvroute.simulator.fleet.batch import BatchJob, batch_lines
from kvroute.simulator.fleet.bounds import prefill_alone_s
from kvroute.simulator.fleet.mix import (
    Mix,
    apportion,
    describe_counts,
    mix_models,
    mix_size,
    parse_mix,
)
from kvroute.simulator.fleet.pd_outcome import format_pd
from kvroute.simulator.fleet.pd_search import search_pd
from kvroute.simulator.fleet.pd_setup import PD_MODES, PdSetup
from kvroute.simulator.fleet.pd_table import PD_FLEETS, format_pd_plan
from kvroute.simulator.fleet.programs import format_programs
from kvroute.simulator.fleet.regret import comparison_lines, counterfactual
from kvroute.simulator.fleet.report import markdown_report
from kvroute.simulator.fleet.returning import (
    pooled_bound_hits,
    returning_indices,
    returning_summary,
)
from kvroute.simulator.fleet.summary import (
    format_loss,
    format_table,
    replay_warnings,
    summarize,
)
from kvroute.simulator.fleet.units import SimRequest, scaled

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input found after parsing: printed as one line, exit status 2."""


# -- argparse value types ---------------------------------------------------------------


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _slo(text: str) -> Slo:
    """``ttft=S,tpot=S`` (either or both), in seconds."""
    fields: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("ttft", "tpot"):
            raise argparse.ArgumentTypeError(
                f"expected ttft=SECONDS,tpot=SECONDS (either or both), got {text!r}"
            )
        fields[key] = positive_float(value)
    return Slo(fields.get("ttft"), fields.get("tpot"))


def _failure(text: str) -> tuple[int, float]:
    """``K@T``: replica K (0-based) fails T seconds into the replay."""
    replica, sep, at = text.partition("@")
    try:
        if not sep:
            raise ValueError
        k, t = int(replica), float(at)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected REPLICA@SECONDS, e.g. 3@600, got {text!r}"
        ) from None
    if k < 0 or not (math.isfinite(t) and t >= 0):
        raise argparse.ArgumentTypeError(f"replica must be >= 0 and time >= 0, got {text!r}")
    return k, t


def _window(text: str) -> tuple[float, float]:
    """``START:END`` in seconds of the trace's own clock."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        a, b = float(start), float(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not (0 <= a < b and math.isfinite(b)):
        raise argparse.ArgumentTypeError(f"window must satisfy 0 <= START < END, got {text!r}")
    return a, b


def policy_name(text: str) -> str:
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}; choose from: {', '.join(sorted(POLICIES))}"
        )
    return text


def _policy_param(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def _policy_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one policy, e.g. kv_aware,round_robin")
    return [policy_name(n) for n in names]


def _multipliers(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,4, got {text!r}") from None
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"multipliers must be positive numbers, got {text!r}")
    return values


def _pd_counts(text: str) -> tuple[int, int]:
    """``P:D``: prefill and decode replicas, at least 1 each."""
    prefill, sep, decode = text.partition(":")
    try:
        if not sep:
            raise ValueError
        p, d = int(prefill), int(decode)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected P:D (prefill and decode replicas), e.g. 2:6, got {text!r}"
        ) from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(
            f"a P/D fleet needs at least 1 prefill and 1 decode replica, got {text!r}"
        )
    return p, d


def _non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def _kv_link(text: str) -> str:
    """``nvlink``, ``rdma`` or GB/s (kvcore/pd.py's links)."""
    try:
        link_bytes_per_s(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# -- parsers ----------------------------------------------------------------------------


def add_replay_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``replay`` and ``plan`` on the ``kvroute`` command line."""
    from kvroute.simulator.traces import FORMATS, SYNTHETIC_HELP

    replay = sub.add_parser(
        "replay",
        help="Replay a trace through a simulated fleet (or a live router) and report.",
        description=wrapped(
            "Simulate a fleet of vLLM engine models behind the router's own policy code and "
            "prefix index, on a virtual clock: requests arrive as the trace says, the policy "
            "routes them with the load and cache information the live router would have, and "
            "each replica schedules, caches and evicts as vLLM does. Prints a summary and "
            "writes DIR/summary.json, DIR/report.md and PNG plots. --compare runs several "
            "policies on the same trace; --fail K@T removes replica K at T seconds (its "
            "requests resume elsewhere); --routers N puts N routers (endpoint pickers) in front "
            "of the fleet, sharing what --share says; --pd P:D makes it a disaggregated fleet of "
            "P prefill and D decode replicas. --live URL replays against a running router "
            "instead."
        ),
        epilog=SYNTHETIC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_trace_args(replay, FORMATS)
    replay.add_argument(
        "--replicas", type=positive_int, help="Fleet size (default 4; with --pd P:D, P+D)."
    )
    replay.add_argument(
        "--policy",
        type=policy_name,
        default=DEFAULT_POLICY,
        help=f"Routing policy (default {DEFAULT_POLICY}): {', '.join(sorted(POLICIES))}.",
    )
    replay.add_argument(
        "--compare",
        type=_policy_list,
        metavar="P1,P2,...",
        help="Run these policies on the same trace and fleet and tabulate them.",
    )
    _add_fleet_args(replay)
    _add_router_args(replay)
    _add_run_args(replay)
    replay.add_argument(
        "--pd",
        type=_pd_counts,
        metavar="P:D",
        help="A disaggregated fleet of P prefill and D decode replicas (P+D in all): the decode "
        "pool's policy picks each request's decode replica; a request split off (--pd-mode) "
        "prefills on a prefill replica picked by the prefill pool's policy, its KV moves over "
        "--kv-link, and it decodes on its decode replica; the rest run there whole.",
    )
    _add_pd_args(replay, mode=True)
    replay.add_argument(
        "--max-in-flight",
        type=positive_int,
        metavar="N",
        help="The router's admission limit (limits.max_concurrent_requests): at most N "
        "requests in service, the rest wait in its fair queue in the order --fairness says; "
        "TTFT counts the wait. summary.json's 'programs' gives TTFT and completion time for "
        "short and long agent programs.",
    )
    replay.add_argument(
        "--fairness",
        choices=FAIRNESS,
        help="With --max-in-flight: the queue's order: fcfs (arrival order, the default); "
        "tenant (each program a tenant, token-fair shares: fairness.by tenant with the program "
        "as X-Tenant-Id); program (least attained service first: fairness.by program).",
    )
    replay.add_argument(
        "--closed-loop",
        action="store_true",
        help="Agents wait for their answers: a session's next request goes out its recorded "
        "gap (the tool call or the user's think time) after its previous response ends, "
        "instead of at its recorded time, so a slow fleet slows its agents as it would live "
        "(claude-code traces record the gaps; a session's first request and a sub-agent's "
        "first keep their recorded times). With --live too: real agents' pace, gaps scaled by "
        "--time-scale.",
    )
    replay.add_argument(
        "--programs",
        type=positive_int,
        metavar="N",
        help="Keep only the trace's first N agent programs (a session and its sub-agents, in "
        "the order of their first requests). With --closed-loop --programs-in-flight N: N "
        "agents started together and run to their end, none replacing them (a drain, as "
        "llm-d's program-aware fairness runs: sessions = concurrency).",
    )
    replay.add_argument(
        "--max-gap-s",
        type=positive_float,
        metavar="S",
        help="With --closed-loop: wait at most S seconds between a response and its session's "
        "next request, whatever the trace recorded (inference-perf's trace replay caps them "
        "with max_wait_ms; llm-d's program-aware runs at 15 s).",
    )
    replay.add_argument(
        "--programs-in-flight",
        type=positive_int,
        metavar="C",
        help="With --closed-loop: C agent programs (a session and its sub-agents) at a time, "
        "each replaced by the trace's next program when its last request ends, instead of "
        "the sessions' recorded start times: a fixed concurrency of agents, as benchmark "
        "clients keep (simulated fleets only).",
    )
    replay.add_argument(
        "--program-max-wait-s",
        type=positive_float,
        default=300.0,
        metavar="S",
        help="With --fairness program: a request queued this long goes first whatever its "
        "program's service (fairness.program_max_wait_s, default 300).",
    )
    replay.add_argument(
        "--program-attained-weight",
        type=_non_negative_float,
        default=FairnessParams().program_attained_weight,
        metavar="W",
        help="With --fairness program: per token a program received, beside its request's "
        "uncached prompt tokens, in its place in the queue (fairness.program_attained_weight, "
        f"default {FairnessParams().program_attained_weight}; 0: fewest uncached tokens first).",
    )
    replay.add_argument(
        "--program-wait-share",
        type=_share,
        default=FairnessParams().program_wait_share,
        metavar="F",
        help="With --fairness program: the share of the queued requests' wait in their order, "
        "beside their service, each normalised over the queue (fairness.program_wait_share, "
        "default 0: least service alone; llm-d's program-aware order is 0.2).",
    )
    replay.add_argument(
        "--out", metavar="DIR", help="Directory for summary.json, report.md, plots."
    )
    replay.add_argument(
        "--quiet", action="store_true", help="No progress bar (the summary still prints)."
    )
    replay.add_argument(
        "--live",
        metavar="URL",
        help="Replay in real time against the router at URL instead of simulating.",
    )
    replay.add_argument("--model", help="With --live: the model name to send.")
    replay.add_argument("--api-key", help="With --live: bearer token for the router.")
    replay.add_argument(
        "--tokens-per-block",
        type=positive_int,
        metavar="N",
        help="With --live: words per trace block (default: the trace's block size); scales "
        "prompts down for small models, e.g. 16 for Mooncake's 512-token blocks.",
    )
    replay.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        metavar="N",
        help="With --live: cut prompts to N words (a prefix stays a prefix).",
    )
    replay.add_argument(
        "--max-output-tokens",
        type=positive_int,
        metavar="N",
        help="With --live: ask for at most N output tokens per request.",
    )
    replay.add_argument(
        "--concurrency",
        type=positive_int,
        default=64,
        metavar="N",
        help="With --live: requests in flight at most (default 64); a request due while all "
        "are busy waits, and the summary says how late requests went out.",
    )
    replay.add_argument(
        "--api",
        choices=("completions", "chat", "messages", "responses"),
        default="completions",
        help="With --live: the API each request speaks (default completions): the same "
        "prompt as a chat's, Anthropic Messages' or OpenAI Responses' one user message, so "
        "an agent API's routing can be compared with chat's on the same trace. messages "
        "names each request's session as Claude Code does (metadata.user_id; a sub-agent "
        "its parent's), so the router finds the agent programs.",
    )
    # A sweep's cell names its own command (report.md's); a replay's is its argv.
    replay.set_defaults(func=_cmd_replay, command=None)

    plan = sub.add_parser(
        "plan",
        help="Smallest simulated fleet that meets an SLO, at the trace's rate and multiples.",
        description=wrapped(
            "For the trace's own request rate and k times it (--rate-multipliers), find the "
            "smallest number of replicas whose simulated TTFT and TPOT at the SLO quantile stay "
            "within the SLO (doubling, then bisection), and its cost per million tokens "
            "(--gpu-price per GPU-hour, times the preset's GPUs per replica), and the 8-GPU "
            "nodes that hold it. --target-rps R plans for R req/s instead of the trace's rate; "
            "--explain first prints the analytic sizing, step by step from the preset's model "
            "and GPU figures, and afterwards sets it beside the simulated answer. --pd compares "
            "the aggregated fleet with always- and conditionally-disaggregated ones at one rate "
            "and the same SLO. "
            "--kv --context T --batch N needs no trace or SLO: it sizes the KV cache of N "
            "sequences of T tokens against one replica of the preset, and ranks what FP8 KV, "
            "GQA/MLA, a smaller batch, paging with preemption, host offload and context "
            "parallelism buy, with their costs. Capacity-only presets ("
            + ", ".join(sorted(capacity.CAPACITY_PRESETS))
            + ") work with --kv and --explain, not with the simulation."
        ),
        epilog=SYNTHETIC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_trace_args(plan, FORMATS, required=False)
    plan.add_argument(
        "--slo",
        type=_slo,
        metavar="ttft=S,tpot=S",
        help="Targets in seconds (required, except with --kv).",
    )
    plan.add_argument(
        "--slo-quantile",
        type=float,
        default=0.99,
        help="The quantile that must meet the SLO (default 0.99).",
    )
    plan.add_argument(
        "--policy",
        type=policy_name,
        default=DEFAULT_POLICY,
        help="Routing policy (default kv_aware).",
    )
    _add_fleet_args(plan, capacity_presets=True)
    plan.add_argument(
        "--rate-multipliers",
        type=_multipliers,
        metavar="K1,K2",
        help="Also plan for these multiples of the base rate (default 2,4; with --target-rps "
        "none). A 1 among them is the base row, not a second one.",
    )
    plan.add_argument(
        "--target-rps",
        type=positive_float,
        metavar="R",
        help="Size for R requests per second instead of the trace's own rate: the trace's "
        "arrivals are compressed or stretched to R (its requests, prompts and prefixes stay).",
    )
    plan.add_argument(
        "--explain",
        action="store_true",
        help="Before searching, print the analytic sizing from the preset's model and GPU "
        "figures (weights, KV bytes and capacity, decode step roofline, decode and prefill "
        "tokens/s, replicas), each as name = formula = value; after it, the analytic replica "
        "count beside the simulated one and why they differ.",
    )
    plan.add_argument(
        "--kv",
        action="store_true",
        help="KV budget only (no trace, no simulation): does --batch sequences of --context "
        "tokens fit one replica of --preset, by how much not, and the levers ranked by the "
        "capacity each buys, each with its cost in latency or quality.",
    )
    plan.add_argument(
        "--context",
        type=positive_int,
        metavar="TOKENS",
        help="With --kv: tokens per sequence (prompt + output), e.g. 131072.",
    )
    plan.add_argument(
        "--batch", type=positive_int, metavar="N", help="With --kv: sequences decoding at once."
    )
    plan.add_argument(
        "--gpu-price",
        type=_non_negative_float,
        metavar="USD_PER_HOUR",
        help="Price of one GPU-hour, for the cost per million tokens (with --explain, also "
        "the analytic fleet's and pure decode's).",
    )
    plan.add_argument(
        "--max-replicas", type=positive_int, default=1024, help="Give up above (default 1024)."
    )
    _add_day_args(plan)
    plan.add_argument(
        "--pd",
        action="store_true",
        help="At the base rate (the trace's, or --target-rps), size three fleets for the same "
        "SLO and compare them: aggregated (as without --pd), always disaggregated and "
        "conditionally disaggregated (--pd-min-uncached), each P/D fleet the fewest replicas "
        "P+D found meeting the SLO; one table with TTFT and TPOT p50/p99, goodput per GPU and "
        "the share of requests split.",
    )
    _add_pd_args(plan, mode=False)
    plan.add_argument(
        "--batch-job",
        type=batch_spec,
        metavar="lines=N,...",
        help="Also size the fleet for this batch job beside the trace (as kvroute replay "
        "--batch-job: lines=N,input=,output=,shared=,window=,slots=,pace=): the smallest fleet "
        "that meets the SLO and finishes the job within its window, e.g. a day's batch volume "
        "beside a day of online traffic (--repeat, --diurnal).",
    )
    plan.add_argument("--out", metavar="DIR", help="Also write DIR/plan.json.")
    plan.add_argument("--quiet", action="store_true", help="No progress lines.")
    plan.set_defaults(func=_cmd_plan)


def wrapped(text: str) -> str:
    """Pre-wrapped description: the raw formatter (kept for the epilog's layout) wraps nothing."""
    return textwrap.fill(text, width=88)


def _add_trace_args(
    p: argparse.ArgumentParser,
    formats: tuple[str, ...],
    required: bool = True,
    rate_scale: bool = True,
) -> None:
    p.add_argument(
        "--trace",
        required=required,
        metavar="FILE",
        help="Trace file (or, with --format synthetic, a generator spec)"
        + ("." if required else "; required, except with --kv."),
    )
    p.add_argument(
        "--format",
        metavar="FORMAT",
        help=f"One of {', '.join(formats)}, optionally with options after a colon "
        "(default: detect from the file).",
    )
    p.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="Stretch arrivals (2 = half rate)."
    )
    if rate_scale:
        p.add_argument(
            "--rate-scale",
            type=positive_float,
            default=1.0,
            help="Compress arrivals (2 = 2x rate).",
        )
    p.add_argument("--window", type=_window, metavar="START:END", help="Seconds of the trace.")
    p.add_argument("--max-requests", type=positive_int, help="Keep only the first N requests.")
    p.add_argument("--seed", type=int, default=0, help="Seed of policies and generators.")


def _add_fleet_args(
    p: argparse.ArgumentParser, capacity_presets: bool = False, kv_capacity: bool = True
) -> None:
    extra = sorted(capacity.CAPACITY_PRESETS) if capacity_presets else []
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS) + extra,
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=f"Model + GPU latency preset (default {DEFAULT_PRESET}): {', '.join(sorted(PRESETS))}"
        + (f"; capacity figures only (--kv, --explain): {', '.join(extra)}" if extra else "")
        + ". -fp8: FP8 weights and KV at the FP8 peak.",
    )
    p.add_argument(
        "--mix",
        type=_mix_arg,
        metavar="PRESET*N,...",
        help="A mixed pool: replicas of several presets, e.g. llama-3.1-8b-h100*4,"
        "llama-3.1-8b-a100*4 (PRESET@SPEED: that preset at SPEED times its pace, @0.5 half "
        "as fast). --replicas defaults to the mix's size; other sizes keep its proportions, "
        "kinds interleaved. KV capacity and batch limits stay --preset's for every replica.",
    )
    p.add_argument(
        "--tell-speeds",
        action="store_true",
        help="With --mix: tell the router each replica's speed against --preset's "
        "(replicas[].speed), so its latency lines start there instead of at --preset's.",
    )
    if kv_capacity:
        p.add_argument(
            "--kv-capacity-tokens",
            type=positive_int,
            metavar="T",
            help="KV cache per replica in tokens (default: the preset's GPU memory less weights).",
        )
    p.add_argument(
        "--kv-tiers",
        choices=TIER_PRESETS,
        default="none",
        help="KV offload tiers below each replica's GPU, as vLLM's OffloadingConnector keeps "
        "them (default none): cpu, host DRAM; cpu+disk, then local NVMe (presets per 8-GPU "
        "H100/H200 node, a replica's share by its GPUs; docs/simulator.md, KV tiers).",
    )
    p.add_argument(
        "--cpu-kv-tokens",
        type=positive_int,
        metavar="T",
        help="With --kv-tiers: the CPU tier per replica in tokens (default: the node preset's).",
    )
    p.add_argument(
        "--disk-kv-tokens",
        type=positive_int,
        metavar="T",
        help="With --kv-tiers cpu+disk: the disk tier per replica in tokens (default: preset).",
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="KV block size (16).")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="Batch limit (256).")
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=8192,
        help="Per-step token budget (8192, vLLM's default for online serving on large GPUs).",
    )
    p.add_argument(
        "--event-lag-s",
        type=_non_negative_float,
        default=0.01,
        help="Delay of KV events to the router's index (default 0.01 s).",
    )
    p.add_argument(
        "--scrape-interval-s",
        type=positive_float,
        default=1.0,
        help="How often replicas' queue depth and KV usage are read (default 1 s).",
    )
    p.add_argument(
        "--engine-model",
        choices=ENGINE_MODELS,
        default="fast",
        help="fast (default): trace-block prefix cache, closed-form decode runs; exact: the "
        "16-token-block engine step by step (slow; for fidelity checks).",
    )
    p.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="Data-parallel ranks per replica (default 1): --replicas counts ranks in all, N to "
        "a replica, each with its own KV cache (see --rank-routing).",
    )
    p.add_argument(
        "--rank-routing",
        choices=RANK_ROUTINGS,
        default="router",
        help="Who picks a data-parallel replica's rank: router (default; kvroute routes to "
        "each rank with its KV events, so ranks are single-rank replicas to it) or vllm (the "
        "router picks the replica without KV events, vLLM's balancer the rank by load).",
    )


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--routers",
        type=positive_int,
        default=1,
        metavar="N",
        help="Routers in front of the fleet (default 1), as a gateway scales out its endpoint "
        "picker: request i goes to router i %% N; each keeps its own prefix index, in-flight "
        "load and predictions, and every one receives every replica's KV events.",
    )
    p.add_argument(
        "--share",
        choices=SHARE_MODES,
        default="none",
        help="What the routers learn of each other's traffic (default none). none: only the "
        "replicas' queue depth and KV usage, scraped every --scrape-interval-s; scrape: the "
        "same, scraped every --share-scrape-interval-s; bus: every dispatch, first token and "
        "finish (load and predictions) published to the other routers --bus-lag-s later; "
        "load: in-flight load summed over the routers at once, predictions each its own (the "
        "workers of kvroute serve --workers N).",
    )
    p.add_argument(
        "--share-scrape-interval-s",
        type=positive_float,
        default=0.05,
        metavar="S",
        help="With --share scrape: the scrape interval (default 0.05 s, the Gateway API "
        "reference picker's).",
    )
    p.add_argument(
        "--bus-lag-s",
        type=_non_negative_float,
        default=0.001,
        metavar="S",
        help="With --share bus: publish to delivery (default 0.001 s, pub/sub on a LAN).",
    )


def _add_pd_args(p: argparse.ArgumentParser, mode: bool) -> None:
    """The split rule and the KV link of a P/D fleet (kvcore/pd.py)."""
    if mode:
        p.add_argument(
            "--pd-mode",
            choices=PD_MODES,
            help="With --pd: conditional (default) splits a request only when at least "
            "--pd-min-uncached of its prompt tokens are not cached on its decode replica; "
            "always splits every request.",
        )
    p.add_argument(
        "--pd-min-uncached",
        type=_non_negative_int,
        metavar="N",
        help="With --pd: the conditional rule's threshold in prompt tokens (default "
        f"{DisaggregationRule().min_uncached_tokens}).",
    )
    p.add_argument(
        "--kv-link",
        type=_kv_link,
        metavar="nvlink|rdma|GBps",
        help="With --pd: the link a split request's KV crosses: nvlink (450 GB/s, within a "
        "node), rdma (default: a 400 Gb/s NIC per GPU of the replica, between nodes) or a "
        "speed in GB/s.",
    )


def _add_day_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="K",
        help="Play the trace K times back to back (before --diurnal): a longer day.",
    )
    p.add_argument(
        "--diurnal",
        type=_diurnal,
        metavar="A[@PERIOD_S]",
        help="Warp arrivals into a day-shaped rate, mean x (1 - A cos(2 pi t / PERIOD)), "
        "lowest at the start (default period: the whole trace, one compressed day).",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy-param",
        type=_policy_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A policy parameter (as in a config's policy.params), e.g. margin_ratio=0.05; "
        "repeat for more. Applies to every policy that accepts it.",
    )
    p.add_argument(
        "--slo",
        type=_slo,
        metavar="ttft=S,tpot=S",
        help="Targets in seconds: goodput (requests that meet both, per second) is measured "
        "against them, and kv_aware routes against them as a router with slo: in its config "
        "does (see --no-slo-routing).",
    )
    p.add_argument(
        "--autoscale",
        type=_autoscale_spec,
        metavar="min=N,...",
        help="Autoscale the fleet (kvcore/autoscale.py, the router's autoscale:): --replicas is "
        "the most it runs, min=N serve from the start; optional target_queue (per replica, 1), "
        "kv_high (0.6), kv_low (0.35), idle (s of quiet before one leaves, 60), interval (s, "
        "10), startup (s a started replica loads before it serves, 60); in_flight=N scales on "
        "the router's own requests in flight per serving replica instead (a leading signal), "
        "in_flight_low (0.8 of N on one replica fewer before one leaves). The summary reports "
        "replica_hours.",
    )
    _add_day_args(p)
    p.add_argument(
        "--no-slo-routing",
        action="store_true",
        help="Measure goodput against --slo but route as without one (the policy's token "
        "cost), to compare the two.",
    )
    p.add_argument(
        "--fail",
        type=_failure,
        action="append",
        default=[],
        metavar="K@T",
        help="Remove replica K (0-based) at T seconds; repeat for more.",
    )
    p.add_argument("--batch-job", type=batch_spec, metavar="lines=N,...", help=BATCH_HELP)
    p.add_argument("--dip", type=dip_spec, metavar="F@T1-T2", help=DIP_HELP)
    p.add_argument("--no-plots", action="store_true", help="Skip the PNG plots.")


def add_cell_args(p: argparse.ArgumentParser) -> None:
    """The simulated replay's flags that ``kvroute sweep`` passes to every cell unchanged: all
    but the grid's own (--policy, --replicas, --kv-capacity-tokens, --rate-scale), --compare,
    --out, --quiet and --live's."""
    from kvroute.simulator.traces import FORMATS

    _add_trace_args(p, FORMATS, rate_scale=False)
    _add_fleet_args(p, kv_capacity=False)
    _add_router_args(p)
    _add_run_args(p)


def replay_args(**values: Any) -> argparse.Namespace:
    """``kvroute replay``'s arguments as its parser defaults them, with ``values`` set (a sweep's
    cell: what the sweep was given, the cell's grid values, its own --out)."""
    parser = argparse.ArgumentParser()
    add_replay_parsers(parser.add_subparsers())
    args = parser.parse_args(["replay", "--trace", "-"])
    for key, value in values.items():
        if not hasattr(args, key):
            raise TypeError(f"kvroute replay has no argument {key!r}")
        setattr(args, key, value)
    return args


def _describe_pd(config: FleetConfig) -> str:
    assert config.pd is not None
    return config.pd.describe(config.engine.latency.num_gpus)


def describe_routers(config: FleetConfig) -> str:
    """The routers in front of the fleet and what they share, for the summary."""
    shared = f"queue depth and KV usage scraped every {config.scrape_every_s:g} s"
    if config.share == "bus":
        shared += (
            f", dispatches, first tokens and finishes published {config.bus_lag_s * 1000:g} "
            "ms later"
        )
    elif config.share == "load":
        shared += ", in-flight load summed at once (as --workers share it), predictions not"
    who = "1 router" if config.routers == 1 else f"{config.routers} routers (request i to i % N)"
    return f"{who}, share {config.share}: {shared}"


# -- shared steps -------------------------------------------------------------------------


def _load_trace(args: argparse.Namespace, time_scale: float) -> Any:
    from kvroute.simulator.traces import TraceError, load_trace

    try:
        trace = load_trace(
            args.trace,
            args.format,
            time_scale=time_scale,
            rate_scale=args.rate_scale,
            window_s=args.window,
            max_requests=args.max_requests,
            seed=args.seed,
            diurnal=getattr(args, "diurnal", None),
            repeat=getattr(args, "repeat", 1),
        )
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read trace {args.trace}: {exc.strerror or exc}") from None
    if getattr(args, "programs", None):
        trace = _first_programs(trace, args.programs)
    if getattr(args, "max_gap_s", None) is not None:
        if not getattr(args, "closed_loop", False):
            raise UsageError(
                "--max-gap-s caps the gaps a closed loop waits: give --closed-loop too"
            )
        trace = _gaps_capped(trace, args.max_gap_s)
    if not trace.requests:
        raise UsageError(f"trace {args.trace} has no requests (after window and caps)")
    return trace


def _gaps_capped(trace: Any, cap_s: float) -> Any:
    """``trace`` with every recorded gap between a response and its next turn at most
    ``cap_s``."""
    requests = tuple(
        replace(r, gap_s=cap_s) if r.gap_s is not None and r.gap_s > cap_s else r
        for r in trace.requests
    )
    return replace(trace, requests=requests)


def _first_programs(trace: Any, count: int) -> Any:
    """``trace`` with the requests of its first ``count`` programs only (a request without a
    session is a program of its own, as admission counts them)."""
    kept: set[str] = set()
    requests = []
    for index, request in enumerate(trace.requests):
        program = program_of(request.session_id, index)
        if program not in kept:
            if len(kept) == count:
                continue
            kept.add(program)
        requests.append(request)
    return replace(trace, requests=tuple(requests))


def _load(args: argparse.Namespace) -> tuple[Any, UnitTrace]:
    trace = _load_trace(args, args.time_scale)
    return trace, prepare(trace)


def _mix_arg(text: str) -> Mix:
    try:
        return parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fleet_config(
    args: argparse.Namespace,
    replicas: int,
    failures: list[tuple[int, float]],
    pd: PdSetup | None = None,
) -> FleetConfig:
    latency = latency_preset(args.preset)
    mix = getattr(args, "mix", None)
    if getattr(args, "tell_speeds", False) and not mix:
        raise UsageError("--tell-speeds needs --mix (the replicas whose speeds to tell)")
    try:
        engine = engine_config(
            latency,
            args.kv_capacity_tokens,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed,
            offload=offload_tiers(
                getattr(args, "kv_tiers", "none"),
                latency,
                args.block_size,
                getattr(args, "cpu_kv_tokens", None),
                getattr(args, "disk_kv_tokens", None),
            ),
        )
        return FleetConfig(
            replicas=replicas,
            engine=engine,
            engine_model=args.engine_model,
            event_lag_s=args.event_lag_s,
            scrape_interval_s=args.scrape_interval_s,
            failures=tuple(failures),
            dip=getattr(args, "dip", None),
            pd=pd,
            admission=_admission(args),
            closed_loop=getattr(args, "closed_loop", False),
            programs_in_flight=getattr(args, "programs_in_flight", None),
            replica_latency=mix_models(mix, replicas) if mix else (),
            tell_speeds=getattr(args, "tell_speeds", False),
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            rank_routing=getattr(args, "rank_routing", "router"),
            **_autoscale_settings(getattr(args, "autoscale", None), replicas),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _admission(args: argparse.Namespace) -> AdmissionSpec | None:
    """--max-in-flight's admission limit and --fairness's order; None without a limit."""
    limit = getattr(args, "max_in_flight", None)
    fairness = getattr(args, "fairness", None)
    if limit is None:
        if fairness is not None:
            raise UsageError("--fairness orders the admission queue: give --max-in-flight N too")
        return None
    return AdmissionSpec(
        limit,
        fairness or "fcfs",
        getattr(args, "program_max_wait_s", 300.0),
        getattr(args, "program_attained_weight", FairnessParams().program_attained_weight),
        program_wait_share=getattr(args, "program_wait_share", 0.0),
    )


_AUTOSCALE_KEYS = {
    "min": ("min", int),
    "max": ("max", int),
    "target_queue": ("target_queue_per_replica", float),
    "kv_high": ("kv_high", float),
    "kv_low": ("kv_low", float),
    "idle": ("scale_down_idle_s", float),
    "interval": ("interval_s", float),
    "startup": ("startup_s", float),
    "in_flight": ("target_in_flight_per_replica", float),
    "in_flight_low": ("in_flight_low", float),
}


def _autoscale_spec(text: str) -> dict[str, float]:
    """``min=2,target_queue=2,idle=120,interval=10,startup=60,...`` (see --autoscale)."""
    fields: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in _AUTOSCALE_KEYS:
            raise argparse.ArgumentTypeError(
                f"expected KEY=VALUE with KEY one of {', '.join(_AUTOSCALE_KEYS)}, got {part!r}"
            )
        try:
            fields[key] = _AUTOSCALE_KEYS[key][1](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: not a number: {value!r}") from None
    return fields


def _autoscale_settings(spec: dict[str, float] | None, replicas: int) -> dict[str, Any]:
    """FleetConfig's autoscale fields: max defaults to the fleet's --replicas."""
    if spec is None:
        return {}
    fields: dict[str, Any] = {_AUTOSCALE_KEYS[k][0]: v for k, v in spec.items()}
    startup = fields.pop("startup_s", 60.0)
    fields.setdefault("max", replicas)
    return {"autoscale": AutoscaleSettings(**fields), "startup_s": startup}


def _diurnal(text: str) -> tuple[float, float | None]:
    """``A`` or ``A@PERIOD_S``: a day-shaped rate (simulator/traces/transform.py)."""
    amplitude, _, period = text.partition("@")
    try:
        a = float(amplitude)
        p = float(period) if period else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A or A@PERIOD_S, got {text!r}") from None
    if not 0 <= a < 1:
        raise argparse.ArgumentTypeError(f"amplitude must be in [0, 1), got {a}")
    if p is not None and not (math.isfinite(p) and p > 0):
        raise argparse.ArgumentTypeError(f"period must be a positive number of seconds, got {p}")
    return a, p


def policy_object(
    name: str,
    seed: int,
    extra: list[tuple[str, Any]] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Any:
    """Policy ``name`` with ``extra`` (--policy-param) over ``defaults`` (the fleet's own,
    ``fleet_defaults``), each taken where the policy has the parameter."""
    accepted = policy_parameters(name)
    params: dict[str, Any] = {"seed": seed} if "seed" in accepted else {}
    params.update((k, v) for k, v in (defaults or {}).items() if k in accepted)
    params.update((k, v) for k, v in extra or () if k in accepted)
    try:
        return build_policy(name, params)
    except PolicyConfigError as exc:
        raise UsageError(str(exc)) from None


class _ProgressBar:
    """A plain-text bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()
        self._last_tenth = -1

    def __call__(self, done: int, total: int, sim_t: float) -> None:
        if not self.enabled:
            return
        frac = done / total if total else 1.0
        wall = time.perf_counter() - self.started
        filled = int(frac * 30)
        line = (
            f"{self.label:<14} [{'#' * filled}{'.' * (30 - filled)}] {frac:4.0%} "
            f"{done}/{total} requests, sim {sim_t:,.0f} s, wall {wall:.1f} s"
        )
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
            sys.stderr.flush()
        elif int(frac * 10) > self._last_tenth:
            self._last_tenth = int(frac * 10)
            print(line, file=sys.stderr)


def fleet_defaults(config: FleetConfig, slo: Slo | None = None) -> dict[str, Any]:
    """Policy parameters the simulated fleet implies: the engine preset's latency lines as the
    prior, and ``slo`` as the routing target (what ``slo:`` in a router's config does)."""
    defaults: dict[str, Any] = dict(config.engine.latency.latency_prior())
    defaults["kv_bytes_per_token"] = int(config.engine.latency.kv_bytes_per_token)
    for tier in config.engine.offload:
        defaults[f"{tier.medium.lower()}_load_gbps"] = tier.load_bytes_per_s / 1e9
    if config.mixed:
        # Replicas of different speeds: kv_aware prices each one's work by its own line.
        defaults["cost_unit"] = "time"
    if slo is not None:
        defaults.update(slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s)
    return defaults


def run_policy(
    units: UnitTrace,
    policy_name: str,
    config: FleetConfig,
    seed: int,
    quiet: bool,
    params: list[tuple[str, Any]] | None = None,
    slo: Slo | None = None,
    batch: tuple[BatchJob, tuple[SimRequest, ...]] | None = None,
) -> tuple[SimResult, float]:
    """Replay ``units`` through ``policy_name``; with ``slo`` the policy routes against it;
    with ``batch`` (a job and its lines) the batch lane runs the job beside it."""
    policy = policy_object(policy_name, seed, params, fleet_defaults(config, slo))
    label = policy_name + (" + batch" if batch is not None else "")
    bar = _ProgressBar(label, not quiet)
    started = time.perf_counter()
    result = simulate(units, policy, config, bar, batch)
    return result, time.perf_counter() - started


# -- replay -------------------------------------------------------------------------------


def _cmd_replay(args: argparse.Namespace) -> int:
    try:
        return run_replay(args)
    except UsageError as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return EXIT_USAGE


def run_replay(args: argparse.Namespace) -> int:
    """``kvroute replay`` once its flags are parsed; bad input raises ``UsageError``."""
    if args.live:
        if getattr(args, "pd", None) is not None:
            raise UsageError(
                "--pd simulates a P/D fleet; with --live the router at the URL routes (give it "
                "its prefill and decode pools in its config)"
            )
        if args.routers != 1 or args.share != "none":
            raise UsageError(
                "--routers and --share set up simulated routers; with --live the router at "
                "the URL routes (run several and put a balancer in front to measure that)"
            )
        if args.mix:
            raise UsageError(
                "--mix simulates a mixed pool; with --live the router's replicas are what they "
                "are (launch.presets gives emulated ones their speeds)"
            )
        if getattr(args, "max_in_flight", None) or getattr(args, "fairness", None):
            raise UsageError(
                "--max-in-flight and --fairness simulate the router's admission; with --live "
                "the router at the URL admits (limits.max_concurrent_requests, fairness.by in "
                "its config)"
            )
        if getattr(args, "programs_in_flight", None):
            raise UsageError(
                "--programs-in-flight starts the programs of a simulated replay; with --live "
                "the trace's sessions start at their recorded times"
            )
        # The live replayer paces by --time-scale itself: load the trace unscaled in time.
        return _replay_live(args, _load_trace(args, 1.0))
    if not args.out:
        raise UsageError("--out DIR is required (where summary.json and report.md go)")
    trace, units, config, policies = _simulated_replay(args)
    _prepare_out(args.out)
    infinite = infinite_cache_hit_rate(units, config.engine.block_size).token_rate
    pooled = pooled_lru_hit_rate(
        units, config.engine.num_blocks * config.replicas, config.engine.block_size
    ).token_rate
    if not args.quiet:
        print(
            f"{len(units.requests)} requests over {units.duration_s:,.0f} s, {args.replicas} "
            f"replicas of {args.preset}, {config.kv_capacity_tokens:,} KV tokens each, "
            f"behind {describe_routers(config)}"
            + (f"; P/D: {_describe_pd(config)}" if config.pd is not None else ""),
            file=sys.stderr,
        )
    own_prefill = prefill_alone_s(units, config.engine, cached=False)
    returning = returning_indices(units)
    bound_hits = (
        pooled_bound_hits(
            units, config.engine.num_blocks * config.replicas, config.engine.block_size
        )
        if returning
        else []
    )
    prefixes, notes = _prefix_source(args)
    results: list[SimResult] = []
    summaries: list[dict[str, Any]] = []
    batch = _batch_job(args, units, config)
    for name in policies:
        alone = None
        if batch is not None:  # the trace alone first: the batch lane's cost is against it
            alone, _ = run_policy(
                units, name, config, args.seed, args.quiet, args.policy_param, _routing_slo(args)
            )
        result, wall = run_policy(
            units, name, config, args.seed, args.quiet, args.policy_param, _routing_slo(args),
            batch,
        )  # fmt: skip
        results.append(result)
        summaries.append(
            summarize(
                result,
                infinite_hit_rate=infinite,
                pooled_lru_hit_rate=pooled,
                slo=args.slo or Slo(),
                wall_s=wall,
                extra={
                    "preset": args.preset,
                    "engine_model": args.engine_model,
                    "share_scrape_interval_s": config.share_scrape_interval_s,
                    "bus_lag_s": config.bus_lag_s,
                    "prefixes": prefixes,
                    "notes": notes,
                    "warnings": replay_warnings(result, own_prefill),
                    "batch": batch_summary(alone, result) if alone is not None else None,
                    "returning_turns": returning_summary(units, result, returning, bound_hits),
                },
            )
        )
    _compare_regret(results, summaries)
    print(format_table(summaries))
    print(f"routers: {describe_routers(config)}")
    print(
        f"bounds: infinite cache {percent(infinite)}, pooled LRU of the fleet's capacity "
        f"{percent(pooled)} (token-weighted hit rates)"
    )
    for summary in summaries:
        turns = summary["returning_turns"]
        if turns is not None and turns["vs_pooled_lru"] is not None:
            print(
                f"returning turns ({summary['policy']}): {turns['requests']:,} served, hit rate "
                f"{percent(turns['hit_rate'])}, pooled LRU on them "
                f"{percent(turns['pooled_lru_hit_rate'])} ({turns['vs_pooled_lru']:.3f}x)"
            )
    for summary in summaries:
        line = format_loss(summary) or format_pd(summary)
        if line:
            print(line)
    if config.admission is not None or config.programs_in_flight is not None:
        for summary in summaries:
            programs = format_programs(summary)
            if programs:
                print(programs)
    for summary in summaries:
        for line in (summary["estimated_regret"] or {}).get("lines", []):
            print(line)
    for summary in summaries:
        if summary.get("batch"):
            for line in batch_report_lines(summary["policy"], summary["batch"]):
                print(line)
    for note in notes:
        print(f"note: {note}")
    for summary in summaries:
        who = f" ({summary['policy']})" if len(summaries) > 1 else ""
        for warning in summary["warnings"]:
            print(f"WARNING{who}: {warning}")
    _write_outputs(args, trace, units, config, results, summaries)
    print(f"wrote {os.path.join(args.out, 'summary.json')} and report.md")
    return 0


def _compare_regret(results: list[SimResult], summaries: list[dict[str, Any]]) -> None:
    """A run that estimated its regret, next to the baseline runs of the same --compare: the
    estimate against the counterfactual (simulator/fleet/regret.py)."""
    for result, summary in zip(results, summaries, strict=True):
        estimated = summary["estimated_regret"]
        if estimated is None:
            continue
        compared = counterfactual(result, [r for r in results if r is not result])
        if compared:
            estimated["counterfactual"] = compared
            estimated["lines"] = comparison_lines(result.policy, compared)


def _simulated_replay(
    args: argparse.Namespace,
) -> tuple[Any, UnitTrace, FleetConfig, list[str]]:
    """The trace, fleet and policies of a simulated replay, its flags checked."""
    pd = _replay_pd(args)
    if pd is not None:
        if args.replicas not in (None, pd.replicas):
            raise UsageError(
                f"--replicas {args.replicas} and --pd {pd.prefill}:{pd.decode} disagree: a P/D "
                f"fleet has P+D = {pd.replicas} replicas (leave out --replicas)"
            )
        args.replicas = pd.replicas
    elif args.replicas is None:
        args.replicas = mix_size(args.mix) if args.mix else 4
    trace, units = _load(args)
    for k, _ in args.fail:
        if k >= args.replicas:
            raise UsageError(f"--fail {k}@...: replicas are numbered 0..{args.replicas - 1}")
    try:
        config = replace(
            _fleet_config(args, args.replicas, args.fail, pd),
            routers=args.routers,
            share=args.share,
            share_scrape_interval_s=args.share_scrape_interval_s,
            bus_lag_s=args.bus_lag_s,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    policies = args.compare or [args.policy]
    for key, _ in args.policy_param:
        if not any(key in policy_parameters(name) for name in policies):
            raise UsageError(f"--policy-param {key}: no policy of {', '.join(policies)} takes it")
    return trace, units, config, policies


def _replay_pd(args: argparse.Namespace) -> PdSetup | None:
    """--pd's fleet with its rule and link, or None without --pd (whose flags then refuse)."""
    counts = getattr(args, "pd", None)
    if counts is None:
        _pd_flags_alone(args, "--pd P:D")
        return None
    refused = [
        flag
        for flag, given in (
            ("--live", bool(getattr(args, "live", None))),
            ("--fail", bool(args.fail)),
            ("--autoscale", args.autoscale is not None),
            ("--dip", args.dip is not None),
            ("--batch-job", args.batch_job is not None),
            ("--routers", args.routers != 1),
            ("--share", args.share != "none"),
            ("--engine-model exact", args.engine_model != "fast"),
        )
        if given
    ]
    if refused:
        raise UsageError(
            f"{', '.join(refused)}: not modelled with --pd (a simulated P/D fleet has one "
            "router, the fast engine model, and no failures, autoscaling, dips or batch jobs)"
        )
    return _pd_setup(args, counts[0], counts[1], args.pd_mode or "conditional")


def _pd_flags_alone(args: argparse.Namespace, needs: str) -> None:
    """The split rule's and the link's flags, given without a P/D fleet to apply to."""
    for flag, value in (
        ("--pd-mode", getattr(args, "pd_mode", None)),
        ("--pd-min-uncached", getattr(args, "pd_min_uncached", None)),
        ("--kv-link", getattr(args, "kv_link", None)),
    ):
        if value is not None:
            raise UsageError(f"{flag} goes with {needs}")


def _pd_setup(args: argparse.Namespace, prefill: int, decode: int, mode: str) -> PdSetup:
    minimum = args.pd_min_uncached
    if minimum is None:
        minimum = DisaggregationRule().min_uncached_tokens
    rule = DisaggregationRule(cast(Mode, mode), minimum)  # PdSetup.problems checks the mode
    setup = PdSetup(prefill, decode, rule, args.kv_link or "rdma")
    problems = setup.problems()
    if problems:
        raise UsageError("--pd: " + "; ".join(problems))
    return setup


def _batch_job(
    args: argparse.Namespace, units: UnitTrace, config: FleetConfig
) -> tuple[BatchJob, tuple[SimRequest, ...]] | None:
    """--batch-job's job and its lines beside ``units``, or None without one."""
    job = getattr(args, "batch_job", None)
    if job is None:
        return None
    try:
        lines = batch_lines(units, job)
    except ValueError as exc:
        raise UsageError(f"--batch-job: {exc}") from None
    too_big = _larger_than_a_replica(lines[:1], config)
    if too_big:
        raise UsageError(f"--batch-job: {too_big}")
    return job, lines


def _larger_than_a_replica(lines: tuple[SimRequest, ...], config: FleetConfig) -> str | None:
    """Why a batch line could never run on one replica of ``config``, or None."""
    for line in lines:
        tokens = line.input_tokens + line.output_tokens
        if not config.engine.fits(tokens):
            return (
                f"a line of {tokens:,} tokens (input + output) needs more KV cache than one "
                f"replica holds ({config.kv_capacity_tokens:,} tokens)"
            )
    return None


def _routing_slo(args: argparse.Namespace) -> Slo | None:
    """The SLO the policy routes against: --slo unless --no-slo-routing (measured only)."""
    return None if args.slo is None or args.no_slo_routing else args.slo


def check_replay(args: argparse.Namespace) -> None:
    """Raise ``UsageError`` for what ``run_replay`` would refuse, without simulating: the trace,
    the fleet's configuration, --fail, --policy-param and the policies it builds (``kvroute
    sweep`` checks its grid)."""
    _, _, _, policies = _simulated_replay(args)
    for name in policies:
        policy_object(name, args.seed, args.policy_param)


# Traces whose prefixes kvroute makes up: their hit rates describe its model, not the workload.
_SYNTHETIC_PREFIXES = {
    "azure": "hit rates rest on synthetic prefixes: the Azure 2023 trace has arrival times and "
    "token counts but no prompt content, so a reuse model decides which prompts share a prefix "
    "(apps' system prompts, follow-up turns; set with --format azure:apps=N,followup=P,...; "
    "see docs/traces.md)",
    "synthetic": "hit rates rest on the generator's prefixes (a synthetic workload)",
}


def _prefix_source(args: argparse.Namespace) -> tuple[str, list[str]]:
    """Where the trace's prefix sharing comes from ("trace" or "synthetic"), and notes on it."""
    from kvroute.simulator.traces import detect_format

    fmt = (args.format or detect_format(args.trace)).partition(":")[0].strip().lower()
    note = _SYNTHETIC_PREFIXES.get(fmt)
    return ("synthetic", [note]) if note else ("trace", [])


def _prepare_out(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create output directory {out}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"output directory {out} is not writable")


def _write_outputs(
    args: argparse.Namespace,
    trace: Any,
    units: UnitTrace,
    config: FleetConfig,
    results: list[SimResult],
    summaries: list[dict[str, Any]],
) -> None:
    summary = dict(summaries[0])
    if len(summaries) > 1:
        summary["runs"] = summaries
    command = args.command or "kvroute " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    plots: list[str] = []
    if not args.no_plots:
        from kvroute.simulator.fleet.plots import write_plots

        plots = write_plots(results, args.out)
    duration = units.duration_s
    context = {
        "trace": os.path.basename(args.trace) if os.path.exists(args.trace) else args.trace,
        "format": args.format or "detected",
        "trace_duration_s": duration,
        "trace_rate_rps": len(units.requests) / duration if duration > 0 else 0.0,
        "preset": args.preset,
        "block_size": config.engine.block_size,
        "engine_model": config.engine_model,
        "event_lag_s": config.event_lag_s,
        "scrape_interval_s": config.scrape_every_s,
        "routers": describe_routers(config),
        "pd": _describe_pd(config) if config.pd is not None else None,
        "seed": args.seed,
        "failures": list(config.failures),
        "command": command,
    }
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown_report(summaries, context, plots))


def _replay_live(args: argparse.Namespace, trace: Any) -> int:
    # Imported here: the live replayer pulls in aiohttp, which simulations do not need.
    from kvroute.simulator.traces.live import LiveReplayError, replay_live

    try:
        replay_live(
            trace,
            args.live,
            model=args.model,
            api_key=args.api_key,
            time_scale=args.time_scale,
            out_dir=args.out,
            tokens_per_block=args.tokens_per_block,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
            concurrency=args.concurrency,
            api=args.api,
            closed_loop=args.closed_loop,
        )
    except (ValueError, LiveReplayError) as exc:  # its one-line errors (no router, ...)
        raise UsageError(str(exc)) from None
    return 0


def percent(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1%}"


# -- plan ---------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        return _plan(args)
    except UsageError as exc:
        print(f"kvroute plan: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _plan(args: argparse.Namespace) -> int:
    if args.kv:
        return _plan_kv(args)
    if args.context is not None or args.batch is not None:
        raise UsageError("--context and --batch go with --kv")
    if args.trace is None:
        raise UsageError("--trace is required (or --kv --context T --batch N for the KV budget)")
    if args.slo is None:
        raise UsageError("--slo is required (or --kv --context T --batch N for the KV budget)")
    if args.preset in capacity.CAPACITY_PRESETS:
        return _plan_capacity_only(args)
    if not 0 < args.slo_quantile < 1:
        raise UsageError(f"--slo-quantile must be between 0 and 1, got {args.slo_quantile}")
    if args.out:
        _prepare_out(args.out)
    _, units = _load(args)
    latency = latency_preset(args.preset)
    figures = capacity.figures_for_preset(latency)
    if args.mix and args.explain:
        raise UsageError("--explain sizes one preset analytically; leave out --mix (or --explain)")
    if args.explain and figures is None:
        raise UsageError(
            f"--explain needs a GPU preset with model and hardware figures; {args.preset} has "
            "none (choose a llama-3.1-* preset)"
        )
    trace_rps = len(units.requests) / units.duration_s if units.duration_s > 0 else 0.0
    base = 1.0
    if args.target_rps is not None:
        if trace_rps <= 0:
            raise UsageError(
                "--target-rps needs a trace with a rate: its requests all arrive at one instant"
            )
        base = args.target_rps / trace_rps
    if args.pd:
        return _plan_pd(args, units, base)
    _pd_flags_alone(args, "--pd")
    multipliers = args.rate_multipliers
    if multipliers is None:
        multipliers = [] if args.target_rps is not None else [2.0, 4.0]
    # 1 is always the first row: a 1 among the multipliers must not plan it twice.
    rates = list(dict.fromkeys([1.0, *multipliers]))
    rows: list[dict[str, Any]] = []
    explained: list[str] = []
    gpus = latency.num_gpus
    for i, m in enumerate(rates):
        k = base * m
        trace_k = scaled(units, k)
        analytic = _analytic(args, figures, trace_k) if figures else None
        if args.explain and analytic and i == 0:
            explained = list(analytic.lines)
            print(f"analytic sizing at {_rate_label(k, trace_k)} (--explain):")
            print("\n".join("  " + line for line in analytic.lines))
            print(flush=True)
        row = _plan_one(args, trace_k, k)
        if args.batch_job is not None and row["replicas"]:
            row["with_batch_job"] = _plan_one(args, trace_k, k, args.batch_job, row["replicas"])
        rows.append(row)
        row["gpus"] = row["replicas"] * gpus if row["replicas"] else None
        row["nodes"] = _nodes(row["replicas"], gpus) if figures else None
        if args.mix and row["replicas"]:
            _mixed_sizes(row, apportion(args.mix, row["replicas"]))
        row["cost_per_million_tokens_usd"] = _cost(args.gpu_price, row)
        if analytic:
            row["analytic_replicas"] = analytic.replicas
            row["analytic_nodes"] = analytic.nodes
            row["analytic_decode_tokens_per_s_per_node"] = analytic.decode_ceiling_per_node
        if row["unreachable"]:
            row["why"] = _why_unreachable(args, trace_k, row["largest_tried"])
    print(_plan_table(args, rows))
    for row in rows:
        if row.get("with_batch_job"):
            print(_batch_plan_line(args, row))
    if args.explain:
        print("\n".join(_analytic_vs_simulated(args, rows)))
    if args.out:
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(
                {
                    "slo": vars(args.slo),
                    "preset": args.preset,
                    "mix": _mix_text(args.mix) if args.mix else None,
                    "target_rps": args.target_rps,
                    "explain": explained,
                    "rows": rows,
                },
                f,
                indent=2,
            )
            f.write("\n")
    return 0


def _count(n: int | None, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _rate_label(k: float, units: UnitTrace) -> str:
    rps = len(units.requests) / units.duration_s if units.duration_s > 0 else 0.0
    return f"{k:.3g}x the trace's rate = {rps:,.2f} req/s"


def _nodes(replicas: int | None, gpus_per_replica: int) -> int | None:
    """Nodes of GPUS_PER_NODE GPUs that hold the replicas (a replica never spans nodes)."""
    if not replicas:
        return None
    per_node = max(1, capacity.GPUS_PER_NODE // gpus_per_replica)
    return -(-replicas // per_node)


def _analytic(
    args: argparse.Namespace,
    figures: tuple[capacity.ModelFigures, capacity.HardwareFigures],
    units: UnitTrace,
) -> capacity.Explanation:
    model, hardware = figures
    load = capacity.workload(
        [(r.input_tokens, r.output_tokens) for r in units.requests], units.duration_s
    )
    return capacity.explain(
        model,
        hardware,
        load,
        tpot_s=args.slo.tpot_s,
        mfu=_mfu(args.preset),
        max_num_seqs=args.max_num_seqs,
        gpu_price=args.gpu_price,
    )


def _mfu(preset: str) -> float:
    """The preset's calibrated MFU; a capacity-only preset borrows the engine presets' 0.53."""
    if preset in capacity.CAPACITY_PRESETS:
        return capacity.PREFILL_MFU
    return latency_preset(preset).mfu


def _plan_kv(args: argparse.Namespace) -> int:
    """``plan --kv``: the KV budget of one replica, no trace and no simulation."""
    if args.context is None or args.batch is None:
        raise UsageError("--kv needs --context TOKENS and --batch N")
    if args.trace is not None or args.explain or args.pd:
        raise UsageError("--kv takes no --trace, --explain or --pd: it sizes the KV cache alone")
    figures = capacity.figures_by_name(args.preset)
    if figures is None:
        raise UsageError(f"--kv needs a preset with model and GPU figures; {args.preset} has none")
    budget = capacity.kv_budget(*figures, args.context, args.batch)
    print("\n".join(budget.lines))
    print(
        "assumptions: host offload over PCIe Gen5 x16 at "
        f"{PCIE_BYTES_PER_S / 1e9:g} GB/s per GPU, "
        f"{HOST_BYTES_PER_NODE / 1e12:g} TB host DRAM per node; context parallelism "
        f"over {capacity.NETWORK_BYTES_PER_S / 1e9:g} GB/s per GPU, "
        f"{capacity.NETWORK_LATENCY_S * 1e6:g} us per collective"
    )
    if args.out:
        _prepare_out(args.out)
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "context": args.context,
                    "batch": args.batch,
                    "kv_needed_bytes": budget.needed_bytes,
                    "kv_available_bytes": budget.available_bytes,
                    "fits": budget.fits,
                    "largest_batch": budget.largest_batch,
                    "levers": [vars(lv) for lv in budget.levers],
                    "lines": list(budget.lines),
                },
                f,
                indent=2,
            )
            f.write("\n")
    return 0


def _plan_capacity_only(args: argparse.Namespace) -> int:
    """A capacity-only preset: the analytic sizing, and no simulation (no engine model)."""
    if not args.explain:
        raise UsageError(
            f"{args.preset} has capacity figures only (no engine latency model to simulate): "
            "use --explain or --kv"
        )
    _, units = _load(args)
    k = 1.0
    if args.target_rps is not None:
        rps = len(units.requests) / units.duration_s if units.duration_s > 0 else 0.0
        if rps <= 0:
            raise UsageError(
                "--target-rps needs a trace with a rate: its requests all arrive at one instant"
            )
        k = args.target_rps / rps
    trace_k = scaled(units, k)
    figures = capacity.CAPACITY_PRESETS[args.preset]
    analytic = _analytic(args, figures, trace_k)
    print(f"analytic sizing at {_rate_label(k, trace_k)} (--explain):")
    print("\n".join("  " + line for line in analytic.lines))
    print(
        f"no simulation: {args.preset} has capacity figures only (the engine model has no MoE "
        "or MLA); the analytic sizing above is the whole answer"
    )
    return 0


def _analytic_vs_simulated(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """Each row's analytic replica count beside the simulated one, and what separates them."""
    latency = latency_preset(args.preset)
    lines = ["analytic vs simulated (--explain):"]
    for r in rows:
        sim = (
            f"{r['replicas']} replicas ({_count(r['nodes'], 'node')})"
            if r["replicas"]
            else f"none up to {r['largest_tried']['replicas']} replicas"
        )
        lines.append(
            f"  {r['rate_multiplier']:.3g}x ({(r['rate_rps'] or 0):,.2f} req/s): analytic "
            f"{r['analytic_replicas']} replicas ({_count(r['analytic_nodes'], 'node')}), "
            f"simulated {sim}, "
            f"simulated hit rate {_opt((r['largest_tried'] or r)['hit_rate'], 100, '%')}"
        )
    lines += [
        _indented(
            "why they differ: the analytic count fills every replica to 100% of its time on "
            "average with no prefix hits; the simulation meets the SLO at "
            f"p{args.slo_quantile * 100:g}, so it needs headroom for queueing at bursts "
            "(more replicas); prefix hits skip prefill (fewer); chunked prefill shares steps "
            "with decode, lengthening TPOT (more); a full KV cache preempts and recomputes "
            "sequences (more); and the engine model runs at "
            f"{latency.bandwidth_efficiency:g} of peak bandwidth and {latency.mfu:g} MFU with "
            f"{latency.step_overhead_s * 1000:g} ms overhead per step and all-reduce time (more); "
            "its KV capacity leaves no room for activations (slightly more KV). A TTFT-only SLO "
            "tolerates decode queues, and a short trace ends before queues reach a steady state "
            "(both fewer)."
        )
    ]
    return lines


def _plan_one(
    args: argparse.Namespace,
    units: UnitTrace,
    k: float,
    job: BatchJob | None = None,
    start: int = 1,
) -> dict[str, Any]:
    """The smallest fleet meeting the SLO at rate ``k``; with ``job``, while running that batch
    job beside the trace within its window too (the search starts at ``start`` replicas: the
    fleet the trace alone needs)."""
    tried: dict[int, dict[str, Any]] = {}

    def meets(n: int) -> bool:
        config = _fleet_config(args, n, [])
        batch = _batch_job(args, units, config) if job is not None else None
        result, wall = run_policy(units, args.policy, config, args.seed, True, batch=batch)
        q = args.slo_quantile
        ttft = percentile(result.ttfts(), q)
        tpot = percentile(result.tpots(), q)
        ok = _meets_slo(args, result, ttft, tpot) and (
            result.batch is None or result.batch.met_window
        )
        tried[n] = {
            "replicas": n,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "hit_rate": result.hit_rate(),
            "requests": result.requests,
            "completed": result.completed,
            "rejected": sum(result.rejected),
            "ok": ok,
            "batch": result.batch.as_dict() if result.batch is not None else None,
        }
        if not args.quiet:
            rps = len(units.requests) / units.duration_s if units.duration_s > 0 else 0.0
            print(
                f"  {k:.3g}x rate, {n} replicas: TTFT p{q * 100:g} {ttft:.3f} s, TPOT "
                f"p{q * 100:g} {tpot * 1000:.1f} ms, {'meets' if ok else 'misses'} the SLO "
                f"(simulated in {wall:.1f} s wall time; rate {rps:,.2f} req/s, hit rate "
                f"{percent(result.hit_rate())}, {result.completed:,} of {result.requests:,} "
                "requests completed"
                + (f"; {_batch_progress(result.batch.as_dict())}" if result.batch else "")
                + ")",
                file=sys.stderr,
            )
        return ok

    low, high = start - 1, start  # low: largest known to miss; high: candidate
    unreachable: str | None = None
    while not meets(high):
        if low in tried and _saturated(tried[low], tried[high]):
            # Twice the replicas changed nothing: what misses is a single request's own time
            # (a long prompt's prefill), which no fleet size shortens.
            before = ", ".join(_slo_values(args, tried[low]))
            unreachable = (
                f"no fleet size meets the SLO: the search stopped at {high} replicas (limit: "
                f"--max-replicas {args.max_replicas}): {'; '.join(_slo_misses(args, tried[high]))}"
                f", as at {low} replicas ({before}): more replicas do not help"
            )
            high = 0
            break
        low = high
        if high >= args.max_replicas:
            unreachable = (
                f"no fleet of up to {high} replicas meets the SLO: the search stopped at the limit,"
                f" --max-replicas {high}: {'; '.join(_slo_misses(args, tried[high]))}"
            )
            high = 0
            break
        high = min(2 * high, args.max_replicas)
    if high:
        while high - low > 1:
            mid = (low + high) // 2
            if meets(mid):
                high = mid
            else:
                low = mid
    duration = units.duration_s
    tokens = sum(r.input_tokens + r.output_tokens for r in units.requests)
    best = tried.get(high, {}) if high else {}
    return {
        "rate_multiplier": k,
        "rate_rps": len(units.requests) / duration if duration > 0 else None,
        "replicas": high or None,
        "ttft_s": best.get("ttft_s"),
        "tpot_s": best.get("tpot_s"),
        "hit_rate": best.get("hit_rate"),
        "duration_s": duration,
        "tokens": tokens,
        "simulated": sorted(tried),
        "unreachable": unreachable,
        # What the largest fleet tried measured, when none met the SLO.
        "largest_tried": tried[max(tried)] if unreachable else None,
        "batch": best.get("batch"),
    }


def _meets_slo(args: argparse.Namespace, result: SimResult, ttft: float, tpot: float) -> bool:
    """Every request finished, and ``ttft`` and ``tpot`` (at the SLO quantile) meet --slo."""
    return (
        result.completed == result.requests
        and (args.slo.ttft_s is None or ttft <= args.slo.ttft_s)
        and (args.slo.tpot_s is None or math.isnan(tpot) or tpot <= args.slo.tpot_s)
    )


# -- plan --pd ----------------------------------------------------------------------------


def _plan_pd(args: argparse.Namespace, units: UnitTrace, k: float) -> int:
    """``plan --pd``: at rate ``k``, the aggregated fleet as plan sizes it, then the fewest
    replicas P+D of an always- and a conditionally-disaggregated fleet meeting the same SLO
    (simulator/fleet/pd_search.py), in one table."""
    for flag, given in (
        ("--rate-multipliers", args.rate_multipliers is not None),
        ("--batch-job", args.batch_job is not None),
        ("--explain", args.explain),
    ):
        if given:
            raise UsageError(
                f"{flag} does not go with --pd: it compares three fleets at one rate (the "
                "trace's, or --target-rps)"
            )
    setup = _pd_setup(args, 1, 1, "conditional")  # the rule and the link, checked up front
    trace_k = scaled(units, k)
    aggregated = _plan_one(args, trace_k, k)
    size = aggregated["replicas"] or aggregated["largest_tried"]["replicas"]
    row = _pd_measure(args, trace_k, size, None)
    row["simulated"] = [[n, None] for n in aggregated["simulated"]]
    rows = [row] + [_pd_fleet(args, trace_k, size, mode) for mode in PD_FLEETS[1:]]
    latency = latency_preset(args.preset)
    rps = len(trace_k.requests) / trace_k.duration_s if trace_k.duration_s > 0 else 0.0
    slo = ", ".join(
        f"{name} <= {v:g} s"
        for name, v in (("TTFT", args.slo.ttft_s), ("TPOT", args.slo.tpot_s))
        if v is not None
    )
    title = [
        f"plan --pd for {args.policy} on {args.preset} at {_rate_label(k, trace_k)} "
        f"({len(trace_k.requests):,} requests), SLO p{args.slo_quantile * 100:g}: {slo}",
        f"split requests' KV over {setup.link} at "
        f"{setup.link_bytes_per_s(latency.num_gpus) / 1e9:,.0f} GB/s per replica; conditional "
        f"splits a request when >= {setup.rule.min_uncached_tokens:,} of its prompt tokens are "
        "not cached on its decode replica",
    ]
    print(format_pd_plan(title, rows))
    if aggregated["unreachable"]:
        print(_indented(f"aggregated: {aggregated['unreachable']}"))
    if args.out:
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(
                {
                    "slo": vars(args.slo),
                    "slo_quantile": args.slo_quantile,
                    "preset": args.preset,
                    "policy": args.policy,
                    "target_rps": args.target_rps,
                    "rate_multiplier": k,
                    "rate_rps": rps,
                    "pd": {
                        "link": setup.link,
                        "link_bytes_per_s": setup.link_bytes_per_s(latency.num_gpus),
                        "min_uncached_tokens": setup.rule.min_uncached_tokens,
                    },
                    "rows": rows,
                },
                f,
                indent=2,
            )
            f.write("\n")
    return 0


def _pd_fleet(args: argparse.Namespace, units: UnitTrace, size: int, mode: str) -> dict[str, Any]:
    """The row of the P/D fleet in ``mode`` with the fewest replicas meeting the SLO, searched
    around the aggregated fleet's ``size`` (or, when none met, the largest one simulated)."""
    measured: dict[tuple[int, int], dict[str, Any]] = {}

    def meets(p: int, d: int) -> bool:
        measured[p, d] = _pd_measure(args, units, p + d, _pd_setup(args, p, d, mode))
        return bool(measured[p, d]["ok"])

    search = search_pd(meets, size, args.max_replicas)
    row = measured[search.best or max(measured, key=sum)]
    row["simulated"] = [[p, d] for p, d in search.simulated]
    return row


def _pd_measure(
    args: argparse.Namespace, units: UnitTrace, replicas: int, pd: PdSetup | None
) -> dict[str, Any]:
    """One fleet (``pd`` None: aggregated) simulated: a row of plan --pd's table."""
    config = _fleet_config(args, replicas, [], pd)
    result, wall = run_policy(units, args.policy, config, args.seed, True)
    q = args.slo_quantile
    ttfts, tpots = result.ttfts(), result.tpots()
    ttft, tpot = percentile(ttfts, q), percentile(tpots, q)
    ok = _meets_slo(args, result, ttft, tpot)
    good, goodput = result.goodput(args.slo)
    gpus = replicas * config.engine.latency.num_gpus
    fleet = "aggregated" if pd is None else pd.rule.mode
    row = {
        "fleet": fleet,
        "prefill": pd.prefill if pd is not None else None,
        "decode": pd.decode if pd is not None else None,
        "replicas": replicas,
        "gpus": gpus,
        "ok": ok,
        "requests": result.requests,
        "completed": result.completed,
        "ttft_p50_s": _finite(percentile(ttfts, 0.5)),
        "ttft_p99_s": _finite(percentile(ttfts, 0.99)),
        "tpot_p50_s": _finite(percentile(tpots, 0.5)),
        "tpot_p99_s": _finite(percentile(tpots, 0.99)),
        "ttft_at_slo_quantile_s": _finite(ttft),
        "tpot_at_slo_quantile_s": _finite(tpot),
        "slo_met_requests": good,
        "goodput_rps": _finite(goodput),
        "goodput_per_gpu": _finite(goodput / gpus),
        "split_share": _finite(result.pd.split_share) if result.pd is not None else None,
        "hit_rate": _finite(result.hit_rate()),
    }
    if not args.quiet:
        where = f"{pd.prefill}+{pd.decode}" if pd is not None else str(replicas)
        split = f", {row['split_share']:.0%} split" if row["split_share"] is not None else ""
        print(
            f"  {fleet}, {where} replicas: TTFT p{q * 100:g} {ttft:.3f} s, TPOT p{q * 100:g} "
            f"{tpot * 1000:.1f} ms, {'meets' if ok else 'misses'} the SLO (simulated in "
            f"{wall:.1f} s wall time; goodput {goodput:.3f} req/s{split})",
            file=sys.stderr,
        )
    return row


def _finite(v: float) -> float | None:
    """plan.json's numbers: None for "none measured" (JSON has no NaN)."""
    return None if math.isnan(v) else v


def _batch_plan_line(args: argparse.Namespace, row: dict[str, Any]) -> str:
    job, planned = args.batch_job, row["with_batch_job"]
    what = (
        f"with the batch job ({job.lines:,} lines of {job.input_tokens:,} + "
        f"{job.output_tokens:,} tokens, {job.window_s / 3600:.3g} h window) at "
        f"{row['rate_multiplier']:.3g}x rate: "
    )
    if not planned["replicas"]:
        return what + (planned["unreachable"] or "no fleet size found")
    batch = planned["batch"]
    return what + (
        f"{planned['replicas']} replicas ({row['replicas']} for the trace alone); "
        f"{_batch_progress(batch)}, {batch['share_of_computed_tokens']:.0%} of the tokens "
        f"computed; TTFT p{args.slo_quantile * 100:g} {_opt(planned['ttft_s'], 1, ' s')}"
    )


def _batch_progress(batch: dict[str, Any]) -> str:
    took = batch["completion_of_window"]
    if took is None:
        return f"batch job: {batch['completed']:,} of {batch['lines']:,} lines in its window"
    return f"batch job done in {took:.0%} of its window"


def _slo_values(args: argparse.Namespace, tried: dict[str, Any]) -> list[str]:
    """The SLO metrics that have a target, as measured on one fleet."""
    q = f"p{args.slo_quantile * 100:g}"
    values = []
    if args.slo.ttft_s is not None:
        values.append(f"TTFT {q} {_opt(tried['ttft_s'], 1, ' s')}")
    if args.slo.tpot_s is not None:
        values.append(f"TPOT {q} {_opt(tried['tpot_s'], 1000, ' ms')}")
    return values


def _slo_misses(args: argparse.Namespace, tried: dict[str, Any]) -> list[str]:
    """What kept one fleet from meeting the SLO, with the measured values and the targets."""
    q = f"p{args.slo_quantile * 100:g}"
    misses = []
    if tried["completed"] < tried["requests"]:
        misses.append(f"{tried['requests'] - tried['completed']:,} requests did not finish")
    ttft, tpot = tried["ttft_s"], tried["tpot_s"]
    if args.slo.ttft_s is not None and not ttft <= args.slo.ttft_s:
        misses.append(f"TTFT {q} {_opt(ttft, 1, ' s')} > {args.slo.ttft_s:g} s")
    if args.slo.tpot_s is not None and not (math.isnan(tpot) or tpot <= args.slo.tpot_s):
        misses.append(f"TPOT {q} {_opt(tpot, 1000, ' ms')} > {args.slo.tpot_s * 1000:g} ms")
    return misses


def _why_unreachable(
    args: argparse.Namespace, units: UnitTrace, largest: dict[str, Any]
) -> list[str]:
    """Why no fleet size tried meets the SLO, from what one request costs alone on a replica."""
    config = _fleet_config(args, 1, [])
    engine = config.engine
    q = args.slo_quantile
    why = []
    if largest["rejected"]:
        why.append(
            f"{largest['rejected']:,} requests need more KV cache than one replica holds "
            f"({config.kv_capacity_tokens:,} tokens; --kv-capacity-tokens): they fail at any "
            "fleet size"
        )
    # The fleet turns away what one replica cannot hold: the rest is what the quantile is over.
    fits = [engine.fits(r.input_tokens + r.output_tokens) for r in units.requests]
    bound = [
        b for b, ok in zip(prefill_alone_s(units, engine, cached=True), fits, strict=True) if ok
    ]
    ttft_slo = args.slo.ttft_s
    if ttft_slo is None or largest["ttft_s"] <= ttft_slo or not bound:
        return why
    floor = percentile(bound, q)
    alone = (
        f"prefill alone on an idle replica of {args.preset} with every reusable prefix cached "
        f"(a lower bound on TTFT at any fleet size)"
    )
    if floor > ttft_slo:
        over = sum(b > ttft_slo for b in bound)
        scratch = prefill_alone_s(units, engine, cached=False)
        longest = max(range(len(units.requests)), key=lambda i: units.requests[i].input_tokens)
        why.append(
            f"{over:,} of {len(bound):,} requests ({over / len(bound):.1%}) take longer than "
            f"{ttft_slo:g} s for {alone}: its p{q * 100:g} is {floor:.2f} s, so no fleet size "
            f"gets TTFT p{q * 100:g} within {ttft_slo:g} s. The longest prompt, "
            f"{units.requests[longest].input_tokens:,} tokens, takes {scratch[longest]:.1f} s "
            "to prefill from scratch"
        )
    elif largest["replicas"] >= args.max_replicas:
        why.append(
            f"{alone} has a p{q * 100:g} of {floor:.2f} s: a fleet larger than "
            f"{args.max_replicas} replicas may meet the SLO (raise --max-replicas)"
        )
    else:
        why.append(
            f"{alone} has a p{q * 100:g} of {floor:.2f} s, within the SLO: the rest is prefill "
            "of prefixes the chosen replicas did not have cached and steps shared with other "
            "requests, which more replicas did not reduce"
        )
    return why


def _saturated(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether the SLO metrics barely moved (< 2%) between two fleet sizes."""
    for key in ("ttft_s", "tpot_s"):
        a, b = before[key], after[key]
        if math.isnan(a) or math.isnan(b):
            continue
        if b < a * 0.98:
            return False
    return bool(after["completed"] == before["completed"])


def _mixed_sizes(row: dict[str, Any], names: list[str]) -> None:
    """A mixed fleet's row: how many of each kind, their GPUs, and the nodes that hold them
    (a node holds one kind: a GPU generation per node)."""
    row["kinds"] = describe_counts(names)
    row["gpus"] = sum(latency_preset(name).num_gpus for name in names)
    row["nodes"] = sum(
        _nodes(names.count(name), latency_preset(name).num_gpus) or 0
        for name in dict.fromkeys(names)
    )


def _cost(price: float | None, row: dict[str, Any]) -> float | None:
    if price is None or not row["replicas"] or not row["tokens"] or not row["duration_s"]:
        return None
    gpu_hours = float(row["gpus"] * row["duration_s"]) / 3600.0
    return price * gpu_hours / (float(row["tokens"]) / 1e6)


def _plan_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    q = f"p{args.slo_quantile * 100:g}"
    lines = [
        f"plan for {args.policy} on "
        + (f"a mix of {_mix_text(args.mix)}" if args.mix else args.preset)
        + f", SLO {q}: "
        + ", ".join(
            f"{k} <= {v:g} s"
            for k, v in (("TTFT", args.slo.ttft_s), ("TPOT", args.slo.tpot_s))
            if v is not None
        ),
        f"{'rate':>8}{'req/s':>9}{'replicas':>12}{'GPUs':>7}{'nodes':>7}{'TTFT ' + q:>12}"
        f"{'TPOT ' + q:>12}"
        f"{'hit rate':>10}{'$/M tokens':>12}",
    ]
    notes = False
    for r in rows:
        cost = r["cost_per_million_tokens_usd"]
        # No fleet met the SLO: the largest one tried, marked, with what it measured.
        shown = r["largest_tried"] or r
        replicas = f"{shown['replicas']} (miss)" if r["largest_tried"] else str(r["replicas"])
        lines.append(
            f"{r['rate_multiplier']:>7.3g}x{(r['rate_rps'] or 0):>9.2f}"
            f"{replicas:>12}{(r['gpus'] or '-'):>7}{(r.get('nodes') or '-'):>7}"
            f"{_opt(shown['ttft_s'], 1, 's'):>12}{_opt(shown['tpot_s'], 1000, 'ms'):>12}"
            f"{_opt(shown['hit_rate'], 100, '%'):>10}{('-' if cost is None else f'{cost:.4f}'):>12}"
        )
        if r.get("kinds"):
            lines.append(_indented(f"of which {r['kinds']}"))
        if r["unreachable"]:
            notes = True
            lines.append(_indented(r["unreachable"]))
            lines += [_indented(f"why: {reason}") for reason in r.get("why", [])]
    if notes:
        lines.append("(miss): no fleet met the SLO; the row shows the largest one simulated")
    return "\n".join(lines)


def _mix_text(mix: Mix) -> str:
    return ",".join(f"{name}*{count}" for name, count in mix)


def _indented(text: str) -> str:
    return textwrap.fill(
        text, width=100, initial_indent=" " * 9, subsequent_indent=" " * 11, break_on_hyphens=False
    )


def _opt(v: float | None, scale: float, unit: str) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v * scale:.{3 if unit.strip() == 's' else 1}f}{unit}"


# -- bench replay -------------------------------------------------------------------------


def _default_bench_trace() -> str | None:
    """The Mooncake trace under $KVROUTE_TRACES (laid out as README.md's "Traces" says)."""
    root = os.environ.get("KVROUTE_TRACES")
    return os.path.join(root, "mooncake", "conversation_trace.jsonl") if root else None


WORKING_SET_KV_TOKENS = 16_000_000  # per replica x 8 > the conversation trace's 93.6M tokens


def add_replay_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvroute bench replay`` on the ``bench`` subparsers."""
    p = sub.add_parser(
        "replay",
        help="The simulator's speed and kv_aware's hit rate on the Mooncake trace.",
        description=(
            "On the Mooncake conversation trace: (1) wall time of 16 simulated replicas "
            "(target <= 30 s), (2) of 200 replicas at 10x the rate (target <= 5 min), "
            "(3) 8 replicas at the preset's KV capacity and at one that holds the working set: "
            "kv_aware, least_loaded and round_robin, hit rate vs the pooled-LRU and infinite "
            "bounds (target >= 0.9x) and TTFT p99 vs least_loaded's. Prints a Markdown section "
            "and appends it to BENCHMARKS.md."
        ),
    )
    default = _default_bench_trace()
    p.add_argument(
        "--trace",
        default=default,
        required=default is None,
        metavar="FILE",
        help="Mooncake's conversation_trace.jsonl (default: under $KVROUTE_TRACES, if set).",
    )
    p.add_argument("--repeat", type=positive_int, default=2, help="Runs of the 16-replica case.")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=f"The simulated replicas' latency model (default {DEFAULT_PRESET}).",
    )
    p.add_argument("--output-md", default="BENCHMARKS.md", help="Where to append the results.")
    p.add_argument("--no-record", action="store_true", help="Print only; append nothing.")
    p.set_defaults(func=_cmd_bench_replay)


def _cmd_bench_replay(args: argparse.Namespace) -> int:
    try:
        section = _bench_replay(args)
    except UsageError as exc:
        print(f"kvroute bench replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print_and_record(section, args.output_md, args.no_record)
    return 0


def print_and_record(section: str, output_md: str, no_record: bool) -> None:
    """Print a bench's Markdown section and, unless told not to, append it to ``output_md``."""
    print(section)
    if not no_record:
        with open(output_md, "a", encoding="utf-8") as f:
            f.write("\n" + section)
        print(f"appended to {output_md}", file=sys.stderr)


def _bench_args(args: argparse.Namespace, **over: Any) -> argparse.Namespace:
    base = {
        "trace": args.trace,
        "format": "mooncake",
        "time_scale": 1.0,
        "rate_scale": 1.0,
        "window": None,
        "max_requests": None,
        "seed": 0,
        "preset": args.preset,
        "kv_capacity_tokens": None,
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "event_lag_s": 0.01,
        "scrape_interval_s": 1.0,
        "engine_model": "fast",
    }
    base.update(over)
    return argparse.Namespace(**base)


def _bench_replay(args: argparse.Namespace) -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"## Simulator, {started}",
        "",
        "```",
        # The trace's own path stays out: it is one machine's (README.md, "Traces", says where).
        "kvroute bench replay --trace path/to/conversation_trace.jsonl "
        f"--repeat {args.repeat}"
        + (f" --preset {args.preset}" if args.preset != DEFAULT_PRESET else ""),
        "```",
        "",
        f"- machine: {os.cpu_count()} CPUs, load average before run "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; preset {args.preset}, fast engine model",
    ]
    base = _bench_args(args)
    _, units = _load(base)
    lines.append(
        f"- trace: {os.path.basename(args.trace)}, {len(units.requests):,} requests over "
        f"{units.duration_s / 60:.0f} min"
    )
    lines += [
        "",
        "| case | policy | wall s | target | hit rate | TTFT p99 s |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for label, replicas, rate, target in (
        ("16 replicas", 16, 1.0, 30.0),
        ("200 replicas, 10x rate", 200, 10.0, 300.0),
    ):
        trace_k = scaled(units, rate)
        config = _fleet_config(_bench_args(args), replicas, [])
        repeat = args.repeat if replicas == 16 else 1
        walls: list[float] = []
        result: SimResult | None = None
        for _ in range(repeat):
            result, wall = run_policy(trace_k, "kv_aware", config, 0, True)
            walls.append(wall)
            print(f"{label}: {wall:.1f} s", file=sys.stderr)
        assert result is not None
        wall_text = f"{min(walls):.1f}-{max(walls):.1f}" if len(walls) > 1 else f"{walls[0]:.1f}"
        lines.append(
            f"| {label} | kv_aware | {wall_text} | <= {target:.0f} "
            f"| {percent(result.hit_rate())} | {percentile(result.ttfts(), 0.99):.2f} |"
        )
    lines += [
        "",
        "| replicas | KV tokens/replica | policy | hit rate | vs pooled LRU | vs infinite "
        "| TTFT p50 s | TTFT p99 s | TTFT p99 vs least_loaded | load max/mean |",
        "|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for kv in (None, WORKING_SET_KV_TOKENS):
        config = _fleet_config(_bench_args(args, kv_capacity_tokens=kv), 8, [])
        bs = config.engine.block_size
        infinite = infinite_cache_hit_rate(units, bs).token_rate
        pooled = pooled_lru_hit_rate(units, config.engine.num_blocks * 8, bs).token_rate
        rows: dict[str, SimResult] = {}
        for name in ("kv_aware", "least_loaded", "round_robin"):
            rows[name], wall = run_policy(units, name, config, 0, True)
            print(
                f"8 replicas, {config.kv_capacity_tokens:,} tokens, {name}: {wall:.1f} s",
                file=sys.stderr,
            )
        ll_p99 = percentile(rows["least_loaded"].ttfts(), 0.99)
        for name, r in rows.items():
            hit = r.hit_rate()
            p99 = percentile(r.ttfts(), 0.99)
            lines.append(
                f"| 8 | {config.kv_capacity_tokens:,} | {name} | {percent(hit)} "
                f"| {hit / pooled:.2f}x | {hit / infinite:.2f}x | {percentile(r.ttfts(), 0.5):.3f} "
                f"| {p99:.2f} | {p99 / ll_p99:.2f}x | {r.load_max_over_mean():.2f} |"
            )
        lines.append(
            f"| | | bounds | infinite {percent(infinite)}, pooled LRU {percent(pooled)} "
            "| | | | | | |"
        )
    return "\n".join(lines) + "\n"
