"""``kvroute replay --batch-job ... [--dip ...]``: a batch job beside the online trace, through a
capacity dip. The flags' value types, and the report lines (simulator/fleet/batch.py runs it)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvroute.kvcore.stats import percentile
from kvroute.simulator.fleet.batch import BatchJob, CapacityDip
from kvroute.simulator.fleet.results import SimResult

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

# --batch KEY=VALUE -> (BatchJob field, type)
_BATCH_KEYS: dict[str, tuple[str, Any]] = {
    "lines": ("lines", int),
    "input": ("input_tokens", int),
    "output": ("output_tokens", int),
    "shared": ("shared_prefix_tokens", int),
    "at": ("start_s", "duration"),
    "window": ("window_s", "duration"),
    "slots": ("max_in_flight_per_replica", int),
    "pace": ("pace_fraction", float),
    "poll": ("poll_s", "duration"),
}

BATCH_HELP = (
    "A batch job beside the trace, run by the router's batch lane (spare capacity, deadline "
    "pacing): lines=N (required), input=TOKENS (1000), output=TOKENS (200), shared=TOKENS of "
    "every prompt alike (0), at=TIME after the first arrival (0), window=TIME (24h), slots=K "
    "(batch.max_in_flight_per_replica, 4), pace=F (batch.pace_fraction, 0.8), poll=TIME (1s); "
    "TIME in seconds or with s/m/h/d. Each policy then runs twice, the trace alone and with "
    "the job, and the summary reports online TTFT p99 both ways, when the job was done against "
    "its window, and its share of the computed tokens."
)
DIP_HELP = (
    "A capacity dip: F of the replicas (the highest-numbered) gone from T1 to T2 (seconds, or "
    "with s/m/h/d, on the trace's clock), e.g. 0.5@20h-22h; their requests resume elsewhere, "
    "and they come back with empty caches."
)


def duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h`` or ``1d`` as seconds."""
    text = text.strip().lower()
    scale = _UNITS.get(text[-1:])
    number = text[:-1] if scale is not None else text
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a time in seconds or with s/m/h/d, got {text!r}"
        ) from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite time >= 0, got {text!r}")
    return value


def batch_spec(text: str) -> BatchJob:
    fields: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in _BATCH_KEYS:
            raise argparse.ArgumentTypeError(
                f"expected KEY=VALUE with KEY one of {', '.join(_BATCH_KEYS)}, got {part!r}"
            )
        name, kind = _BATCH_KEYS[key]
        try:
            fields[name] = duration(value) if kind == "duration" else kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: not a number: {value!r}") from None
    if "lines" not in fields:
        raise argparse.ArgumentTypeError("lines=N is required (how many requests the job has)")
    job = BatchJob(**fields)
    problems = job.problems()
    if problems:
        raise argparse.ArgumentTypeError("; ".join(problems))
    return job


def dip_spec(text: str) -> CapacityDip:
    fraction, sep, window = text.partition("@")
    start, dash, end = window.partition("-")
    if not sep or not dash:
        raise argparse.ArgumentTypeError(f"expected F@T1-T2, e.g. 0.5@20h-22h, got {text!r}")
    try:
        f = float(fraction)
    except ValueError:
        raise argparse.ArgumentTypeError(f"fraction: not a number: {fraction!r}") from None
    dip = CapacityDip(f, duration(start), duration(end))
    problems = dip.problems()
    if problems:
        raise argparse.ArgumentTypeError("; ".join(problems))
    return dip


def online_p99(result: SimResult) -> float:
    return percentile(result.ttfts(), 0.99)


def batch_summary(alone: SimResult, both: SimResult) -> dict[str, Any]:
    """The job's outcome, and what it did to the online requests' TTFT p99."""
    outcome = both.batch
    assert outcome is not None
    a, b = online_p99(alone), online_p99(both)
    return outcome.as_dict() | {
        "online_ttft_p99_alone_s": a,
        "online_ttft_p99_with_batch_s": b,
        "online_ttft_p99_ratio": b / a if a > 0 else None,
    }


def batch_report_lines(policy: str, summary: dict[str, Any]) -> list[str]:
    """What a person reads of a run with a batch job."""
    took = summary["completion_s"]
    done = (
        f"done in {took / 3600:,.2f} h of its {summary['window_s'] / 3600:g} h window "
        f"({summary['completion_of_window']:.0%})"
        if took is not None
        else f"{summary['completed']:,} of {summary['lines']:,} lines done"
    )
    verdict = "met its window" if summary["met_window"] else "MISSED its window"
    ratio = summary["online_ttft_p99_ratio"]
    return [
        f"batch ({policy}): {summary['lines']:,} lines {done}, {verdict}; "
        f"{summary['promoted']:,} lines promoted behind pace; "
        f"{summary['share_of_computed_tokens']:.1%} of the tokens the fleet computed",
        f"online TTFT p99 ({policy}): {summary['online_ttft_p99_alone_s']:.3f} s alone, "
        f"{summary['online_ttft_p99_with_batch_s']:.3f} s with the batch lane"
        + (f" ({ratio:.2f}x)" if ratio is not None else ""),
    ]


__all__ = [
    "BATCH_HELP",
    "DIP_HELP",
    "batch_report_lines",
    "batch_spec",
    "batch_summary",
    "dip_spec",
    "duration",
]
