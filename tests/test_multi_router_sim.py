"""Several routers (endpoint pickers) in front of one simulated fleet: one router is the
single-router path unchanged, N pickers that share nothing lose cache hits, a bus between them
wins them back, and bad settings are clear errors."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvroute.cli import main
from kvroute.kvcore.stats import percentile
from kvroute.policies import Decision, FleetView, Policy, RouteRequest, build_policy
from kvroute.simulator.engine.latency import latency_preset
from kvroute.simulator.fleet import FleetConfig, SimResult, UnitTrace, engine_config, prepare
from kvroute.simulator.fleet import simulate as simulate_fleet
from kvroute.simulator.fleet.fleet import _Fleet
from kvroute.simulator.traces import load_trace

from .helpers import CLAUDE_CODE, MOONCAKE

H100 = latency_preset("llama-3.1-8b-h100")


@cache
def sessions() -> UnitTrace:
    """600 requests of 10 Claude Code sessions: long prompts, each turn extends the last."""
    return prepare(load_trace(str(CLAUDE_CODE), None, seed=0, max_requests=600))


@cache
def mooncake() -> UnitTrace:
    """The first 300 Mooncake requests (100 s): bursts of arrivals at one instant."""
    return prepare(load_trace(str(MOONCAKE), None, seed=0, max_requests=300))


def config(replicas: int = 4, kv_tokens: int = 100_000, **pickers: Any) -> FleetConfig:
    return FleetConfig(replicas=replicas, engine=engine_config(H100, kv_tokens), **pickers)


def simulate(units: UnitTrace, fleet: FleetConfig, **params: Any) -> SimResult:
    return simulate_fleet(units, build_policy("kv_aware", {"seed": 0, **params}), fleet)


def same_run(a: SimResult, b: SimResult) -> bool:
    return (
        a.first_token_s == b.first_token_s
        and a.finish_s == b.finish_s
        and a.replica == b.replica
        and a.hit_tokens == b.hit_tokens
        and a.reasons == b.reasons
    )


def test_one_router_gives_the_numbers_of_the_single_router_path() -> None:
    # What the fleet simulator gave on this run before it knew of several routers (and before
    # kv_aware knew of live sessions: off here, so the numbers stay comparable).
    old = {"session_ttl_s": 0.0}
    res = simulate(sessions(), config(kv_tokens=200_000, routers=1, share="none"), **old)
    assert (sum(res.hit_tokens), sum(res.queried_tokens)) == (49_360_384, 54_365_564)
    assert sum(res.first_token_s) == pytest.approx(1_747_585.8835177, abs=1e-6)
    assert res.routed_requests == [73, 236, 211, 80]
    # A bus with nobody to talk to changes nothing.
    assert same_run(res, simulate(sessions(), config(kv_tokens=200_000, share="bus"), **old))


def test_a_bus_without_lag_makes_four_pickers_one_router_even_through_a_failure() -> None:
    """Every picker repeats every other's ledger calls at once: each holds the single router's
    load and predictions, and (same policy, same view) decides as it would."""
    failure = ((1, 40.0),)  # busy then: some requests move off replica 1
    one = simulate(mooncake(), config(kv_tokens=200_000, failures=failure))
    four = simulate(
        mooncake(),
        config(kv_tokens=200_000, failures=failure, routers=4, share="bus", bus_lag_s=0.0),
    )
    assert any(one.reroutes)
    assert same_run(one, four)


def test_a_bus_without_lag_shares_session_claims_too() -> None:
    """kv_aware's live sessions on: each picker's own policy hears of the others' turns (a
    ``remote`` dispatch), so with a lag-0 bus four pickers keep one router's claims and decide
    as it would. Without the claims on the bus, a session's turn routed by one picker left the
    others' policies blind to it: a different run."""
    one = simulate(sessions(), config())
    four = simulate(sessions(), config(routers=4, share="bus", bus_lag_s=0.0))
    assert same_run(one, four)
    assert one.reasons["kv_session"] > 0


def test_pickers_that_share_nothing_lose_hits_and_the_bus_wins_them_back() -> None:
    """Ten sessions (median prompt 89k tokens) on four replicas of 100k KV tokens: a replica
    holds about one session's context, so where each turn lands decides its hits. (With roomier
    caches, blind pickers may gain hits instead by keeping sessions on busy homes, and pay in
    the tail.) kv_aware's live sessions are off: each picker would keep its own, which hides
    what sharing does (with them on, blind pickers keep 84% of hits on these sessions)."""
    off = {"session_ttl_s": 0.0}
    one = simulate(sessions(), config(), **off)
    alone = simulate(sessions(), config(routers=4, share="none"), **off)
    scraped = simulate(sessions(), config(routers=4, share="scrape"), **off)
    bus = simulate(sessions(), config(routers=4, share="bus"), **off)
    # (239 prompts exceed a replica's cache: rejected in every run.)
    assert one.completed == alone.completed == scraped.completed == bus.completed
    # Measured: 83.1% with one router, 77.3% with four that share nothing (the scraped queue
    # depth does not change that: vLLM's waiting queue is empty most of the time), 83.1% again
    # with a 1 ms bus (sessions' turns are seconds apart, never within the bus's lag).
    gap = one.hit_rate() - alone.hit_rate()
    assert gap > 0.03
    assert scraped.hit_rate() <= one.hit_rate() - 0.03
    assert bus.hit_rate() - alone.hit_rate() >= 0.8 * gap
    # Pickers blind to each other's load pile requests onto the replicas that hold their
    # prefixes: the tail waits (p99 TTFT 8 s with a bus, 32 s without).
    assert percentile(bus.ttfts(), 0.99) < 0.5 * percentile(alone.ttfts(), 0.99)


def test_workers_sharing_load_but_not_predictions_route_as_one_router() -> None:
    """``kvroute serve --workers N``: the in-flight load is summed at once through shared
    memory, predictions stay each worker's own. On the same sessions that cost pickers 6
    points of hit rate and a 4x tail, shared load alone brings back one router's figures
    (measured: 83.2% and 8.0 s, against 83.1% and 8.0 s): a session's turns are seconds
    apart, its blocks are confirmed by KV events long before the next one. (Live sessions off,
    as above: workers keep them per worker.)"""
    off = {"session_ttl_s": 0.0}
    one = simulate(sessions(), config(), **off)
    workers = simulate(sessions(), config(routers=4, share="load"), **off)
    assert workers.completed == one.completed
    assert abs(workers.hit_rate() - one.hit_rate()) < 0.01
    assert percentile(workers.ttfts(), 0.99) <= 1.1 * percentile(one.ttfts(), 0.99)


def test_several_pickers_are_deterministic() -> None:
    fleet = config(kv_tokens=200_000, routers=3, share="bus", failures=((0, 40.0),))
    a, b = simulate(mooncake(), fleet), simulate(mooncake(), fleet)
    assert same_run(a, b) and a.routers == 3 and a.share == "bus"


class _Counting(Policy):
    """First eligible replica; notes which policy object decided."""

    name = "counting"
    deciders: ClassVar[list[int]] = []

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        _Counting.deciders.append(id(self))
        return Decision(tuple(r.replica_id for r in fleet.eligible(request.model)), "first")


def test_request_i_goes_to_picker_i_mod_n_each_with_its_own_policy() -> None:
    _Counting.deciders.clear()
    res = simulate_fleet(mooncake(), _Counting(), config(kv_tokens=200_000, routers=3))
    deciders = _Counting.deciders
    assert len(deciders) == res.requests == res.completed
    assert len(set(deciders)) == 3
    assert deciders[:6] == deciders[:3] * 2  # request i to picker i % 3


@pytest.mark.parametrize(
    ("share", "lag"), [("none", 0.001), ("bus", 0.001), ("bus", 0.0), ("load", 0.001)]
)
def test_every_pickers_load_returns_to_zero(share: str, lag: float) -> None:
    """Each picker counts down what it counted up: its own dispatches and, over the bus, the
    others' (failures and resumed requests included)."""
    settings = config(
        kv_tokens=200_000, routers=4, share=share, bus_lag_s=lag, failures=((1, 40.0),)
    )
    fleet = _Fleet(mooncake(), build_policy("kv_aware", {"seed": 0}), settings)
    loads: list[list[int]] = []

    def progress(done: int, total: int, t: float) -> None:
        loads.append([sum(s.in_flight for s in router.states) for router in fleet.routers])

    res = fleet.run(progress)
    assert res.completed == res.requests and any(res.reroutes)
    if share == "bus" and lag == 0:  # every picker counts the whole fleet's load, always
        assert all(len(set(counts)) == 1 for counts in loads)
        assert max(counts[0] for counts in loads) > 10
    if fleet.board is not None:  # share="load": a router reads the sums when it decides
        for router in fleet.routers:
            fleet.board.totals_into(router.states)
    for router in fleet.routers:
        for state in router.states:
            assert (state.in_flight, state.in_flight_tokens) == (0, 0)
            assert (state.prefilling, state.prefill_tokens) == (0, 0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"routers": 0}, "routers must be >= 1, got 0"),
        ({"routers": 1.5}, "routers must be an integer >= 1, got 1.5"),
        ({"share": "x"}, "share must be one of none, scrape, bus, load, got 'x'"),
        ({"share_scrape_interval_s": 0.0}, "share_scrape_interval_s must be > 0"),
        ({"bus_lag_s": -1.0}, "bus_lag_s must be a finite number >= 0, got -1.0"),
    ],
)
def test_bad_settings_are_clear_errors(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config(**settings)


def test_replay_says_how_many_routers_and_what_they_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["replay", "--trace", str(MOONCAKE), "--max-requests", "100", "--replicas", "4"]
    code = main([*argv, "--routers", "2", "--share", "bus", "--out", str(out), "--no-plots"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["routers"], summary["share"], summary["bus_lag_s"]) == (2, "bus", 0.001)
    assert summary["completed"] == 100
    line = (
        "routers: 2 routers (request i to i % N), share bus: queue depth and KV usage scraped "
        "every 1 s, dispatches, first tokens and finishes published 1 ms later"
    )
    assert line in captured.out.splitlines()
    assert f"- {line}" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--routers", "0"], "--routers"),
        (["--share", "x"], "--share"),
        (["--bus-lag-s", "-1"], "--bus-lag-s"),
        (["--routers", "2", "--live", "http://127.0.0.1:1"], "--routers and --share"),
    ],
)
def test_bad_router_flags_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    argv = ["replay", "--trace", str(MOONCAKE), "--out", str(tmp_path / "o"), *extra]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert expected in err.strip().splitlines()[-1], err
