"""How well the caches that spare a long conversation's re-tokenization hold: lookups that hit
or missed, and bytes kept against each cache's share of ``routing.tokenizer_cache_mb``.

A picker or router with more long conversations in flight than these caches hold renders and
tokenizes each turn whole again (LRU over conversations that come round in turn keeps none of
them): a hit ratio that falls while the bytes sit at the limit says to raise the setting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

# The caches, as labelled: a conversation's token ids (kvcore incremental), its rendered chat
# template (kvcore chat_render) and its parsed messages (router chat_parse).
CACHES = ("token_ids", "rendering", "parsed_messages")


@dataclass(slots=True, frozen=True)
class CacheCounts:
    hits: int
    misses: int
    bytes: int
    limit_bytes: int


Counts = dict[str, CacheCounts]


class TokenizerCacheMetrics:
    """A ``RouterMetrics`` part: ``sources`` gives each cache's counts (one dict per pool's
    tokenizer, and the request parser's), summed here and with the other workers'."""

    def __init__(self, sources: Callable[[], Iterable[Counts]]) -> None:
        self._sources = sources

    def snapshot(self) -> dict[str, list[int]]:
        total: dict[str, list[int]] = {}
        for counts in self._sources():
            for cache, c in counts.items():
                into = total.setdefault(cache, [0, 0, 0, 0])
                for i, value in enumerate((c.hits, c.misses, c.bytes, c.limit_bytes)):
                    into[i] += value
        return total

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        merged: dict[str, list[int]] = {}
        for snapshot in [self.snapshot(), *peers]:
            for cache, values in snapshot.items():
                into = merged.setdefault(cache, [0, 0, 0, 0])
                for i, value in enumerate(values):
                    into[i] += value
        lookups = CounterMetricFamily(
            "kvroute_tokenizer_cache_lookups",
            "Lookups of a conversation's earlier turn in each cache (token_ids, rendering, "
            "parsed_messages), by result: a miss tokenizes, renders or decodes the whole "
            "conversation again.",
            labels=["cache", "result"],
        )
        kept = GaugeMetricFamily(
            "kvroute_tokenizer_cache_bytes",
            "Bytes each cache keeps (about), against kvroute_tokenizer_cache_limit_bytes.",
            labels=["cache"],
        )
        limit = GaugeMetricFamily(
            "kvroute_tokenizer_cache_limit_bytes",
            "Each cache's share of routing.tokenizer_cache_mb.",
            labels=["cache"],
        )
        for cache in CACHES:
            hits, misses, size, most = merged.get(cache, (0, 0, 0, 0))
            lookups.add_metric([cache, "hit"], hits)
            lookups.add_metric([cache, "miss"], misses)
            kept.add_metric([cache], size)
            limit.add_metric([cache], most)
        yield lookups
        yield kept
        yield limit
