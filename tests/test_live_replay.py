"""``kvroute replay --live``: a trace replayed through a router in front of emulated replicas,
with prompts whose tokens keep the trace's prefix structure."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvroute.backends.process import free_ports
from kvroute.kvcore.tokenizer import SimpleTokenizer
from kvroute.simulator.traces import Trace, TraceRequest, load_trace
from kvroute.simulator.traces.live import LiveReplayError, replay_live, replay_live_async
from kvroute.simulator.traces.prompts import PromptBuilder

from .conftest import Running, StartEmulated, StartRouter
from .helpers import replica_source


def engine_prefix_tokens(replicas: list[Running]) -> tuple[int, int]:
    stats = [r.replica.engine.stats for r in replicas]
    return sum(s.prefix_cache_queries for s in stats), sum(s.prefix_cache_hits for s in stats)


def shareable_tokens(trace: Trace) -> int:
    """Tokens of whole blocks an unlimited cache would serve, replaying the trace in order."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for request in trace.requests:
        whole = request.input_tokens // trace.block_tokens
        ids = request.block_ids[:whole]
        total += trace.block_tokens * sum(ids[: k + 1] in seen for k in range(len(ids)))
        seen.update(ids[: k + 1] for k in range(len(ids)))
    return total


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_equal_block_prefixes_become_equal_token_prefixes() -> None:
    tokenizer = SimpleTokenizer()
    builder = PromptBuilder(block_tokens=512, tokens_per_block=16)
    one = TraceRequest(0.0, 512 * 3 + 100, 1, (7, 8, 9, 10))
    two = TraceRequest(0.0, 512 * 4, 1, (7, 8, 11, 12))
    a, b = (tokenizer.encode(builder.prompt(r)) for r in (one, two))
    assert len(a) == builder.words(one) == round((512 * 3 + 100) * 16 / 512)
    assert len(b) == 64
    assert common_prefix(a, b) == 32  # two shared blocks of 16 tokens, and not one token more
    # Block texts do not merge at their boundaries: a block's tokens are the same in any prompt.
    alone = tokenizer.encode(builder.prompt(TraceRequest(0.0, 512, 1, (8,))))
    assert a[16:32] == alone


def test_caps_and_requests_without_prefix_data() -> None:
    tokenizer = SimpleTokenizer()
    capped = PromptBuilder(block_tokens=16, tokens_per_block=16, max_prompt_tokens=20)
    request = TraceRequest(0.0, 64, 1, (1, 2, 3, 4))
    assert len(tokenizer.encode(capped.prompt(request))) == 20
    plain = PromptBuilder(block_tokens=16, tokens_per_block=16)
    full = tokenizer.encode(plain.prompt(request))
    assert full[:20] == tokenizer.encode(capped.prompt(request))  # a cap keeps the prefix
    bare = TraceRequest(0.0, 40, 1, ())
    first, second = (tokenizer.encode(plain.prompt(bare, salt=s)) for s in (1, 2))
    assert len(first) == len(second) == 40
    assert common_prefix(first, second) < 2
    assert common_prefix(first, full) < 2


async def test_replay_through_the_router_gets_the_trace_prefix_hits(
    start_emulated: StartEmulated, start_router: StartRouter, tmp_path: Path
) -> None:
    replicas = [await start_emulated(num_blocks=512) for _ in range(2)]
    router = await start_router(
        [replica_source(r, f"emu-{i}") for i, r in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    spec = "multi-tenant:tenants=3,rate=15,duration=2,system_tokens=320,prompt_tokens=24,output_tokens=4,block_tokens=16"
    trace = load_trace(spec, seed=5)
    assert len(trace.requests) >= 15
    queries_before, hits_before = engine_prefix_tokens(replicas)
    seen: list[tuple[int, int]] = []
    summary = await replay_live_async(
        trace,
        router.url,
        model=None,
        api_key=None,
        time_scale=1.0,
        out_dir=str(tmp_path),
        progress=lambda done, total: seen.append((done, total)),
        echo=None,
    )
    queries_after, hits_after = engine_prefix_tokens(replicas)
    assert (summary["sent"], summary["ok"], summary["failed"]) == (len(trace.requests),) * 2 + (0,)
    assert summary["model"] == "tiny"
    assert seen[-1] == (len(trace.requests), len(trace.requests))
    assert summary["ttft_p50_s"] > 0 and summary["ttft_p99_s"] >= summary["ttft_p50_s"]
    assert summary["output_tokens_received"] == sum(r.output_tokens for r in trace.requests)
    # The hit rate is the replicas' own, measured over exactly this replay.
    assert summary["prefix_hit_rate_source"] == "replicas"
    assert summary["prefix_queried_tokens"] == queries_after - queries_before
    assert summary["prefix_hit_tokens"] == hits_after - hits_before
    # Tenants' system prompts are shared: the prompts reproduce the trace's shared blocks token
    # for token (16-token blocks, as the replicas'), and kv_aware sends tenants where they hit.
    bound = shareable_tokens(trace)
    assert bound > 0
    assert 0.7 * bound <= summary["prefix_hit_tokens"] <= bound
    assert summary["prefix_hit_rate"] > 0.5
    written = json.loads((tmp_path / "live_summary.json").read_text())
    assert written["ok"] == summary["ok"]


async def test_sync_entry_point_replays_in_time_scaled_real_time(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replica = await start_emulated()
    router = await start_router([replica_source(replica, "emu")], routing={"tokenizer": "builtin"})
    requests = tuple(TraceRequest(t, 48, 2, (1, 2, 3 + int(t))) for t in (0.0, 1.0, 2.0))
    trace = Trace("three", 16, requests)
    lines: list[str] = []
    summary = await asyncio.to_thread(
        replay_live,
        trace,
        router.url,
        model="tiny",
        api_key=None,
        time_scale=0.25,
        out_dir=None,
        echo=lines.append,
    )
    assert summary["ok"] == 3
    # Arrivals 0, 1, 2 s at a quarter of the time: the last is sent at 0.5 s.
    assert 0.5 <= summary["wall_s"] < 3.0
    assert "3 sent, 3 ok, 0 failed" in lines[0]
    assert summary["prefix_hit_tokens"] == 64  # two followers reuse the 32-token shared prefix


async def test_unreachable_router_is_one_clear_line() -> None:
    (port,) = free_ports(1)
    trace = load_trace("chat:duration=5")
    with pytest.raises(
        LiveReplayError, match=f"cannot reach the router at http://127.0.0.1:{port}"
    ) as caught:
        await replay_live_async(trace, f"http://127.0.0.1:{port}", echo=None)
    assert "\n" not in str(caught.value)


async def test_bad_replay_settings_are_clear_errors() -> None:
    trace = load_trace("chat:duration=5")
    with pytest.raises(LiveReplayError, match="time_scale must be a positive number"):
        await replay_live_async(trace, "http://127.0.0.1:1", time_scale=0, echo=None)
    with pytest.raises(LiveReplayError, match="max_prompt_tokens must be at least 1"):
        await replay_live_async(trace, "http://127.0.0.1:1", max_prompt_tokens=0, echo=None)
