"""``kvroute bench prefix --saturate``: run end to end as a user runs it (on the replica
emulator, so it needs no vLLM and takes under a minute), and its pass/fail lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvroute.bench.chat_load import RunResult
from kvroute.bench.closed_loop import WindowResult
from kvroute.bench.prefix import TARGETS
from kvroute.bench.saturate import Row, choose_concurrency, verdict_lines

TARGET_NAMES = ("oracle", "kvroute-kv", "kvroute-rr")


def _table(text: str, header_start: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)))
    return rows


def test_saturate_runs_every_target_and_reports_throughput_ttft_and_ratios(
    tmp_path: Path,
) -> None:
    md = tmp_path / "bench.md"
    argv = [
        sys.executable, "-m", "kvroute.cli", "bench", "prefix", "--saturate",
        "--engine", "emulated", "--targets", ",".join(TARGET_NAMES),
        "--warmup", "1", "--duration", "3", "--ramp-step", "1.5", "--output-md", str(md),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    rows = {r["target"]: r for r in _table(done.stdout, "| target | output tok/s")}
    assert tuple(rows) == TARGET_NAMES
    for row in rows.values():
        assert float(row["output tok/s"]) > 0, row
        assert float(row["TTFT p50 ms"]) > 0, row
        assert float(row["TTFT p90 ms"]) >= float(row["TTFT p50 ms"]), row
        assert int(row["requests"]) > 0 and row["errors"] == "0", row
        assert row["kv_aware ÷ this"].endswith("x"), row
        assert row["hit rate"].endswith("%"), row
    assert rows["kvroute-kv"]["kv_aware ÷ this"] == "1.00x"
    assert "- kv_aware output tokens/s vs oracle's: " in done.stdout
    assert "(target >= 0.95)" in done.stdout
    assert "- kv_aware output tokens/s vs kvroute-rr's: " in done.stdout

    ramp = _table(done.stdout, "| in flight |")
    assert ramp and any("(chosen)" in r["in flight"] for r in ramp)
    assert "conversations in flight (the ramp's " in done.stdout

    recorded = md.read_text()
    assert "## Saturation on emulated replicas, " in recorded
    assert "kvroute bench prefix --saturate --engine emulated" in recorded
    assert done.stdout.strip() in recorded


def _result(tokens_per_s: float, waiting: list[float] | None = None) -> WindowResult:
    result = WindowResult(RunResult("x"), concurrency=6, window_s=10.0)
    result.output_tokens = round(tokens_per_s * 10)
    result.waiting = {"r0": waiting or [1.0], "r1": [1.0]}
    return result


def test_kv_aware_must_reach_095_of_the_oracle_and_beat_every_peer() -> None:
    rows = [
        Row(TARGETS["oracle"], _result(100.0)),
        Row(TARGETS["kvroute-kv"], _result(96.0)),
        Row(TARGETS["kvroute-rr"], _result(60.0)),
        Row(TARGETS["vllm-router-kv"], _result(96.0)),
        Row(TARGETS["smg-ca"], _result(80.0)),
        Row(TARGETS["vllm-router-ca"], error="vllm-router not found"),
    ]
    lines = verdict_lines(rows)
    assert "- kv_aware output tokens/s vs oracle's: 0.96 (target >= 0.95): met" in lines
    assert "- kv_aware output tokens/s vs kvroute-rr's: 1.60" in lines  # ours: no target
    # A tie with a peer is not being ahead of it.
    assert "- kv_aware output tokens/s vs vllm-router-kv's: 1.00 (target > 1.0): NOT met" in lines
    assert "- kv_aware output tokens/s vs smg-ca's: 1.20 (target > 1.0): met" in lines
    assert not any("vllm-router-ca" in line for line in lines)


def test_the_ramp_stops_at_the_first_level_where_every_replica_queues() -> None:
    quiet = _result(50.0, waiting=[0.0, 0.0, 1.0, 0.0])  # r0 queued in 25% of readings
    busy = _result(80.0, waiting=[1.0, 2.0, 3.0, 0.0, 4.0])  # 80%: saturated
    quiet.concurrency, busy.concurrency = 3, 6
    assert quiet.min_queued_share == 0.25
    assert choose_concurrency([quiet, busy]) == 6
    assert choose_concurrency([quiet]) == 3  # none saturated: the highest level tried


def test_rounds_of_one_target_add_up() -> None:
    a, b = _result(30.0, waiting=[1.0, 0.0]), _result(50.0, waiting=[1.0, 1.0])
    a.run.ttfts, b.run.ttfts = [0.1], [0.3, 0.2]
    a.run.hit_rate, b.run.hit_rate = 0.5, 0.7
    both = WindowResult.combined([a, b])
    assert both.window_s == 20.0 and both.output_tokens == 800
    assert both.tokens_per_s == 40.0
    assert sorted(both.run.ttfts) == [0.1, 0.2, 0.3]
    assert both.run.hit_rate == 0.6
    assert both.queued_share("r0") == 0.75
