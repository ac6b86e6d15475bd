"""Prefill/decode disaggregation through the router, on emulated replicas that speak vLLM's
kv_transfer_params protocol: which requests are split, that the client sees one ordinary
answer either way, and that a failing leg loses nothing. Asserted as a client (the ``openai``
client) and an operator (the router's and the replicas' Prometheus metrics) see it."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvroute.simulator.replica.faults import FaultSpec

from .conftest import Running, RunningRouter, StartEmulated, StartRouter
from .helpers import replica_source, wait_until

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# 16-token blocks; a prompt of ~200 built-in tokens is well past min_uncached_tokens (64).
LONG = " ".join(f"word{i}" for i in range(200))
SHORT = "hello there"


async def metric(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on ``url``/metrics matching ``labels``."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


Fleet = tuple[RunningRouter, list[Running], list[Running]]


async def start_pd(
    start_emulated: StartEmulated,
    start_router: StartRouter,
    *,
    prefill: int = 1,
    decode: int = 2,
    connector: bool = True,
    mode: str = "conditional",
) -> Fleet:
    transfer = NIXL if connector else None
    p = [
        await start_emulated(model="llama", kv_transfer=transfer, num_blocks=256)
        for _ in range(prefill)
    ]
    d = [
        await start_emulated(model="llama", kv_transfer=NIXL, num_blocks=256) for _ in range(decode)
    ]
    router = await start_router(
        [],
        pools=[
            {
                "name": "pre",
                "model": "llama",
                "role": "prefill",
                "tokenizer": "builtin",
                "replicas": [replica_source(r, f"pre-{i}") for i, r in enumerate(p)],
            },
            {
                "name": "dec",
                "model": "llama",
                "role": "decode",
                "tokenizer": "builtin",
                "block_size": 16,
                "replicas": [replica_source(r, f"dec-{i}") for i, r in enumerate(d)],
                "disaggregate": {"mode": mode, "min_uncached_tokens": 64},
            },
        ],
        decision_headers=True,
    )
    # The replicas share this event loop: on a busy box a first probe can outlast its 0.5 s,
    # and a request sent before the next one would find no replica in rotation.
    await wait_until(
        lambda: all(h.state.healthy for h in router.router.replicas.values()),
        timeout_s=15,
        what="every replica of both pools in rotation",
    )
    return router, p, d


async def decisions(router: RunningRouter) -> dict[str, float]:
    return {
        d: await metric(router.url, "kvroute_pd_decisions_total", decision=d)
        for d in ("split", "short", "cached", "no_prefill", "never")
    }


async def test_a_long_prompt_is_prefilled_on_the_prefill_pool_and_decoded_with_its_kv(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    router, prefill, decode = await start_pd(start_emulated, start_router)
    client = client_for(router.url)
    stream = await client.completions.create(
        model="llama", prompt=LONG, max_tokens=8, stream=True, temperature=0
    )
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text
    assert (await decisions(router))["split"] == 1
    assert await metric(router.url, "kvroute_pd_prefill_legs_total", outcome="ok") == 1
    # The prefill replica computed the prompt; a decode replica read it instead of computing.
    computed = await metric(
        prefill[0].url, "vllm:prompt_tokens_by_source_total", source="local_compute"
    )
    assert computed >= 200
    moved = [
        await metric(r.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        for r in decode
    ]
    assert max(moved) >= 192 and min(moved) == 0  # one decode replica, whole blocks
    # The answer a client gets is the same as an aggregated replica's at temperature 0.
    plain = await client_for(decode[0].url).completions.create(
        model="llama", prompt=LONG, max_tokens=8, temperature=0
    )
    assert plain.choices[0].text == text


async def test_short_and_cached_prompts_decode_in_place(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    router, prefill, _ = await start_pd(start_emulated, start_router)
    client = client_for(router.url)
    await client.completions.create(model="llama", prompt=SHORT, max_tokens=4)
    first = await client.completions.with_raw_response.create(
        model="llama", prompt=LONG, max_tokens=4
    )
    # The same prompt again: its decode replica holds it now (the transferred blocks).
    again = await client.completions.with_raw_response.create(
        model="llama", prompt=LONG, max_tokens=4
    )
    assert again.headers["x-kvroute-replica"] == first.headers["x-kvroute-replica"]
    assert await decisions(router) == {
        "split": 1,
        "short": 1,
        "cached": 1,
        "no_prefill": 0,
        "never": 0,
    }
    requests = await metric(prefill[0].url, "vllm:request_success_total")
    assert requests == 1  # the split one's prefill leg only


async def test_chat_non_streamed_answer_and_usage_are_the_decode_replicas(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    router, _, _ = await start_pd(start_emulated, start_router, mode="always")
    client = client_for(router.url)
    answer = await client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": LONG}],
        max_tokens=6,
        # vLLM's: left out of the one-token prefill leg, given to the decode leg.
        extra_body={"min_tokens": 6},
    )
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 6
    assert answer.usage.prompt_tokens > 200
    assert answer.choices[0].finish_reason == "length"
    assert (await decisions(router))["split"] == 1


async def test_a_failing_prefill_pool_costs_no_request(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    router, prefill, decode = await start_pd(start_emulated, start_router, prefill=2)
    for replica in prefill:
        replica.replica.faults.update(FaultSpec(error_rate=1.0))
    client = client_for(router.url)
    answer = await client.completions.create(model="llama", prompt=LONG, max_tokens=4)
    assert answer.choices[0].text
    assert await metric(router.url, "kvroute_pd_prefill_legs_total", outcome="failed") == 1
    # Both prefill replicas were tried (within retry.max_attempts) before the decode replica
    # prefilled it itself.
    for name in ("pre-0", "pre-1"):
        assert await metric(router.url, "kvroute_upstream_errors_total", replica=name) >= 1
    computed = [
        await metric(r.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        for r in decode
    ]
    assert max(computed) >= 200


async def test_a_failing_decode_replica_is_retried_with_the_same_transfer(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    router, _, decode = await start_pd(start_emulated, start_router, mode="always")
    decode[0].replica.faults.update(FaultSpec(error_rate=1.0))
    client = client_for(router.url)
    # Prompts until one is ranked to dec-0 first (placement is a hash of the prompt).
    for i in range(10):
        answer = await client.completions.with_raw_response.create(
            model="llama", prompt=f"{i} {LONG}", max_tokens=4
        )
        assert answer.headers["x-kvroute-replica"] == "dec-1"
        if await metric(router.url, "kvroute_upstream_errors_total", replica="dec-0"):
            break
    else:
        raise AssertionError("no prompt was ranked to dec-0 first")
    # The retry on dec-1 read the prompt's KV from the prefill replica all the same.
    moved = await metric(
        decode[1].url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    assert moved >= 192 * (i + 1)


async def test_replicas_without_a_kv_connector_still_answer(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    router, _, _ = await start_pd(start_emulated, start_router, connector=False)
    answer = await client_for(router.url).completions.create(
        model="llama", prompt=LONG, max_tokens=4
    )
    assert answer.choices[0].text
    assert await metric(router.url, "kvroute_pd_prefill_legs_total", outcome="no_params") == 1


async def test_the_decode_replica_counts_a_split_request_while_it_is_prefilled(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """Else every request arriving during a long prefill would see its decode replica idle."""
    router, prefill, _ = await start_pd(start_emulated, start_router, decode=1, mode="always")
    prefill[0].replica.faults.update(FaultSpec(stall_s=1.0))  # a long prefill
    client = client_for(router.url)
    asking = asyncio.create_task(
        client.completions.create(model="llama", prompt=LONG, max_tokens=4)
    )

    async def in_flight() -> dict[str, int]:
        async with aiohttp.ClientSession() as http:
            async with http.get(router.url + "/admin/replicas") as response:
                rows = (await response.json())["replicas"]
        return {row["name"]: row["in_flight"] for row in rows}

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while (seen := await in_flight()) != {"pre-0": 1, "dec-0": 1}:
        assert not asking.done() and loop.time() < deadline, seen
        await asyncio.sleep(0.02)
    assert (await asking).choices[0].text
    assert await in_flight() == {"pre-0": 0, "dec-0": 0}
