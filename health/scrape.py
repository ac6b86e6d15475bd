"""Read each replica's own /metrics: queue depth, KV usage, prefix-cache hits, block size,
LoRA adapters in use.

vLLM's /metrics page is large (histograms with many buckets), so only the lines of the few
families we use are parsed (``kvcore.stats.parse_metrics``); the router stays cheap at one scrape
per replica per interval. What is read goes into ``ReplicaState.reported_*`` (the policy's fresh
load signals) and into ``ReplicaReport`` (exported, so operators can compare the replicas'
reported prefix-cache hits with what the router predicted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from kvroute.kvcore.stats import MetricsPage, parse_metrics
from kvroute.policies import ReplicaState

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
    # Sum and count only (the buckets are most of the page): the mean over a scrape interval.
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_sum",  # before vLLM 0.11
    "vllm:time_per_output_token_seconds_count",
    # Only with LoRA on: max_lora, running_lora_adapters, waiting_lora_adapters as labels.
    "vllm:lora_requests_info",
)
LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


@dataclass(slots=True)
class ReplicaReport:
    """The replica's own numbers from its last successful scrape (cumulative counters)."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None  # tokens looked up in the prefix cache
    prefix_hits: float | None = None  # of those, tokens found cached
    block_size: int | None = None
    kv_capacity_tokens: int | None = None  # num_gpu_blocks x block_size
    itl_sum: float | None = None  # inter-token latency histogram: seconds, cumulative
    itl_count: float | None = None  # and output tokens after the first, cumulative
    max_loras: int | None = None  # adapter slots (None: LoRA off)
    lora_running: frozenset[str] = frozenset()  # adapters of running requests
    lora_waiting: frozenset[str] = frozenset()  # adapters of waiting requests


def parse_vllm_metrics(text: bytes, engine: int | None = None) -> ReplicaReport:
    """The fields of ``ReplicaReport`` from a vLLM /metrics page (missing ones stay None).

    Gauges and counters are summed over a replica's label sets (engine index, model name);
    ``engine``: only that data-parallel rank's (vLLM's ``engine="k"`` label), for an endpoint
    that routes to one rank.
    """
    page = parse_metrics(text, only=WANTED)
    if engine is not None:
        label = str(engine)
        page = MetricsPage(
            [s for s in page.samples if s.labels.get("engine", label) == label], page.families
        )
    report = ReplicaReport()
    for labels, _ in page.series("vllm:cache_config_info"):
        size = labels.get("block_size")
        if size and size.isdigit():
            report.block_size = int(size)
            blocks = labels.get("num_gpu_blocks")
            if blocks and blocks.isdigit():
                report.kv_capacity_tokens = int(blocks) * int(size)
    if "vllm:num_requests_waiting" in page:
        report.waiting = int(page.sum("vllm:num_requests_waiting"))
    if "vllm:num_requests_running" in page:
        report.running = int(page.sum("vllm:num_requests_running"))
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        series = page.series(name)
        if series:  # a fraction per engine: the mean over data-parallel engines
            report.kv_usage = sum(value for _, value in series) / len(series)
            break
    report.prefix_queries = _first_sum(
        page, "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"
    )
    report.prefix_hits = _first_sum(page, "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        if name + "_count" in page:
            report.itl_sum = page.sum(name + "_sum")
            report.itl_count = page.sum(name + "_count")
            break
    _read_lora_info(page, report)
    return report


def _read_lora_info(page: MetricsPage, report: ReplicaReport) -> None:
    """``vllm:lora_requests_info``: vLLM sets a new label set to the current time at every
    stats update and never drops the old ones, so the newest sample (the largest value) per
    engine is now; adapters are comma-separated names, united over data-parallel engines."""
    newest: dict[tuple[tuple[str, str], ...], tuple[float, dict[str, str]]] = {}
    for labels, value in page.series("vllm:lora_requests_info"):
        engine = tuple(sorted((k, v) for k, v in labels.items() if k not in LORA_LABELS))
        if engine not in newest or value >= newest[engine][0]:
            newest[engine] = (value, labels)
    running: set[str] = set()
    waiting: set[str] = set()
    for _, labels in newest.values():
        slots = labels.get("max_lora", "")
        if slots.isdigit() and int(slots) > 0:
            report.max_loras = max(report.max_loras or 0, int(slots))
        running.update(n for n in labels.get("running_lora_adapters", "").split(",") if n)
        waiting.update(n for n in labels.get("waiting_lora_adapters", "").split(",") if n)
    report.lora_running = frozenset(running)
    report.lora_waiting = frozenset(waiting)


def observe_decode(state: ReplicaState, before: ReplicaReport | None, now: ReplicaReport) -> None:
    """Feed the replica's latency lines (when the policy keeps them) its mean inter-token
    latency since the last scrape, paired with the batch it ran (the mean of the two reads)."""
    if state.latency is None or before is None:
        return
    if before.itl_count is None or now.itl_count is None or before.itl_sum is None:
        return
    tokens = now.itl_count - before.itl_count
    if tokens <= 0 or now.itl_sum is None:
        return  # nothing decoded since, or the replica restarted (counters went back)
    running = [r for r in (before.running, now.running) if r is not None]
    batch = sum(running) / len(running) if running else 1.0
    state.latency.observe_decode(batch, (now.itl_sum - before.itl_sum) / tokens)


def _first_sum(page: MetricsPage, *names: str) -> float | None:
    """The sum of the first of ``names`` the page has (older vLLM names come last)."""
    for name in names:
        if name in page:
            return page.sum(name)
    return None


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
        self.scraped_at: dict[str, float] = {}  # monotonic time of each last good scrape
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
            report = parse_vllm_metrics(response.content, replica.data_parallel_rank)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            # Stale signals are worse than none: the policy falls back to its own accounting.
            state.reported_waiting = None
            state.reported_kv_usage = None
            state.lora_running = frozenset()
            log.debug("scrape of %s failed: %s", state.replica_id, exc)
            return
        observe_decode(state, self.reports.get(state.replica_id), report)
        self.reports[state.replica_id] = report
        self.scraped_at[state.replica_id] = time.monotonic()
        state.reported_waiting = report.waiting
        state.reported_kv_usage = report.kv_usage
        # Waiting adapters are about to take a slot as much as running ones hold one.
        state.lora_running = report.lora_running | report.lora_waiting
        state.max_loras = report.max_loras
        if report.kv_capacity_tokens is not None:
            state.kv_capacity_tokens = report.kv_capacity_tokens
        if report.block_size is not None:
            self._on_block_size(state.replica_id, report.block_size)

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet."""
        self.reports.pop(replica_id, None)
        self.scraped_at.pop(replica_id, None)

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
