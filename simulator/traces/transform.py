"""Windows, time and rate scaling, and request caps applied to a loaded trace (pure).

Order and meaning, the same for every format:
1. ``window_s=(start, end)`` keeps requests with ``start <= arrival_s < end`` on the trace's own
   clock (before any scaling; for formats whose arrivals are generated, the generated clock), and
   shifts them so ``start`` becomes 0.
2. ``max_requests=N`` keeps the first N of those, in arrival order.
3. Arrival times are multiplied by ``time_scale / rate_scale``: ``time_scale=2`` stretches the
   trace to twice its length (half the requests per second); ``rate_scale=2`` compresses it to half
   its length, so twice the requests per second. Token counts and prefixes never change.
4. ``repeat=K`` plays the (windowed, capped, scaled) trace K times back to back, each copy
   starting one mean gap after the last one's last arrival: a day long enough for an autoscaler
   from an hour of arrivals, with the same prompts (and prefixes) again.
5. ``diurnal=(A, P)`` warps the arrival times (same requests, same order, same span) so that the
   rate follows one day's shape: ``mean x (1 - A cos(2 pi t / P))``, lowest at the start of each
   period ``P`` (default: the whole trace, one compressed day) and ``1 + A`` times the mean half
   way. A trace of steady arrivals becomes a day of load for an autoscaler to follow.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .errors import TraceError
from .model import Trace, TraceRequest


def validate_transform(
    *,
    time_scale: float,
    rate_scale: float,
    window_s: tuple[float, float] | None,
    max_requests: int | None,
) -> None:
    """Raise a TraceError for scaling, window or cap values that have no meaning."""
    for name, value in (("time_scale", time_scale), ("rate_scale", rate_scale)):
        if not (math.isfinite(value) and value > 0):
            raise TraceError(f"{name} must be a positive number, got {value!r}")
    if window_s is not None:
        start, end = window_s
        if not (math.isfinite(start) and start >= 0 and end > start):
            raise TraceError(f"window must satisfy 0 <= start < end, got {start!r}..{end!r}")
    if max_requests is not None and max_requests < 1:
        raise TraceError(f"max_requests must be at least 1, got {max_requests!r}")


def apply_transform(
    trace: Trace,
    *,
    time_scale: float = 1.0,
    rate_scale: float = 1.0,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
    diurnal: tuple[float, float | None] | None = None,
    repeat: int = 1,
) -> Trace:
    """``trace`` windowed, capped, scaled, repeated and warped as the module docstring says."""
    validate_transform(
        time_scale=time_scale, rate_scale=rate_scale, window_s=window_s, max_requests=max_requests
    )
    requests = trace.requests
    offset = 0.0
    if window_s is not None:
        start, end = window_s
        requests = tuple(r for r in requests if start <= r.arrival_s < end)
        offset = start
    if max_requests is not None:
        requests = requests[:max_requests]
    factor = time_scale / rate_scale
    if offset or factor != 1.0:
        requests = tuple(_shifted(r, offset, factor) for r in requests)
    if repeat < 1:
        raise TraceError(f"repeat must be at least 1, got {repeat!r}")
    if repeat > 1 and requests:
        span = requests[-1].arrival_s
        copy_s = span + span / max(1, len(requests) - 1)
        requests = tuple(
            replace(r, arrival_s=r.arrival_s + k * copy_s) for k in range(repeat) for r in requests
        )
    if diurnal is not None and requests:
        amplitude, period = diurnal
        if not 0 <= amplitude < 1:
            raise TraceError(f"diurnal amplitude must be in [0, 1), got {amplitude!r}")
        day = period if period is not None else requests[-1].arrival_s
        if not (math.isfinite(day) and day > 0):
            raise TraceError(f"diurnal period must be a positive number, got {day!r}")
        requests = tuple(
            replace(r, arrival_s=diurnal_time(r.arrival_s, amplitude, day)) for r in requests
        )
    return Trace(trace.name, trace.block_tokens, requests)


def diurnal_time(s: float, amplitude: float, period: float) -> float:
    """The time ``t`` by which a day-shaped rate ``1 - A cos(2 pi t / P)`` (mean 1) has seen as
    many arrivals as a steady rate of 1 by ``s``: the inverse of ``t - A P/(2 pi) sin(2 pi t / P)``,
    found by Newton's method (the function is increasing for A < 1)."""
    w = 2 * math.pi / period
    t = s
    for _ in range(50):
        f = t - amplitude / w * math.sin(w * t) - s
        slope = 1 - amplitude * math.cos(w * t)
        step = f / slope
        t -= step
        if abs(step) < 1e-9 * max(1.0, abs(s)):
            break
    return t


def _shifted(request: TraceRequest, offset: float, factor: float) -> TraceRequest:
    gap = request.gap_s * factor if request.gap_s is not None else None
    return replace(request, arrival_s=(request.arrival_s - offset) * factor, gap_s=gap)
