"""``kvroute plan --explain`` and ``--target-rps``: the capacity arithmetic, checked against a
hand calculation from the raw figures of reference/roofline.md, and what plan prints."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.simulator.capacity import (
    figures_for_preset,
    kv_bytes_per_token,
    kv_capacity_tokens,
    max_decode_tokens_per_s_per_node,
    weight_bytes_per_gpu,
)
from kvroute.simulator.engine.latency import latency_preset

from .helpers import MOONCAKE

# reference/roofline.md, typed in again: H100 SXM5 and Llama-3.1-70B.
H100_HBM = 80e9
H100_BW = 3.35e12
H100_BF16 = 989e12
PARAMS_70B = 70.56e9
KV_70B = 2 * 80 * 8 * 128 * 2  # K and V x layers x KV heads x head_dim x bf16 = 327,680 B


def hand_decode_ceiling_per_node(tp: int, context: float) -> float:
    """Decode tokens/s of an 8-GPU node at the largest batch its KV cache holds at ``context``.

    KV capacity = TP x (0.9 x HBM - 2 GB activations) - weights, in tokens of KV_70B bytes;
    B = floor(capacity / C); step = max(weights/(TP x BW) + B x C x KV/(TP x BW),
    B x (2 x P + 4 x 80 x 8192 x C) / (TP x BF16)); node = (8 / TP) x B / step.
    """
    weights = PARAMS_70B * 2
    capacity = math.floor((tp * (0.9 * H100_HBM - 2e9) - weights) / KV_70B)
    batch = math.floor(capacity / context)
    memory = weights / (tp * H100_BW) + batch * context * KV_70B / (tp * H100_BW)
    compute = batch * (2 * PARAMS_70B + 4 * 80 * 8192 * context) / (tp * H100_BF16)
    return (8 // tp) * batch / max(memory, compute)


@pytest.mark.parametrize(
    ("preset", "tp"), [("llama-3.1-70b-8xh100", 8), ("llama-3.1-70b-4xh100", 4)]
)
@pytest.mark.parametrize("context", [2048.0, 4096.0, 15_000.0])
def test_decode_ceiling_matches_the_hand_calculation(preset: str, tp: int, context: float) -> None:
    figures = figures_for_preset(latency_preset(preset))
    assert figures is not None
    model, hardware = figures
    assert hardware.tensor_parallel == tp and hardware.replicas_per_node == 8 // tp
    got = max_decode_tokens_per_s_per_node(model, hardware, context).value
    assert got == pytest.approx(hand_decode_ceiling_per_node(tp, context), rel=0.01)


def test_the_steps_show_their_figures_and_units() -> None:
    figures = figures_for_preset(latency_preset("llama-3.1-70b-8xh100"))
    assert figures is not None
    model, hw = figures
    assert weight_bytes_per_gpu(model, hw).line() == (
        "weights per GPU = params x bytes/weight / TP = 7.056e+10 x 2 B / 8 = 17.64 GB"
    )
    assert kv_bytes_per_token(model).line() == (
        "KV per token = 2 (K,V) x layers x KV heads x head dim x bytes = 2 x 80 x 8 x 128 x 2 B "
        "= 327,680 B"
    )
    # roofline.md: 70B on 4xH100 (TP4) holds about 420k tokens.
    four = figures_for_preset(latency_preset("llama-3.1-70b-4xh100"))
    assert four is not None
    assert kv_capacity_tokens(*four).value == pytest.approx(420_000, rel=0.02)
    assert figures_for_preset(latency_preset("tiny-cpu")) is None


def _trace_contexts(n: int) -> float:
    """The mean decode context of the first n Mooncake requests: output-weighted input + j."""
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:n]]
    pairs = [(max(1, r["input_length"]), max(1, r["output_length"])) for r in rows]
    return sum(o * (i + (o + 1) / 2) for i, o in pairs) / sum(o for _, o in pairs)


def _number(line: str) -> float:
    """The value at the end of ``name = formula = value unit``."""
    value = line.rsplit(" = ", 1)[1].split()[0]
    return float(value.replace(",", ""))


def test_plan_explain_prints_the_arithmetic_then_the_simulated_answer_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--trace", str(MOONCAKE), "--max-requests", "200", "--quiet"]
    args += ["--preset", "llama-3.1-70b-8xh100", "--slo", "ttft=10,tpot=0.1", "--explain"]
    code = main([*args, "--rate-multipliers", "1", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [line.strip() for line in captured.out.splitlines()]
    assert lines[0] == "analytic sizing at 1x the trace's rate = 2.78 req/s (--explain):"
    named = {line.split(" = ", 1)[0]: line for line in lines if line.count(" = ") >= 2}
    for name in (
        "weights per GPU",
        "KV per token",
        "KV capacity per replica",
        "decode step floor (weights read once per step)",
        "ridge point",
        "max decode tokens/s per node",
        "largest batch with step <= TPOT 100 ms",
        "prefill per replica at MFU 0.53",
        "replicas",
        "nodes",
    ):
        assert name in named, name
    assert named["weights per GPU"].endswith("= 17.64 GB")
    assert named["KV capacity per replica"].endswith("= 1,278,320 tokens")
    assert named["decode step floor (weights read once per step)"].endswith("= 5.27 ms")
    assert named["ridge point"].endswith("= 295 FLOP/B")
    ceiling = _number(named["max decode tokens/s per node"])
    assert named["max decode tokens/s per node"].endswith(" tokens/s")
    assert ceiling == pytest.approx(hand_decode_ceiling_per_node(8, _trace_contexts(200)), rel=0.01)
    # The table, then the analytic count beside the simulated one, and why they differ.
    row = next(line for line in lines if line.startswith("1x "))
    plan = json.loads((tmp_path / "plan.json").read_text())["rows"][0]
    assert row.split()[:5] == [
        "1x",
        "2.78",
        str(plan["replicas"]),
        str(plan["replicas"] * 8),
        str(plan["nodes"]),
    ]
    analytic = int(_number(named["replicas"]))
    assert plan["analytic_replicas"] == analytic
    assert (
        f"1x (2.78 req/s): analytic {analytic} replicas ({analytic} nodes), simulated "
        f"{plan['replicas']} replicas ({plan['nodes']} nodes)"
    ) in captured.out
    assert "why they differ:" in captured.out and "queueing" in captured.out


def test_a_rate_multiplier_of_one_plans_the_base_rate_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--trace", str(MOONCAKE), "--max-requests", "100"]
    code = main([*args, "--slo", "ttft=8,tpot=0.1", "--rate-multipliers", "1,5"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = [line.split()[0] for line in captured.out.splitlines() if re.match(r"\s+\d+x ", line)]
    assert rows == ["1x", "5x"]
    # Every number in a progress line says what it is.
    progress = [line for line in captured.err.splitlines() if "replicas:" in line]
    assert progress
    for line in progress:
        assert re.fullmatch(
            r"  [\d.]+x rate, \d+ replicas: TTFT p99 [\d.]+ s, TPOT p99 [\d.]+ ms, (meets|misses) "
            r"the SLO \(simulated in [\d.]+ s wall time; rate [\d.,]+ req/s, hit rate [\d.]+%, "
            r"[\d,]+ of [\d,]+ requests completed\)",
            line,
        ), line


def test_target_rps_sizes_for_that_rate_in_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--trace", str(MOONCAKE), "--max-requests", "100", "--quiet"]
    args += ["--preset", "llama-3.1-8b-h100", "--slo", "ttft=30", "--target-rps", "100"]
    code = main([*args, "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (row,) = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert row["rate_rps"] == pytest.approx(100)
    assert row["nodes"] == -(-row["replicas"] // 8)  # 8 one-GPU replicas per node
    line = next(line for line in captured.out.splitlines() if "100.00" in line)
    assert line.split()[1:5] == [
        "100.00",
        str(row["replicas"]),
        str(row["gpus"]),
        str(row["nodes"]),
    ]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--target-rps", "0"], "--target-rps: must be > 0"),
        (["--target-rps", "lots"], "--target-rps: not a number"),
        (["--explain", "--preset", "tiny-cpu"], "--explain needs a GPU preset"),
    ],
)
def test_bad_plan_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    argv = ["plan", "--trace", str(MOONCAKE), "--max-requests", "5", "--slo", "ttft=1", *extra]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert expected in err.strip().splitlines()[-1], err
