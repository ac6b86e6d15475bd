"""Latency by agent program: what program-aware fairness is judged on (``summary.json``'s
``programs``).

A program is a session and its sub-agents (admission.program_of). Its size is the tokens it
moved, prompt plus output over all its requests (what least attained service counts); the
programs at or below the median size are *short*, the rest *long*. Per class: TTFT
percentiles over the class's requests, the mean program completion time (the last finish less
the first arrival, over programs whose every request finished), and the longest wait in the
router's queue (behind an admission limit). Pure: ``summarize`` works over plain per-request
lists, so the live replay (simulator/traces/live.py) reports its requests the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvroute.kvcore.stats import percentile

from .results import SimResult

CLASSES = ("all", "short", "long")


def program_summary(result: SimResult, online: int | None = None) -> dict[str, Any] | None:
    """TTFT, completion time and queue wait per program class; None without programs.
    ``online``: requests past this index (batch lines) are left out."""
    programs = result.programs
    if not programs:
        return None
    count = len(programs) if online is None else min(online, len(programs))
    return summarize(
        programs[:count],
        [result.input_tokens[i] + result.output_tokens[i] for i in range(count)],
        result.arrival_s,
        result.first_token_s,
        result.finish_s,
        result.queue_wait_s,
        fairness=result.fairness,
        max_in_flight=result.max_in_flight,
        programs_in_flight=result.programs_in_flight,
    )


def summarize(
    programs: Sequence[str],
    tokens: Sequence[int],
    arrival_s: Sequence[float],
    first_token_s: Sequence[float],
    finish_s: Sequence[float],
    queue_wait_s: Sequence[float] | None = None,
    *,
    fairness: str | None = None,
    max_in_flight: int | None = None,
    programs_in_flight: int | None = None,
) -> dict[str, Any]:
    """The per-class summary of requests ``0 .. len(programs) - 1``: request i belongs to
    ``programs[i]``, moved ``tokens[i]`` (prompt plus output), arrived at ``arrival_s[i]``, had
    its first token at ``first_token_s[i]`` and finished at ``finish_s[i]`` (NaN for both: it
    failed); ``queue_wait_s[i]`` its wait in the router's queue (NaN or no list: unknown)."""
    members: dict[str, list[int]] = {}
    for index, name in enumerate(programs):
        members.setdefault(name, []).append(index)
    size = {name: sum(tokens[i] for i in indices) for name, indices in members.items()}
    ranked = sorted(size.values())
    threshold = ranked[(len(ranked) - 1) // 2] if ranked else 0
    classes: dict[str, list[str]] = {"all": list(members)}
    classes["short"] = [name for name in members if size[name] <= threshold]
    classes["long"] = [name for name in members if size[name] > threshold]
    out: dict[str, Any] = {
        "fairness": fairness,
        "max_in_flight": max_in_flight,
        "programs_in_flight": programs_in_flight,
        "programs": len(members),
        "short_max_tokens": threshold,
    }
    times = (arrival_s, first_token_s, finish_s, queue_wait_s)
    for label in CLASSES:
        out[label] = _class_summary(times, [members[name] for name in classes[label]])
    return out


_Times = tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float] | None]


def _class_summary(times: _Times, groups: list[list[int]]) -> dict[str, Any]:
    arrival_s, first_token_s, finish_s, queue_wait_s = times
    ttfts: list[float] = []
    completions: list[float] = []
    waits: list[float] = []
    requests = 0
    for indices in groups:
        requests += len(indices)
        finished = True
        for i in indices:
            if math.isnan(finish_s[i]):
                finished = False
                continue
            ttfts.append(first_token_s[i] - arrival_s[i])
            if queue_wait_s is not None and not math.isnan(queue_wait_s[i]):
                waits.append(queue_wait_s[i])
        if finished and indices:
            first = min(arrival_s[i] for i in indices)
            completions.append(max(finish_s[i] for i in indices) - first)
    return {
        "programs": len(groups),
        "requests": requests,
        "ttft_mean_s": _num(sum(ttfts) / len(ttfts) if ttfts else math.nan),
        "ttft_p50_s": _num(percentile(ttfts, 0.5)),
        "ttft_p90_s": _num(percentile(ttfts, 0.9)),
        "ttft_p99_s": _num(percentile(ttfts, 0.99)),
        "completion_mean_s": _num(sum(completions) / len(completions) if completions else math.nan),
        "queue_wait_max_s": _num(max(waits) if waits else math.nan),
        "queue_wait_p99_s": _num(percentile(waits, 0.99)),
    }


def _num(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def format_programs(summary: dict[str, Any]) -> str | None:
    """One line per class for the CLI: TTFT p99 and mean, completion and longest queue wait."""
    programs = summary.get("programs")
    if not programs:
        return None
    head = (
        f"programs ({summary['policy']}, fairness {programs['fairness'] or 'none'}, "
        f"max in flight {programs['max_in_flight'] or 'unlimited'}"
        + (
            f", {programs['programs_in_flight']} programs at a time"
            if programs.get("programs_in_flight")
            else ""
        )
        + f"): {programs['programs']}, "
        f"short = up to {programs['short_max_tokens']:,} tokens"
    )
    return "\n".join([head, *class_lines(programs)])


def class_lines(programs: dict[str, Any]) -> list[str]:
    """One line per class of a ``summarize`` block: TTFT p99 and mean, completion and the
    longest queue wait."""
    lines = []
    for label in CLASSES:
        c = programs[label]
        lines.append(
            f"  {label:5} {c['programs']:>5} programs  TTFT p99 {_s(c['ttft_p99_s'])}  "
            f"mean {_s(c['ttft_mean_s'])}  completion mean {_s(c['completion_mean_s'])}  "
            f"longest queue wait {_s(c['queue_wait_max_s'])}"
        )
    return lines


def _s(value: float | None) -> str:
    return f"{value:.2f}s" if value is not None else "-"
