"""``kvroute drill --scenario router-restart|router-kill``: several routers behind one Envoy,
one of them killed or restarted under load (issue 36)."""

from __future__ import annotations

import re

import pytest

from kvroute.drill.routers import (
    Restart,
    RouterDrillOptions,
    RouterDrillReport,
    Sent,
    recovery,
    router_drill_passed,
)

from .test_drill import drill, field


def _options(**changes: object) -> RouterDrillOptions:
    base = dict(
        config="c.yaml",
        scenario="router-restart",
        routers=3,
        router=2,
        at_s=5.0,
        rate=10.0,
        duration_s=20.0,
        down_s=1.0,
        max_tokens=8,
    )
    return RouterDrillOptions(**{**base, **changes})  # type: ignore[arg-type]


def _answer(at: float, router: str, cached: int, ok: bool = True, started: bool = True) -> Sent:
    return Sent(at, True, router, ok, started, "" if ok else "cut", 0.05, 100, cached)


def test_recovery_is_the_first_second_the_restarted_router_is_back_to_the_others() -> None:
    """Cold for its first two seconds after ready (0.1, then 0.5), then as the others'."""
    restart = Restart("r2", warm=False, spawned_at=10.0, ready_after_s=2.0)
    sent = [_answer(t / 10, "r0", 90) for t in range(0, 200)]  # the others: 0.9
    sent += [_answer(12.2, "r2", 10), _answer(13.4, "r2", 50)]
    sent += [_answer(12.0 + s + 0.5, "r2", 88) for s in range(2, 8)]
    sent += [_answer(18.5, "r2", 20)]  # a later dip is the fleet's noise, not the restart's
    report = RouterDrillReport(_options(), sent, "r2", ["r0", "r1", "r2"], True, 5.0, [restart])
    got = recovery(report, restart)
    assert got.others == pytest.approx(0.9)
    assert got.dip == pytest.approx(0.1)
    assert got.back_after_s == 2.0
    assert [round(r, 2) for _, r in got.buckets[:3]] == [0.1, 0.5, 0.88]


def test_only_streams_already_relayed_may_be_lost() -> None:
    ok = [_answer(1.0, "r0", 0)]
    cut = _answer(2.0, "r2", 0, ok=False, started=True)
    refused = _answer(2.0, "r2", 0, ok=False, started=False)
    passed = RouterDrillReport(_options(), [*ok, cut], "r2", [], True, 5.0)
    failed = RouterDrillReport(_options(), [*ok, cut, refused], "r2", [], True, 5.0)
    assert router_drill_passed(passed) and not router_drill_passed(failed)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--routers", "1"), "at least 2 routers"),
        (("--routers", "2", "--cold-beside"), "--cold-beside needs --routers 3"),
        (("--router", "5"), "the routers are 0-2"),
    ],
)
def test_a_router_drill_that_cannot_run_says_why(args: tuple[str, ...], why: str) -> None:
    result = drill(
        "--config", "configs/drill-routers.yaml", "--scenario", "router-restart", *args
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert why in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_warm_restarted_router_routes_warm_at_once_and_a_cold_one_does_not() -> None:
    result = drill(
        "--config", "configs/drill-routers.yaml", "--scenario", "router-restart", "--cold-beside",
        "--at", "5", "--rate", "15", "--duration", "45",
    )  # fmt: skip  # a router takes 5-15 s to start on a busy 2-core box
    report = result.stdout
    assert result.returncode == 0, report + result.stderr
    assert field(report, "failed (lost)") == "0"
    warm = re.search(r"warm restart .* hit rate lowest ([\d.]+) vs the others' ([\d.]+)", report)
    assert warm, report
    assert float(warm.group(1)) >= 0.9 * float(warm.group(2)), report
    assert "router: warm start: pool default loaded" in report
    assert "cold restart of" in report


@pytest.mark.slow
def test_killing_one_of_three_routers_behind_envoy_loses_only_streams_it_relayed() -> None:
    result = drill(
        "--config", "configs/drill-routers.yaml", "--scenario", "router-kill",
        "--at", "4", "--rate", "20", "--duration", "10",
    )  # fmt: skip
    report = result.stdout
    assert result.returncode == 0, report + result.stderr
    assert "behind one Envoy" in report
    lost = int(field(report, "failed (lost)"))
    relayed = int(re.search(r"went\s+(\d+)", report).group(1))  # type: ignore[union-attr]
    assert lost == relayed
