"""Prefill/decode disaggregation in the simulator: ``kvroute replay --pd P:D`` and ``kvroute
plan --pd``, on small synthetic traces and the Mooncake excerpt (tests/data)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.kvcore.pd import CACHED, SPLIT, DisaggregationRule, link_bytes_per_s, transfer_s
from kvroute.policies import build_policy
from kvroute.simulator.engine.latency import latency_preset
from kvroute.simulator.fleet import FleetConfig, SimResult, engine_config, prepare, simulate
from kvroute.simulator.fleet.bounds import prefill_alone_s
from kvroute.simulator.fleet.pd_search import search_pd
from kvroute.simulator.fleet.pd_setup import PdSetup
from kvroute.simulator.traces.model import Trace, TraceRequest

from .helpers import MOONCAKE

L70 = latency_preset("llama-3.1-70b-8xh100")
BLOCK = 512  # tokens per trace block, as Mooncake's


def _run(trace: Trace, pd: PdSetup | None, replicas: int = 2) -> SimResult:
    config = FleetConfig(
        replicas=pd.replicas if pd is not None else replicas,
        engine=engine_config(L70, 400_000),
        pd=pd,
    )
    return simulate(prepare(trace), build_policy("kv_aware", {"seed": 0}), config)


def _request(at: float, blocks: range, extra: int = 0, output: int = 8) -> TraceRequest:
    return TraceRequest(at, len(blocks) * BLOCK + extra, output, tuple(blocks))


def test_a_split_requests_ttft_is_its_prefill_plus_the_transfer_plus_one_decode_step() -> None:
    trace = Trace("one", BLOCK, (_request(0.0, range(1, 13)),))  # 6,144 prompt tokens
    prompt = trace.requests[0].input_tokens
    pd = _run(trace, PdSetup(1, 1, DisaggregationRule("always")))
    alone = _run(trace, None, replicas=1)

    prefill = prefill_alone_s(prepare(trace), engine_config(L70, 400_000), cached=False)[0]
    moved = transfer_s(prompt, L70.kv_bytes_per_token, link_bytes_per_s("rdma", L70.num_gpus))
    first_step = L70.step_time(1, prompt, prompt)  # its last prompt token, on the decode side
    assert pd.pd is not None and pd.pd.decision == [SPLIT]
    assert pd.pd.transfer_tokens == [prompt]  # the decode replica held none of it
    assert pd.pd.prefill_done_s[0] == pytest.approx(prefill)
    assert pd.pd.transfer_s[0] == pytest.approx(moved) and moved > 0.002
    assert pd.first_token_s[0] == pytest.approx(prefill + moved + first_step)
    # Aggregated, the same request's first token comes with its prefill alone.
    assert alone.first_token_s[0] == pytest.approx(prefill)
    # The client's TPOT is the decode replica's: every token is decoded there.
    assert pd.finish_s[0] > pd.first_token_s[0]
    assert pd.replica[0] == 1  # d0: the fleet's prefill pool comes first


def test_a_prompt_cached_on_its_decode_replica_is_not_split_and_only_new_kv_moves() -> None:
    first = _request(0.0, range(1, 9))  # 4,096 tokens: split, its KV lands on d0
    follow_up = _request(30.0, range(1, 10), extra=0, output=4)  # + 1 block: 512 new tokens
    short_turn = TraceRequest(60.0, 9 * BLOCK + 200, 4, (*range(1, 10), 99))  # + 200 new tokens
    trace = Trace("turns", BLOCK, (first, follow_up, short_turn))

    conditional = _run(trace, PdSetup(1, 1))
    assert conditional.pd is not None
    assert conditional.pd.decision == [SPLIT, SPLIT, CACHED]
    assert conditional.pd.prefill_replica[2] == -1  # prefilled where it decodes
    assert math.isnan(conditional.pd.transfer_s[2])
    assert conditional.hit_tokens[2] == 9 * BLOCK  # found on the decode replica
    assert conditional.routed_requests == [2, 3]  # p0 prefilled two, d0 served all three

    always = _run(trace, PdSetup(1, 1, DisaggregationRule("always")))
    assert always.pd is not None and always.pd.decision == [SPLIT] * 3
    # Only what the decode replica lacked moved: the whole first prompt, then the new tokens.
    assert always.pd.transfer_tokens == [8 * BLOCK, BLOCK, 200]


def _replay(tmp_path: Path, *extra: str, requests: int = 40) -> dict[str, object]:
    out = tmp_path / "run"
    code = main(
        [
            "replay",
            "--trace",
            str(MOONCAKE),
            "--max-requests",
            str(requests),
            "--preset",
            "llama-3.1-70b-8xh100",
            "--slo",
            "ttft=10,tpot=0.05",
            "--no-plots",
            "--quiet",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    summary["report"] = (out / "report.md").read_text()
    return summary


def test_pd_mode_always_splits_every_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = _replay(tmp_path, "--pd", "1:2", "--pd-mode", "always")
    pd = summary["pd"]
    assert isinstance(pd, dict)
    assert pd["mode"] == "always" and pd["split_share"] == 1.0
    assert pd["decisions"] == {SPLIT: 40}
    assert summary["completed"] == 40
    out = capsys.readouterr().out
    assert "P/D (kv_aware): 1 prefill + 2 decode, always: 100% split" in out


def test_pd_replica_counts_are_the_fleet(tmp_path: Path) -> None:
    summary = _replay(tmp_path, "--pd", "2:3", "--kv-link", "nvlink", requests=60)
    pd = summary["pd"]
    assert isinstance(pd, dict)
    assert summary["replicas"] == 5
    assert (pd["prefill_replicas"], pd["decode_replicas"]) == (2, 3)
    assert pd["link_bytes_per_s"] == 450e9
    routed = summary["routed_requests_per_replica"]
    assert isinstance(routed, list) and len(routed) == 5
    # The prefill pool saw the split requests only; every request went through the decode pool.
    assert sum(routed[:2]) == pd["decisions"][SPLIT] > 0
    assert sum(routed[2:]) == 60 == summary["completed"]
    assert all(n > 0 for n in routed)
    assert "- P/D disaggregation: 2 prefill + 3 decode replicas, conditional" in str(
        summary["report"]
    )


def test_plan_pd_compares_aggregated_disaggregated_and_conditional(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "plan",
            "--trace",
            str(MOONCAKE),
            "--max-requests",
            "40",
            "--preset",
            "llama-3.1-70b-8xh100",
            "--slo",
            "ttft=10,tpot=0.05",
            "--pd",
            "--quiet",
            "--out",
            str(tmp_path),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = [line.split() for line in captured.out.splitlines()]
    labels = [r[0] for r in rows if r and r[0] in ("aggregated", "disaggregated", "conditional")]
    assert labels == ["aggregated", "disaggregated", "conditional"]
    assert "goodput/GPU" in captured.out and "split" in captured.out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [r["fleet"] for r in plan["rows"]] == ["aggregated", "always", "conditional"]
    aggregated, always, conditional = plan["rows"]
    assert aggregated["prefill"] is None and aggregated["split_share"] is None
    assert always["split_share"] == 1.0
    for row in plan["rows"]:
        assert row["ok"], row
        assert row["gpus"] == 8 * row["replicas"]
        assert row["ttft_p99_s"] <= 10 and row["tpot_p99_s"] <= 0.05
        assert row["goodput_per_gpu"] == pytest.approx(row["goodput_rps"] / row["gpus"])
    for row in (always, conditional):
        assert row["prefill"] + row["decode"] == row["replicas"]
        assert [row["prefill"], row["decode"]] in row["simulated"]
        # The table's size column is P+D.
        assert f"{row['prefill']}+{row['decode']}" in captured.out


def test_pd_search_finds_the_fewest_replicas_with_few_tries() -> None:
    tried: list[tuple[int, int]] = []

    def meets(p: int, d: int) -> bool:  # needs 9 prefill and 3 decode replicas
        tried.append((p, d))
        return p >= 9 and d >= 3

    search = search_pd(meets, around=16, max_replicas=1024)
    assert search.best == (9, 3)
    assert len(tried) <= 16 and len(set(tried)) == len(tried)
    # Nothing meets: the search stops at the limit and says so with no best.
    assert search_pd(lambda p, d: False, around=2, max_replicas=12).best is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--pd", "3"], "expected P:D"),
        (["--pd", "0:2"], "at least 1 prefill and 1 decode"),
        (["--pd", "a:b"], "expected P:D"),
        (["--pd-mode", "always"], "--pd-mode goes with --pd P:D"),
        (["--pd", "1:1", "--pd-mode", "never"], "--pd-mode"),
        (["--pd", "1:1", "--kv-link", "warp"], "unknown link 'warp'"),
        (["--pd", "1:1", "--kv-link", "-5"], "above 0 GB/s"),
        (["--pd", "1:1", "--pd-min-uncached", "-1"], "--pd-min-uncached"),
        (["--pd", "1:1", "--replicas", "3"], "--replicas 3 and --pd 1:1 disagree"),
        (["--pd", "1:1", "--fail", "0@1"], "--fail: not modelled with --pd"),
        (["--pd", "1:1", "--engine-model", "exact"], "--engine-model exact: not modelled"),
    ],
)
def test_bad_pd_flags_are_one_clear_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    argv = ["replay", "--trace", str(MOONCAKE), "--max-requests", "5"]
    code = _exit_code([*argv, "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert expected in err.strip().splitlines()[-1], err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--pd", "--rate-multipliers", "2"], "--rate-multipliers does not go with --pd"),
        (["--kv-link", "rdma"], "--kv-link goes with --pd"),
        (["--pd", "--kv-link", "0"], "above 0 GB/s"),
    ],
)
def test_bad_plan_pd_flags_are_one_clear_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    argv = ["plan", "--trace", str(MOONCAKE), "--max-requests", "5", "--slo", "ttft=10"]
    code = _exit_code([*argv, "--quiet", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert expected in err.strip().splitlines()[-1], err


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)
