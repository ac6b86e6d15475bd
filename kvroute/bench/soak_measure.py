"""What the soak samples from the router, and how it judges growth over a run.

A sample is the router's resources (RSS and open fds of its processes, from /proc) and the
gauges of its /metrics page that a leak would make climb: prefix-index entries and the
in-flight counters. Growth compares a window at the start of the measured span (after the
warm-up) with a window at its end; see ``window_growth``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.bench.soak_procs import RouterTree
from kvroute.kvcore.stats import MetricsPage, parse_metrics

# Allowed growth from the start window to the end window (issue 17: "growth <= 5%").
GROWTH_LIMIT = 0.05
# Each window is this share of the measured span (and at least MIN_WINDOW_SAMPLES samples).
WINDOW_FRACTION = 0.2
MIN_WINDOW_SAMPLES = 3

LOOP_LAG = "kvroute_event_loop_lag_seconds"


@dataclass(frozen=True)
class Resource:
    key: str  # the Sample field
    label: str
    unit: str  # how values print: "MiB", "" (a count)
    # Load-driven gauges (what is in flight right now) have no floor a leak lifts in a
    # percentage: their samples are Little's law noise around rate x latency. For them a rise
    # counts only beyond the start window's own spread (see ``judge``); a leaked request shows
    # where it cannot hide, in the idle check after the traffic stops.
    load_driven: bool = False


RESOURCES = (
    Resource("rss_bytes", "router RSS", "MiB"),
    Resource("open_fds", "router open fds", ""),
    Resource("index_entries", "prefix index entries", ""),
    Resource("in_flight_requests", "in-flight requests (sum over replicas)", "", True),
    Resource("in_flight_tokens", "in-flight tokens (sum over replicas)", "", True),
    Resource("active_requests", "active client requests", "", True),
)
IDLE_GAUGES = ("in_flight_requests", "in_flight_tokens", "active_requests", "queued_requests")


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the traffic started
    rss_bytes: float
    open_fds: float
    index_entries: float
    in_flight_requests: float
    in_flight_tokens: float
    active_requests: float
    queued_requests: float
    lag_sum_s: float | None  # the event-loop lag histogram's running sum and count, if exported
    lag_count: float | None

    def value(self, key: str) -> float:
        return float(getattr(self, key))


def gauges(page: MetricsPage) -> dict[str, float]:
    return {
        "index_entries": page.sum("kvroute_prefix_index_entries"),
        "in_flight_requests": page.sum("kvroute_in_flight_requests"),
        "in_flight_tokens": page.sum("kvroute_in_flight_tokens"),
        "active_requests": page.sum("kvroute_active_requests"),
        "queued_requests": page.sum("kvroute_queued_requests"),
    }


def take_sample(t: float, tree: RouterTree, metrics_text: str) -> Sample:
    page = parse_metrics(metrics_text)
    has_lag = f"{LOOP_LAG}_count" in page
    return Sample(
        t=t,
        rss_bytes=float(tree.rss_bytes()),
        open_fds=float(tree.open_fds()),
        lag_sum_s=page.sum(f"{LOOP_LAG}_sum") if has_lag else None,
        lag_count=page.sum(f"{LOOP_LAG}_count") if has_lag else None,
        **gauges(page),
    )


@dataclass(frozen=True)
class Growth:
    resource: Resource
    start: float  # the start window's median
    end: float  # the end window's median
    allowance: float  # how far ``end`` may exceed ``start`` and pass
    samples: int  # in each window
    # A hard bound the resource stays under when nothing leaks (the prefix index: the fleet's
    # KV blocks); None for resources with no such bound.
    ceiling: float | None = None
    peak: float = 0.0  # the end window's largest sample, judged against ``ceiling``

    @property
    def growth(self) -> float | None:
        """(end - start) / start; None when start is 0."""
        return (self.end - self.start) / self.start if self.start else None

    @property
    def within_ceiling(self) -> bool:
        return self.ceiling is not None and self.peak <= self.ceiling

    @property
    def passed(self) -> bool:
        # A bounded resource that is still filling towards its bound (a short run, or a
        # cache that took longer than the warm-up to fill) grows without leaking; a leak
        # would carry it past the bound, because what leaks stays while the fleet fills on.
        return self.end - self.start <= self.allowance or self.within_ceiling


def window_size(measured: int, cycle_samples: int) -> int:
    """Samples in each window: WINDOW_FRACTION of the ``measured`` ones, at least
    MIN_WINDOW_SAMPLES, and at least a kill cycle's worth (every replica killed once, so both
    windows hold every phase of the index's sawtooth)."""
    return max(MIN_WINDOW_SAMPLES, round(WINDOW_FRACTION * measured), cycle_samples)


def windows(
    samples: Sequence[Sample], warmup_s: float, cycle_samples: int = 0
) -> tuple[list[Sample], list[Sample]] | None:
    """The first and last window of the samples taken after ``warmup_s``; None when there
    are too few for two windows that do not overlap."""
    measured = [s for s in samples if s.t >= warmup_s]
    size = window_size(len(measured), cycle_samples)
    if len(measured) < 2 * size:
        return None
    return measured[:size], measured[-size:]


def window_growth(
    resource: Resource,
    first: Sequence[Sample],
    last: Sequence[Sample],
    ceiling: float | None = None,
) -> Growth:
    """Median of the first window against the median of the last.

    Medians, not single samples or means: the soak's faults make every resource a sawtooth. A
    killed replica's index entries drop to zero and refill over a minute; the garbage collector
    and the allocator move RSS up and down; fds follow open connections. A median over a window
    that spans several of these cycles ignores the teeth and keeps the level, so only a level
    that moved (a leak) reads as growth. Against ``GROWTH_LIMIT`` of that level; load-driven
    gauges may also move within the start window's interquartile range (see ``Resource``); a
    resource with a ``ceiling`` may also grow while the end window stays under it.
    """
    values = [s.value(resource.key) for s in first]
    start = statistics.median(values)
    end = statistics.median(s.value(resource.key) for s in last)
    allowance = GROWTH_LIMIT * start
    if resource.load_driven and len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4)
        allowance = max(allowance, q3 - q1)
    peak = max(s.value(resource.key) for s in last)
    return Growth(resource, start, end, allowance, len(first), ceiling, peak)


def mean_loop_lag_ms(window: Sequence[Sample]) -> float | None:
    """The event loop's mean lag over a window, from the histogram's sum and count."""
    a, b = window[0], window[-1]
    if a.lag_sum_s is None or b.lag_sum_s is None or a.lag_count is None or b.lag_count is None:
        return None
    count = b.lag_count - a.lag_count
    return 1000 * (b.lag_sum_s - a.lag_sum_s) / count if count > 0 else None


def idle(sample_gauges: dict[str, float]) -> bool:
    return all(sample_gauges[g] == 0 for g in IDLE_GAUGES)
