"""``kvroute replay`` and ``kvroute plan`` end to end, on a slice of the real Mooncake trace and
on bad input (one line on stderr, exit status 2, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"

SUMMARY_KEYS = {
    "policy",
    "replicas",
    "requests",
    "kv_capacity_tokens_per_replica",
    "prefix_hit_rate",
    "infinite_cache_hit_rate",
    "pooled_lru_hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "goodput_rps",
    "load_max_over_mean",
    "wall_s",
}

needs_mooncake = pytest.mark.skipif(
    not MOONCAKE.is_file(), reason=f"the Mooncake trace is not at {MOONCAKE}"
)


@needs_mooncake
def test_replay_compares_policies_on_a_mooncake_slice_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "replay",
            "--trace",
            str(MOONCAKE),
            "--max-requests",
            "300",
            "--replicas",
            "4",
            "--compare",
            "kv_aware,round_robin",
            "--kv-capacity-tokens",
            "200000",
            "--slo",
            "ttft=2,tpot=0.05",
            "--fail",
            "1@40",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert summary["policy"] == "kv_aware"
    assert summary["replicas"] == 4 and summary["requests"] == 300
    assert summary["kv_capacity_tokens_per_replica"] == 200000
    assert [r["policy"] for r in summary["runs"]] == ["kv_aware", "round_robin"]
    for run in summary["runs"]:
        assert run["completed"] == 300
        assert run["failed_replicas"] == [1]
        assert 0 <= run["prefix_hit_rate"] <= run["infinite_cache_hit_rate"] <= 1
        assert run["ttft_p50_s"] <= run["ttft_p99_s"]
    assert summary["prefix_hit_rate"] > summary["runs"][1]["prefix_hit_rate"]
    report = (out / "report.md").read_text()
    assert "| kv_aware |" in report and "| round_robin |" in report
    for png in ("ttft_cdf.png", "tpot_cdf.png", "hit_rate_over_time.png", "load_per_replica.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png in report
    # The terminal gets the table and the progress bar.
    assert "kv_aware" in captured.out and "round_robin" in captured.out
    assert "100%" in captured.err


@needs_mooncake
def test_plan_finds_the_smallest_fleet_meeting_the_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "plan",
            "--trace",
            str(MOONCAKE),
            "--max-requests",
            "100",
            "--slo",
            "ttft=8,tpot=0.1",
            "--rate-multipliers",
            "4",
            "--gpu-price",
            "2.5",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    plan = json.loads((tmp_path / "plan.json").read_text())
    one, four = plan["rows"]
    assert one["rate_multiplier"] == 1 and four["rate_multiplier"] == 4
    assert 1 <= one["replicas"] <= four["replicas"]
    # Minimal: the fleet one smaller was simulated and missed the SLO (unless it is 1).
    for row in (one, four):
        assert row["ttft_s"] <= 8 and row["tpot_s"] <= 0.1
        if row["replicas"] > 1:
            assert row["replicas"] - 1 in row["simulated"]
        assert row["cost_per_million_tokens_usd"] > 0
    assert "$/M tokens" in captured.out


@needs_mooncake
def test_plan_says_when_no_fleet_size_can_meet_the_slo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The slice holds a prompt whose prefill alone takes seconds: no fleet gets p99 under 1 s.
    args = ["plan", "--trace", str(MOONCAKE), "--max-requests", "100", "--quiet"]
    code = main([*args, "--slo", "ttft=1", "--rate-multipliers", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("unreachable: ") == 2 and "more replicas do not help" in out


def _bad_trace(tmp_path: Path) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{oops\n'
    )
    return str(path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["replay", "--trace", "/nonexistent/trace.jsonl", "--out", "{out}"], "trace.jsonl"),
        (["replay", "--trace", "{bad}", "--format", "mooncake", "--out", "{out}"], "bad.jsonl:2"),
        (["replay", "--trace", "{mooncake}", "--slo", "ttft=fast", "--out", "{out}"], "--slo"),
        (["replay", "--trace", "{mooncake}", "--fail", "x@3", "--out", "{out}"], "--fail"),
        (["replay", "--trace", "{mooncake}", "--policy", "nope", "--out", "{out}"], "nope"),
        (["replay", "--trace", "{mooncake}", "--replicas", "0", "--out", "{out}"], "--replicas"),
        (
            [
                "replay",
                "--trace",
                "{mooncake}",
                "--max-requests",
                "5",
                "--fail",
                "4@1",
                "--out",
                "{out}",
            ],
            "replicas are numbered 0..3",
        ),
        (["replay", "--trace", "{mooncake}", "--max-requests", "5"], "--out"),
        (["plan", "--trace", "{mooncake}"], "--slo"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    values = {"out": str(tmp_path / "o"), "bad": _bad_trace(tmp_path), "mooncake": str(MOONCAKE)}
    argv = [a.format(**values) for a in args]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert expected in last, err
