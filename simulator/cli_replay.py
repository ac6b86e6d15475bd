"""``kvroute replay`` and ``kvroute plan``: replay traces through simulated fleets.

``replay`` simulates one policy (or several with ``--compare``) on a fleet of engine models,
prints a summary table and writes ``summary.json``, ``report.md`` and PNG plots to ``--out``;
with ``--live URL`` it replays the trace against a running router instead. ``plan`` finds the
smallest fleet that meets an SLO at the trace's rate and at multiples of it, with its cost.
Bad flags or input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import shlex
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from typing import Any

from policies import DEFAULT_POLICY, POLICIES, PolicyConfigError, build_policy
from policies.registry import policy_parameters
from simulator.engine.latency import (
    DEFAULT_PRESET,
    PRESETS,
    TINY_CPU,
    LatencyModel,
    latency_preset,
)
from simulator.fleet import (
    ENGINE_MODELS,
    FleetConfig,
    SimResult,
    Slo,
    UnitTrace,
    engine_config,
    infinite_cache_hit_rate,
    percentile,
    pooled_lru_hit_rate,
    prepare,
    simulate,
)
from simulator.fleet.report import markdown_report
from simulator.fleet.summary import format_table, summarize
from simulator.fleet.units import scaled

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input found after parsing: printed as one line, exit status 2."""


# -- argparse value types ---------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
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
        fields[key] = _positive_float(value)
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


def _policy(text: str) -> str:
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
    return [_policy(n) for n in names]


def _multipliers(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,4, got {text!r}") from None
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"multipliers must be positive numbers, got {text!r}")
    return values


# -- parsers ----------------------------------------------------------------------------


def add_replay_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``replay`` and ``plan`` on the ``kvroute`` command line."""
    from simulator.traces import FORMATS, SYNTHETIC_HELP

    replay = sub.add_parser(
        "replay",
        help="Replay a trace through a simulated fleet (or a live router) and report.",
        description=_wrapped(
            "Simulate a fleet of vLLM engine models behind the router's own policy code and "
            "prefix index, on a virtual clock: requests arrive as the trace says, the policy "
            "routes them with the load and cache information the live router would have, and "
            "each replica schedules, caches and evicts as vLLM does. Prints a summary and "
            "writes DIR/summary.json, DIR/report.md and PNG plots. --compare runs several "
            "policies on the same trace; --fail K@T removes replica K at T seconds (its "
            "requests resume elsewhere). --live URL replays against a running router instead."
        ),
        epilog=SYNTHETIC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_trace_args(replay, FORMATS)
    replay.add_argument("--replicas", type=_positive_int, default=4, help="Fleet size (default 4).")
    replay.add_argument(
        "--policy",
        type=_policy,
        default=DEFAULT_POLICY,
        help=f"Routing policy (default {DEFAULT_POLICY}): {', '.join(sorted(POLICIES))}.",
    )
    replay.add_argument(
        "--policy-param",
        type=_policy_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A policy parameter (as in a config's policy.params), e.g. margin_ratio=0.05; "
        "repeat for more. Applies to every policy that accepts it.",
    )
    replay.add_argument(
        "--compare",
        type=_policy_list,
        metavar="P1,P2,...",
        help="Run these policies on the same trace and fleet and tabulate them.",
    )
    _add_fleet_args(replay)
    replay.add_argument(
        "--slo",
        type=_slo,
        metavar="ttft=S,tpot=S",
        help="Targets in seconds for goodput (requests that meet both per second).",
    )
    replay.add_argument(
        "--fail",
        type=_failure,
        action="append",
        default=[],
        metavar="K@T",
        help="Remove replica K (0-based) at T seconds; repeat for more.",
    )
    replay.add_argument(
        "--out", metavar="DIR", help="Directory for summary.json, report.md, plots."
    )
    replay.add_argument("--no-plots", action="store_true", help="Skip the PNG plots.")
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
        type=_positive_int,
        metavar="N",
        help="With --live: words per trace block (default: the trace's block size); scales "
        "prompts down for small models, e.g. 16 for Mooncake's 512-token blocks.",
    )
    replay.add_argument(
        "--max-prompt-tokens",
        type=_positive_int,
        metavar="N",
        help="With --live: cut prompts to N words (a prefix stays a prefix).",
    )
    replay.add_argument(
        "--max-output-tokens",
        type=_positive_int,
        metavar="N",
        help="With --live: ask for at most N output tokens per request.",
    )
    replay.add_argument(
        "--concurrency",
        type=_positive_int,
        default=64,
        metavar="N",
        help="With --live: requests in flight at most (default 64); a request due while all "
        "are busy waits, and the summary says how late requests went out.",
    )
    replay.set_defaults(func=_cmd_replay)

    plan = sub.add_parser(
        "plan",
        help="Smallest simulated fleet that meets an SLO, at the trace's rate and multiples.",
        description=_wrapped(
            "For the trace's own request rate and k times it (--rate-multipliers), find the "
            "smallest number of replicas whose simulated TTFT and TPOT at the SLO quantile stay "
            "within the SLO (doubling, then bisection), and its cost per million tokens "
            "(--gpu-price per GPU-hour, times the preset's GPUs per replica)."
        ),
        epilog=SYNTHETIC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_trace_args(plan, FORMATS)
    plan.add_argument(
        "--slo", type=_slo, required=True, metavar="ttft=S,tpot=S", help="Targets in seconds."
    )
    plan.add_argument(
        "--slo-quantile",
        type=float,
        default=0.99,
        help="The quantile that must meet the SLO (default 0.99).",
    )
    plan.add_argument(
        "--policy", type=_policy, default=DEFAULT_POLICY, help="Routing policy (default kv_aware)."
    )
    _add_fleet_args(plan)
    plan.add_argument(
        "--rate-multipliers",
        type=_multipliers,
        default=[2.0, 4.0],
        metavar="K1,K2",
        help="Also plan for these multiples of the trace's rate (default 2,4).",
    )
    plan.add_argument(
        "--gpu-price",
        type=_non_negative_float,
        metavar="USD_PER_HOUR",
        help="Price of one GPU-hour, for the cost per million tokens.",
    )
    plan.add_argument(
        "--max-replicas", type=_positive_int, default=1024, help="Give up above (default 1024)."
    )
    plan.add_argument("--out", metavar="DIR", help="Also write DIR/plan.json.")
    plan.add_argument("--quiet", action="store_true", help="No progress lines.")
    plan.set_defaults(func=_cmd_plan)


def _wrapped(text: str) -> str:
    """Pre-wrapped description: the raw formatter (kept for the epilog's layout) wraps nothing."""
    return textwrap.fill(text, width=88)


def _add_trace_args(p: argparse.ArgumentParser, formats: tuple[str, ...]) -> None:
    p.add_argument(
        "--trace",
        required=True,
        metavar="FILE",
        help="Trace file (or, with --format synthetic, a generator spec).",
    )
    p.add_argument(
        "--format",
        metavar="FORMAT",
        help=f"One of {', '.join(formats)}, optionally with options after a colon "
        "(default: detect from the file).",
    )
    p.add_argument(
        "--time-scale", type=_positive_float, default=1.0, help="Stretch arrivals (2 = half rate)."
    )
    p.add_argument(
        "--rate-scale", type=_positive_float, default=1.0, help="Compress arrivals (2 = 2x rate)."
    )
    p.add_argument("--window", type=_window, metavar="START:END", help="Seconds of the trace.")
    p.add_argument("--max-requests", type=_positive_int, help="Keep only the first N requests.")
    p.add_argument("--seed", type=int, default=0, help="Seed of policies and generators.")


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=f"Model + GPU latency preset (default {DEFAULT_PRESET}): {', '.join(sorted(PRESETS))}.",
    )
    p.add_argument(
        "--kv-capacity-tokens",
        type=_positive_int,
        metavar="T",
        help="KV cache per replica in tokens (default: the preset's GPU memory less weights).",
    )
    p.add_argument("--block-size", type=_positive_int, default=16, help="KV block size (16).")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256, help="Batch limit (256).")
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
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
        type=_positive_float,
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


# -- shared steps -------------------------------------------------------------------------


def _load_trace(args: argparse.Namespace, time_scale: float) -> Any:
    from simulator.traces import TraceError, load_trace

    try:
        trace = load_trace(
            args.trace,
            args.format,
            time_scale=time_scale,
            rate_scale=args.rate_scale,
            window_s=args.window,
            max_requests=args.max_requests,
            seed=args.seed,
        )
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read trace {args.trace}: {exc.strerror or exc}") from None
    if not trace.requests:
        raise UsageError(f"trace {args.trace} has no requests (after window and caps)")
    return trace


def _load(args: argparse.Namespace) -> tuple[Any, UnitTrace]:
    trace = _load_trace(args, args.time_scale)
    return trace, prepare(trace)


def _fleet_config(
    args: argparse.Namespace, replicas: int, failures: list[tuple[int, float]]
) -> FleetConfig:
    latency = latency_preset(args.preset)
    try:
        engine = engine_config(
            latency,
            args.kv_capacity_tokens,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed,
        )
        return FleetConfig(
            replicas=replicas,
            engine=engine,
            engine_model=args.engine_model,
            event_lag_s=args.event_lag_s,
            scrape_interval_s=args.scrape_interval_s,
            failures=tuple(failures),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _policy_object(name: str, seed: int, extra: list[tuple[str, Any]] | None = None) -> Any:
    accepted = policy_parameters(name)
    params: dict[str, Any] = {"seed": seed} if "seed" in accepted else {}
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


def _run_one(
    units: UnitTrace,
    policy_name: str,
    config: FleetConfig,
    seed: int,
    quiet: bool,
    params: list[tuple[str, Any]] | None = None,
) -> tuple[SimResult, float]:
    policy = _policy_object(policy_name, seed, params)
    bar = _ProgressBar(policy_name, not quiet)
    started = time.perf_counter()
    result = simulate(units, policy, config, bar)
    return result, time.perf_counter() - started


# -- replay -------------------------------------------------------------------------------


def _cmd_replay(args: argparse.Namespace) -> int:
    try:
        return _replay(args)
    except UsageError as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _replay(args: argparse.Namespace) -> int:
    if args.live:
        # The live replayer paces by --time-scale itself: load the trace unscaled in time.
        return _replay_live(args, _load_trace(args, 1.0))
    trace, units = _load(args)
    if not args.out:
        raise UsageError("--out DIR is required (where summary.json and report.md go)")
    _prepare_out(args.out)
    for k, _ in args.fail:
        if k >= args.replicas:
            raise UsageError(f"--fail {k}@...: replicas are numbered 0..{args.replicas - 1}")
    config = _fleet_config(args, args.replicas, args.fail)
    policies = args.compare or [args.policy]
    for key, _ in args.policy_param:
        if not any(key in policy_parameters(name) for name in policies):
            raise UsageError(f"--policy-param {key}: no policy of {', '.join(policies)} takes it")
    infinite = infinite_cache_hit_rate(units, config.engine.block_size).token_rate
    pooled = pooled_lru_hit_rate(
        units, config.engine.num_blocks * config.replicas, config.engine.block_size
    ).token_rate
    if not args.quiet:
        print(
            f"{len(units.requests)} requests over {units.duration_s:,.0f} s, {args.replicas} "
            f"replicas of {args.preset}, {config.kv_capacity_tokens:,} KV tokens each",
            file=sys.stderr,
        )
    results: list[SimResult] = []
    summaries: list[dict[str, Any]] = []
    for name in policies:
        result, wall = _run_one(units, name, config, args.seed, args.quiet, args.policy_param)
        results.append(result)
        summaries.append(
            summarize(
                result,
                infinite_hit_rate=infinite,
                pooled_lru_hit_rate=pooled,
                slo=args.slo or Slo(),
                wall_s=wall,
                extra={"preset": args.preset, "engine_model": args.engine_model},
            )
        )
    print(format_table(summaries))
    print(
        f"bounds: infinite cache {_pct(infinite)}, pooled LRU of the fleet's capacity "
        f"{_pct(pooled)} (token-weighted hit rates)"
    )
    _write_outputs(args, trace, units, config, results, summaries)
    print(f"wrote {os.path.join(args.out, 'summary.json')} and report.md")
    return 0


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
    command = "kvroute " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    plots: list[str] = []
    if not args.no_plots:
        from simulator.fleet.plots import write_plots

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
        "scrape_interval_s": config.scrape_interval_s,
        "seed": args.seed,
        "failures": list(config.failures),
        "command": command,
    }
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown_report(summaries, context, plots))


def _replay_live(args: argparse.Namespace, trace: Any) -> int:
    try:
        live = importlib.import_module("simulator.traces.live")
    except ImportError:
        raise UsageError("--live is not available in this build (simulator.traces.live)") from None
    try:
        live.replay_live(
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
        )
    except (ValueError, live.LiveReplayError) as exc:  # its one-line errors (no router, ...)
        raise UsageError(str(exc)) from None
    return 0


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1%}"


# -- plan ---------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        return _plan(args)
    except UsageError as exc:
        print(f"kvroute plan: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _plan(args: argparse.Namespace) -> int:
    if not 0 < args.slo_quantile < 1:
        raise UsageError(f"--slo-quantile must be between 0 and 1, got {args.slo_quantile}")
    if args.out:
        _prepare_out(args.out)
    _, units = _load(args)
    latency = latency_preset(args.preset)
    rows: list[dict[str, Any]] = []
    for k in [1.0, *args.rate_multipliers]:
        trace_k = scaled(units, k)
        row = _plan_one(args, trace_k, k)
        rows.append(row)
        gpus = latency.num_gpus
        row["gpus"] = row["replicas"] * gpus if row["replicas"] else None
        row["cost_per_million_tokens_usd"] = _cost(args.gpu_price, row, gpus)
    print(_plan_table(args, rows))
    if args.out:
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump({"slo": vars(args.slo), "preset": args.preset, "rows": rows}, f, indent=2)
            f.write("\n")
    return 0


def _plan_one(args: argparse.Namespace, units: UnitTrace, k: float) -> dict[str, Any]:
    tried: dict[int, dict[str, Any]] = {}

    def meets(n: int) -> bool:
        config = _fleet_config(args, n, [])
        result, wall = _run_one(units, args.policy, config, args.seed, True)
        q = args.slo_quantile
        ttft = percentile(result.ttfts(), q)
        tpot = percentile(result.tpots(), q)
        ok = (
            result.completed == result.requests
            and (args.slo.ttft_s is None or ttft <= args.slo.ttft_s)
            and (args.slo.tpot_s is None or math.isnan(tpot) or tpot <= args.slo.tpot_s)
        )
        tried[n] = {
            "ttft_s": ttft,
            "tpot_s": tpot,
            "hit_rate": result.hit_rate(),
            "completed": result.completed,
            "rejected": sum(result.rejected),
            "ok": ok,
        }
        if not args.quiet:
            print(
                f"  {k:g}x rate, {n} replicas: TTFT p{q * 100:g} {ttft:.3f} s, TPOT "
                f"p{q * 100:g} {tpot * 1000:.1f} ms, {'meets' if ok else 'misses'} the SLO "
                f"({wall:.1f} s)",
                file=sys.stderr,
            )
        return ok

    low, high = 0, 1  # low: largest known to miss; high: candidate
    unreachable: str | None = None
    while not meets(high):
        if low and _saturated(tried[low], tried[high]):
            # Twice the replicas changed nothing: what misses is a single request's own time
            # (a long prompt's prefill), which no fleet size shortens.
            unreachable = (
                f"TTFT {tried[high]['ttft_s']:.3f} s / TPOT {tried[high]['tpot_s'] * 1000:.1f} ms "
                f"at {low} and {high} replicas: more replicas do not help"
            )
            high = 0
            break
        low = high
        if high >= args.max_replicas:
            unreachable = f"not met with --max-replicas {args.max_replicas}"
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
    }


def _saturated(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether the SLO metrics barely moved (< 2%) between two fleet sizes."""
    for key in ("ttft_s", "tpot_s"):
        a, b = before[key], after[key]
        if math.isnan(a) or math.isnan(b):
            continue
        if b < a * 0.98:
            return False
    return bool(after["completed"] == before["completed"])


def _cost(price: float | None, row: dict[str, Any], gpus_per_replica: int) -> float | None:
    if price is None or not row["replicas"] or not row["tokens"] or not row["duration_s"]:
        return None
    gpu_hours = float(row["replicas"] * gpus_per_replica * row["duration_s"]) / 3600.0
    return price * gpu_hours / (float(row["tokens"]) / 1e6)


def _plan_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    q = f"p{args.slo_quantile * 100:g}"
    lines = [
        f"plan for {args.policy} on {args.preset}, SLO {q}: "
        + ", ".join(
            f"{k} <= {v:g} s"
            for k, v in (("TTFT", args.slo.ttft_s), ("TPOT", args.slo.tpot_s))
            if v is not None
        ),
        f"{'rate':>8}{'req/s':>9}{'replicas':>10}{'GPUs':>7}{'TTFT ' + q:>12}{'TPOT ' + q:>12}"
        f"{'hit rate':>10}{'$/M tokens':>12}",
    ]
    for r in rows:
        cost = r["cost_per_million_tokens_usd"]
        lines.append(
            f"{r['rate_multiplier']:>7g}x{(r['rate_rps'] or 0):>9.2f}"
            f"{(r['replicas'] or 0) if r['replicas'] else '> max':>10}{(r['gpus'] or 0):>7}"
            f"{_opt(r['ttft_s'], 1, 's'):>12}{_opt(r['tpot_s'], 1000, 'ms'):>12}"
            f"{_opt(r['hit_rate'], 100, '%'):>10}{('-' if cost is None else f'{cost:.4f}'):>12}"
        )
        if r["unreachable"]:
            lines.append(f"{'':>8} unreachable: {r['unreachable']}")
    return "\n".join(lines)


def _opt(v: float | None, scale: float, unit: str) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v * scale:.{3 if unit == 's' else 1}f}{unit}"


# -- bench replay -------------------------------------------------------------------------

DEFAULT_BENCH_TRACE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "shared",
    "traces",
    "mooncake",
    "conversation_trace.jsonl",
)
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
    p.add_argument("--trace", default=DEFAULT_BENCH_TRACE, metavar="FILE")
    p.add_argument("--repeat", type=_positive_int, default=2, help="Runs of the 16-replica case.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET, metavar="NAME")
    p.add_argument("--output-md", default="BENCHMARKS.md", help="Where to append the results.")
    p.add_argument("--no-record", action="store_true", help="Print only; append nothing.")
    p.set_defaults(func=_cmd_bench_replay)


def _cmd_bench_replay(args: argparse.Namespace) -> int:
    try:
        section = _bench_replay(args)
    except UsageError as exc:
        print(f"kvroute bench replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(section)
    if not args.no_record:
        with open(args.output_md, "a", encoding="utf-8") as f:
            f.write("\n" + section)
        print(f"appended to {args.output_md}", file=sys.stderr)
    return 0


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
        f"kvroute bench replay --repeat {args.repeat}"
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
            result, wall = _run_one(trace_k, "kv_aware", config, 0, True)
            walls.append(wall)
            print(f"{label}: {wall:.1f} s", file=sys.stderr)
        assert result is not None
        wall_text = f"{min(walls):.1f}-{max(walls):.1f}" if len(walls) > 1 else f"{walls[0]:.1f}"
        lines.append(
            f"| {label} | kv_aware | {wall_text} | <= {target:.0f} | {_pct(result.hit_rate())} "
            f"| {percentile(result.ttfts(), 0.99):.2f} |"
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
            rows[name], wall = _run_one(units, name, config, 0, True)
            print(
                f"8 replicas, {config.kv_capacity_tokens:,} tokens, {name}: {wall:.1f} s",
                file=sys.stderr,
            )
        ll_p99 = percentile(rows["least_loaded"].ttfts(), 0.99)
        for name, r in rows.items():
            hit = r.hit_rate()
            p99 = percentile(r.ttfts(), 0.99)
            lines.append(
                f"| 8 | {config.kv_capacity_tokens:,} | {name} | {_pct(hit)} | {hit / pooled:.2f}x "
                f"| {hit / infinite:.2f}x | {percentile(r.ttfts(), 0.5):.3f} | {p99:.2f} "
                f"| {p99 / ll_p99:.2f}x | {r.load_max_over_mean():.2f} |"
            )
        lines.append(
            f"| | | bounds | infinite {_pct(infinite)}, pooled LRU {_pct(pooled)} | | | | | | |"
        )
    return "\n".join(lines) + "\n"


# -- bench fidelity -----------------------------------------------------------------------

FIDELITY_WORKLOAD = (
    "multi-tenant:tenants=6,rate=0.5,duration=120,system_tokens=512,prompt_tokens=64,"
    "output_tokens=8,zipf=0.5,block_tokens=32"
)
FIDELITY_HIT_RATE_PP = 3.0  # the target: simulated engine hit rate within 3 points of vLLM's
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM 0.32's default for the API server on CPU
_PROBE_TOKENS = (40, 400, 800, 1200, 1600)  # prompt sizes of the latency probe
_PROBE_REPEATS = 3
_PROBE_OUTPUT_TOKENS = 24


def add_fidelity_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvroute bench fidelity`` on the ``bench`` subparsers."""
    p = sub.add_parser(
        "fidelity",
        help="The simulator against real vllm-cpu replicas on the same workload.",
        description=_wrapped(
            "Launch real vllm-cpu replicas (the tiny model) behind `kvroute serve`, fit the "
            "engine's step times with a short probe (sequential requests of growing prompts), "
            "replay a trace live through the router (kvroute replay --live), then simulate the "
            "same prompts, token for token, on a fleet with the same replica count, KV blocks, "
            "block size, max_num_seqs and token budget. Prints the engines' prefix hit rate "
            "(target: within 3 points of vLLM's) and TTFT p50/p90/p99 side by side, with the "
            "command, and appends them to BENCHMARKS.md. Takes 3-6 minutes here, mostly vLLM "
            "start-up."
        ),
        epilog=SYNTHETIC_HELP_FOR_FIDELITY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        default=FIDELITY_WORKLOAD,
        metavar="SPEC",
        help="A synthetic spec (see below) whose prompts fit the tiny model (default: 6 tenants, "
        "0.5 req/s for 120 s: light enough that the shared 2-core box keeps up).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the workload and the policy.")
    p.add_argument("--replicas", type=_positive_int, default=2, help="vLLM replicas (2).")
    p.add_argument(
        "--kv-blocks",
        type=_positive_int,
        default=64,
        help="KV blocks per replica (--num-gpu-blocks-override; default 64, of which vLLM "
        "keeps one back): small, so eviction matters.",
    )
    p.add_argument(
        "--max-num-seqs", type=_positive_int, default=16, help="Batch limit per replica (16)."
    )
    p.add_argument(
        "--tokens-per-block",
        type=_positive_int,
        default=11,
        help="Words per trace block in the prompts (default 11: about 32 tiny-model tokens).",
    )
    p.add_argument(
        "--policy", type=_policy, default=DEFAULT_POLICY, help="Routing policy (default kv_aware)."
    )
    p.add_argument(
        "--time-scale", type=_positive_float, default=1.0, help="Stretch arrivals (2 = half rate)."
    )
    p.add_argument(
        "--startup-timeout-s",
        type=_positive_float,
        default=600.0,
        help="Wait this long for the replicas (default 600).",
    )
    p.add_argument("--log-dir", metavar="DIR", help="Keep the replicas' and router's logs here.")
    p.add_argument("--output-md", default="BENCHMARKS.md", help="Where to append the results.")
    p.add_argument("--no-record", action="store_true", help="Print only; append nothing.")
    p.set_defaults(func=_cmd_bench_fidelity)


SYNTHETIC_HELP_FOR_FIDELITY = (
    "Workload specs use the grammar of `kvroute replay --help` (synthetic traces); prompts plus "
    "outputs\nmust fit the replicas' context ((kv-blocks - 1) x 32 tokens)."
)


def _cmd_bench_fidelity(args: argparse.Namespace) -> int:
    try:
        section = _bench_fidelity(args)
    except UsageError as exc:
        print(f"kvroute bench fidelity: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(section)
    if not args.no_record:
        with open(args.output_md, "a", encoding="utf-8") as f:
            f.write("\n" + section)
        print(f"appended to {args.output_md}", file=sys.stderr)
    return 0


def _bench_fidelity(args: argparse.Namespace) -> str:
    from router.tokenization import HFTokenizerFiles
    from simulator.traces import TraceError, load_trace
    from simulator.traces.prompts import PromptBuilder

    block = 32  # vLLM's CPU attention backend takes multiples of 32 only
    try:
        trace = load_trace(args.workload, "synthetic", seed=args.seed)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    builder = PromptBuilder(trace.block_tokens, args.tokens_per_block)
    model_dir = _orchestration("backends.launcher").ensure_tiny_model()
    encode = HFTokenizerFiles(model_dir).encode
    tokenized = _tokenized_trace(trace, builder, encode, block, args.time_scale)
    context = (args.kv_blocks - 1) * block  # vLLM keeps one block back
    longest = max(r.input_tokens + r.output_tokens for r in tokenized.requests)
    if longest > context:
        raise UsageError(
            f"the longest request needs {longest} tokens but {args.kv_blocks} KV blocks hold "
            f"{context}: raise --kv-blocks or lower --tokens-per-block"
        )
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    live, probes = _fidelity_live(args, trace, encode, block, context, str(model_dir))
    fit = _fit_latency(probes)
    units = prepare(tokenized)
    runs: list[tuple[str, SimResult, float]] = []
    for label, latency, engine_model, offset in (
        ("simulated, exact engine, fitted latency", fit.model, "exact", fit.api_overhead_s),
        ("simulated, fast engine, fitted latency", fit.model, "fast", fit.api_overhead_s),
        ("simulated, exact engine, tiny-cpu preset", latency_preset("tiny-cpu"), "exact", 0.0),
    ):
        engine = engine_config(
            latency,
            context,
            block_size=block,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
            seed=args.seed,
        )
        config = FleetConfig(replicas=args.replicas, engine=engine, engine_model=engine_model)
        result, _ = _run_one(units, args.policy, config, args.seed, True)
        runs.append((label, result, offset))
    return _fidelity_report(args, started, load, tokenized, live, fit, runs)


def _orchestration(module: str) -> Any:
    """Process launching and bench helpers, imported untyped: they sit outside the strict
    mypy set this module belongs to (and pull in transformers)."""
    return importlib.import_module(module)


def _tokenized_trace(trace: Any, builder: Any, encode: Any, block: int, time_scale: float) -> Any:
    """The live replay's prompts as the replicas see them: real token ids cut into blocks.

    Block ids chain (parent id, block tokens), so equal ids mean equal token prefixes: the
    simulated engines cache exactly what vLLM's can, whatever the tokenizer did to the words.
    """
    from simulator.traces import Trace, TraceRequest

    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    first = trace.requests[0].arrival_s
    requests = []
    for index, request in enumerate(trace.requests):
        tokens = encode(builder.prompt(request, salt=index))  # the salt replay_live uses
        chain: list[int] = []
        parent = -1
        for start in range(0, len(tokens), block):
            parent = ids.setdefault((parent, tuple(tokens[start : start + block])), len(ids))
            chain.append(parent)
        requests.append(
            TraceRequest(
                arrival_s=(request.arrival_s - first) * time_scale,
                input_tokens=len(tokens),
                output_tokens=max(1, request.output_tokens),
                block_ids=tuple(chain),
                session_id=request.session_id,
            )
        )
    return Trace(f"{trace.name} (tokenized)", block, tuple(requests))


Probe = tuple[int, float, float]  # (prompt tokens, TTFT s, TPOT s) of one request alone


def _fidelity_live(
    args: argparse.Namespace,
    trace: Any,
    encode: Any,
    block: int,
    context: int,
    model_dir: str,
) -> tuple[dict[str, Any], list[Probe]]:
    """Launch the replicas and the router, probe step times, replay; stop everything."""
    import contextlib
    from pathlib import Path

    launcher = _orchestration("backends.launcher")
    launch_error = _orchestration("backends.process").LaunchError
    processes = _orchestration("router.bench.processes")
    kvroute_argv = _orchestration("router.bench.overhead").kvroute_argv

    host = "127.0.0.1"
    with contextlib.ExitStack() as stack:
        if args.log_dir:
            log_dir = Path(args.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = stack.enter_context(processes.log_directory("kvroute-bench-fidelity-"))
        stack.enter_context(processes.sigterm_as_exit())
        spec = launcher.LaunchSpec(
            engine="vllm", count=args.replicas, model="tiny", model_path=None, tokenizer=None,
            block_size=block, num_gpu_blocks=args.kv_blocks, max_num_seqs=args.max_num_seqs,
            preset="", time_scale=1.0, kv_events=True, host=host, log_dir=str(log_dir),
            startup_timeout_s=args.startup_timeout_s, max_restarts=0,
        )  # fmt: skip
        print(
            f"kvroute bench fidelity: starting {args.replicas} vLLM replicas (logs in {log_dir})",
            file=sys.stderr,
            flush=True,
        )
        fleet = launcher.LaunchedFleet(spec)
        stack.callback(fleet.stop, 20.0)
        try:
            fleet.start()
        except launch_error as exc:
            raise UsageError(f"vLLM replicas did not start: {str(exc).splitlines()[0]}") from None
        port = processes.free_ports(1)[0]
        argv = [*kvroute_argv(), "serve", "--host", host, "--port", str(port)]
        argv += ["--policy", args.policy, "--tokenizer", model_dir, "--block-size", str(block)]
        for r in fleet.replicas:
            argv += ["--replica", r.url, "--kv-events", f"{r.url}={r.kv_events},{r.kv_replay}"]
        base = f"http://{host}:{port}"
        try:
            stack.enter_context(processes.managed("kvroute", argv, log_dir, base + "/ready", 120))
        except processes.StartError as exc:
            raise UsageError(f"the router did not start: {str(exc).splitlines()[0]}") from None
        urls = [r.url for r in fleet.replicas]
        return asyncio.run(_fidelity_measure(args, base, urls, trace, encode, context))


async def _fidelity_measure(
    args: argparse.Namespace,
    base: str,
    replica_urls: list[str],
    trace: Any,
    encode: Any,
    context: int,
) -> tuple[dict[str, Any], list[Probe]]:
    import aiohttp

    reset_prefix_caches = _orchestration("router.bench.chat_load").reset_prefix_caches
    from simulator.traces.live import replay_live_async

    sizes = [n for n in _PROBE_TOKENS if n + 2 * _PROBE_OUTPUT_TOKENS <= context]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    probes: list[Probe] = []
    async with aiohttp.ClientSession(timeout=timeout) as http:
        salt = 0
        for url in replica_urls:  # the first requests compile kernels: not measured
            for n in (sizes[0], sizes[-1]):
                salt += 1
                await _stream_once(http, url, _probe_prompt(n, salt), 4)
        print("probing step times (sequential requests) ...", file=sys.stderr, flush=True)
        for _ in range(_PROBE_REPEATS):
            for n in sizes:
                salt += 1
                prompt = _probe_prompt(n, salt)
                ttft, tpot = await _stream_once(http, base, prompt, _PROBE_OUTPUT_TOKENS)
                probes.append((len(encode(prompt)), ttft, tpot))
                print(
                    f"  {probes[-1][0]} prompt tokens: TTFT {ttft * 1000:.0f} ms, "
                    f"TPOT {tpot * 1000:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        await reset_prefix_caches(http, replica_urls)
    print(
        f"replaying {len(trace.requests)} requests live through the router ...",
        file=sys.stderr,
        flush=True,
    )
    summary = await replay_live_async(
        trace,
        base,
        model="tiny",
        time_scale=args.time_scale,
        tokens_per_block=args.tokens_per_block,
        echo=None,
    )
    return summary, probes


def _probe_prompt(tokens: int, salt: int) -> str:
    """A prompt of about ``tokens`` tiny-model tokens that shares nothing with any other."""
    from simulator.traces import TraceRequest
    from simulator.traces.prompts import PromptBuilder

    words = max(1, round(tokens / 2.9))  # the tiny BPE spends ~2.9 tokens per 3-letter word
    return PromptBuilder(1, 1).prompt(TraceRequest(0.0, words, 1, ()), salt=10**6 + salt)


async def _stream_once(http: Any, url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one streamed completion, measured here."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    first: float | None = None
    last = sent
    chunks = 0
    tokens: int | None = None  # a lagging server packs several tokens into one chunk
    async with http.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            text = (await response.text())[:200]
            raise UsageError(f"probe request to {url} answered HTTP {response.status}: {text}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
            if any(choice.get("text") for choice in event.get("choices") or ()):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    if first is None:
        raise UsageError(f"probe request to {url} produced no tokens")
    tokens = tokens or chunks
    return first - sent, (last - first) / (tokens - 1) if tokens > 1 else math.nan


@dataclass(frozen=True)
class LatencyFit:
    """A tiny-cpu latency model fitted to probe requests, and what the engine does not model."""

    model: LatencyModel
    api_overhead_s: float  # HTTP, router, tokenization, detokenization: added to TTFTs
    prefill_1k_s: float  # a 1,000-token prefill beyond the fixed step cost
    probes: tuple[Probe, ...]


def _fit_latency(probes: list[Probe]) -> LatencyFit:
    """Fit ``TINY_CPU``'s roofline to requests sent alone (pure).

    A lone request's TPOT is one decode step: its median is the fixed step cost. Its TTFT is
    API overhead + that fixed cost + the prefill's compute: a least-squares line of TTFT
    against the roofline's FLOPs of the prompt gives the effective FLOP rate (slope) and the
    API overhead (intercept less the step cost).
    """
    flops_of = replace(TINY_CPU, name="flops", peak_flops=1.0, mfu=1.0, step_overhead_s=0.0)
    by_size: dict[int, list[float]] = {}
    for n, ttft, _ in probes:
        by_size.setdefault(n, []).append(ttft)
    # Medians per prompt size, then a line through them: one slow request (the box is shared)
    # moves a median little and the line not at all.
    points = [
        (flops_of.step_time(n, n * (n + 1) // 2, n), _median(ttfts))
        for n, ttfts in sorted(by_size.items())
    ]
    if len(points) < 2:
        raise UsageError("the probe needs at least two prompt sizes")
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    if not slope > 0:
        raise UsageError("the probe's TTFT did not grow with prompt length: machine too noisy")
    intercept = _median([y - slope * x for x, y in points])
    step = _median([t for _, _, t in probes if not math.isnan(t)])
    model = replace(
        TINY_CPU, name="tiny-cpu-fitted", peak_flops=1.0 / slope, mfu=1.0, step_overhead_s=step
    )
    prefill_1k = model.step_time(1000, 1000 * 1001 // 2, 1000) - step
    return LatencyFit(model, max(0.0, intercept - step), prefill_1k, tuple(probes))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _fidelity_report(
    args: argparse.Namespace,
    started: str,
    load: tuple[float, float, float],
    tokenized: Any,
    live: dict[str, Any],
    fit: LatencyFit,
    runs: list[tuple[str, SimResult, float]],
) -> str:
    package_version = _orchestration("router.bench.overhead").package_version

    def ms(value: float | None) -> str:
        return "n/a" if value is None or math.isnan(value) else f"{value * 1000:.0f}"

    live_hit = live.get("prefix_hit_rate")
    per_replica = "/".join(str(v) for v in live.get("requests_per_replica", {}).values())
    lines = [
        f"## Simulator fidelity against real vLLM, {started}",
        "",
        "```",
        "kvroute " + shlex.join(sys.argv[1:]),
        "```",
        "",
        "| run | engine hit rate | vs vLLM | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms "
        "| TPOT p50 ms | requests per replica |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
        f"| {args.replicas} x vllm-cpu through kvroute ({live['ok']}/{live['sent']} ok) "
        f"| {_pct(live_hit if live_hit is not None else math.nan)} | "
        f"| {ms(live.get('ttft_p50_s'))} | {ms(live.get('ttft_p90_s'))} "
        f"| {ms(live.get('ttft_p99_s'))} | {ms(live.get('tpot_p50_s'))} | {per_replica} |",
    ]
    verdicts: list[str] = []
    for label, result, offset in runs:
        hit = result.hit_rate()
        diff = (hit - live_hit) * 100 if live_hit is not None else math.nan
        ttfts = [t + offset for t in result.ttfts()]
        lines.append(
            f"| {label} | {_pct(hit)} | {diff:+.1f} pp | {ms(percentile(ttfts, 0.5))} "
            f"| {ms(percentile(ttfts, 0.9))} | {ms(percentile(ttfts, 0.99))} "
            f"| {ms(percentile(result.tpots(), 0.5))} "
            f"| {'/'.join(str(n) for n in result.routed_requests)} |"
        )
        if "fitted" in label:
            met = abs(diff) <= FIDELITY_HIT_RATE_PP
            verdicts.append(
                f"- {label}: hit rate {diff:+.1f} points from vLLM's (target within "
                f"{FIDELITY_HIT_RATE_PP:g}): {'met' if met else 'NOT met'}"
            )
    requests = tokenized.requests
    prompt_mean = sum(r.input_tokens for r in requests) / len(requests)
    probe_sizes = sorted({n for n, _, _ in fit.probes})
    lines += [
        "",
        *verdicts,
        f"- latency fitted from {len(fit.probes)} probe requests sent alone through the router "
        f"(prompts of {probe_sizes[0]}-{probe_sizes[-1]} tokens, {_PROBE_OUTPUT_TOKENS} output "
        f"tokens): step {fit.model.step_overhead_s * 1000:.1f} ms (median TPOT), prefill "
        f"{fit.prefill_1k_s * 1000:.0f} ms per 1,000 tokens (effective "
        f"{fit.model.peak_flops:.3g} FLOP/s), API + router overhead "
        f"{fit.api_overhead_s * 1000:.0f} ms added to simulated TTFTs; the tiny-cpu preset row "
        "has no such offset",
        f"- workload: `{args.workload}` (seed {args.seed}), {len(requests)} requests over "
        f"{requests[-1].arrival_s:.0f} s, {args.tokens_per_block} words per trace block; "
        f"prompts tokenized by the tiny model: mean {prompt_mean:.0f} tokens; the simulator "
        "replays those token ids' 32-token blocks",
        f"- replicas: {args.replicas} x vllm-cpu {package_version('vllm-cpu') or '?'}, "
        f"{args.kv_blocks} KV blocks of 32 tokens ({args.kv_blocks - 1} usable), max_num_seqs "
        f"{args.max_num_seqs}, max_num_batched_tokens {VLLM_CPU_MAX_NUM_BATCHED_TOKENS}; "
        f"policy {args.policy}; live send lateness p99 {ms(live.get('send_late_p99_s'))} ms",
        f"- machine: {os.cpu_count()} CPUs, load average before run "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    ]
    return "\n".join(lines) + "\n"
