"""The loss against the pooled-LRU bound, by cause (simulator/fleet/loss.py): each category on
a hand-made case, the exact sum on a real trace excerpt, and what `kvroute replay` shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.policies import build_policy
from kvroute.simulator.engine.config import EngineConfig
from kvroute.simulator.engine.latency import latency_preset
from kvroute.simulator.fleet import (
    FleetConfig,
    SimResult,
    UnitTrace,
    engine_config,
    pooled_lru_hit_rate,
    prepare,
    simulate,
)
from kvroute.simulator.fleet.kv_units import Holdings, UnitPool
from kvroute.simulator.fleet.loss import CATEGORIES, LossTracker
from kvroute.simulator.traces import load_trace
from kvroute.simulator.traces.model import Trace, TraceRequest

from .helpers import MOONCAKE

H100 = latency_preset("llama-3.1-8b-h100")


def _evict(pool: UnitPool, key: int) -> None:
    """Cache ``key`` (4 blocks) in ``pool``, free it, then fill the pool so it is evicted."""
    unit = pool.register(key, 4, True)
    assert unit is not None
    pool.release([unit], 0, 0)
    n = pool.free_blocks
    pool.allocate(n)  # evicts it
    pool.release([], 0, n)  # and gives the blocks back, empty


def _six_unit_request() -> tuple[Trace, int]:
    # 7 units of 64 tokens (block size 16: 4 KV blocks each); the bound reuses the first 6.
    trace = Trace("hand", 64, (TraceRequest(0.0, 7 * 64, 1, (1, 2, 3, 4, 5, 6, 7)),))
    return trace, 64


def test_each_unit_the_bound_reused_lands_in_the_first_category_that_fits() -> None:
    trace, unit = _six_unit_request()
    request = prepare(trace).requests[0]
    k = request.unit_keys
    holdings = Holdings()
    chosen, other = UnitPool(64, holdings), UnitPool(64, holdings)
    chosen.register(k[0], 4, True)  # held by the chosen replica when routed
    # k[1]: the index predicted it on the chosen replica (predicted=2 below); nobody holds it
    other.register(k[2], 4, True)  # held on another replica only
    _evict(chosen, k[3])  # the chosen replica had it, evicted it
    _evict(other, k[4])  # another replica had it, evicted it
    # k[5]: nobody has computed it yet
    tracker = LossTracker((request,), [6], 64, 16, holdings)
    tracker.routed(request, chosen, predicted=2, reason="kv_load")

    missed_all = tracker.breakdown([0])
    assert missed_all.bound_tokens == 6 * unit
    assert missed_all.tokens == {
        "evicted_while_queued": unit,
        "wrong_prediction": unit,
        "spread_load": unit,
        "spread_other": 0,
        "evicted_on_chosen": unit,
        "evicted_elsewhere": unit,
        "not_yet_cached": unit,
        "not_served": 0,
    }
    # It hit its first unit and half the second: only the rest is lost.
    partly = tracker.breakdown([unit + 32])
    assert partly.tokens["evicted_while_queued"] == 0
    assert partly.tokens["wrong_prediction"] == 32
    assert sum(partly.tokens.values()) == 6 * unit - (unit + 32)
    # More than the bound: the excess is above_bound, nothing is lost.
    above = tracker.breakdown([7 * unit - 16])
    assert sum(above.tokens.values()) == 0
    assert above.above_bound_tokens == unit - 16


def test_a_spread_for_another_reason_and_a_request_never_routed() -> None:
    trace, unit = _six_unit_request()
    request = prepare(trace).requests[0]
    holdings = Holdings()
    chosen, other = UnitPool(64, holdings), UnitPool(64, holdings)
    for key in request.unit_keys[:6]:
        other.register(key, 4, True)
    tracker = LossTracker((request,), [6], 64, 16, holdings)
    assert tracker.breakdown([0]).tokens["not_served"] == 6 * unit
    tracker.routed(request, chosen, predicted=0, reason="round_robin")
    assert tracker.breakdown([0]).tokens["spread_other"] == 6 * unit
    other.forget()  # that replica failed: what it held is held nowhere now
    tracker.routed(request, chosen, predicted=0, reason="round_robin")
    assert tracker.breakdown([0]).tokens["evicted_elsewhere"] == 6 * unit


def _mooncake(
    policy: str, replicas: int, kv_tokens: int
) -> tuple[UnitTrace, EngineConfig, SimResult]:
    units = prepare(load_trace(str(MOONCAKE), None))
    engine = engine_config(H100, kv_tokens)
    config = FleetConfig(replicas=replicas, engine=engine)
    params = {"seed": 0} if policy == "kv_aware" else {}
    return units, engine, simulate(units, build_policy(policy, params), config)


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_on_a_mooncake_excerpt_the_causes_add_up_to_the_gap_exactly(policy: str) -> None:
    units, engine, res = _mooncake(policy, 4, 400_000)
    loss = res.loss
    assert loss is not None
    prompt = sum(r.input_tokens for r in units.requests)
    pooled = pooled_lru_hit_rate(units, engine.num_blocks * 4, engine.block_size).token_rate
    assert loss.bound_tokens == pytest.approx(pooled * prompt)
    assert loss.hit_tokens == sum(res.hit_tokens)
    assert loss.hit_tokens == loss.bound_tokens - sum(loss.tokens.values()) + (
        loss.above_bound_tokens
    )
    assert set(loss.tokens) == set(CATEGORIES)
    assert sum(loss.tokens.values()) > 0  # 4 caches lose something to one pooled cache
    if policy == "round_robin":
        # Blind placement: prefixes live elsewhere, never for load, never predicted.
        assert loss.tokens["spread_other"] > 0
        assert loss.tokens["spread_load"] == loss.tokens["wrong_prediction"] == 0


def test_kv_aware_spreads_less_of_the_bound_than_round_robin() -> None:
    kv = _mooncake("kv_aware", 4, 400_000)[2].loss
    rr = _mooncake("round_robin", 4, 400_000)[2].loss
    assert kv is not None and rr is not None
    spread = ("spread_load", "spread_other")
    assert sum(kv.shares()[c] for c in spread) < sum(rr.shares()[c] for c in spread) / 2


def test_the_exact_engine_has_no_decomposition() -> None:
    trace = Trace("two", 64, tuple(TraceRequest(t, 256, 4, (1, 2, 3, 4)) for t in (0.0, 1.0)))
    config = FleetConfig(replicas=2, engine=engine_config(H100, 100_000), engine_model="exact")
    res = simulate(prepare(trace), build_policy("round_robin"), config)
    assert res.completed == 2 and res.loss is None


def test_replay_reports_the_loss_in_summary_report_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["replay", "--trace", str(MOONCAKE), "--max-requests", "200", "--replicas", "4"]
    args += ["--kv-capacity-tokens", "400000", "--compare", "kv_aware,round_robin"]
    assert main([*args, "--no-plots", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "loss against pooled LRU (kv_aware): hit/bound" in printed
    assert "loss against pooled LRU (round_robin): hit/bound" in printed
    summary = json.loads((out / "summary.json").read_text())
    for run in summary["runs"]:
        loss = run["loss"]
        assert set(loss["shares_of_bound"]) == set(CATEGORIES)
        # hit/bound = 1 - the shares + the excess, and matches the two hit rates' ratio.
        rebuilt = 1 - sum(loss["shares_of_bound"].values()) + loss["above_bound_share"]
        assert loss["hit_over_bound"] == pytest.approx(rebuilt, abs=1e-5)
        ratio = run["prefix_hit_rate"] / run["pooled_lru_hit_rate"]
        assert loss["hit_over_bound"] == pytest.approx(ratio, rel=1e-4)
    report = (out / "report.md").read_text()
    assert "## Where the hit rate goes" in report
    assert "| kv_aware |" in report.split("## Where the hit rate goes")[1]
