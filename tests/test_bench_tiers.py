"""``kvroute bench tiers`` at a small scale: the GPU+CPU fleet serves llm-d's tiered workload
shape faster than the GPU-only one, and the table says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvroute.cli import main


def test_bench_tiers_records_the_gain_of_a_cpu_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    md = tmp_path / "BENCH.md"
    argv = ["bench", "tiers", "--rates", "10", "--duration", "60", "--output-md", str(md)]
    assert main(argv) == 0
    text = md.read_text()
    assert (
        "Command: `kvroute bench tiers --rates 10 --arms gpu-only,cpu-flat,cpu-weights,cpu-time "
        "--duration 60 --replicas 8 --seed 0`"
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
