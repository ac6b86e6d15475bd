"""Calibrating the simulator against real replicas (pure): the prompts they saw, their latency.

``tokenized_trace`` turns a trace into the token blocks a real tokenizer produced, so simulated
engines can cache exactly what real ones can; ``fit_latency`` fits ``TINY_CPU``'s roofline to
requests sent alone. ``kvroute bench fidelity`` (kvroute/bench/fidelity.py) does the measuring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvroute.simulator.engine.latency import TINY_CPU, LatencyModel
from kvroute.simulator.traces.model import Trace, TraceRequest
from kvroute.simulator.traces.prompts import PromptBuilder

Probe = tuple[int, float, float]  # (prompt tokens, TTFT s, TPOT s) of one request alone


class CalibrationError(ValueError):
    """The measurements cannot be fitted; the message says why, in one line."""


def tokenized_trace(
    trace: Trace,
    builder: PromptBuilder,
    encode: Callable[[str], Sequence[int]],
    block: int,
    time_scale: float,
) -> Trace:
    """The live replay's prompts as the replicas see them: real token ids cut into blocks.

    Block ids chain (parent id, block tokens), so equal ids mean equal token prefixes: the
    simulated engines cache exactly what vLLM's can, whatever the tokenizer did to the words.
    """
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


@dataclass(frozen=True)
class LatencyFit:
    """A tiny-cpu latency model fitted to probe requests, and what the engine does not model."""

    model: LatencyModel
    api_overhead_s: float  # HTTP, router, tokenization, detokenization: added to TTFTs
    prefill_1k_s: float  # a 1,000-token prefill beyond the fixed step cost
    probes: tuple[Probe, ...]


def fit_latency(probes: Sequence[Probe]) -> LatencyFit:
    """Fit ``TINY_CPU``'s roofline to requests sent alone.

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
        raise CalibrationError("the probe needs at least two prompt sizes")
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    if not slope > 0:
        raise CalibrationError(
            "the probe's TTFT did not grow with prompt length: machine too noisy"
        )
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
