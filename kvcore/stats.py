"""Numbers from measurements (pure): percentiles of samples, and the samples of a Prometheus
/metrics page.

The one home of both. ``percentile`` serves the simulator's summaries (summary.json, the replay
tables), the live replay, the benches, the drill and the demo; ``parse_metrics`` reads vLLM's
/metrics for the router's scraper (``health.scrape``), the live replay, the benches, the drill
and the tests. It lives in kvcore because the simulator and health may both import kvcore, and
neither may import the other: both functions are text and numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

PercentileMethod = Literal["linear", "nearest_rank", "rank_above", "nearest"]


def percentile(values: Iterable[float], q: float, *, method: PercentileMethod = "linear") -> float:
    """The ``q``-quantile (``q`` from 0 to 1) of ``values``; NaN when there are none.

    With the values sorted, ``n`` of them, ``v[0]`` the smallest:

    * ``linear`` (the default; numpy's default): interpolated at position ``q * (n - 1)``.
      The simulator's numbers (summary.json, the replay and fidelity tables).
    * ``nearest_rank`` (numpy's "inverted_cdf"): ``v[ceil(q * n) - 1]`` (at least ``v[0]``), the
      smallest value with at least a ``q`` share of the values at or below it. Measured
      latencies: the live replay's summary, the overhead bench's built-in load, the drill.
    * ``rank_above``: ``v[floor(q * n)]`` (at most the largest), the smallest value with more
      than a ``q`` share of the values at or below it: ``nearest_rank``, but one rank higher
      when ``q * n`` is a whole number. The demo's and ``bench prefix``'s TTFT and latency.
    * ``nearest`` (numpy's "nearest"): ``v[round(q * (n - 1))]``, ties to even. The index
      bench's lookup times.

    Callers that show percentiles in units (``q`` = 99 for p99) pass ``q / 100``: the float
    arithmetic is then the same as theirs was.
    """
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    if method == "linear":
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    if method == "nearest_rank":
        index = math.ceil(q * n) - 1
    elif method == "rank_above":
        index = int(q * n)
    elif method == "nearest":
        index = round(q * (n - 1))
    else:
        raise ValueError(f"unknown percentile method {method!r}")
    return ordered[min(n - 1, max(0, index))]


# ------------------------------------------------------------------ /metrics pages


@dataclass(frozen=True, slots=True)
class Sample:
    name: str  # as exposed: a counter's samples end in "_total", a histogram's in "_bucket", ...
    labels: Mapping[str, str]
    value: float


@dataclass
class MetricsPage:
    """The samples of one Prometheus text page, looked up by name and labels.

    A name finds the samples of exactly that name or, when there are none, those of
    ``name + "_total"``: a counter can be asked for by its family name
    (``vllm:prefix_cache_hits``) or its sample name (``vllm:prefix_cache_hits_total``).
    Labels given to a lookup must all match; others a sample has are free.
    """

    samples: list[Sample]
    families: frozenset[str] = frozenset()  # declared by the page, even those without samples
    _by_name: dict[str, list[Sample]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {}
        for sample in self.samples:
            self._by_name.setdefault(sample.name, []).append(sample)

    def _named(self, name: str) -> list[Sample]:
        return self._by_name.get(name) or self._by_name.get(name + "_total") or []

    def series(self, name: str, /, **labels: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of every sample of ``name`` that has the given labels."""
        return [
            (dict(s.labels), s.value)
            for s in self._named(name)
            if all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def sum(self, name: str, /, **labels: str) -> float:
        """The sum over the samples of ``name`` with the given labels; 0.0 when none."""
        return sum(value for _, value in self.series(name, **labels))

    def __contains__(self, name: object) -> bool:
        """Whether the page has samples of ``name`` or declares a family by that name."""
        if not isinstance(name, str):
            return False
        return (
            bool(self._named(name))
            or name in self.families
            or name.removesuffix("_total") in self.families
        )


def parse_metrics(text: str | bytes, only: Iterable[str] = ()) -> MetricsPage:
    """A Prometheus text page (vLLM's /metrics, the router's, the emulated replica's), parsed by
    prometheus-client's parser. Raises ValueError on a malformed page.

    With ``only``, just the sample lines starting with one of those names are parsed (their
    # HELP and # TYPE lines are skipped too): a vLLM page is large, mostly histogram buckets,
    and the router scrapes every replica every second.
    """
    # prometheus-client (40 ms to import) only when a page is read: kvcore's importers that
    # only want percentiles (the simulator) do not pay for it.
    from prometheus_client.parser import text_string_to_metric_families

    prefixes = tuple(only)
    if prefixes:
        if isinstance(text, bytes):
            wanted = tuple(p.encode() for p in prefixes)
            text = b"\n".join(line for line in text.split(b"\n") if line.startswith(wanted))
        else:
            text = "\n".join(line for line in text.split("\n") if line.startswith(prefixes))
    if isinstance(text, bytes):
        text = text.decode()
    if not text.endswith("\n"):
        text += "\n"
    samples: list[Sample] = []
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        samples.extend(Sample(s.name, s.labels, s.value) for s in family.samples)
    return MetricsPage(samples, frozenset(families))
