"""/metrics with vLLM's names, labels and buckets (vllm/v1/metrics/loggers.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.simulator.engine import PROMPT_SOURCES, EngineConfig, EngineStats

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
LABELS = ["model_name", "engine"]


@dataclass(frozen=True, slots=True)
class RankSeries:
    """One engine's (data-parallel rank's) histograms."""

    ttft: Any
    itl: Any
    e2e: Any


class ReplicaMetrics:
    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        stats: Callable[[], Sequence[EngineStats]],
        lora: bool = False,
    ) -> None:
        """``stats``: each engine's, in rank order (one per data-parallel rank), labelled
        ``engine="k"`` as vLLM labels them."""
        self.registry = CollectorRegistry()
        ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            LABELS, buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        itl = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            LABELS, buckets=ITL_BUCKETS, registry=self.registry,
        )  # fmt: skip
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            LABELS, buckets=E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*LABELS, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self._model = model_name
        self.ranks = [
            RankSeries(
                ttft.labels(model_name, str(k)),
                itl.labels(model_name, str(k)),
                e2e.labels(model_name, str(k)),
            )
            for k in range(len(stats()))
        ]
        self.ttft, self.itl, self.e2e = self.ranks[0].ttft, self.ranks[0].itl, self.ranks[0].e2e
        self.registry.register(_EngineCollector(model_name, config, stats, lora))

    def finished(self, reason: str, rank: int = 0) -> None:
        self._success.labels(self._model, str(rank), reason).inc()


class _EngineCollector(Collector):
    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        stats: Callable[[], Sequence[EngineStats]],
        lora: bool,
    ) -> None:
        self._model = model_name
        self._config = config
        self._stats = stats
        self._lora = lora  # vLLM exports lora_requests_info only with LoRA enabled

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        ranks = [([self._model, str(k)], s) for k, s in enumerate(self._stats())]
        s = ranks[0][1]  # LoRA info: one engine's (LoRA with data parallelism is not emulated)
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                "num_running",
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                "num_waiting",
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                "kv_cache_usage",
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            for labels, stats in ranks:
                gauge.add_metric(labels, getattr(stats, value))
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, stats in ranks:
                counter.add_metric(labels, getattr(stats, value))
            yield counter
        yield from _prompt_sources(ranks)
        c = self._config
        info = {
            "block_size": str(c.block_size),
            "num_gpu_blocks": str(c.num_blocks),
            "enable_prefix_caching": str(c.enable_prefix_caching),
        }
        gauge = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*info, "engine"],
        )
        for k in range(len(ranks)):
            gauge.add_metric([*info.values(), str(k)], 1.0)
        yield gauge
        if self._lora:
            # vLLM sets a label set to the current time at every stats update (and keeps the
            # old ones: readers take the newest); only the current one here.
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric(
                [str(c.max_loras), ",".join(s.waiting_loras), ",".join(s.running_loras)],
                time.time(),
            )
            yield lora


def _prompt_sources(ranks: list[tuple[list[str], EngineStats]]) -> Iterable[CounterMetricFamily]:
    """vllm:prompt_tokens_by_source (computed here, local prefix hits, moved in from a prefill
    replica) and vllm:prompt_tokens_cached (the two last, as vLLM counts them)."""
    by_source = CounterMetricFamily(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        labels=[*LABELS, "source"],
    )
    for labels, s in ranks:
        for source, value in zip(PROMPT_SOURCES, s.prompt_tokens_by_source, strict=True):
            by_source.add_metric([*labels, source], value)
    yield by_source
    cached = CounterMetricFamily(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        labels=LABELS,
    )
    for labels, s in ranks:
        cached.add_metric(labels, s.prompt_tokens_cached)
    yield cached
