"""Windows, time and rate scaling, and request caps applied to a loaded trace (pure).

Order and meaning, the same for every format:
1. ``window_s=(start, end)`` keeps requests with ``start <= arrival_s < end`` on the trace's own
   clock (before any scaling; for formats whose arrivals are generated, the generated clock), and
   shifts them so ``start`` becomes 0.
2. ``max_requests=N`` keeps the first N of those, in arrival order.
3. Arrival times are multiplied by ``time_scale / rate_scale``: ``time_scale=2`` stretches the
   trace to twice its length (half the requests per second); ``rate_scale=2`` compresses it to half
   its length, so twice the requests per second. Token counts and prefixes never change.
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
) -> Trace:
    """``trace`` windowed, capped and scaled as the module docstring says."""
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
    return Trace(trace.name, trace.block_tokens, requests)


def _shifted(request: TraceRequest, offset: float, factor: float) -> TraceRequest:
    return replace(request, arrival_s=(request.arrival_s - offset) * factor)
