"""The tokenizer caches' Prometheus families (router/tokenizer_cache_metrics.py): what an
operator reads to tell whether ``routing.tokenizer_cache_mb`` holds the conversations in
flight."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvroute.backends.launcher import ensure_tiny_model
from kvroute.router.tokenizer_cache_metrics import CacheCounts, TokenizerCacheMetrics

from .conftest import StartReplica, StartRouter


def samples(text: str) -> dict[tuple[str, ...], float]:
    """(sample name, cache[, result]) -> value, for the tokenizer cache families."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvroute_tokenizer_cache"):
            for s in family.samples:
                out[(s.name, *s.labels.values())] = s.value
    return out


def test_counts_are_summed_over_sources_and_other_workers() -> None:
    part = TokenizerCacheMetrics(
        lambda: [
            {"parsed_messages": CacheCounts(3, 1, 100, 1000)},
            {"token_ids": CacheCounts(2, 2, 50, 500), "rendering": CacheCounts(1, 0, 5, 9)},
            {"token_ids": CacheCounts(1, 0, 10, 500)},
        ]
    )
    peer = {"token_ids": [10, 20, 30, 500]}
    families = {f.name: f for f in part.families([peer])}
    lookups = {
        tuple(s.labels.values()): s.value
        for s in families["kvroute_tokenizer_cache_lookups"].samples
    }
    assert lookups[("token_ids", "hit")] == 13 and lookups[("token_ids", "miss")] == 22
    assert lookups[("parsed_messages", "hit")] == 3 and lookups[("rendering", "miss")] == 0
    kept = {s.labels["cache"]: s.value for s in families["kvroute_tokenizer_cache_bytes"].samples}
    assert kept == {"token_ids": 90, "rendering": 5, "parsed_messages": 100}
    limit = families["kvroute_tokenizer_cache_limit_bytes"].samples
    assert {s.labels["cache"]: s.value for s in limit}["token_ids"] == 1500


async def test_a_conversations_next_turn_shows_as_hits_on_metrics(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    replica = await start_replica()
    router = await start_router([replica], routing={"tokenizer": str(ensure_tiny_model())})
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="-", max_retries=0) as oai:
        history = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}. " * 60}
            for i in range(21)
        ]
        await oai.chat.completions.create(model="tiny", messages=history, max_tokens=1)  # type: ignore[arg-type]
        history += [
            {"role": "assistant", "content": "A reply."},
            {"role": "user", "content": "And the next question?"},
        ]
        await oai.chat.completions.create(model="tiny", messages=history, max_tokens=1)  # type: ignore[arg-type]
    async with httpx.AsyncClient() as http:
        page = samples((await http.get(router.url + "/metrics")).text)
    lookups = "kvroute_tokenizer_cache_lookups_total"
    for cache in ("token_ids", "rendering", "parsed_messages"):
        assert page[(lookups, cache, "miss")] == 1, cache  # the first turn
        assert page[(lookups, cache, "hit")] == 1, cache  # the second took it over
        kept = page[("kvroute_tokenizer_cache_bytes", cache)]
        assert 0 < kept <= page[("kvroute_tokenizer_cache_limit_bytes", cache)]
