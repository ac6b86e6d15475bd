"""Read each replica's own /metrics: queue depth, KV usage, prefix-cache hits, block size.

vLLM's /metrics page is large (histograms with many buckets), so only the lines of the few
families we use are handed to prometheus-client's parser; the router stays cheap at one scrape
per replica per interval. What is read goes into ``ReplicaState.reported_*`` (the policy's fresh
load signals) and into ``ReplicaReport`` (exported, so operators can compare the replicas'
reported prefix-cache hits with what the router predicted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .probe import Probeable

log = logging.getLogger(__name__)

WANTED = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # before vLLM 0.10
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries",  # before vLLM 0.10
    "vllm:gpu_prefix_cache_hits",
    "vllm:cache_config_info",
)
_PREFIXES = tuple(name.encode() for name in WANTED)


@dataclass(slots=True)
class ReplicaReport:
    """The replica's own numbers from its last successful scrape (cumulative counters)."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None  # tokens looked up in the prefix cache
    prefix_hits: float | None = None  # of those, tokens found cached
    block_size: int | None = None


def parse_vllm_metrics(text: bytes) -> ReplicaReport:
    """The fields of ``ReplicaReport`` from a vLLM /metrics page (missing ones stay None)."""
    lines = [line for line in text.split(b"\n") if line.startswith(_PREFIXES)]
    report = ReplicaReport()
    sums: dict[str, float] = {}
    series: dict[str, int] = {}
    for family in text_string_to_metric_families(b"\n".join(lines).decode() + "\n"):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name == "vllm:cache_config_info":
                size = sample.labels.get("block_size")
                if size and size.isdigit():
                    report.block_size = int(size)
                continue
            # Summed over label sets (engine index, model name) of one replica.
            sums[name] = sums.get(name, 0.0) + sample.value
            series[name] = series.get(name, 0) + 1
    if "vllm:num_requests_waiting" in sums:
        report.waiting = int(sums["vllm:num_requests_waiting"])
    if "vllm:num_requests_running" in sums:
        report.running = int(sums["vllm:num_requests_running"])
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        if name in sums:  # a fraction per engine: the mean over data-parallel engines
            report.kv_usage = sums[name] / series[name]
            break
    report.prefix_queries = sums.get(
        "vllm:prefix_cache_queries", sums.get("vllm:gpu_prefix_cache_queries")
    )
    report.prefix_hits = sums.get("vllm:prefix_cache_hits", sums.get("vllm:gpu_prefix_cache_hits"))
    return report


class MetricsScraper:
    """Scrapes every healthy replica's /metrics on an interval, concurrently."""

    def __init__(
        self,
        replicas: Callable[[], Sequence[Probeable]],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        on_block_size: Callable[[str, int], None] = lambda replica, size: None,
    ) -> None:
        self._replicas = replicas
        self._interval_s = interval_s
        self._on_block_size = on_block_size
        self.reports: dict[str, ReplicaReport] = {}
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._task: asyncio.Task[None] | None = None

    async def scrape_all(self) -> None:
        replicas = [r for r in self._replicas() if r.state.healthy]
        await asyncio.gather(*(self._scrape(r) for r in replicas))

    async def _scrape(self, replica: Probeable) -> None:
        state = replica.state
        try:
            response = await self._client.get(replica.base_url + "/metrics")
            if response.status_code != 200:
                raise ValueError(f"status {response.status_code}")
            report = parse_vllm_metrics(response.content)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            # Stale signals are worse than none: the policy falls back to its own accounting.
            state.reported_waiting = None
            state.reported_kv_usage = None
            log.debug("scrape of %s failed: %s", state.replica_id, exc)
            return
        self.reports[state.replica_id] = report
        state.reported_waiting = report.waiting
        state.reported_kv_usage = report.kv_usage
        if report.block_size is not None:
            self._on_block_size(state.replica_id, report.block_size)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-metrics-scrape")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.scrape_all()
            except Exception:  # one bad round must not end scraping for good
                log.exception("metrics scrape round failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()
