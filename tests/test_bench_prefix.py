"""``kvroute bench prefix``'s negative controls: their workloads, their verdicts, and a run end to
end as a user runs it, on the replica emulator (no vLLM; seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvroute.bench.chat_load import RunResult
from kvroute.bench.prefix import (
    CONTROLS,
    FITS_TENANTS,
    TARGETS,
    Options,
    Row,
    control_verdicts,
    control_workload,
)


def test_the_hot_prompt_is_in_every_request_and_nothing_else_is_shared() -> None:
    requests, warm = control_workload("hot-prompt", Options(control_requests=12))
    assert len(requests) == 12 and warm == []
    assert len({c.system_prompt for c in requests}) == 1
    assert len({c.user_turns for c in requests}) == 12
    assert len({c.tenant for c in requests}) == 12  # one user each: no session to follow


def test_the_fitting_working_set_is_a_few_short_prompts_sent_everywhere_first() -> None:
    options = Options(control_requests=12)
    requests, warm = control_workload("fits", options)
    prompts = {c.system_prompt for c in requests}
    assert len(prompts) == FITS_TENANTS
    assert {c.system_prompt for c in warm} == prompts
    assert all(len(p.split()) < options.system_words for p in prompts)
    assert len({c.tenant for c in requests}) == 12
    no_reuse, _ = control_workload("no-reuse", options)
    assert len({c.system_prompt for c in no_reuse}) == 12


def _run(ttfts: list[float], per_s: float) -> RunResult:
    result = RunResult("x", ttfts=list(ttfts), latencies=list(ttfts), wall_s=len(ttfts) / per_s)
    return result


def test_kv_aware_must_stay_within_5_percent_of_round_robin_or_beat_it() -> None:
    rr = _run([0.100] * 99 + [0.200], 10.0)
    close = _run([0.104] * 99 + [0.208], 9.6)
    rows = [Row(TARGETS["kvroute-kv"], close), Row(TARGETS["kvroute-rr"], rr)]
    lines = control_verdicts("hot-prompt", rows)
    assert lines == [
        "- hot-prompt: kv_aware TTFT p50 / round_robin's: 1.04 (target <= 1.05): met",
        "- hot-prompt: kv_aware TTFT p99 / round_robin's: 1.04 (target <= 1.05): met",
        "- hot-prompt: kv_aware requests/s / round_robin's: 0.96 (target >= 0.95): met",
        "- hot-prompt: kv_aware within 5% of round robin's or better: yes",
    ]
    tail = _run([0.100] * 99 + [0.300], 10.0)  # one slow request is a worse p99
    lines = control_verdicts(
        "fits", [Row(TARGETS["kvroute-kv"], tail), Row(TARGETS["kvroute-rr"], rr)]
    )
    assert "- fits: kv_aware TTFT p99 / round_robin's: 1.50 (target <= 1.05): NOT met" in lines
    assert lines[-1] == "- fits: kv_aware within 5% of round robin's or better: NO"
    failed = [Row(TARGETS["kvroute-kv"], error="did not start"), Row(TARGETS["kvroute-rr"], rr)]
    assert control_verdicts("no-reuse", failed) == ["- no-reuse: not measured (a target failed)"]


def test_prefix_bench_runs_the_negative_controls_on_emulated_replicas(tmp_path: Path) -> None:
    md = tmp_path / "bench.md"
    argv = [
        sys.executable, "-m", "kvroute.cli", "bench", "prefix", "--engine", "emulated",
        "--targets", "kvroute-kv,kvroute-rr", "--tenants", "2", "--conversations", "1",
        "--turns", "2", "--control-requests", "6", "--output-md", str(md),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| control | target | hit rate | TTFT p50 ms | TTFT p99 ms | requests/s" in out
    for control in CONTROLS:
        for target in ("kvroute-kv", "kvroute-rr"):
            assert f"| {control} | {target} | " in out
        assert f"- {control}: kv_aware within 5% of round robin's or better: " in out
    recorded = md.read_text()
    assert "--control-requests 6" in recorded and out.strip() in recorded
