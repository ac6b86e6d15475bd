"""Per-tenant Prometheus metrics: tokens, requests, queue time and rejections.

Plain dicts bumped on the data path, turned into families at scrape time and merged with the
other workers' (``RouterMetrics.parts``), like the router's own counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from .metrics import Histogram


class TenantMetrics:
    def __init__(self) -> None:
        self.tokens: dict[tuple[str, str], int] = {}  # (tenant, input|output) -> tokens
        self.requests: dict[tuple[str, str], int] = {}  # (tenant, outcome) -> requests
        self.rejections: dict[tuple[str, str], int] = {}  # (tenant, reason) -> requests
        self.queue: dict[str, Histogram] = {}  # tenant -> seconds waited for admission

    def tokens_used(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        tokens = self.tokens
        for key, n in (((tenant, "input"), input_tokens), ((tenant, "output"), output_tokens)):
            tokens[key] = tokens.get(key, 0) + n

    def request(self, tenant: str, outcome: str) -> None:
        key = (tenant, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def rejected(self, tenant: str, reason: str) -> None:
        key = (tenant, reason)
        self.rejections[key] = self.rejections.get(key, 0) + 1

    def queued(self, tenant: str, seconds: float) -> None:
        h = self.queue.get(tenant)
        if h is None:
            h = self.queue[tenant] = Histogram()
        h.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        return {
            "tokens": [[*k, v] for k, v in self.tokens.items()],
            "requests": [[*k, v] for k, v in self.requests.items()],
            "rejections": [[*k, v] for k, v in self.rejections.items()],
            "queue": {t: [h.counts, h.total] for t, h in self.queue.items()},
        }

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        mine = self.snapshot()
        snapshots = [mine, *peers]
        for name, doc, labels, key in (
            (
                "kvroute_tenant_tokens",
                "Tokens served per tenant (replicas' usage).",
                "kind",
                "tokens",
            ),
            ("kvroute_tenant_requests", "Requests per tenant, by outcome.", "outcome", "requests"),
            (
                "kvroute_tenant_rejections",
                "Requests refused per tenant, by reason (over_budget, queue_full, shed, ...).",
                "reason",
                "rejections",
            ),
        ):
            totals: dict[tuple[str, str], int] = {}
            for snap in snapshots:
                for tenant, label, count in snap.get(key, []):
                    totals[(tenant, label)] = totals.get((tenant, label), 0) + count
            family = CounterMetricFamily(name, doc, labels=["tenant", labels])
            for (tenant, label), count in sorted(totals.items()):
                family.add_metric([tenant, label], count)
            yield family
        merged: dict[str, Histogram] = {}
        for snap in snapshots:
            for tenant, (counts, total) in snap.get("queue", {}).items():
                h = merged.setdefault(tenant, Histogram())
                h.counts = [a + b for a, b in zip(h.counts, counts, strict=True)]
                h.total += total
        queue = HistogramMetricFamily(
            "kvroute_tenant_queue_seconds",
            "Time requests waited for admission, per tenant (0 when admitted at once).",
            labels=["tenant"],
        )
        for tenant, h in sorted(merged.items()):
            queue.add_metric([tenant], h.buckets(), h.total)
        yield queue
