"""``kvroute sweep`` end to end: a 2 x 2 grid on the Mooncake excerpt on a local Ray, its
table, CSV and plot, each cell against a direct ``kvroute replay``; the sweep resumed on an
existing cluster; bad grid input refused before Ray starts. Two Ray starts in all."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from kvroute.cli import main
from kvroute.simulator.sweep_grid import Cell, cell_status

from .helpers import MOONCAKE

TRACE = ["--trace", str(MOONCAKE), "--max-requests", "120", "--no-plots"]
CELLS = [
    ("kv_aware", 2),
    ("kv_aware", 4),
    ("round_robin", 2),
    ("round_robin", 4),
]
NAMES = [f"{policy}-r{n}-kvpreset-x1" for policy, n in CELLS]
GRID = ["--policies", "kv_aware,round_robin", "--replicas", "2,4"]
SWEEP = ["sweep", *TRACE, *GRID]


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def run(argv: list[str]) -> Run:
    """``kvroute ARGV`` in this process, as a user runs it; its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return Run(code, out.getvalue(), err.getvalue())


def without_wall_time(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "wall_s"}


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    out = tmp_path_factory.mktemp("sweep")
    argv = [*SWEEP, "--out", str(out)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["kvroute", *argv])  # as the console script sees it
        result = run(argv)
    assert result.code == 0, result.stderr
    return out, result


def test_a_sweep_tabulates_every_cell_of_the_grid(swept: tuple[Path, Run]) -> None:
    out, result = swept
    assert "starting 4 cells on a local Ray" in result.stderr
    assert not ray.is_initialized()  # the sweep's own Ray is gone with it
    table = (out / "sweep.md").read_text()
    assert result.stdout == table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows[1:]] == NAMES
    with open(out / "sweep.csv", newline="") as f:
        records = list(csv.DictReader(f))
    assert [(r["policy"], int(r["replicas"])) for r in records] == CELLS
    for record in records:
        summary = json.loads((out / record["cell"] / "summary.json").read_text())
        assert float(record["prefix_hit_rate"]) == summary["prefix_hit_rate"]
        assert float(record["ttft_p99_s"]) == summary["ttft_p99_s"]
        assert int(record["requests"]) == 120
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_cell_is_what_the_kvroute_replay_its_report_quotes_gives(
    swept: tuple[Path, Run], tmp_path: Path
) -> None:
    out, _ = swept
    for (policy, replicas), name in zip(CELLS, NAMES, strict=True):
        report = (out / name / "report.md").read_text()
        argv = ["replay", *TRACE, "--policy", policy, "--replicas", str(replicas)]
        quoted = shlex.join(["kvroute", *argv, "--out", str(out / name)])
        assert f"Reproduce: `{quoted}`" in report
        direct = tmp_path / name
        assert run([*argv, "--quiet", "--out", str(direct)]).code == 0
        swept_summary = json.loads((out / name / "summary.json").read_text())
        direct_summary = json.loads((direct / "summary.json").read_text())
        assert without_wall_time(swept_summary) == without_wall_time(direct_summary)


def test_a_sweep_run_again_runs_only_the_cells_not_done_here_on_a_cluster(
    swept: tuple[Path, Run], tmp_path: Path
) -> None:
    """Resumed on an existing Ray cluster (--ray-address): the missing cell runs there and its
    files come back to --out through the driver."""
    from ray.cluster_utils import Cluster

    out = tmp_path / "again"
    shutil.copytree(swept[0], out)
    redo = out / NAMES[1] / "summary.json"
    redo.unlink()
    kept = {
        name: (out / name / "summary.json").stat().st_mtime_ns for name in NAMES if name != NAMES[1]
    }
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    address = cluster.address
    try:
        result = run([*SWEEP, "--ray-address", address, "--out", str(out)])
    finally:
        cluster.shutdown()
    assert result.code == 0, result.stderr
    assert "resuming: 3 of 4 cells already done" in result.stderr
    assert f"starting 1 cell on {address}" in result.stderr
    assert f"[1/1] {NAMES[1]}:" in result.stderr
    rerun = json.loads(redo.read_text())
    assert without_wall_time(rerun) == without_wall_time(
        json.loads((swept[0] / NAMES[1] / "summary.json").read_text())
    )
    assert {name: (out / name / "summary.json").stat().st_mtime_ns for name in kept} == kept
    assert result.stdout.count("| kv_aware-") + result.stdout.count("| round_robin-") == 4

    again = run([*SWEEP, "--out", str(out)])
    assert again.code == 0
    assert "all 4 cells already done" in again.stderr and "starting" not in again.stderr
    assert again.stdout == result.stdout


def test_a_cell_run_with_other_parameters_is_not_done(swept: tuple[Path, Run]) -> None:
    out, _ = swept
    cell = Cell("kv_aware", 2, None, 1.0)
    record = json.loads((out / cell.name / "cell.json").read_text())
    assert cell_status(str(out), cell, record) == "done"
    record["replay"]["seed"] = 1
    assert cell_status(str(out), cell, record) == "stale"
    assert cell_status(str(out), Cell("kv_aware", 3, None, 1.0), record) == "todo"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "kv_aware,nope", "--replicas", "2"], "unknown policy 'nope'"),
        (["--policies", "kv_aware", "--replicas", "2,0"], "must be at least 1, got 0"),
        (["--policies", "kv_aware", "--replicas", "2", "--capacity", "big"], "not an integer"),
    ],
)
def test_a_bad_grid_is_a_usage_error(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sweep", *TRACE, *argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "no/such/trace.jsonl"], "cannot read trace no/such/trace.jsonl"),
        ([*TRACE, "--fail", "3@10"], "--fail 3@...: replicas are numbered 0..1"),
        ([*TRACE, "--policy-param", "nope=1"], "--policy-param nope: no policy of kv_aware"),
        (
            [*TRACE, "--policy-param", "margin_ratio=-1"],
            "policy 'kv_aware': margin_ratio must be a finite",
        ),
    ],
)
def test_bad_input_fails_before_ray_starts(argv: list[str], message: str, tmp_path: Path) -> None:
    result = run(
        [
            "sweep",
            *argv,
            "--policies",
            "kv_aware",
            "--replicas",
            "2,4",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert result.code == 2
    assert result.stderr.startswith(f"kvroute sweep: {message}")
    assert "starting" not in result.stderr and not ray.is_initialized()
    assert not (tmp_path / "out").exists()  # nothing written
