"""The autoscaler's decision (kvcore/autoscale.py) and the day-shaped arrivals it is judged on."""

from __future__ import annotations

import collections
import contextlib
import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.kvcore.autoscale import Autoscaler, AutoscaleSettings, ReplicaSignal
from kvroute.simulator.traces.errors import TraceError
from kvroute.simulator.traces.model import Trace, TraceRequest
from kvroute.simulator.traces.transform import apply_transform, diurnal_time

from .helpers import AZURE_CONV

SETTINGS = AutoscaleSettings(
    min=2, max=6, target_queue_per_replica=2, kv_high=0.9, kv_low=0.6, scale_down_idle_s=60
)


def signals(*pairs: tuple[int, float]) -> list[ReplicaSignal]:
    return [ReplicaSignal(w, u) for w, u in pairs]


def test_a_queue_past_its_target_starts_enough_replicas_to_bring_it_back() -> None:
    scaler = Autoscaler(SETTINGS)
    # 10 waiting on 2 replicas: 5 each against a target of 2 -> 5 replicas' worth, 3 more.
    assert scaler.decide(0.0, signals((6, 0.5), (4, 0.5)), starting=0, draining=0) == 3
    # Never past max, counting what is starting; nothing more while some are starting.
    assert scaler.decide(0.0, signals((40, 0.5), (40, 0.5)), starting=0, draining=0) == 4
    assert scaler.decide(0.0, signals((40, 0.5), (40, 0.5)), starting=1, draining=0) == 0


def test_a_nearly_full_kv_cache_starts_one_even_without_a_queue() -> None:
    scaler = Autoscaler(SETTINGS)
    assert scaler.decide(0.0, signals((0, 0.95), (0, 0.92)), starting=0, draining=0) == 1


def test_scale_down_waits_for_a_quiet_spell_then_steps_one_per_interval() -> None:
    scaler = Autoscaler(SETTINGS)
    quiet = signals((0, 0.2), (0, 0.2), (0, 0.2))  # 0.3 on two replicas: under kv_low
    assert scaler.decide(0.0, quiet, starting=0, draining=0) == 0
    assert scaler.decide(59.0, quiet, starting=0, draining=0) == 0
    assert scaler.decide(60.0, quiet, starting=0, draining=0) == -1
    # Not while one drains; once it is gone and it is still quiet, the next at once.
    assert scaler.decide(65.0, quiet, starting=0, draining=1) == 0
    assert scaler.decide(70.0, quiet, starting=0, draining=0) == -1
    # A queue anywhere breaks the spell: a whole one again before the next leaves.
    assert scaler.decide(100.0, signals((1, 0.2), (0, 0.2), (0, 0.2)), 0, 0) == 0
    assert scaler.decide(150.0, quiet, starting=0, draining=0) == 0
    assert scaler.decide(210.0, quiet, starting=0, draining=0) == -1


def test_never_below_min_nor_while_one_fits_badly_on_fewer() -> None:
    scaler = Autoscaler(SETTINGS)
    two = signals((0, 0.1), (0, 0.1))
    assert all(scaler.decide(t, two, 0, 0) == 0 for t in (0.0, 100.0, 1000.0))
    busy = signals((0, 0.5), (0, 0.5), (0, 0.5))  # 0.75 each on two: over kv_low
    assert all(scaler.decide(t, busy, 0, 0) == 0 for t in (0.0, 100.0, 1000.0))
    # Below min (a replica died): back up to it.
    assert Autoscaler(SETTINGS).decide(0.0, signals((0, 0.1)), starting=0, draining=0) == 1


LEADING = AutoscaleSettings(
    min=2, max=8, target_in_flight_per_replica=10, in_flight_low=0.8, scale_down_idle_s=60
)


def in_flight(*counts: int, waiting: int = 0, kv: float = 0.1) -> list[ReplicaSignal]:
    return [ReplicaSignal(waiting, kv, c) for c in counts]


def test_in_flight_past_its_target_starts_enough_replicas_before_any_queue() -> None:
    scaler = Autoscaler(LEADING)
    # 45 in flight on 2 replicas, no queue yet: 5 replicas' worth at 10 each, 3 more.
    assert scaler.decide(0.0, in_flight(25, 20), starting=0, draining=0) == 3
    # Those starting count: with 3 starting nothing more; with 1, the 2 still lacking.
    assert scaler.decide(0.0, in_flight(25, 20), starting=3, draining=0) == 0
    assert scaler.decide(0.0, in_flight(25, 20), starting=1, draining=0) == 2
    # Never past max.
    assert scaler.decide(0.0, in_flight(100, 100), starting=0, draining=0) == 6
    # At the target: hold.
    assert scaler.decide(0.0, in_flight(10, 10), starting=0, draining=0) == 0


def test_in_flight_mode_ignores_the_lagging_queue_but_not_a_full_cache() -> None:
    scaler = Autoscaler(LEADING)
    # A queue with little in flight (a burst of long prompts, say) starts nothing.
    assert scaler.decide(0.0, in_flight(4, 4, waiting=5), starting=0, draining=0) == 0
    # KV usage past kv_high still does.
    assert scaler.decide(0.0, in_flight(4, 4, kv=0.95), starting=0, draining=0) >= 1


def test_in_flight_scale_down_when_one_fewer_stays_under_the_low_mark() -> None:
    scaler = Autoscaler(LEADING)
    # 3 replicas, 15 in flight: 7.5 each on two, under 8 (0.8 x 10), with a queue (ignored).
    quiet = in_flight(5, 5, 5, waiting=1)
    assert scaler.decide(0.0, quiet, starting=0, draining=0) == 0
    assert scaler.decide(59.0, quiet, starting=0, draining=0) == 0
    assert scaler.decide(60.0, quiet, starting=0, draining=0) == -1
    assert scaler.decide(65.0, quiet, starting=0, draining=1) == 0
    # 18 in flight: 9 each on two, over the low mark: the spell breaks.
    assert scaler.decide(70.0, in_flight(6, 6, 6), starting=0, draining=0) == 0
    assert scaler.decide(80.0, quiet, starting=0, draining=0) == 0
    assert scaler.decide(140.0, quiet, starting=0, draining=0) == -1
    # Never below min.
    two = in_flight(0, 0)
    assert all(Autoscaler(LEADING).decide(t, two, 0, 0) == 0 for t in (0.0, 100.0, 1000.0))


def test_bad_settings_name_the_key() -> None:
    bad = AutoscaleSettings(min=0, max=-1, interval_s=0, kv_low=0.95, kv_high=0.9)
    problems = bad.problems()
    assert any(p.startswith("autoscale.min:") for p in problems)
    assert any(p.startswith("autoscale.max:") for p in problems)
    assert any(p.startswith("autoscale.interval_s:") for p in problems)
    assert any(p.startswith("autoscale.kv_low/kv_high:") for p in problems)
    leading = AutoscaleSettings(target_in_flight_per_replica=-1, in_flight_low=1.5).problems()
    assert any(p.startswith("autoscale.target_in_flight_per_replica:") for p in leading)
    assert any(p.startswith("autoscale.in_flight_low:") for p in leading)
    assert SETTINGS.problems() == []


def test_diurnal_arrivals_keep_the_requests_and_span_and_follow_a_day() -> None:
    steady = Trace("steady", 16, tuple(TraceRequest(float(s), 100, 10, ()) for s in range(0, 3601)))
    day = apply_transform(steady, diurnal=(0.8, None))
    times = [r.arrival_s for r in day.requests]
    assert len(times) == 3601 and times == sorted(times)
    assert times[0] == 0.0 and times[-1] == pytest.approx(3600.0)
    per_10_min = collections.Counter(int(t // 600) for t in times)
    # Quietest at the ends, busiest in the middle: about 1 - 0.8 and 1 + 0.8 of the mean
    # (600 a bucket) averaged over each bucket.
    assert per_10_min[0] < 250 and per_10_min[5] < 250
    assert per_10_min[2] > 950 and per_10_min[3] > 950
    assert diurnal_time(1800.0, 0.8, 3600.0) == pytest.approx(1800.0)
    with pytest.raises(TraceError, match="amplitude"):
        apply_transform(steady, diurnal=(1.0, None))


# -- the simulator runs the same autoscaler ----------------------------------------------


def test_replay_autoscales_a_day_of_load_and_counts_the_replica_hours(tmp_path: Path) -> None:
    """Four copies of the Azure excerpt warped into one day: replicas start as the load rises
    (serving 10 s after they are started), leave as it falls, and the run uses fewer
    replica-hours than four replicas throughout, every request served."""
    out = tmp_path / "run"
    args = ["replay", "--trace", str(AZURE_CONV), "--preset", "llama-3.1-70b-2xh200"]
    args += ["--replicas", "4", "--autoscale", "min=1,startup=10,idle=20,interval=5"]
    args += ["--repeat", "4", "--diurnal", "0.8", "--rate-scale", "2", "--policy", "kv_aware"]
    assert main([*args, "--no-plots", "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == summary["requests"] == 4000
    assert summary["scale_ups"] >= 1 and summary["scale_downs"] >= 1
    fixed = 4 * summary["makespan_s"] / 3600
    assert 0 < summary["replica_hours"] < 0.8 * fixed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--autoscale", "min=0"], "autoscale.min"),
        (["--autoscale", "most=3"], "--autoscale"),
        (["--autoscale", "min=2,max=3"], "autoscale.max"),
        (["--diurnal", "1.5"], "--diurnal"),
        (["--repeat", "0"], "--repeat"),
    ],
)
def test_bad_autoscale_flags_are_one_clear_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["replay", "--trace", str(AZURE_CONV), "--replicas", "4", "--no-plots", "--quiet"]
    with contextlib.suppress(SystemExit):
        code = main([*args, *flags, "--out", "/dev/null/x"])
        assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_leading_signal_is_a_key_of_the_replay_flag_and_the_router_config() -> None:
    from kvroute.router.config import AutoscaleConfig
    from kvroute.simulator.cli_replay import _autoscale_settings, _autoscale_spec

    spec = _autoscale_spec("min=2,in_flight=60,in_flight_low=0.7")
    settings = _autoscale_settings(spec, 12)["autoscale"]
    assert (settings.target_in_flight_per_replica, settings.in_flight_low) == (60.0, 0.7)
    assert settings.max == 12 and settings.problems() == []
    live = AutoscaleConfig(target_in_flight_per_replica=60).settings()
    assert live.target_in_flight_per_replica == 60 and live.in_flight_low == 0.8
    # Off by default: the replicas' own queue and KV usage, as before.
    assert AutoscaleConfig().settings().target_in_flight_per_replica == 0
