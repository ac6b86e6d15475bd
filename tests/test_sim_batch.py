"""The batch lane in the simulator: a job beside an online trace, through a capacity dip."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import main
from kvroute.policies import build_policy
from kvroute.simulator.engine.latency import latency_preset
from kvroute.simulator.fleet.batch import BatchJob, CapacityDip, batch_lines
from kvroute.simulator.fleet.config import FleetConfig, engine_config
from kvroute.simulator.fleet.fleet import simulate
from kvroute.simulator.fleet.results import SimResult
from kvroute.simulator.fleet.units import prepare
from kvroute.simulator.traces.model import Trace, TraceRequest

from .helpers import AZURE_CONV

ENGINE = engine_config(latency_preset("llama-3.1-8b-h100"), 64 * 1024)


def steady_trace(rate: float, seconds: float, prompt: int = 800, output: int = 100) -> Trace:
    """Online requests at a fixed rate, each prompt its own (nothing to share)."""
    n = int(rate * seconds)
    return Trace("steady", 16, tuple(TraceRequest(i / rate, prompt, output, ()) for i in range(n)))


def run(trace: Trace, job: BatchJob | None, replicas: int = 2, **fleet: Any) -> SimResult:
    config = FleetConfig(replicas=replicas, engine=ENGINE, **fleet)
    policy = build_policy("kv_aware", {})
    if job is None:
        return simulate(prepare(trace), policy, config)
    units = prepare(trace)
    return simulate(units, policy, config, batch=(job, batch_lines(units, job)))


def test_a_job_on_an_idle_fleet_runs_on_spare_capacity_and_meets_its_window() -> None:
    trace = steady_trace(rate=2, seconds=120)
    job = BatchJob(lines=300, input_tokens=1000, output_tokens=50, window_s=3600)
    alone, both = run(trace, None), run(trace, job)
    outcome = both.batch
    assert outcome is not None
    assert outcome.completed == outcome.on_time == 300 and outcome.met_window
    assert outcome.promoted == 0  # spare capacity was enough: nothing ran behind pace
    # The online requests are reported as without the job: the same requests, all served.
    assert both.requests == alone.requests == 240 and both.completed == 240
    assert 0 < outcome.token_share < 1


def test_the_lane_keeps_its_lines_within_the_spare_slots_of_each_replica() -> None:
    """On an idle fleet of 2, slots=1 runs the job two lines at a time and slots=4 eight at a
    time: the second is done in well under half the time of the first."""
    trace = steady_trace(rate=0.01, seconds=100)  # one online request
    narrow = run(trace, BatchJob(lines=80, input_tokens=400, output_tokens=200,
                                 max_in_flight_per_replica=1))  # fmt: skip
    wide = run(trace, BatchJob(lines=80, input_tokens=400, output_tokens=200,
                               max_in_flight_per_replica=4))  # fmt: skip
    assert narrow.batch is not None and wide.batch is not None
    assert narrow.batch.met_window and wide.batch.met_window
    # Decode of 200 tokens dominates each line: 4 at a time per replica finish ~4x sooner.
    assert wide.batch.done_s < 0.4 * narrow.batch.done_s


def test_a_job_behind_its_pace_is_promoted_and_still_meets_a_tight_window() -> None:
    """Online load keeps each replica above the spare-capacity threshold: without pacing the
    job would wait for the trace to end; behind its line, its lines run anyway."""
    trace = steady_trace(rate=12, seconds=600, prompt=2000, output=300)
    job = BatchJob(lines=200, input_tokens=1000, output_tokens=100, window_s=700,
                   max_in_flight_per_replica=2)  # fmt: skip
    outcome = run(trace, job).batch
    assert outcome is not None
    assert outcome.promoted > 0
    assert outcome.met_window, outcome.as_dict()


def test_a_job_too_large_for_its_window_expires_with_what_it_finished() -> None:
    trace = steady_trace(rate=1, seconds=60)
    job = BatchJob(lines=5000, input_tokens=2000, output_tokens=500, window_s=120)
    outcome = run(trace, job).batch  # returns: the lane stops at the end of the window
    assert outcome is not None
    assert 0 < outcome.on_time < 5000 and not outcome.met_window
    assert outcome.as_dict()["completion_s"] is None  # never all done


def test_a_capacity_dip_moves_requests_off_the_gone_replicas_and_brings_them_back() -> None:
    trace = steady_trace(rate=4, seconds=300)
    dip = CapacityDip(0.5, 100, 200)
    assert dip.replicas(4) == [2, 3]
    result = run(trace, None, replicas=4, dip=dip)
    assert result.completed == result.requests  # nothing lost: they resumed elsewhere
    assert sorted(result.failed_replicas) == [2, 3]
    by_replica = {r: 0 for r in range(4)}
    for arrival, replica in zip(result.arrival_s, result.replica, strict=True):
        if 110 <= arrival <= 190:
            by_replica[replica] += 1
    assert by_replica[2] == by_replica[3] == 0 < by_replica[0]
    late = [rep for a, rep in zip(result.arrival_s, result.replica, strict=True) if a > 220]
    assert {2, 3} <= set(late)  # back in rotation after the dip


def test_replay_reports_the_job_against_its_window_and_online_ttft_both_ways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["replay", "--trace", str(AZURE_CONV), "--preset", "llama-3.1-70b-2xh200"]
    args += [
        "--replicas",
        "4",
        "--batch-job",
        "lines=500,input=1500,output=200,shared=512,window=2h",
    ]
    args += ["--dip", "0.5@60-120", "--no-plots", "--quiet", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == summary["completed"] == 1000  # the online trace's own
    batch = summary["batch"]
    assert batch["lines"] == batch["completed"] == batch["on_time"] == 500
    assert batch["met_window"] and 0 < batch["completion_of_window"] < 1
    assert batch["online_ttft_p99_alone_s"] > 0 and batch["online_ttft_p99_ratio"] > 0
    assert "met its window" in printed and "with the batch lane" in printed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-job", "input=100"], "lines=N is required"),
        (["--batch-job", "lines=10,speed=3"], "--batch-job"),
        (["--batch-job", "lines=10,window=soon"], "window"),
        (["--batch-job", "lines=10,input=100,shared=200"], "shared_prefix_tokens"),
        (["--batch-job", "lines=10,input=9000000"], "more KV cache than one replica"),
        (["--dip", "1.5@10-20"], "dip fraction"),
        (["--dip", "0.5@2h-1h"], "dip window"),
        (["--dip", "0.5"], "F@T1-T2"),
        (["--dip", "0.5@1h-2h", "--autoscale", "min=1"], "autoscaler"),
    ],
)
def test_bad_batch_and_dip_flags_are_one_clear_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["replay", "--trace", str(AZURE_CONV), "--replicas", "4", "--no-plots", "--quiet"]
    with contextlib.suppress(SystemExit):
        code = main([*args, *flags, "--out", str(tmp_path / "x")])
        assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_batch_runs_a_day_live_alone_and_with_a_job(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvroute bench batch` on a short day: two fresh emulated fleets, the online trace on
    both, the job through the openai client on the second; the report says both ways."""
    code = main(["bench", "batch", "--trace", str(AZURE_CONV), "--day", "8", "--max-requests",
                 "20", "--lines", "8", "--input-words", "50", "--no-record"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| online alone | 20 | 0 |" in out
    assert "| online + batch lane | 20 | 0 |" in out and "8/8 lines, completed" in out
    assert "online TTFT p99 with the lane / alone:" in out
    assert "the job met its window: **yes**" in out


def test_plan_sizes_the_fleet_for_the_trace_and_then_for_the_job_within_its_window(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["plan", "--trace", str(AZURE_CONV), "--preset", "llama-3.1-70b-2xh200", "--slo",
            "ttft=2", "--rate-multipliers", "1", "--quiet", "--out", str(tmp_path)]  # fmt: skip
    big = "lines=6000,input=1500,output=300,window=10m"
    assert main([*args, "--batch-job", big]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    row = plan["rows"][0]
    alone, with_job = row["replicas"], row["with_batch_job"]
    assert with_job["replicas"] > alone >= 1  # the job needed more than the trace alone
    assert with_job["batch"]["met_window"] and with_job["batch"]["lines"] == 6000
    assert f"{with_job['replicas']} replicas ({alone} for the trace alone)" in out
