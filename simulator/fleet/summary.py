"""The numbers of one simulated run, as ``summary.json`` holds them and the CLI prints them,
and the warnings that say when those numbers do not describe a working fleet.

Overload: a request's *wait* is its TTFT less its prefill alone on an idle replica with nothing
cached (``bounds.prefill_alone_s``: at least its own work, so the wait is if anything
understated). A fleet that keeps up makes most requests wait little; one that does not queues
them longer and longer, and its latencies grow with the trace's length. The run is called
overloaded when the median wait, over all finished requests or over the last quarter of
arrivals (a queue still growing at the end), exceeds both ``OVERLOAD_MIN_WAIT_S`` and
``OVERLOAD_WAIT_FACTOR`` times the median request's own prefill time.
"""

from __future__ import annotations

import math
from typing import Any

from kvroute.kvcore.stats import percentile

from .programs import program_summary
from .regret import estimate_summary
from .results import SimResult, Slo


def summarize(
    result: SimResult,
    *,
    infinite_hit_rate: float,
    pooled_lru_hit_rate: float,
    slo: Slo,
    wall_s: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run's summary: the keys the issue asks for, then more detail."""
    ttfts = result.ttfts()
    tpots = result.tpots()
    good, goodput = result.goodput(slo)
    completed = result.completed
    summary: dict[str, Any] = {
        "policy": result.policy,
        "replicas": result.replicas,
        "requests": result.requests,
        "kv_capacity_tokens_per_replica": result.kv_capacity_tokens,
        "prefix_hit_rate": _num(result.hit_rate()),
        "infinite_cache_hit_rate": _num(infinite_hit_rate),
        "pooled_lru_hit_rate": _num(pooled_lru_hit_rate),
        "ttft_p50_s": _num(percentile(ttfts, 0.5)),
        "ttft_p99_s": _num(percentile(ttfts, 0.99)),
        "tpot_p50_s": _num(percentile(tpots, 0.5)),
        "tpot_p99_s": _num(percentile(tpots, 0.99)),
        "goodput_rps": _num(goodput),
        "load_max_over_mean": _num(result.load_max_over_mean()),
        "wall_s": round(wall_s, 3),
        "completed": completed,
        "rejected": sum(result.rejected),
        "unserved": result.requests - completed - sum(result.rejected),
        "rerouted": sum(1 for r in result.reroutes if r),
        "failed_replicas": list(result.failed_replicas),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "slo_met_requests": good,
        "throughput_rps": _num(
            completed / result.makespan_s() if result.makespan_s() else math.nan
        ),
        "makespan_s": _num(result.makespan_s()),
        # With --autoscale: what the autoscaler ran; else every replica throughout.
        "replica_hours": _num(result.replica_hours()),
        "scale_ups": sum(1 for _, action, _ in result.scale_actions if action == "up"),
        "scale_downs": sum(1 for _, action, _ in result.scale_actions if action == "down"),
        "ttft_p90_s": _num(percentile(ttfts, 0.9)),
        "tpot_p90_s": _num(percentile(tpots, 0.9)),
        "prompt_tokens": sum(result.input_tokens),
        "output_tokens": sum(result.output_tokens),
        "routed_requests_per_replica": list(result.routed_requests),
        "decision_reasons": dict(sorted(result.reasons.items())),
        "engine_steps": result.engine_steps,
        "decode_runs": result.decode_runs,
        "preemptions": result.preemptions,
        "routers": result.routers,
        "share": result.share,
        # The shortfall against the pooled LRU by cause (loss.py); None with the exact engine.
        "loss": result.loss.as_dict() if result.loss is not None else None,
        # The policy's TTFT estimates on its choices and round robin's / power of two's
        # (regret.py); None for a policy that makes none. --compare adds the counterfactual.
        "estimated_regret": estimate_summary(result),
        # Latency by agent program, short and long (programs.py); with --max-in-flight the
        # admission's fairness and queue waits.
        "programs": program_summary(result, len(result.arrival_s) - _batch_lines(result)),
    }
    if result.pd is not None:  # only then: an aggregated summary.json stays as it was
        summary["pd"] = result.pd.as_dict(result.arrival_s, result.first_token_s, result.finish_s)
    if extra:
        summary.update(extra)
    return summary


def _batch_lines(result: SimResult) -> int:
    """Batch lines at the end of the result's lists (the batch lane's), 0 without."""
    return len(result.arrival_s) - len(result.programs) if result.programs else 0


OVERLOAD_WAIT_FACTOR = 10.0
OVERLOAD_MIN_WAIT_S = 1.0


def replay_warnings(result: SimResult, prefill_alone_s: list[float]) -> list[str]:
    """Unfinished requests and overload (see the module docstring), one sentence each."""
    warnings: list[str] = []
    unfinished = result.requests - result.completed
    if unfinished:
        rejected = sum(result.rejected)
        causes = []
        if rejected:
            causes.append(
                f"{rejected:,} need more KV cache than one replica holds "
                f"({result.kv_capacity_tokens:,} tokens; see --kv-capacity-tokens)"
            )
        if unfinished - rejected:
            causes.append(f"{unfinished - rejected:,} were left with no replica (all failed)")
        warnings.append(
            f"{unfinished:,} of {result.requests:,} requests did not finish: {'; '.join(causes)}. "
            "Latencies and goodput leave them out."
        )
    done = [i for i, f in enumerate(result.finish_s) if not math.isnan(f)]
    if not done:
        return warnings
    # Trace order is arrival order: the last quarter of ``done`` arrived last.
    waits = [
        max(0.0, result.first_token_s[i] - result.arrival_s[i] - prefill_alone_s[i]) for i in done
    ]
    quarter = max(1, len(waits) // 4)
    wait, first, last = (percentile(w, 0.5) for w in (waits, waits[:quarter], waits[-quarter:]))
    own = percentile([prefill_alone_s[i] for i in done], 0.5)
    limit = max(OVERLOAD_MIN_WAIT_S, OVERLOAD_WAIT_FACTOR * own)
    if max(wait, last) > limit:
        drain = max(result.finish_s[i] for i in done) - max(result.arrival_s)
        warnings.append(
            f"the fleet is overloaded: the median request waited {_secs(wait)} for its first "
            f"token beyond its own prefill ({_secs(own)} median, alone on an idle replica), "
            f"{_secs(first)} in the first quarter of arrivals and {_secs(last)} in the last; the "
            f"last request finished {_secs(drain)} after the last arrival. Requests arrive faster "
            "than the fleet serves them, so latencies grow with the trace's length: try more "
            "--replicas or a lower --rate-scale."
        )
    return warnings


def _secs(v: float) -> str:
    return f"{v:.2f} s" if v < 10 else f"{v:,.0f} s"


def _num(value: float) -> float | None:
    """JSON has no NaN: None stands for "no value" (no requests of that kind)."""
    return None if math.isnan(value) else round(value, 6)


def format_table(summaries: list[dict[str, Any]]) -> str:
    """A plain-text table of runs, one row per policy, for the terminal."""
    header = (
        f"{'policy':<16}{'reqs':>7}{'done':>7}{'hit rate':>10}{'vs LRU':>8}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
        f"{'goodput':>9}{'load':>6}{'wall':>7}"
    )
    lines = [header]
    for s in summaries:
        lines.append(
            f"{s['policy']:<16}{s['requests']:>7}{s['completed']:>7}"
            f"{_pct(s['prefix_hit_rate']):>10}{_ratio(s['prefix_hit_rate'], s['pooled_lru_hit_rate']):>8}"
            f"{_s(s['ttft_p50_s']):>10}{_s(s['ttft_p99_s']):>10}"
            f"{_ms(s['tpot_p50_s']):>10}{_ms(s['tpot_p99_s']):>10}"
            f"{_f(s['goodput_rps'], 2):>9}{_f(s['load_max_over_mean'], 2):>6}{s['wall_s']:>6.1f}s"
        )
    return "\n".join(lines)


def format_loss(summary: dict[str, Any]) -> str | None:
    """One line: the run's shortfall against the pooled LRU by cause, as shares of the bound."""
    loss = summary.get("loss")
    if not loss or not loss["bound_tokens"]:
        return None
    parts = [
        f"{name.replace('_', ' ')} {share:.1%}"
        for name, share in loss["shares_of_bound"].items()
        if share
    ]
    if loss["above_bound_share"]:
        parts.append(f"above bound +{loss['above_bound_share']:.1%}")
    return (
        f"loss against pooled LRU ({summary['policy']}): hit/bound {loss['hit_over_bound']:.2f}; "
        + (", ".join(parts) or "none")
    )


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms"


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
