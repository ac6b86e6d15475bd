"""The soak's result, its verdict, and how it reads on the terminal and in BENCHMARKS.md."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.bench.harness.report import section_head
from kvroute.bench.soak_kills import Kill
from kvroute.bench.soak_measure import (
    GROWTH_LIMIT,
    RESOURCES,
    Growth,
    Sample,
    mean_loop_lag_ms,
    window_growth,
    windows,
)
from kvroute.bench.soak_traffic import CUT_AFTER_CHUNKS, Tally


@dataclass
class SoakResult:
    samples: list[Sample]
    tally: Tally
    kills: list[Kill]
    hang_ups_sent: int
    idle_after_s: float | None  # in-flight counters at 0 this long after the last answer
    idle_gauges: dict[str, float]  # their values when the idle wait ended
    counters: dict[str, float]  # router counters over the run (retries, resumes, resyncs)
    warmup_s: float
    cycle_samples: int  # samples in a kill cycle (every replica killed once; 0: no kills)
    missed_samples: int = 0  # /metrics did not answer in time
    # Hard bounds by Sample field (the prefix index: replicas x KV blocks); see ``Growth``.
    ceilings: dict[str, float] = field(default_factory=dict)
    growth: list[Growth] = field(default_factory=list)
    # The first and last window after the warm-up (see ``soak_measure.windows``), once judged.
    windows: tuple[list[Sample], list[Sample]] | None = None

    def judge(self) -> None:
        self.windows = windows(self.samples, self.warmup_s, self.cycle_samples)
        if self.windows is not None:
            first, last = self.windows
            self.growth = [
                window_growth(r, first, last, self.ceilings.get(r.key)) for r in RESOURCES
            ]

    def failures(self) -> list[str]:
        """Why the soak failed; empty when it passed."""
        why = [
            f"{g.resource.label} grew {_pct(g.growth)} (from {_value(g.resource.unit, g.start)} "
            f"to {_value(g.resource.unit, g.end)})"
            for g in self.growth
            if not g.passed
        ]
        if not self.growth:
            why.append("too few samples after the warm-up to compare two windows")
        if self.idle_after_s is None:
            left = ", ".join(f"{k} {v:g}" for k, v in self.idle_gauges.items() if v)
            why.append(f"in-flight counters did not return to 0 after the traffic ({left})")
        if self.tally.unexpected:
            why.append(f"{self.tally.unexpected} requests failed unexpectedly")
        lost = [k for k in self.kills if k.pid is not None and k.back_after_s is None]
        if lost:
            why.append(f"{len(lost)} killed replicas did not come back")
        return why


def _pct(growth: float | None) -> str:
    return "-" if growth is None else f"{100 * growth:+.1f}%"


def _value(unit: str, value: float) -> str:
    if unit == "MiB":
        return f"{value / 2**20:.1f} MiB"
    return f"{value:g}"


def resource_table(result: SoakResult) -> str:
    lines = [
        "| resource | after warm-up | at the end | growth | limit | result |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for g in result.growth:
        unit = g.resource.unit
        limit = f"{100 * GROWTH_LIMIT:.0f}%"
        if g.resource.load_driven and g.allowance > GROWTH_LIMIT * g.start:
            limit += f" or +{_value(unit, g.allowance)} (IQR)"
        if g.ceiling is not None:
            limit += f" or all <= {_value(unit, g.ceiling)} (the fleet's KV blocks)"
        lines.append(
            f"| {g.resource.label} | {_value(unit, g.start)} | {_value(unit, g.end)} | "
            f"{_pct(g.growth)} | {limit} | {'pass' if g.passed else 'FAIL'} |"
        )
    idle = (
        f"0 after {result.idle_after_s:.2f} s"
        if result.idle_after_s is not None
        else "not 0: " + ", ".join(f"{k} {v:g}" for k, v in result.idle_gauges.items())
    )
    lines.append(
        f"| in-flight counters once the traffic stopped | | {idle} | | 0 | "
        f"{'pass' if result.idle_after_s is not None else 'FAIL'} |"
    )
    return "\n".join(lines)


def outcome_table(tally: Tally) -> str:
    return "\n".join(
        [
            "| requests by outcome | count |",
            "|---|---:|",
            f"| answered whole (chat and completions) | {tally.ok} |",
            f"| bad input answered 4xx, as expected | {tally.rejected} |",
            f"| streams cut by the client after {CUT_AFTER_CHUNKS} chunks, by design | {tally.cut} |",
            f"| unexpected failures | {tally.unexpected} |",
            f"| total | {tally.total} |",
        ]
    )


def faults_lines(result: SoakResult) -> list[str]:
    tally = result.tally
    done = [k for k in result.kills if k.pid is not None]
    back = [k.back_after_s for k in done if k.back_after_s is not None]
    recovery = (
        f"back in rotation after median {statistics.median(back):.1f} s, max {max(back):.1f} s"
        if back
        else "none came back"
    )
    kills = f"replica kills (SIGKILL to the process group): {len(done)}"
    if done:
        kills += f", {len(back)} restarted by kvroute serve and {recovery}"
    skipped = len(result.kills) - len(done)
    if skipped:
        kills += f" ({skipped} skipped: the replica was still restarting)"
    bad = ", ".join(f"{what} x{n}" for what, n in sorted(tally.bad_input.items())) or "none"
    normal = ", ".join(f"{what} x{n}" for what, n in sorted(tally.normal.items()))
    c = result.counters
    return [
        kills,
        f"client hang-ups mid-stream: {result.hang_ups_sent} sent, {tally.cut} cut as planned",
        f"bad input (answer status): {bad}",
        f"normal requests sent: {normal}",
        f"router: {c['retries']:.0f} retries, {c['resumed']:.0f} streams resumed on another "
        f"replica, {c['resyncs']:.0f} index resyncs (a restarted replica's entries dropped)",
    ]


def summary_lines(result: SoakResult) -> list[str]:
    lines = []
    if result.windows is not None:
        first, last = result.windows
        a, b, c, d = first[0].t, first[-1].t, last[0].t, last[-1].t
        n = len(first)
        lines.append(
            f"windows: medians of the samples at t={a:.0f}-{b:.0f} s and t={c:.0f}-{d:.0f} s "
            f"({n} samples each{', a kill cycle or more' if result.cycle_samples else ''}; "
            f"{len(result.samples)} samples in all, {result.missed_samples} missed)"
        )
        start_lag, end_lag = (mean_loop_lag_ms(w) for w in result.windows)
        if start_lag is not None and end_lag is not None:
            lines.append(
                f"event-loop lag (mean over each window): {start_lag:.2f} ms, then {end_lag:.2f} ms"
            )
    for error in result.tally.errors:
        lines.append(f"unexpected: {error}")
    failures = result.failures()
    lines.append("result: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return lines


def text_report(header: Sequence[str], result: SoakResult) -> str:
    return "\n".join(
        [
            *header,
            "",
            resource_table(result),
            "",
            outcome_table(result.tally),
            "",
            *faults_lines(result),
            *summary_lines(result),
        ]
    )


def markdown_section(title: str, command: str, header: Sequence[str], result: SoakResult) -> str:
    lines = [
        *section_head(title, command),
        *(f"- {h}" for h in header),
        "",
        resource_table(result),
        "",
        outcome_table(result.tally),
        "",
        *(f"- {line}" for line in faults_lines(result) + summary_lines(result)),
    ]
    return "\n".join(lines) + "\n"
