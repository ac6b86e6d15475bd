"""kv_aware end to end over emulated replicas: the router tokenizes like the replicas, follows
their KV events and its own predictions, and its predicted hits are what the replicas report."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time
from typing import Any

import aiohttp
import openai

from kvroute.kvcore.block_hashing import block_hashes, extra_key
from kvroute.kvcore.stats import parse_metrics
from kvroute.kvcore.tokenizer import SimpleTokenizer
from kvroute.router.prompt_tokenizer import PromptTokenizer
from kvroute.simulator.replica.faults import FaultSpec

from .conftest import Running, StartEmulated, StartRouter
from .helpers import replica_source, wait_until


def tenant_messages(tenant: int, question: str) -> list[Any]:
    system = f"Tenant {tenant} handbook. " + " ".join(
        f"Rule {tenant}.{i}: be brief, cite section {i}, never guess." for i in range(10)
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def router_samples(url: str) -> dict[tuple[str, str | None], float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, s.labels.get("replica")): s.value for s in parse_metrics(text).samples}


async def test_kv_aware_keeps_tenants_on_their_replica_and_predicts_their_hits(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replicas = [await start_emulated(num_blocks=256) for _ in range(3)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    assert r.router.policy.name == "kv_aware"
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    tokenizer = PromptTokenizer("builtin")
    homes = {}
    for tenant in range(6):
        messages = tenant_messages(tenant, "first question")
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=2
        )
        homes[tenant] = raw.headers["x-kvroute-replica"]
        text = tokenizer.render_chat(messages, {})
        hashes = block_hashes(SimpleTokenizer().encode(text, add_special_tokens=False), 16)

        def all_confirmed(home: str = homes[tenant], hashes: list[int] = hashes) -> bool:
            match = r.router.index.match(hashes, now=1e12).get(home)
            return match is not None and match.confirmed == len(hashes)

        await wait_until(all_confirmed, 30, what="the replica's KV events")
    assert len(set(homes.values())) >= 2, "six cold tenants all went to one replica"

    before = await router_samples(r.url)
    hits_before = sum(rep.replica.engine.stats.prefix_cache_hits for rep in replicas)
    for tenant in range(6):
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=tenant_messages(tenant, "second question"), max_tokens=2
        )
        assert raw.headers["x-kvroute-replica"] == homes[tenant]
        assert raw.headers["x-kvroute-reason"] == "kv_affinity"
    after = await router_samples(r.url)
    predicted = sum(
        after[key] - before.get(key, 0.0)
        for key in after
        if key[0] == "kvroute_predicted_prefix_hit_tokens_total"
    )
    reported = sum(rep.replica.engine.stats.prefix_cache_hits for rep in replicas) - hits_before
    assert predicted > 0
    assert predicted == reported


async def test_predictions_route_followers_before_any_event_arrives(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """Replicas without KV events: the router's own predictions are the whole index."""
    replicas = [await start_emulated(kv_events=False) for _ in range(4)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}", events=False) for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    shared = "A long shared document that every request quotes in full. " * 30

    async def ask(i: int) -> tuple[str, str]:
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=shared + f"Question {i}?", max_tokens=1
        )
        return raw.headers["x-kvroute-replica"], raw.headers["x-kvroute-reason"]

    first_replica, _ = await ask(0)
    answers = await asyncio.gather(*(ask(i) for i in range(1, 6)))
    assert {replica for replica, _ in answers} == {first_replica}
    assert {reason for _, reason in answers} == {"kv_affinity"}


async def test_router_learns_the_block_size_from_the_replica(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    running = await start_emulated(block_size=32)
    r = await start_router([replica_source(running, "emu")], routing={"tokenizer": "builtin"})
    # Before any event: from its vllm:cache_config_info, scraped at startup.
    assert r.router.block_size() == 32
    assert r.router.index.block_size is None
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    await client.completions.create(model="tiny", prompt="word " * 200, max_tokens=1)
    # And from the KV events, which carry it in every BlockStored.
    await wait_until(lambda: r.router.index.block_size == 32, what="block size from KV events")


async def test_replicas_reported_load_and_hits_are_scraped_and_exported(
    replica: Running, start_router: StartRouter
) -> None:
    r = await start_router([replica_source(replica, "emu")], routing={"scrape_interval_s": 0.1})
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    prompt = "the same prompt twice over " * 20
    for _ in range(2):
        await client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    hits = replica.replica.engine.stats.prefix_cache_hits
    assert hits > 0

    async def exported() -> bool:
        samples = await router_samples(r.url)
        return samples.get(("kvroute_replica_prefix_cache_hits_tokens", "emu")) == hits

    async with asyncio.timeout(10):
        while not await exported():
            await asyncio.sleep(0.05)
    state = r.router.replicas["emu"].state
    assert state.reported_waiting == 0
    assert state.reported_kv_usage == 0.0  # idle: cached blocks are free blocks to vLLM


async def test_long_prompts_are_tokenized_in_a_worker_process_with_the_same_result() -> None:
    text = "A prompt long enough to leave the event loop. " * 400
    inline = PromptTokenizer("builtin", inline_chars=10**9)
    offloaded = PromptTokenizer("builtin", inline_chars=100, processes=1)
    try:
        a = await inline.blocks(text, True, 16, None)
        b = await offloaded.blocks(text, True, 16, "salt")
        c = await offloaded.blocks(text, True, 16, None)
    finally:
        offloaded.close()
    assert (inline.offloaded, offloaded.offloaded) == (0, 2)
    assert a == c
    assert b.tokens == a.tokens and b.hashes != a.hashes  # the cache salt seeds the chain


async def test_events_lost_on_the_live_socket_are_replayed_into_the_index(
    replica: Running, start_router: StartRouter
) -> None:
    r = await start_router([replica_source(replica, "emu")], routing={"tokenizer": "builtin"})
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    tokenizer = SimpleTokenizer()

    def held(prompt: str) -> bool:
        hashes = block_hashes(tokenizer.encode(prompt), 16)
        match = r.router.index.match(hashes, now=1e12).get("emu")
        return match is not None and match.confirmed == len(hashes)

    prompts = [f"Prompt {name} for the replay test. " * 12 for name in ("one", "two", "three")]
    await client.completions.create(model="tiny", prompt=prompts[0], max_tokens=1)
    await wait_until(lambda: held(prompts[0]), what="the first prompt's events")
    publisher = replica.replica.publisher
    assert publisher is not None
    publisher.paused = True  # batches still go to the replay buffer, not to subscribers
    await client.completions.create(model="tiny", prompt=prompts[1], max_tokens=1)
    publisher.paused = False
    await client.completions.create(model="tiny", prompt=prompts[2], max_tokens=1)
    await wait_until(lambda: all(held(p) for p in prompts), what="the replayed events")
    (stats,) = r.router.kv_events.stats_by_source().values()
    assert stats.gaps >= 1 and stats.replayed_batches >= 1
    assert stats.resyncs == 0


async def test_a_cache_salt_separates_prefixes_as_it_does_in_vllm(
    replica: Running, start_router: StartRouter
) -> None:
    r = await start_router([replica_source(replica, "emu")], routing={"tokenizer": "builtin"})
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    prompt = "A prompt two tenants send, one of them salted. " * 10
    ids = SimpleTokenizer().encode(prompt)
    salted = block_hashes(ids, 16, "tenant-b")
    plain = block_hashes(ids, 16)
    await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-b"}
    )

    def confirmed(hashes: list[int]) -> int:
        match = r.router.index.match(hashes, now=1e12).get("emu")
        return match.confirmed if match else 0

    await wait_until(lambda: confirmed(salted) == len(salted), what="the salted blocks")
    assert confirmed(plain) == 0  # the unsalted prompt shares none of them, as in the engine
    hits = replica.replica.engine.stats.prefix_cache_hits
    await client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert replica.replica.engine.stats.prefix_cache_hits == hits


async def test_a_lora_adapters_prefix_goes_where_that_adapter_cached_it(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    # vLLM keys a LoRA request's blocks by the adapter's name: the router learns the adapters
    # from /v1/models (cards with a parent) and hashes requests naming one the same way.
    replicas = [await start_emulated(lora_modules={"sql-lora": "/adapters/sql"}) for _ in range(2)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    models = await client.models.list()
    assert {m.id for m in models.data} == {"tiny", "sql-lora"}
    prompt = "Translate the question into SQL over the orders table. " * 8
    ids = SimpleTokenizer().encode(prompt)
    adapter = block_hashes(ids, 16, extra_key("sql-lora", None))
    base = block_hashes(ids, 16)
    raw = await client.completions.with_raw_response.create(
        model="sql-lora", prompt=prompt, max_tokens=1
    )
    assert raw.parse().model == "sql-lora"
    home = raw.headers["x-kvroute-replica"]

    def confirmed(hashes: list[int]) -> int:
        match = r.router.index.match(hashes, now=1e12).get(home)
        return match.confirmed if match else 0

    await wait_until(lambda: confirmed(adapter) == len(adapter), what="the adapter's blocks")
    assert confirmed(base) == 0  # the base model's prompt shares none of them, as in vLLM
    for _ in range(3):  # the adapter's requests follow its blocks; the router predicted the hit
        raw = await client.completions.with_raw_response.create(
            model="sql-lora", prompt=prompt, max_tokens=1
        )
        assert raw.headers["x-kvroute-replica"] == home
        assert int(raw.headers["x-kvroute-prefix-hit-tokens"]) == len(adapter) * 16


async def test_a_replica_that_answers_with_errors_does_not_attract_the_prefix(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    broken, healthy = await start_emulated(), await start_emulated()
    broken.replica.faults.update(FaultSpec(error_rate=1.0))
    r = await start_router(
        [replica_source(broken, "broken"), replica_source(healthy, "healthy")],
        routing={"tokenizer": "builtin"},
    )
    errors = r.router.metrics.upstream_errors
    async with aiohttp.ClientSession() as http:
        for i in range(40):  # new prefixes until one's home is the broken replica
            prompt = f"Prefix {i}: a prompt the broken replica will never cache. " * 10
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            async with http.post(r.url + "/v1/completions", json=body) as resp:
                await resp.read()
                # The broken replica's 500 is retried on the healthy one: the client never sees it.
                assert resp.status == 200
                assert resp.headers["X-Kvroute-Replica"] == "healthy"
                if errors.get(("broken", "http_500")):
                    assert resp.headers["X-Kvroute-Reason"] == "retry"
                    break
        else:
            raise AssertionError("no request reached the broken replica")
    hashes = block_hashes(SimpleTokenizer().encode(prompt), 16)
    assert "broken" not in r.router.index.match(hashes, time.monotonic())
    for state in (r.router.replicas[name].state for name in ("broken", "healthy")):
        assert (state.in_flight, state.prefilling, state.prefill_tokens) == (0, 0, 0)


async def test_load_accounting_returns_to_zero_after_disconnects(
    replica: Running, start_router: StartRouter
) -> None:
    r = await start_router([replica_source(replica, "emu")], routing={"tokenizer": "builtin"})
    replica.replica.faults.update(FaultSpec(stall_s=30))
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "stalled " * 50, "max_tokens": 4, "stream": True}
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(0.5):
                async with http.post(r.url + "/v1/completions", json=body) as resp:
                    await resp.read()
    state = r.router.replicas["emu"].state
    await wait_until(lambda: state.in_flight == 0, what="the disconnect to reach the router")
    assert (state.prefilling, state.prefill_tokens, state.in_flight_tokens) == (0, 0, 0)


async def test_a_dead_tokenizer_worker_costs_one_estimate_not_an_error(
    replica: Running, start_router: StartRouter
) -> None:
    r = await start_router(
        [replica_source(replica, "emu")],
        routing={"tokenizer": "builtin", "tokenize_inline_chars": 100},
    )
    tokenizer = r.router.tokenizer
    assert tokenizer is not None
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    long_prompt = "Long enough to be tokenized in a worker process. " * 20
    await client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1)
    pool = tokenizer._pool
    assert pool is not None
    for process in list(pool._processes.values()):  # type: ignore[union-attr]
        os.kill(process.pid, signal.SIGKILL)
    for _ in range(3):
        completion = await client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1)
        assert completion.choices[0].finish_reason == "length"
    assert tokenizer._pool is not None and tokenizer._pool is not pool  # restarted


async def test_tokenizer_processes_0_tokenizes_long_prompts_in_the_router_with_no_worker(
    replica: Running, start_router: StartRouter
) -> None:
    """routing.tokenizer_processes: 0 starts no tokenizer process, and a prompt past
    tokenize_inline_chars is still tokenized (the router predicts its cached prefix on the next
    request), in the router's own process; the default runs one in a worker process."""
    long_prompt = "Long enough to be tokenized in a worker process, if there is one. " * 20
    for processes, workers in ((0, False), (1, True)):
        before = {p.pid for p in multiprocessing.active_children()}
        name = f"emu{processes}"
        r = await start_router(
            [replica_source(replica, name)],
            routing={
                "tokenizer": "builtin",
                "tokenize_inline_chars": 100,
                "tokenizer_processes": processes,
            },
        )
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        prompt = f"{processes}: {long_prompt}"
        hashes = block_hashes(SimpleTokenizer().encode(prompt), 16)
        await client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        index = r.router.index
        await wait_until(
            lambda index=index, hashes=hashes, name=name: _holds(index, hashes, name),
            what="the prompt's blocks in the index",
        )
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=1
        )
        assert int(raw.headers["X-Kvroute-Prefix-Hit-Tokens"]) == len(hashes) * 16
        started = {p.pid for p in multiprocessing.active_children()} - before
        assert bool(started) is workers, (processes, started)
        await client.close()


def _holds(index: Any, hashes: list[int], replica: str) -> bool:
    match = index.match(hashes, now=1e12).get(replica)
    return match is not None and match.confirmed == len(hashes)
