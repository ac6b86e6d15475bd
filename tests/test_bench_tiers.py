"""``kvroute bench tiers`` at a small scale: the GPU+CPU fleet serves llm-d's tiered workload
shape faster than the GPU-only one, and the table says so; inference-perf's protocol (its
stages, its Poisson timer, its prompts) as llm-d's benchmark runs it."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest

from kvroute.bench import tiers, tiers_stages
from kvroute.cli import main
from kvroute.simulator.fleet.results import SimResult
from kvroute.simulator.traces.model import Trace


def test_bench_tiers_records_the_gain_of_a_cpu_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    md = tmp_path / "BENCH.md"
    argv = ["bench", "tiers", "--protocol", "steady", "--rates", "10", "--duration", "60"]
    assert main([*argv, "--output-md", str(md)]) == 0
    text = md.read_text()
    assert (
        "Command: `kvroute bench tiers --protocol steady --rates 10 --duration 60 "
        "--arms gpu-only,cpu-flat,cpu-weights,cpu-time --replicas 8 --seed 0`"
    ) in text
    rows = {
        m.group(1): float(m.group(2).replace(",", ""))
        for m in re.finditer(r"^\| 10 \| (\S+) \| ([\d,]+) \|", text, re.M)
    }
    assert set(rows) == {"gpu-only", "cpu-flat", "cpu-weights", "cpu-time"}
    assert rows["cpu-time"] > 1.1 * rows["gpu-only"]
    assert "| 10 | cpu-time |" in capsys.readouterr().out


def test_bench_tiers_refuses_a_run_without_its_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "tiers", "--arms", "cpu-time"])
    assert "gpu-only is the baseline" in capsys.readouterr().err


def test_inference_perf_timer_fills_each_second_and_sends_exactly_rate_times_duration() -> None:
    rng = random.Random(3)
    times = tiers_stages.stage_times(20.0, 1200, 100.0, rng)
    assert len(times) == 1200
    assert times == sorted(times) and times[0] > 100.0
    # Each second's requests end exactly on the second (normalised gaps), as inference-perf's.
    ends = [t for t in times if abs(t - round(t)) < 1e-9]
    assert len(ends) >= 50
    # About 60 s for 1,200 requests at 20/s (Poisson: a few seconds either way).
    assert 54.0 < times[-1] - 100.0 < 66.0


def test_shared_prefix_prompts_are_groups_of_one_system_prompt_shuffled_by_seed() -> None:
    prompts = tiers_stages.shared_prefix_prompts(seed=0)
    assert len(prompts) == 250 * 5
    assert {p.tokens for p in prompts} == {16_000 + 256}
    whole = 16_000 // tiers_stages.BLOCK_TOKENS  # blocks that hold only the system prompt
    groups = {p.block_ids[:whole] for p in prompts}
    assert len(groups) == 250
    assert len({p.block_ids for p in prompts}) == 1250  # every question its own prompt
    assert prompts == tiers_stages.shared_prefix_prompts(seed=0)
    assert prompts != tiers_stages.shared_prefix_prompts(seed=1)
    # As llm-d's run sent them (inference-perf v0.4.0's text of random ids tokenizes longer):
    # 17,090 tokens, the system prompt still one prefix per group.
    as_run = tiers_stages.shared_prefix_prompts(0, tiers_stages.AS_RUN_LENGTH_SCALE)
    assert {p.tokens for p in as_run} == {16_821 + 269}
    assert len({p.block_ids[: 16_821 // tiers_stages.BLOCK_TOKENS] for p in as_run}) == 250


def test_a_stage_starts_its_interval_after_the_previous_stage_has_drained() -> None:
    replay = tiers.arm_simulator("gpu-only", replicas=8, seed=0)
    seen: list[tuple[Trace, SimResult]] = []

    def recording(trace: Trace) -> SimResult:
        result = replay(trace)
        seen.append((trace, result))
        return result

    rows = tiers_stages.run_stages([2.0, 4.0], "gpu-only", recording, 0, 10.0, 30.0)
    assert [r.requests for r in rows] == [20, 40]
    trace, result = seen[-1]
    first_stage_end = max(result.finish_s[:20])
    second_start = min(r.arrival_s for r in trace.requests[20:])
    assert first_stage_end + 30.0 < second_start < first_stage_end + 31.0
    # Every request finished, and the first stage ran the same alone as with the second after it.
    assert not any(math.isnan(f) for f in result.finish_s)
    assert seen[0][1].finish_s == result.finish_s[:20]
    assert rows[1].wall_s == pytest.approx(max(result.finish_s[20:]) - min(result.arrival_s[20:]))


def test_bench_tiers_inference_perf_protocol_with_its_gain_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    md = tmp_path / "BENCH.md"
    argv = ["bench", "tiers", "--rates", "5,20", "--stage-s", "30", "--seeds", "2"]
    assert main([*argv, "--arms", "gpu-only,cpu-time", "--output-md", str(md)]) == 0
    text = md.read_text()
    assert (
        "Command: `kvroute bench tiers --protocol inference-perf --rates 5,20 --stage-s 30 "
        "--interval-s 60 --seeds 2 --prompt-lengths as-run --arms gpu-only,cpu-time "
        "--replicas 8 --seed 0`"
    ) in text
    totals = {
        (m.group(1), m.group(2)): float(m.group(3).replace(",", ""))
        for m in re.finditer(r"^\| (5|20) \| (\S+) \| [\d,]+ \| \d+ s \| ([\d,]+) \|", text, re.M)
    }
    assert set(totals) == {(r, a) for r in ("5", "20") for a in ("gpu-only", "cpu-time")}
    # At 20/s (saturated without the tier) the CPU tier serves the stage much sooner.
    assert totals["20", "cpu-time"] > 1.2 * totals["20", "gpu-only"]
    spread = re.search(r"^\| 20 \| cpu-time \| ([+-][\d.]+)% \(", text, re.M)
    assert spread is not None and float(spread.group(1)) > 20.0
    # 30 s stages are not llm-d's protocol: its figures are not set beside them.
    assert "| 20 | cpu-time |" in text and "300,749" not in text
    assert "Gain over gpu-only across 2 seeds" in capsys.readouterr().out


def test_bench_tiers_refuses_a_stage_that_sends_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--rates", "0.01", "--no-record"]) == 2
    assert "a 60 s stage at 0.01 QPS sends no request" in capsys.readouterr().err
