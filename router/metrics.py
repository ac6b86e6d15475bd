"""Prometheus metrics, all named kvroute_*.

Each router has its own registry (tests run several routers in one process). Per-replica
gauges are read from the live ``ReplicaState`` at scrape time instead of being updated on
every request, so the hot path only pays for counters and histograms, and label children
are cached so it never rebuilds label tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from policies import ReplicaState

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Iterable[ReplicaState]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvroute_requests",
            "Requests answered, by replica, HTTP status and routing reason.",
            ["replica", "status", "reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvroute_rejected_requests",
            "Requests answered by the router itself without reaching a replica, by status and code.",
            ["status", "code"],
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "kvroute_time_to_first_byte_seconds",
            "From dispatch to the first byte of the replica's response body.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvroute_request_duration_seconds",
            "From dispatch to the last byte relayed to the client.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failures talking to a replica, by kind (connect, timeout, broken_stream).",
            ["replica", "kind"],
            registry=self.registry,
        )
        self.registry.register(_ReplicaGauges(replicas))
        self._request_children: dict[tuple[str, int, str], Counter] = {}
        self._ttfb_children: dict[str, Histogram] = {}
        self._duration_children: dict[str, Histogram] = {}

    def observe_request(
        self, replica: str, status: int, reason: str, ttfb_s: float | None, duration_s: float
    ) -> None:
        key = (replica, status, reason)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(replica, str(status), reason)
        child.inc()
        if ttfb_s is not None:
            ttfb = self._ttfb_children.get(replica)
            if ttfb is None:
                ttfb = self._ttfb_children[replica] = self.time_to_first_byte.labels(replica)
            ttfb.observe(ttfb_s)
        duration = self._duration_children.get(replica)
        if duration is None:
            duration = self._duration_children[replica] = self.duration.labels(replica)
        duration.observe(duration_s)


class _ReplicaGauges(Collector):
    def __init__(self, replicas: Callable[[], Iterable[ReplicaState]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterable[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "kvroute_in_flight_requests",
            "Requests the router has in flight per replica.",
            labels=["replica"],
        )
        in_flight_tokens = GaugeMetricFamily(
            "kvroute_in_flight_tokens",
            "Estimated tokens (prompt plus max output) in flight per replica.",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily(
            "kvroute_replica_healthy", "1 when the replica is taking traffic.", labels=["replica"]
        )
        for replica in self._replicas():
            in_flight.add_metric([replica.replica_id], replica.in_flight)
            in_flight_tokens.add_metric([replica.replica_id], replica.in_flight_tokens)
            healthy.add_metric([replica.replica_id], 1.0 if replica.healthy else 0.0)
        yield in_flight
        yield in_flight_tokens
        yield healthy

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []
