"""The router follows its replicas' KV events: its prefix index holds what they cache, under the
router's own block hashes, and /metrics shows the subscription."""

from __future__ import annotations

import aiohttp
import openai

from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.stats import parse_metrics
from kvroute.kvcore.tokenizer import SimpleTokenizer

from .conftest import Running, StartRouter
from .helpers import wait_until

PROMPT = "Every full block of this prompt ends up in the router's index. " * 12


async def test_index_learns_what_the_replica_caches(
    replica: Running, start_router: StartRouter
) -> None:
    source = {
        "url": replica.url,
        "name": "emu",
        "kv_events": replica.events,
        "kv_replay": replica.replay,
    }
    r = await start_router([source])
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    hashes = block_hashes(SimpleTokenizer().encode(PROMPT), 16)
    assert len(hashes) >= 8

    def held() -> int:
        match = r.router.index.match(hashes, now=0.0).get("emu")
        return match.confirmed if match else 0

    # The subscriber may join after the first batch: replay from 0 fills it in.
    await wait_until(
        lambda: held() == len(hashes), what="the index to hold every full prompt block"
    )

    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    samples = {(s.name, s.labels.get("replica")): s.value for s in parse_metrics(text).samples}
    assert samples[("kvroute_kv_event_batches_total", "emu")] >= 1
    assert samples[("kvroute_kv_event_connected", "emu")] == 1
    assert samples[("kvroute_prefix_index_entries", None)] >= len(hashes)
