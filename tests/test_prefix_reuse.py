"""Prefix reuse decomposed per request (kvcore/reuse.py): available, captured, confirmed, and
the tokens lost to the workload, to routing and to the index; pure, then end to end through a
router over emulated replicas with the openai client."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import openai
from prometheus_client import generate_latest

from kvroute.kvcore.reuse import Reuse, available_tokens, decompose, reusable
from kvroute.kvcore.stats import parse_metrics
from kvroute.policies import RouteRequest
from kvroute.router.metrics import RouterMetrics
from kvroute.router.usage import StreamTail, cached_tokens_of
from kvroute.simulator.replica.faults import FaultSpec

from .conftest import StartEmulated, StartRouter
from .helpers import replica_source, wait_until


def request(prompt: int, prefix: dict[str, int] | None, blocks: int | None = None) -> RouteRequest:
    hashes = list(range(prompt // 16 if blocks is None else blocks))
    return RouteRequest(prompt, 8, block_hashes=hashes, prefix_tokens=prefix)


# -- pure ------------------------------------------------------------------------------------


def test_a_cold_prompt_is_all_workload_loss() -> None:
    reuse = decompose(request(100, {}), ("a", "b"), 0, 0, 16)
    assert reuse == Reuse(100, 0, 0, 0)
    assert (reuse.lost_workload, reuse.lost_routing, reuse.lost_index) == (100, 0, 0)


def test_load_winning_over_the_holder_is_routing_loss() -> None:
    req = request(100, {"a": 64, "b": 16})
    assert available_tokens(req, ("a", "b")) == 64
    reuse = decompose(req, ("b", "a"), 16, 16, 16)  # sent to b, which held one block
    assert reuse is not None
    assert (reuse.available, reuse.captured, reuse.confirmed) == (64, 16, 16)
    assert (reuse.lost_workload, reuse.lost_routing, reuse.lost_index) == (36, 48, 0)


def test_a_holder_that_may_not_take_it_is_not_available() -> None:
    # "a" holds the prefix but is not eligible (unhealthy, another model): nothing was lost
    # to routing, it was never on offer.
    reuse = decompose(request(100, {"a": 64}), ("b",), 0, 0, 16)
    assert reuse is not None and reuse.available == 0 and reuse.lost_workload == 100


def test_the_index_expecting_more_than_the_engine_reused_is_index_loss() -> None:
    reuse = decompose(request(100, {"a": 64}), ("a",), 64, 32, 16)
    assert reuse is not None and (reuse.lost_routing, reuse.lost_index) == (0, 32)
    # The engine found more than the index knew of: reuse nobody lost, not a negative loss.
    surprise = decompose(request(100, {"a": 32}), ("a",), 32, 64, 16)
    assert surprise is not None and surprise.lost_index == 0 and surprise.confirmed == 64
    # Not reported: index loss unknown, not 0.
    unknown = decompose(request(100, {"a": 64}), ("a",), 64, None, 16)
    assert unknown is not None and unknown.lost_index is None


def test_the_engine_recomputes_the_last_token_so_a_whole_prompt_is_never_expected() -> None:
    # 64 tokens, 4 full blocks all cached: vLLM reuses 3 (it must compute the last token).
    reuse = decompose(request(64, {"a": 64}), ("a",), 64, 48, 16)
    assert reuse == Reuse(64, 48, 48, 48)
    assert (reuse.lost_workload, reuse.lost_routing, reuse.lost_index) == (16, 0, 0)
    assert reusable(64, 65, 16) == 64 and reusable(64, 64, 16) == 48 and reusable(5, 3, 0) == 2


def test_a_prompt_the_router_did_not_hash_is_not_decomposed() -> None:
    # No tokenizer (or a policy that reads no prefixes): available is unknown, not 0.
    assert decompose(request(100, None, blocks=0), ("a",), 0, 40, 16) is None
    # Shorter than a block: nothing to reuse anywhere, all workload.
    short = decompose(request(10, None, blocks=0), ("a",), 0, 0, 16)
    assert short == Reuse(10, 0, 0, 0)


def test_cached_tokens_are_read_from_a_body_and_from_a_streams_last_usage_event() -> None:
    body = b'{"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}'
    assert cached_tokens_of(body, sse=False) == 32
    assert cached_tokens_of(b'{"usage": {"prompt_tokens": 40}}', sse=False) is None
    assert cached_tokens_of(b'{"usage": {"prompt_tokens_details": null}}', sse=False) is None
    tail = StreamTail()
    for i in range(2000):  # a long stream: only its tail is kept
        tail.add(b'data: {"choices": [{"text": "%d"}], "usage": null}\n\n' % i)
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": '
    event += b'{"cached_tokens": 16}}}\n\ndata: [DONE]\n\n'
    for i in range(0, len(event), 7):  # cut anywhere across chunks
        tail.add(event[i : i + 7])
    assert tail.cached_tokens() == 16
    # Only the usage object is kept, not the stream's last KiB (issue 39: memory per stream).
    assert len(tail._last or b"") + len(tail._open) + len(tail._carry) < 200


def test_metrics_count_each_kind_and_cause_and_merge_workers() -> None:
    metrics = RouterMetrics(list)
    metrics.observe_reuse("a", Reuse(100, 64, 64, 48))
    metrics.observe_reuse("a", Reuse(100, 64, 0, None))
    metrics.observe_reuse("a", None)
    peer = RouterMetrics(list)
    peer.observe_reuse("b", Reuse(50, 0, 0, 0))
    metrics._peers = lambda: [peer.snapshot()]
    page = parse_metrics(generate_latest(metrics.registry))
    got = {
        (s.name, s.labels["replica"], s.labels.get("kind") or s.labels.get("cause")): s.value
        for s in page.samples
        if s.name.startswith("kvroute_prefix_reuse")
    }
    assert got == {
        ("kvroute_prefix_reuse_tokens_total", "a", "available"): 128,
        ("kvroute_prefix_reuse_tokens_total", "a", "captured"): 64,
        ("kvroute_prefix_reuse_tokens_total", "a", "confirmed"): 48,
        ("kvroute_prefix_reuse_lost_tokens_total", "a", "workload"): 72,
        ("kvroute_prefix_reuse_lost_tokens_total", "a", "routing"): 64,
        ("kvroute_prefix_reuse_lost_tokens_total", "a", "index"): 16,
        ("kvroute_prefix_reuse_unconfirmed_requests_total", "a", None): 1,
        ("kvroute_prefix_reuse_tokens_total", "b", "available"): 0,
        ("kvroute_prefix_reuse_tokens_total", "b", "captured"): 0,
        ("kvroute_prefix_reuse_tokens_total", "b", "confirmed"): 0,
        ("kvroute_prefix_reuse_lost_tokens_total", "b", "workload"): 50,
        ("kvroute_prefix_reuse_lost_tokens_total", "b", "routing"): 0,
        ("kvroute_prefix_reuse_lost_tokens_total", "b", "index"): 0,
    }


# -- end to end --------------------------------------------------------------------------------

Samples = dict[tuple[str, str, str], float]


async def reuse_samples(url: str) -> Samples:
    """The router's reuse counters, by (family, kind or cause, replica)."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: Samples = {}
    for s in parse_metrics(text).samples:
        if s.name.startswith("kvroute_prefix_reuse_"):
            label = s.labels.get("kind") or s.labels.get("cause") or ""
            family = s.name.removeprefix("kvroute_prefix_reuse_").removesuffix("_total")
            out[(family, label, s.labels["replica"])] = s.value
    return out


def delta(after: Samples, before: Samples, family: str, label: str = "") -> float:
    """Fleet-wide change of one counter (summed over replicas)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == family and k[1] == label)


async def changed(url: str, before: Samples, family: str, label: str = "") -> Samples:
    """The counters once ``family{label}`` moved (the router counts after the last byte, which
    may come just after the client has its answer)."""
    out: Samples = {}

    async def moved() -> bool:
        nonlocal out
        out = await reuse_samples(url)
        return delta(out, before, family, label) > 0

    async with asyncio.timeout(5):
        while not await moved():
            await asyncio.sleep(0.02)
    return out


async def test_a_repeated_prompt_captures_what_was_available_and_the_engine_confirms_it(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replicas = [await start_emulated(num_blocks=256) for _ in range(2)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    prompt = "A handbook every request of this tenant quotes before its question. " * 8

    before = await reuse_samples(r.url)
    first = await client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=2
    )
    usage = first.parse().usage
    assert usage is not None and usage.prompt_tokens > 64
    assert first.headers["x-kvroute-prefix-available-tokens"] == "0"
    after = await changed(r.url, before, "lost_tokens", "workload")
    # Nobody had any of it: the whole prompt is workload loss, nothing else.
    assert delta(after, before, "lost_tokens", "workload") == usage.prompt_tokens
    assert delta(after, before, "tokens", "available") == 0
    assert delta(after, before, "tokens", "confirmed") == 0

    before = after
    second = await client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=2
    )
    usage = second.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > 0
    assert second.headers["x-kvroute-replica"] == first.headers["x-kvroute-replica"]
    hit = int(second.headers["x-kvroute-prefix-hit-tokens"])
    assert int(second.headers["x-kvroute-prefix-available-tokens"]) == hit > 0
    after = await changed(r.url, before, "tokens", "confirmed")
    available = delta(after, before, "tokens", "available")
    assert available == delta(after, before, "tokens", "captured") == cached > 0
    assert delta(after, before, "tokens", "confirmed") == cached
    assert delta(after, before, "lost_tokens", "routing") == 0
    assert delta(after, before, "lost_tokens", "index") == 0
    assert delta(after, before, "lost_tokens", "workload") == usage.prompt_tokens - cached

    # Streamed: confirmed by the last usage event. The router asks the replica for usage on
    # every stream (tenants are charged the replica's counts), and hides that event from a
    # client that did not ask for it: such a stream is confirmed too.
    for ask in (True, False):
        before = after
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2,
            stream=True,
            **({"stream_options": {"include_usage": True}} if ask else {}),
        )
        usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert len(usages) == (1 if ask else 0)
        after = await changed(r.url, before, "tokens", "confirmed")
        assert delta(after, before, "tokens", "confirmed") == cached
        assert delta(after, before, "unconfirmed_requests") == 0


async def test_load_sending_a_request_away_from_its_holder_is_routing_loss(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replicas = [await start_emulated(num_blocks=512) for _ in range(2)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    prompt = "A short shared preamble that one replica caches first. " * 4
    first = await client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=1
    )
    holder = first.headers["x-kvroute-replica"]
    held = replicas[int(holder.removeprefix("emu-"))]
    # Load on the holder, by the front door: it stalls, and a long request that starts with the
    # same preamble follows its prefix there and waits, its long uncached tail queued prefill.
    held.replica.faults.update(FaultSpec(stall_s=30))
    long_request = asyncio.create_task(
        client.completions.create(
            model="tiny", prompt=prompt + "A long new document to read. " * 300, max_tokens=1
        )
    )
    state = r.router.replicas[holder].state
    try:
        await wait_until(lambda: state.prefilling == 1, what="the long request on the holder")
        before = await reuse_samples(r.url)
        moved = await client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=1
        )
        assert moved.headers["x-kvroute-replica"] != holder
        assert moved.headers["x-kvroute-reason"] == "kv_load"
        available = int(moved.headers["x-kvroute-prefix-available-tokens"])
        assert available > 0 and moved.headers["x-kvroute-prefix-hit-tokens"] == "0"
        after = await changed(r.url, before, "lost_tokens", "routing")
        usage = moved.parse().usage
        assert usage is not None
        routing = delta(after, before, "lost_tokens", "routing")
        assert routing == delta(after, before, "tokens", "available") > 0
        assert routing <= available  # at most the full blocks before the last token
        assert delta(after, before, "tokens", "captured") == 0
        assert delta(after, before, "lost_tokens", "workload") == usage.prompt_tokens - routing
    finally:
        long_request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long_request
