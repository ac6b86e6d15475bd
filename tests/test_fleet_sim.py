"""The fleet simulator: determinism, conservation, failures, the bounds, the closed-form decode
runs, the fast engine against the exact one, and cache-aware routing paying off."""

from __future__ import annotations

import math
import random

import pytest

from kvroute.policies import build_policy
from kvroute.simulator.engine.latency import PRESETS, latency_preset
from kvroute.simulator.fleet import (
    FleetConfig,
    SimResult,
    engine_config,
    infinite_cache_hit_rate,
    pooled_lru_hit_rate,
    prepare,
    simulate,
)
from kvroute.simulator.fleet.steptime import DecodeTimer
from kvroute.simulator.traces.model import Trace, TraceRequest

H100 = latency_preset("llama-3.1-8b-h100")


def tenant_trace(
    *,
    tenants: int = 6,
    per_tenant: int = 30,
    system_blocks: int = 8,
    block_tokens: int = 64,
    rate: float = 4.0,
    seed: int = 1,
) -> Trace:
    """Requests that share one of ``tenants`` long system prompts, then a unique question."""
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    next_id = 10_000
    t = 0.0
    for _ in range(tenants * per_tenant):
        tenant = rng.randrange(tenants)
        question = rng.randint(1, 3)
        ids = tuple(tenant * 100 + b for b in range(system_blocks)) + tuple(
            range(next_id, next_id + question)
        )
        next_id += question
        tokens = (system_blocks + question) * block_tokens - rng.randrange(block_tokens)
        requests.append(TraceRequest(t, tokens, rng.randint(20, 80), ids, f"s{tenant}"))
        t += rng.expovariate(rate)
    return Trace("tenants", block_tokens, tuple(requests))


def run(
    trace: Trace,
    policy: str,
    *,
    replicas: int = 4,
    kv_tokens: int = 200_000,
    engine_model: str = "fast",
    failures: tuple[tuple[int, float], ...] = (),
    seed: int = 0,
    event_lag_s: float = 0.01,
) -> SimResult:
    params = {"seed": seed} if policy in ("kv_aware", "random", "power_of_two") else {}
    config = FleetConfig(
        replicas=replicas,
        engine=engine_config(H100, kv_tokens),
        engine_model=engine_model,
        failures=failures,
        event_lag_s=event_lag_s,
    )
    return simulate(prepare(trace), build_policy(policy, params), config)


def test_same_seed_same_run_different_seed_different_run() -> None:
    trace = tenant_trace()
    a = run(trace, "power_of_two", seed=3)
    b = run(trace, "power_of_two", seed=3)
    c = run(trace, "power_of_two", seed=4)
    assert a.finish_s == b.finish_s and a.replica == b.replica
    assert a.replica != c.replica
    k1 = run(trace, "kv_aware", seed=3)
    k2 = run(trace, "kv_aware", seed=3)
    assert k1.first_token_s == k2.first_token_s and k1.hit_tokens == k2.hit_tokens


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware", "least_loaded"])
def test_every_request_finishes_once_with_its_tokens_in_order(policy: str) -> None:
    trace = tenant_trace()
    res = run(trace, policy)
    assert res.completed == res.requests == len(trace.requests)
    assert sum(res.routed_requests) == res.requests
    for a, f, d in zip(res.arrival_s, res.first_token_s, res.finish_s, strict=True):
        assert a < f <= d
    assert all(0 <= h <= q for h, q in zip(res.hit_tokens, res.queried_tokens, strict=True))


def test_failed_replica_requests_resume_elsewhere_and_all_finish() -> None:
    trace = tenant_trace(rate=20.0)  # busy: the failed replica holds work when it dies
    fail_at = 3.0
    res = run(trace, "kv_aware", failures=((1, fail_at),))
    assert res.completed == res.requests
    assert res.failed_replicas == [1]
    moved = [i for i, n in enumerate(res.reroutes) if n]
    assert moved, "the failed replica held no request: the drill tested nothing"
    assert all(res.replica[i] != 1 for i in moved)
    # Nothing finishes on the failed replica after it failed, nothing is routed there after.
    assert all(not (r == 1 and d > fail_at) for r, d in zip(res.replica, res.finish_s, strict=True))
    # Requests resumed from tokens already generated keep their first-token time.
    for i in moved:
        assert res.first_token_s[i] <= res.finish_s[i]


def test_losing_every_replica_leaves_requests_unfinished_not_lost_silently() -> None:
    trace = tenant_trace(rate=20.0)
    res = run(trace, "round_robin", replicas=2, failures=((0, 2.0), (1, 2.0)))
    after = sum(1 for a in res.arrival_s if a > 2.0)
    assert after > 0
    assert res.completed <= res.requests - after
    assert all(math.isnan(d) for a, d in zip(res.arrival_s, res.finish_s, strict=True) if a > 2.0)


def test_request_larger_than_a_replicas_cache_is_rejected() -> None:
    trace = Trace(
        "big",
        16,
        (
            TraceRequest(0.0, 100, 10, tuple(range(7))),
            TraceRequest(0.1, 5000, 10, tuple(range(100, 413))),
        ),
    )
    res = run(trace, "round_robin", replicas=2, kv_tokens=1024)
    assert res.rejected == [False, True]
    assert res.completed == 1


def test_bounds_on_a_hand_made_trace() -> None:
    # block 4 tokens, KV block 4: A = [1 2 3], B = [1 2 4] shares 2 blocks, C = [1 2 3]
    # repeats A (its last block is recomputed: vLLM always computes the last token).
    t = Trace(
        "hand",
        4,
        (
            TraceRequest(0.0, 12, 1, (1, 2, 3)),
            TraceRequest(1.0, 12, 1, (1, 2, 4)),
            TraceRequest(2.0, 12, 1, (1, 2, 3)),
            TraceRequest(3.0, 6, 1, (9, 8)),  # partial last block: never cached
        ),
    )
    units = prepare(t)
    inf = infinite_cache_hit_rate(units, block_size=4)
    assert inf.token_rate == pytest.approx((0 + 8 + 8 + 0) / 42)
    assert inf.unit_rate == pytest.approx((0 + 2 + 3 + 0) / 11)
    # A pool of 3 blocks: after B, unit 3 of A was evicted (LRU), so C hits only 2 blocks.
    lru = pooled_lru_hit_rate(units, capacity_blocks=3, block_size=4)
    assert lru.token_rate == pytest.approx((0 + 8 + 8 + 0) / 42)
    assert lru.unit_rate == pytest.approx((0 + 2 + 2 + 0) / 11)
    big = pooled_lru_hit_rate(units, capacity_blocks=100, block_size=4)
    assert big.unit_rate == inf.unit_rate


def test_decode_runs_in_closed_form_equal_step_by_step_latency() -> None:
    rng = random.Random(7)
    for latency in PRESETS.values():
        timer = DecodeTimer(latency)
        for _ in range(50):
            m = rng.randint(1, 200)
            c0 = m * rng.randint(1, 30_000)
            k = rng.randint(1, 500)
            step_by_step = sum(latency.step_time(m, c0 + m * i, c0 + m * i) for i in range(k))
            assert timer.run_time(m, c0, k) == pytest.approx(step_by_step, rel=1e-9)
            elapsed = step_by_step * rng.random()
            done = timer.steps_within(m, c0, elapsed, k)
            assert timer.run_time(m, c0, done) <= elapsed < timer.run_time(m, c0, done + 1)


def random_trace(n: int, block_tokens: int, seed: int) -> Trace:
    rng = random.Random(seed)
    requests = []
    t = 0.0
    for i in range(n):
        tokens = rng.randint(20, 1500)
        blocks = -(-tokens // block_tokens)
        shared = rng.choice([0, 0, 2, 5])  # a few common prefixes
        ids = tuple(range(shared)) + tuple(
            range(1000 * (i + 1), 1000 * (i + 1) + blocks - min(shared, blocks))
        )
        requests.append(TraceRequest(t, tokens, rng.randint(1, 120), ids[:blocks]))
        t += rng.expovariate(6.0)
    return Trace("random", block_tokens, tuple(requests))


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_fast_engine_times_equal_the_exact_engine_when_blocks_match(policy: str) -> None:
    """With trace blocks as large as KV blocks and no eviction, the fast engine's prefix cache
    is the exact one, so every first token and finish must land at the same instant: this pins
    the decode runs, their splitting by arrivals, and the scheduler port."""
    trace = random_trace(150, 16, seed=5)
    fast = run(trace, policy, replicas=3, kv_tokens=400_000)
    exact = run(trace, policy, replicas=3, kv_tokens=400_000, engine_model="exact")
    assert fast.replica == exact.replica
    assert fast.hit_tokens == exact.hit_tokens
    assert fast.first_token_s == pytest.approx(exact.first_token_s, rel=1e-9)
    assert fast.finish_s == pytest.approx(exact.finish_s, rel=1e-9)


def test_fast_engine_close_to_exact_under_eviction_and_preemption() -> None:
    """Trace blocks of 4 KV blocks, a cache of ~4 prompts per replica: the fast engine evicts
    whole units and drops preempted requests' output blocks, so it only approximates."""
    trace = tenant_trace(tenants=10, per_tenant=25, rate=30.0, block_tokens=64)
    fast = run(trace, "kv_aware", replicas=3, kv_tokens=3000)
    exact = run(trace, "kv_aware", replicas=3, kv_tokens=3000, engine_model="exact")
    assert fast.completed == exact.completed == fast.requests
    assert fast.preemptions > 0 and exact.preemptions > 0
    assert abs(fast.hit_rate() - exact.hit_rate()) < 0.05
    ttft_fast = sorted(fast.ttfts())
    ttft_exact = sorted(exact.ttfts())
    median = len(ttft_fast) // 2
    assert ttft_fast[median] == pytest.approx(ttft_exact[median], rel=0.2)


def test_kv_aware_beats_round_robin_on_shared_prefixes() -> None:
    trace = tenant_trace(tenants=8, per_tenant=40, rate=6.0)
    # A replica holds ~3 of the 8 tenants' 512-token prompts (plus running requests): kept
    # apart they stay cached, spread over every replica they evict each other.
    kv = run(trace, "kv_aware", kv_tokens=2048)
    rr = run(trace, "round_robin", kv_tokens=2048)
    assert kv.hit_rate() > rr.hit_rate() + 0.15
    assert kv.reasons["kv_affinity"] > 0


def test_kv_events_reach_the_index_and_steer_routing() -> None:
    trace = tenant_trace(tenants=2, per_tenant=20, rate=1.0)
    # No prediction, slow scrapes: only the KV events can tell the router where prefixes are.
    res = run(trace, "kv_aware", event_lag_s=0.05)
    late = [
        h / q for h, q, a in zip(res.hit_tokens, res.queried_tokens, res.arrival_s, strict=True)
    ]
    assert sum(late[10:]) / len(late[10:]) > 0.5
