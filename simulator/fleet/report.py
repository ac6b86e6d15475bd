"""The Markdown report of a replay (pure: returns text; the CLI writes it)."""

from __future__ import annotations

from typing import Any

from .pd_outcome import format_pd

PLOTS = (
    ("ttft_cdf.png", "Time to first token (CDF)"),
    ("tpot_cdf.png", "Time per output token (CDF)"),
    ("hit_rate_over_time.png", "Prefix-cache hit rate over time"),
    ("load_per_replica.png", "Requests routed to each replica"),
)


def markdown_report(
    summaries: list[dict[str, Any]], context: dict[str, Any], plots: list[str]
) -> str:
    """The report: what was simulated, the runs side by side, the bounds, and the plots."""
    first = summaries[0]
    lines = [f"# Replay: {context['trace']}", ""]
    lines += [
        f"- trace: {context['trace']} ({context['format']}), {first['requests']} requests over "
        f"{context['trace_duration_s']:.0f} s ({context['trace_rate_rps']:.2f} req/s), "
        f"{first['prompt_tokens']:,} prompt and {first['output_tokens']:,} output tokens",
        f"- fleet: {first['replicas']} replicas of `{context['preset']}`, "
        f"{first['kv_capacity_tokens_per_replica']:,} KV tokens each "
        f"(block size {context['block_size']}), engine model `{context['engine_model']}`",
        f"- router: KV events applied {context['event_lag_s'] * 1000:.0f} ms after their step, "
        f"replicas scraped every {context['scrape_interval_s']:g} s, seed {context['seed']}",
        f"- routers: {context.get('routers', '1 router')}",
        f"- SLO: {_slo(first['slo'])}",
    ]
    if context.get("pd"):
        lines.append(f"- P/D disaggregation: {context['pd']}")
    if context.get("failures"):
        fails = ", ".join(f"replica {k} at {t:g} s" for k, t in context["failures"])
        lines.append(f"- failures: {fails}")
    lines += [f"- prefixes: {note}" for note in first.get("notes", [])]
    warned = [s for s in summaries if s.get("warnings")]
    if warned:
        lines += ["", "## Warnings", ""]
        for s in warned:
            who = f"{s['policy']}: " if len(summaries) > 1 else ""
            lines += [f"- **{who}{warning}**" for warning in s["warnings"]]
    lines += [
        "",
        "## Results",
        "",
        "| policy | completed | hit rate | vs pooled LRU | vs infinite | TTFT p50 | TTFT p99 "
        "| TPOT p50 | TPOT p99 | goodput req/s | load max/mean | rerouted | sim wall |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['policy']} | {s['completed']}/{s['requests']} | {_pct(s['prefix_hit_rate'])} "
            f"| {_ratio(s['prefix_hit_rate'], s['pooled_lru_hit_rate'])} "
            f"| {_ratio(s['prefix_hit_rate'], s['infinite_cache_hit_rate'])} "
            f"| {_s(s['ttft_p50_s'])} | {_s(s['ttft_p99_s'])} | {_ms(s['tpot_p50_s'])} "
            f"| {_ms(s['tpot_p99_s'])} | {_f(s['goodput_rps'])} | {_f(s['load_max_over_mean'])} "
            f"| {s['rerouted']} | {s['wall_s']:.1f} s |"
        )
    lines += [
        "",
        "Hit rate: prompt tokens found in a replica's prefix cache over prompt tokens looked up "
        "(vLLM's `prefix_cache_hits / prefix_cache_queries`, summed over the fleet).",
        f"Bounds on this trace: one infinite cache {_pct(first['infinite_cache_hit_rate'])}; "
        f"one LRU cache holding the whole fleet's capacity "
        f"({first['replicas'] * first['kv_capacity_tokens_per_replica']:,} tokens) "
        f"{_pct(first['pooled_lru_hit_rate'])}.",
        "Goodput: requests that finished within the SLO per second, first arrival to last "
        "finish (all finished requests when no SLO is set).",
    ]
    lines += _loss_section(summaries)
    lines += _pd_section(summaries)
    lines += _regret_section(summaries)
    lines += [
        "",
        "## Routing decisions",
        "",
    ]
    for s in summaries:
        reasons = ", ".join(f"{k} {v}" for k, v in s["decision_reasons"].items())
        lines.append(f"- {s['policy']}: {reasons or 'none'}")
    if plots:
        lines += ["", "## Plots", ""]
        titles = dict(PLOTS)
        for name in plots:
            lines += [
                f"### {titles.get(name, name)}",
                "",
                f"![{titles.get(name, name)}]({name})",
                "",
            ]
    lines += [
        "",
        "Reproduce: `" + context["command"] + "`",
        "",
    ]
    return "\n".join(lines)


LOSS_COLUMNS = (
    ("evicted_while_queued", "evicted while queued"),
    ("wrong_prediction", "wrong prediction"),
    ("spread_load", "spread: load"),
    ("spread_other", "spread: other"),
    ("evicted_on_chosen", "evicted on chosen"),
    ("evicted_elsewhere", "evicted elsewhere"),
    ("not_yet_cached", "not yet cached"),
    ("not_served", "not served"),
)


def _pd_section(summaries: list[dict[str, Any]]) -> list[str]:
    """What a P/D fleet split off and what moving the KV cost (none for an aggregated one)."""
    found = [line for line in map(format_pd, summaries) if line]
    if not found:
        return []
    return [
        "",
        "## P/D disaggregation",
        "",
        *(f"- {line}" for line in found),
        "",
        "Split: prefilled on a prefill replica, its KV moved to its decode replica. The hit rate "
        "counts prefix-cache hits where prompts are computed (prefill replicas, and decode "
        "replicas for requests not split); a decode replica's own copy of a moved prompt "
        "saves transfer, not compute, and is not counted.",
    ]


def _regret_section(summaries: list[dict[str, Any]]) -> list[str]:
    """The policy's own regret estimate against round robin and power of two (the router's
    kvroute_routing_estimated_ttft_seconds), and against the baseline runs when compared."""
    runs = [s for s in summaries if s.get("estimated_regret")]
    if not runs:
        return []
    lines = [
        "",
        "## Regret against round robin",
        "",
        "At each decision the policy estimates the request's TTFT on its choice, on the replica "
        "round robin would have picked and on a power-of-two choice, the fleet as it stood "
        "(the live router's `kvroute_routing_estimated_ttft_seconds`). Negative regret: the "
        "choice looked better.",
        "",
    ]
    for s in runs:
        r = s["estimated_regret"]
        means = r["estimated_ttft_mean_s"]
        lines.append(
            f"- {s['policy']}: {r['decisions']:,} decisions, mean estimated TTFT "
            f"{means['chosen']:.3f} s on its choices, {means['round_robin']:.3f} s on round "
            f"robin's, {means['power_of_two']:.3f} s on power of two's; estimated worse than "
            f"round robin's in {r['worse_share']['round_robin']:.1%} of decisions"
        )
        lines += [f"- {line}" for line in r.get("lines", [])]
    return lines


def _loss_section(summaries: list[dict[str, Any]]) -> list[str]:
    """Where the hit rate goes: the shortfall against the pooled LRU by cause (loss.py)."""
    runs = [s for s in summaries if s.get("loss") and s["loss"]["bound_tokens"]]
    if not runs:
        return []
    head = " | ".join(label for _, label in LOSS_COLUMNS)
    lines = [
        "",
        "## Where the hit rate goes",
        "",
        "Tokens the pooled LRU reused and the fleet did not, by cause, as shares of the pooled "
        'LRU\'s reused tokens (docs/simulator.md, "Loss against the pooled-LRU bound"); '
        "hit/bound = 1 - their sum + above bound.",
        "",
        f"| policy | hit/bound | {head} | above bound |",
        "|---|--:|" + "--:|" * len(LOSS_COLUMNS) + "--:|",
    ]
    for s in runs:
        loss = s["loss"]
        shares = loss["shares_of_bound"]
        cells = " | ".join(f"{shares[key]:.1%}" for key, _ in LOSS_COLUMNS)
        lines.append(
            f"| {s['policy']} | {loss['hit_over_bound']:.3f} | {cells} "
            f"| {loss['above_bound_share']:.1%} |"
        )
    return lines


def _slo(slo: dict[str, Any]) -> str:
    parts = []
    if slo.get("ttft_s") is not None:
        parts.append(f"TTFT <= {slo['ttft_s']:g} s")
    if slo.get("tpot_s") is not None:
        parts.append(f"TPOT <= {slo['tpot_s'] * 1000:g} ms")
    return " and ".join(parts) if parts else "none (goodput counts every finished request)"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
