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


# -- plan --kv: the KV budget ----------------------------------------------------------------


def _plan_out(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out.splitlines()


def test_kv_budget_70b_at_128k_batch_32_does_not_fit_and_ranks_the_levers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--kv", "--preset", "llama-3.1-70b-8xh100", "--context", "131072", "--batch", "32"]
    lines = _plan_out(capsys, argv)
    # Needed: 32 x 131,072 x 327,680 B; available: 8 x (0.9 x 80 GB - 2 GB) - 141.12 GB.
    need = 32 * 131_072 * KV_70B
    assert need == 1_374_389_534_720
    avail = 8 * (0.9 * H100_HBM - 2e9) - PARAMS_70B * 2
    assert avail == pytest.approx(418.88e9)
    assert lines[0] == (
        "KV budget: llama-3.1-70b on 8xH100 (TP 8), context 131,072 tokens, batch 32"
    )
    assert lines[2] == (
        "KV needed = batch x context x KV per token = 32 x 131,072 x 327,680 B = 1,374.39 GB"
    )
    assert lines[3].endswith("= 418.88 GB")
    short = (need - avail) / 1e9
    assert f"{short:,.1f}" == "955.5"
    assert lines[4] == (
        "does not fit: short by 955.5 GB (69.5% of the need); largest batch at this context 9"
    )
    assert math.floor(avail / (131_072 * KV_70B)) == 9
    levers = [line for line in lines if re.match(r"\d\. ", line)]
    assert [lv.split(":")[0] for lv in levers] == [
        "1. GQA (8 KV heads) vs MHA",
        "2. offload KV to host memory",
        "3. context parallelism over 4 replicas' GPUs",
        "4. smaller batch (9)",
        "5. FP8 KV cache",
        "6. paging with preemption",
    ]
    out = "\n".join(lines)
    # FP8 halves the bytes: 163,840 B per token, 687.2 GB needed, still 268.3 GB short.
    assert (
        "5. FP8 KV cache: x2.00: KV per token 327,680 B x 1/2 = 163,840 B; KV needed 687.2 GB: "
        "still short by 268.3 GB; largest batch 19"
    ) in out
    assert "x8.00: already in this model" in out and "it would need 10,995.1 GB" in out
    # Offload: the 955.5 GB shortfall over 8 links at 64 GB/s, every step.
    assert f"= {short * 1e9 / (8 * 64e9) * 1e3:,.0f} ms added per step" in out
    assert "1,866 ms added per step" in out
    # Context parallelism: ceil(1,374.4 / 418.9) = 4 replicas' GPUs hold it.
    assert "4 x 8 = 32 GPUs each hold 1/4 of every sequence's KV: 1,675.5 GB available, fits" in out
    # The smaller batch's throughput cost comes from the decode roofline.
    assert "decode 457 tokens/s per replica at B=9 vs 566 at B=32 if it fitted (-19%" in out
    assert "recomputes its prefill: 131,072 tokens at" in out
    assert lines[-1].startswith("assumptions: host offload over PCIe Gen5 x16 at 64 GB/s per GPU")


def test_kv_budget_of_the_moe_preset_fits_with_mla(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--kv", "--preset", "deepseek-v3-8xh200", "--context", "131072", "--batch", "32"]
    lines = _plan_out(capsys, argv)
    assert lines[1] == (
        "KV per token = layers x (kv_lora_rank 512 + rope dim 64) x bytes = 61 x 576 x 2 B "
        "= 70,272 B"
    )
    # 8 x (0.9 x 141 GB - 2 GB) - 671 GB of FP8 weights = 328.2 GB for KV.
    assert lines[3].endswith("= 328.20 GB")
    assert lines[4] == "fits: 33.5 GB spare (11% of the need); largest batch at this context 35"
    assert any(line.startswith("1. MLA vs MHA: x56.89: already in this model") for line in lines)
    assert any("nothing to offload" in line for line in lines)


def test_moe_and_fp8_figures() -> None:
    from kvroute.simulator.capacity import figures_by_name, weights_read_bytes
    from kvroute.simulator.fleet.config import default_kv_capacity_tokens

    ds = figures_by_name("deepseek-v3-8xh200")
    assert ds is not None
    model, hw = ds
    # Shared + 8 of 256 experts is the published 37B active; a big batch touches them all.
    assert weights_read_bytes(model, 1) == pytest.approx(37e9, rel=0.02)
    assert weights_read_bytes(model, 2000) == pytest.approx(671e9, rel=1e-3)
    assert hw.fp8_compute and hw.flops == 1979e12
    # FP8 Llama: 1 byte per weight and per KV element, the FP8 peak, twice the KV tokens.
    fp8 = latency_preset("llama-3.1-70b-8xh100-fp8")
    bf16 = latency_preset("llama-3.1-70b-8xh100")
    assert fp8.kv_bytes_per_token == KV_70B / 2 and fp8.weight_bytes == PARAMS_70B
    assert fp8.peak_flops == 1979e12
    assert default_kv_capacity_tokens(fp8) > 2 * default_kv_capacity_tokens(bf16)
    figures = figures_by_name("llama-3.1-70b-8xh100-fp8")
    assert figures is not None and figures[1].fp8_compute and figures[1].bf16_flops == H100_BF16
    assert figures_by_name("tiny-cpu") is None


def test_mla_under_tensor_parallel_attention_holds_one_eighth_of_data_parallel_s_kv() -> None:
    """MLA's latent has no heads to split: TP attention keeps it whole on every GPU, so an
    8-GPU node holds 1/8 the tokens it holds with each GPU a data-parallel attention rank, and
    every GPU reads all of it each step; per-head KV (GQA) is unaffected."""
    from kvroute.simulator.capacity import (
        decode_step_s,
        figures_by_name,
        kv_capacity_tokens,
        kv_copies,
        kv_levers,
    )

    dp, tp = figures_by_name("deepseek-v3-8xh200"), figures_by_name("deepseek-v3-8xh200-tp8")
    assert dp is not None and tp is not None
    (model, dp_hw), (_, tp_hw) = dp, tp
    assert (kv_copies(model, dp_hw), kv_copies(model, tp_hw)) == (1, 8)
    dp_tokens = kv_capacity_tokens(model, dp_hw).value
    assert kv_capacity_tokens(model, tp_hw).value == pytest.approx(dp_tokens / 8, abs=1)
    assert decode_step_s(model, tp_hw, 32, 8192).value > decode_step_s(model, dp_hw, 32, 8192).value
    gqa = figures_by_name("llama-3.1-70b-8xh100")
    assert gqa is not None and kv_copies(*gqa) == 1
    # Under TP, data-parallel attention is a lever worth the copies; with DP there is none.
    assert any(lv.name == "data-parallel attention" and lv.factor == 8 for lv in
               kv_levers(model, tp_hw, 131072, 32))  # fmt: skip
    assert not any(lv.name == "data-parallel attention" for lv in
                   kv_levers(model, dp_hw, 131072, 32))  # fmt: skip


def test_plan_explain_sizes_a_data_parallel_attention_fleet_smaller(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nodes = {}
    for preset in ("deepseek-v3-8xh200", "deepseek-v3-8xh200-tp8"):
        argv = ["plan", "--explain", "--preset", preset, "--trace", str(MOONCAKE)]
        argv += ["--slo", "ttft=2,tpot=0.05", "--target-rps", "20"]
        main(argv)
        out = capsys.readouterr().out
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith("nodes = ")]
        nodes[preset] = int(line.rsplit("=", 1)[1])
        if preset.endswith("tp8"):
            assert "TP 8" in out and "8 copies (MLA under TP)" in out
        else:
            assert "attention DP 8" in out and "--max-num-seqs 256 x 8 ranks" in out
    assert nodes["deepseek-v3-8xh200"] < nodes["deepseek-v3-8xh200-tp8"], nodes


def test_plan_explain_of_the_moe_preset_prices_it_without_simulating(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--trace", str(MOONCAKE), "--max-requests", "200", "--preset", "deepseek-v3-8xh200"]
    lines = _plan_out(
        capsys, [*argv, "--slo", "ttft=10,tpot=0.1", "--explain", "--gpu-price", "2.5"]
    )
    named = {line.strip().split(" = ", 1)[0]: line for line in lines if line.count(" = ") >= 2}
    ceiling = _number(named["max decode tokens/s per node"])
    cost = _number(named["decode cost per million output tokens at the node ceiling"])
    assert cost == pytest.approx(8 * 2.5 / 3600 / ceiling * 1e6, rel=0.01)
    assert "analytic cost per million tokens" in named
    assert lines[-1].startswith("no simulation: deepseek-v3-8xh200 has capacity figures only")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--kv", "--context", "1000"], "--kv needs --context TOKENS and --batch N"),
        (["--context", "1000", "--batch", "2"], "--context and --batch go with --kv"),
        (["--slo", "ttft=1"], "--trace is required"),
        (["--trace", str(MOONCAKE)], "--slo is required"),
        (
            ["--trace", str(MOONCAKE), "--slo", "ttft=1", "--preset", "deepseek-v3-8xh200"],
            "capacity figures only",
        ),
        (["--kv", "--context", "9", "--batch", "1", "--preset", "tiny-cpu"], "has none"),
    ],
)
def test_bad_kv_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    code = main(["plan", *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
