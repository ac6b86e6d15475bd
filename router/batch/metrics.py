"""The batch lane's Prometheus metrics: lines by outcome, jobs by status, preemptions.

A ``RouterMetrics`` part (plain counters merged with the other workers' at scrape time).
Jobs by status come from the shared store, so every worker reports the same numbers: the
gauge is this worker's reading, not a sum.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from .model import Status

# completed: a 2xx answer stored; failed: an error stored; requeued: given back to the queue
# (preempted, cancelled while running, or to retry after a 5xx / no replica).
LINE_OUTCOMES = ("completed", "failed", "requeued")


class BatchMetrics:
    def __init__(self) -> None:
        self.lines = dict.fromkeys(LINE_OUTCOMES, 0)
        self.preemptions = 0
        self.jobs = {s.value: 0 for s in Status}

    def line(self, outcome: str) -> None:
        self.lines[outcome] = self.lines.get(outcome, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"lines": dict(self.lines), "preemptions": self.preemptions}

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        snapshots = [self.snapshot(), *peers]
        lines = CounterMetricFamily(
            "kvroute_batch_lines",
            "Batch request lines by outcome: completed, failed (error stored) or requeued.",
            labels=["status"],
        )
        totals: dict[str, int] = {}
        for snap in snapshots:
            for outcome, n in snap.get("lines", {}).items():
                totals[outcome] = totals.get(outcome, 0) + n
        for outcome, n in sorted(totals.items()):
            lines.add_metric([outcome], n)
        yield lines
        preemptions = CounterMetricFamily(
            "kvroute_batch_preemptions",
            "Running batch lines aborted and re-queued for an online request that waited.",
        )
        preemptions.add_metric([], sum(s.get("preemptions", 0) for s in snapshots))
        yield preemptions
        jobs = GaugeMetricFamily(
            "kvroute_batch_jobs", "Batch jobs in the store by status.", labels=["status"]
        )
        for status, n in sorted(self.jobs.items()):
            jobs.add_metric([status], n)
        yield jobs
