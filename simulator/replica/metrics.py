"""/metrics with vLLM's names, labels and buckets (vllm/v1/metrics/loggers.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

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


class ReplicaMetrics:
    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        stats: Callable[[], EngineStats],
        lora: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = (model_name, "0")
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            LABELS, buckets=TTFT_BUCKETS, registry=self.registry,
        ).labels(*labels)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            LABELS, buckets=ITL_BUCKETS, registry=self.registry,
        ).labels(*labels)  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            LABELS, buckets=E2E_BUCKETS, registry=self.registry,
        ).labels(*labels)  # fmt: skip
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*LABELS, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self._labels = labels
        self.registry.register(_EngineCollector(model_name, config, stats, lora))

    def finished(self, reason: str) -> None:
        self._success.labels(*self._labels, reason).inc()


class _EngineCollector(Collector):
    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        stats: Callable[[], EngineStats],
        lora: bool,
    ) -> None:
        self._labels = [model_name, "0"]
        self._config = config
        self._stats = stats
        self._lora = lora  # vLLM exports lora_requests_info only with LoRA enabled

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                s.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                s.num_waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                s.kv_cache_usage,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(self._labels, value)
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self._labels, value)
            yield counter
        yield from _prompt_sources(self._labels, s)
        if s.offload:  # vLLM's OffloadingConnector metrics (its flat names, 0.32)
            for name, doc, value in (
                ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.", s.offload_load_bytes),
                ("vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds.", s.offload_load_seconds),
                ("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.", s.offload_store_bytes),
            ):  # fmt: skip
                counter = CounterMetricFamily(name, doc, labels=LABELS)
                counter.add_metric(self._labels, value)
                yield counter
        c = self._config
        info = {
            "block_size": str(c.block_size),
            "num_gpu_blocks": str(c.num_blocks),
            "enable_prefix_caching": str(c.enable_prefix_caching),
            "engine": "0",
        }
        gauge = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        gauge.add_metric(list(info.values()), 1.0)
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


def _prompt_sources(labels: list[str], s: EngineStats) -> Iterable[CounterMetricFamily]:
    """vllm:prompt_tokens_by_source (computed here, local prefix hits, moved in from a prefill
    replica) and vllm:prompt_tokens_cached (the two last, as vLLM counts them)."""
    by_source = CounterMetricFamily(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        labels=[*LABELS, "source"],
    )
    for source, value in zip(PROMPT_SOURCES, s.prompt_tokens_by_source, strict=True):
        by_source.add_metric([*labels, source], value)
    yield by_source
    cached = CounterMetricFamily(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        labels=LABELS,
    )
    cached.add_metric(labels, s.prompt_tokens_cached)
    yield cached
