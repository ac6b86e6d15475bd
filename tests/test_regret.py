"""Regret against round robin (policies/regret.py): the pure estimate, the router's counters and
/status line over emulated replicas with the openai client, and the simulator's estimate
against its counterfactual replay on a Mooncake excerpt."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client import generate_latest

from kvroute.cli import main
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.stats import parse_metrics
from kvroute.policies import FleetView, ReplicaState, RouteRequest
from kvroute.policies.kv_aware import KvAware
from kvroute.policies.regret import RegretEstimator, TtftEstimate, estimator_for
from kvroute.policies.round_robin import RoundRobin
from kvroute.router.metrics import RouterMetrics
from kvroute.router.status import regret_summary

from .conftest import StartEmulated, StartRouter
from .helpers import MOONCAKE, replica_source


def fleet(n: int = 3) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}") for i in range(n)]


def kv_estimator() -> RegretEstimator:
    estimator = estimator_for(KvAware())
    assert estimator is not None
    return estimator


# -- the pure estimate ---------------------------------------------------------------------


def test_a_replica_holding_the_prefix_is_estimated_faster_than_a_cold_one() -> None:
    replicas = fleet(2)
    request = RouteRequest(2048, 8, block_hashes=[1, 2, 3], prefix_tokens={"r0": 1536})
    estimator = kv_estimator()
    est = estimator.estimate(request, replicas, replicas[0])  # round robin's first is r0 too
    assert est.round_robin_replica == "r0" and est.round_robin == est.chosen
    est = estimator.estimate(request, replicas, replicas[0])  # round robin's next: cold r1
    assert est.round_robin_replica == "r1"
    assert est.chosen < est.round_robin
    assert est.regret_round_robin < 0
    # In seconds, from kv_aware's prior: 512 vs 2048 uncached tokens at 3.2e-5 s each.
    assert est.round_robin - est.chosen == pytest.approx(1536 * 3.2e-5)


def test_queued_prefill_counts_against_a_replica() -> None:
    replicas = fleet(2)
    replicas[1].prefill_tokens = 10_000
    request = RouteRequest(512, 8)
    estimator = kv_estimator()
    estimator.estimate(request, replicas, replicas[0])
    est = estimator.estimate(request, replicas, replicas[1])  # chose the busy one: regret > 0
    assert est.round_robin_replica == "r1"
    first = estimator.estimate(request, replicas, replicas[1])
    assert first.round_robin_replica == "r0" and first.regret_round_robin > 0
    assert est.regret_round_robin == 0


def test_the_rotation_steps_once_per_decision_and_skips_replicas_out_of_rotation() -> None:
    replicas = fleet(3)
    estimator = kv_estimator()
    request = RouteRequest(100, 8)
    picks = [
        estimator.estimate(request, replicas, replicas[0]).round_robin_replica for _ in range(4)
    ]
    assert picks == ["r0", "r1", "r2", "r0"]
    replicas[2].healthy = False
    replicas[0].models = frozenset({"other"})
    picks = [
        estimator.estimate(RouteRequest(100, 8, "tiny"), replicas, replicas[1]).round_robin_replica
        for _ in range(3)
    ]
    assert picks == ["r1", "r1", "r1"]  # the only replica that may take "tiny"


def test_power_of_two_draws_are_deterministic_and_take_the_less_loaded() -> None:
    replicas = fleet(5)
    for i, r in enumerate(replicas):
        r.in_flight_tokens = 100 * i  # r4 the most loaded: it loses every pair it is in
    requests = [RouteRequest(64 + i, 8, block_hashes=[i * 7919]) for i in range(200)]

    def draws() -> list[str]:
        estimator = kv_estimator()
        return [estimator.estimate(q, replicas, replicas[0]).power_of_two_replica for q in requests]

    first = draws()
    assert first == draws()  # the same decisions draw the same pairs
    assert "r4" not in first
    assert {"r0", "r1", "r2", "r3"} <= set(first)  # pairs spread over the fleet
    # Without block hashes the draws still vary (a decision counter is mixed in).
    estimator = kv_estimator()
    bare = {
        estimator.estimate(RouteRequest(64, 8), replicas, replicas[0]).power_of_two_replica
        for _ in range(50)
    }
    assert len(bare) > 1


def test_admits_agrees_with_eligible() -> None:
    replicas = [
        ReplicaState("a"),
        ReplicaState("b", healthy=False),
        ReplicaState("c", ejected=True),
        ReplicaState("d", quarantined=True),
        ReplicaState("e", models=frozenset({"tiny"})),
        ReplicaState("f", models=frozenset({"other"})),
    ]
    view = FleetView(replicas)
    for model in (None, "tiny", "other"):
        assert [r for r in replicas if FleetView.admits(r, model)] == view.eligible(model)


def test_only_kv_aware_estimates_and_the_ledger_attaches_it_to_the_route() -> None:
    assert estimator_for(RoundRobin()) is None
    request = RouteRequest(100, 8, block_hashes=[5, 6])
    for policy, expected in ((KvAware(seed=1), True), (RoundRobin(), False)):
        ledger = DispatchLedger(policy, FleetView(fleet(3)), PrefixIndex(), prediction_ttl_s=1.0)
        route = ledger.route(request, 0.0, 16)
        assert (route.estimate is not None) is expected


# -- the router's counters and /status line -----------------------------------------------


def test_metrics_sum_the_estimates_and_merge_workers() -> None:
    metrics = RouterMetrics(list)
    metrics.observe_estimate(TtftEstimate(0.1, 0.3, 0.2, "r1", "r2"))
    peer = RouterMetrics(list)
    peer.observe_estimate(TtftEstimate(0.5, 0.4, 0.5, "r0", "r0"))
    metrics._peers = lambda: [peer.snapshot()]
    page = parse_metrics(generate_latest(metrics.registry))
    got = {
        (s.name, s.labels.get("choice") or s.labels.get("baseline") or ""): s.value
        for s in page.samples
        if s.name.startswith("kvroute_routing_estimated")
    }
    assert got == pytest.approx(
        {
            ("kvroute_routing_estimated_ttft_seconds_total", "chosen"): 0.6,
            ("kvroute_routing_estimated_ttft_seconds_total", "round_robin"): 0.7,
            ("kvroute_routing_estimated_ttft_seconds_total", "power_of_two"): 0.7,
            ("kvroute_routing_estimated_decisions_total", ""): 2,
            ("kvroute_routing_estimated_worse_decisions_total", "round_robin"): 1,
            ("kvroute_routing_estimated_worse_decisions_total", "power_of_two"): 0,
        }
    )


def test_the_status_line_says_better_or_worse_and_over_what() -> None:
    grown = {"est:n": 4.0, "est:chosen": 2.0, "est:round_robin": 4.0, "est:power_of_two": 3.0}
    line = regret_summary(grown, 600.0, True)
    assert line is not None
    assert line["line"] == (
        "kv_aware vs round robin over the last hour: estimated TTFT 0.500 s vs 1.000 s (50% better)"
    )
    worse = regret_summary({**grown, "est:chosen": 5.0}, 3600.0, False)
    assert worse is not None and worse["line"].endswith("(25% worse)")
    late = regret_summary(grown, 3 * 3600.0, True)  # first looked at 3 h after the start
    assert late is not None and "since the router started (3.0 h ago)" in late["line"]
    assert regret_summary({}, 10.0, True) is None


async def test_router_exports_the_estimates_and_status_shows_the_line(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replicas = [await start_emulated(num_blocks=256) for _ in range(2)]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    prompt = "A handbook every request of this tenant quotes before its question. " * 8
    served = set()
    for _ in range(3):
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=2
        )
        served.add(raw.headers["x-kvroute-replica"])
    assert len(served) == 1  # kv_aware keeps the prompt where it is cached
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        page = parse_metrics(await resp.text())
    # Counted at dispatch, before the answer: no waiting for the counters.
    assert page.sum("kvroute_routing_estimated_decisions_total") == 3
    ttft = {
        s.labels["choice"]: s.value
        for s in page.samples
        if s.name == "kvroute_routing_estimated_ttft_seconds_total"
    }
    assert set(ttft) == {"chosen", "round_robin", "power_of_two"}
    # Round robin's rotation sends one of the repeats to the replica without the prompt.
    assert 0 < ttft["chosen"] < ttft["round_robin"]
    status = json.loads(r.router.status.json())
    assert status["regret"]["decisions"] == 3
    assert status["regret"]["line"].startswith(
        "kv_aware vs round robin over the last hour: estimated TTFT "
    )
    assert status["regret"]["line"].endswith("better)")


async def test_a_policy_without_estimates_exports_zeros_and_no_status_line(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replica = await start_emulated()
    r = await start_router([replica_source(replica, "emu")], policy={"name": "round_robin"})
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    await client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        page = parse_metrics(await resp.text())
    assert page.sum("kvroute_routing_estimated_decisions_total") == 0
    assert json.loads(r.router.status.json())["regret"] is None


# -- the simulator: the estimate against the counterfactual replay ----------------------------


def test_replay_compares_the_estimate_with_the_counterfactual_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = [
        "replay", "--trace", str(MOONCAKE), "--max-requests", "300", "--replicas", "4",
        "--compare", "kv_aware,round_robin,power_of_two", "--kv-capacity-tokens", "200000",
        "--out", str(out), "--no-plots", "--quiet",
    ]  # fmt: skip
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads((out / "summary.json").read_text())
    regret = summary["estimated_regret"]  # the kv_aware run's
    assert regret["decisions"] == 300
    assert {r["policy"]: r["estimated_regret"] for r in summary["runs"]}["round_robin"] is None
    for base in ("round_robin", "power_of_two"):
        c = regret["counterfactual"][base]
        assert c["requests"] == 300
        # Cache-aware routing wins on this conversation trace, measured and estimated alike.
        assert c["measured_difference_s"] < 0
        assert c["estimated_regret_mean_s"] < 0
        assert c["signs_agree"] is True
    assert "kv_aware vs round_robin: estimated regret -" in captured.out
    assert "signs agree" in captured.out
    report = (out / "report.md").read_text()
    assert "## Regret against round robin" in report
    assert "kv_aware vs power_of_two: estimated regret" in report
