"""``kvroute replay`` and ``kvroute plan`` end to end, on excerpts of the public traces
(tests/data) and on bad input (one line on stderr, exit status 2, no traceback)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import main

from .fake_replica import FakeReplica
from .helpers import AZURE_CONV, MOONCAKE

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
            "--no-slo-routing",  # on this slice most prompts miss 2 s anywhere
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
    # This slice has little reuse (both near the pooled bound): kv_aware wins on load.
    rr = summary["runs"][1]
    assert summary["prefix_hit_rate"] >= 0.95 * rr["prefix_hit_rate"]
    assert summary["ttft_p50_s"] < rr["ttft_p50_s"]
    report = (out / "report.md").read_text()
    assert "| kv_aware |" in report and "| round_robin |" in report
    for png in ("ttft_cdf.png", "tpot_cdf.png", "hit_rate_over_time.png", "load_per_replica.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png in report
    # The terminal gets the table and the progress bar.
    assert "kv_aware" in captured.out and "round_robin" in captured.out
    assert "100%" in captured.err


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


def test_plan_says_where_it_stopped_and_why_no_fleet_size_meets_the_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The slice holds prompts whose prefill alone takes seconds: no fleet gets p99 under 1 s.
    args = ["plan", "--trace", str(MOONCAKE), "--max-requests", "100", "--out", str(tmp_path)]
    code = main([*args, "--slo", "ttft=1", "--rate-multipliers", "2"])
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())  # the explanation is wrapped to the terminal
    assert code == 0
    # The row shows the largest fleet simulated, not "> max", and says it missed.
    row = next(line for line in captured.out.splitlines() if line.strip().startswith("1x"))
    assert row.split()[2:4] == ["8", "(miss)"] and "> max" not in captured.out
    for rate_stop in (
        "no fleet size meets the SLO: the search stopped at 8 replicas (limit: --max-replicas "
        "1024): TTFT p99 6.524 s > 1 s, as at 4 replicas (TTFT p99 6.536 s): more replicas do "
        "not help",
        "no fleet size meets the SLO: the search stopped at 64 replicas (limit: --max-replicas "
        "1024): TTFT p99 6.532 s > 1 s, as at 32 replicas (TTFT p99 6.532 s): more replicas do "
        "not help",
    ):
        assert out.count(rate_stop) == 1  # one per rate
    assert (
        "why: 18 of 100 requests (18.0%) take longer than 1 s for prefill alone on an idle "
        "replica of llama-3.1-8b-h100 with every reusable prefix cached (a lower bound on TTFT "
        "at any fleet size): its p99 is 6.52 s, so no fleet size gets TTFT p99 within 1 s. The "
        "longest prompt, 120,633 tokens, takes 11.0 s to prefill from scratch"
    ) in out
    # Progress lines label their wall time.
    progress = "1x rate, 8 replicas: TTFT p99 6.524 s, TPOT p99 208.4 ms, misses the SLO"
    assert f"{progress} (simulated in " in captured.err
    row_json = json.loads((tmp_path / "plan.json").read_text())["rows"][0]
    assert row_json["replicas"] is None and row_json["simulated"][-1] == 8
    assert row_json["largest_tried"]["replicas"] == 8
    assert row_json["largest_tried"]["ttft_s"] == pytest.approx(6.524, abs=0.001)
    assert row_json["unreachable"].startswith("no fleet size meets the SLO")
    assert row_json["why"][0].startswith("18 of 100 requests")


def test_plan_at_its_replica_limit_says_a_larger_fleet_may_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--trace", str(MOONCAKE), "--max-requests", "100", "--max-replicas", "2"]
    code = main([*args, "--quiet", "--slo", "ttft=8,tpot=0.1", "--rate-multipliers", "4"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert (
        "no fleet of up to 2 replicas meets the SLO: the search stopped at the limit, "
        "--max-replicas 2: TTFT p99 11.250 s > 8 s; TPOT p99 332.4 ms > 100 ms"
    ) in out
    assert "a fleet larger than 2 replicas may meet the SLO (raise --max-replicas)" in out
    assert "more replicas do not help" not in out and "no fleet size" not in out


def _replay(tmp_path: Path, trace: Path, *extra: str) -> tuple[dict[str, Any], str]:
    """Run ``kvroute replay`` quietly: its summary.json and report.md."""
    out = tmp_path / "run"
    argv = ["replay", "--trace", str(trace), "--out", str(out), "--no-plots", "--quiet", *extra]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()


def test_replay_of_a_fleet_that_keeps_up_warns_of_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary, report = _replay(tmp_path, MOONCAKE, "--max-requests", "300", "--replicas", "8")
    out = capsys.readouterr().out
    assert summary["completed"] == 300
    assert summary["warnings"] == [] and "WARNING" not in out and "## Warnings" not in report
    assert summary["prefixes"] == "trace" and summary["notes"] == [] and "note:" not in out


def test_replay_warns_when_requests_do_not_finish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 17 of the first 300 prompts (with their output) exceed a 50,000-token KV cache.
    extra = ("--max-requests", "300", "--replicas", "8", "--kv-capacity-tokens", "50000")
    summary, report = _replay(tmp_path, MOONCAKE, *extra)
    out = capsys.readouterr().out
    expected = (
        "17 of 300 requests did not finish: 17 need more KV cache than one replica holds "
        "(50,000 tokens; see --kv-capacity-tokens). Latencies and goodput leave them out."
    )
    assert f"WARNING: {expected}" in out.splitlines()
    assert summary["warnings"][0] == expected and summary["rejected"] == 17
    assert f"- **{expected}**" in report


def test_replay_warns_when_the_queue_grows_through_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 600 requests in 201 s on one replica: the Mooncake slice needs about four.
    summary, report = _replay(tmp_path, MOONCAKE, "--replicas", "1")
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("WARNING: "))
    assert warning.startswith(
        "WARNING: the fleet is overloaded: the median request waited 197 s for its first token "
        "beyond its own prefill (0.31 s median, alone on an idle replica), 27 s in the first "
        "quarter of arrivals and 344 s in the last; the last request finished 390 s after the "
        "last arrival."
    )
    assert summary["completed"] == 600 and summary["ttft_p50_s"] > 100
    assert summary["warnings"] == [warning.removeprefix("WARNING: ")]
    assert "## Warnings" in report and "the fleet is overloaded" in report


def test_replay_on_azure_says_its_prefixes_are_synthetic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ("--max-requests", "300", "--replicas", "2")
    summary, report = _replay(tmp_path, AZURE_CONV, *extra)
    out = capsys.readouterr().out
    assert summary["prefixes"] == "synthetic"
    assert summary["notes"][0].startswith("hit rates rest on synthetic prefixes: the Azure 2023")
    assert f"note: {summary['notes'][0]}" in out.splitlines()
    assert f"- prefixes: {summary['notes'][0]}" in report
    assert summary["warnings"] == []


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


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_live_replay_against_no_router_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    code = main(["replay", "--trace", "multi-tenant:duration=2", "--live", url])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        next(line for line in err.splitlines() if line.startswith("kvroute replay: "))
    ]
    assert f"cannot reach the router at {url}" in err


async def test_live_replay_flags_shape_the_requests_sent(tmp_path: Path) -> None:
    replica = await FakeReplica("r0").start()
    try:
        argv = [
            "replay",
            "--trace",
            "multi-tenant:tenants=2,rate=20,duration=1,system_tokens=256,prompt_tokens=64,"
            "output_tokens=40",
            "--live",
            replica.url,
            "--tokens-per-block",
            "8",
            "--max-prompt-tokens",
            "20",
            "--max-output-tokens",
            "3",
            "--concurrency",
            "2",
            "--out",
            str(tmp_path),
        ]
        code = await asyncio.to_thread(main, argv)
    finally:
        await replica.stop()
    assert code == 0
    summary = json.loads((tmp_path / "live_summary.json").read_text())
    assert summary["tokens_per_block"] == 8 and summary["max_prompt_tokens"] == 20
    bodies = [seen.body for seen in replica.seen]
    assert len(bodies) == summary["sent"] > 5
    assert all(body["max_tokens"] <= 3 for body in bodies)
    # 64-token blocks as 8 words: a 256-token system prompt alone would be 32 words; capped at 20.
    assert max(len(body["prompt"].split()) for body in bodies) == 20


def test_replay_and_plan_help_explain_synthetic_specs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("replay", "plan"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "multi-tenant  requests with a per-tenant system prompt" in out
        assert "Example: 'multi-tenant:tenants=8,rate=4,duration=600'" in out


def test_fidelity_fit_recovers_the_step_cost_and_prefill_rate_of_its_probes() -> None:
    from dataclasses import replace

    from kvroute.simulator.engine.latency import TINY_CPU
    from kvroute.simulator.fleet.calibration import fit_latency

    truth = replace(TINY_CPU, peak_flops=4e9, mfu=1.0, step_overhead_s=0.05)
    api = 0.2
    probes = [
        (n, api + truth.step_time(n, n * (n + 1) // 2, n), truth.step_overhead_s + 0.001 * k)
        for k, n in enumerate((40, 400, 800, 1200, 1600))
    ]
    fit = fit_latency(probes)
    assert fit.model.step_overhead_s == pytest.approx(0.052)  # the median TPOT
    assert fit.model.peak_flops * fit.model.mfu == pytest.approx(4e9, rel=1e-6)
    assert fit.api_overhead_s == pytest.approx(api - 0.002, abs=1e-6)


def test_fidelity_trace_shares_blocks_exactly_where_token_prefixes_are_equal() -> None:
    from kvroute.simulator.fleet.calibration import tokenized_trace
    from kvroute.simulator.traces import Trace, TraceRequest
    from kvroute.simulator.traces.prompts import PromptBuilder

    trace = Trace(
        "t",
        64,
        (
            TraceRequest(10.0, 64 * 3, 4, (1, 2, 3)),
            TraceRequest(12.0, 64 * 3, 0, (1, 2, 9)),
        ),
    )

    def encode(text: str) -> list[int]:  # two tokens a word: blocks do not align with words
        return [t for word in text.split() for t in (ord(word[0]), ord(word[1]) * 7 + ord(word[2]))]

    out = tokenized_trace(trace, PromptBuilder(64, 20), encode, 32, 2.0)
    one, two = out.requests
    assert out.block_tokens == 32
    assert (one.arrival_s, two.arrival_s) == (0.0, 4.0)  # from the first arrival, time x2
    assert one.input_tokens == two.input_tokens == 120  # 60 words, 2 tokens each
    assert (one.output_tokens, two.output_tokens) == (4, 1)
    # 40 words (80 tokens) in common: the first two 32-token blocks are shared, no more.
    shared = sum(a == b for a, b in zip(one.block_ids, two.block_ids, strict=True))
    assert shared == 2 and one.block_ids[:2] == two.block_ids[:2]


def test_replay_routes_against_its_slo_unless_told_to_only_measure_it(tmp_path: Path) -> None:
    reasons = {}
    for flag in ([], ["--no-slo-routing"]):
        out = tmp_path / ("measured" if flag else "routed")
        args = ["replay", "--trace", str(MOONCAKE), "--max-requests", "200", "--replicas", "2"]
        args += ["--slo", "ttft=0.001", "--quiet", "--no-plots", "--out", str(out), *flag]
        assert main(args) == 0
        summary = json.loads((out / "summary.json").read_text())
        reasons[bool(flag)] = summary["decision_reasons"]
    # 1 ms is beyond any prefill: routed against it, every decision says no replica meets it.
    assert reasons[False] == {"kv_slo_miss": 200}
    assert "kv_slo_miss" not in reasons[True]
