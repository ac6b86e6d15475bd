"""Capacity arithmetic from a model's and a GPU's public figures: what ``kvroute plan --explain``
prints before it simulates anything.

Every function is pure (no I/O, no clock) and returns a ``Quantity``: a value with the formula
that produced it, so the explanation shows its arithmetic as ``name = formula = value unit``.
The decode model is a roofline at datasheet peaks (no efficiency factor, no per-step overhead):

    step(B, C) = max(W / (TP * BW) + B * C * KV / (TP * BW),  B * (2 * P + 4 * L * h * C) / (TP * F))

W weight bytes, KV bytes per token, P parameters, L layers, h hidden size, TP tensor-parallel
GPUs per replica, BW HBM bytes/s and F BF16 FLOP/s per GPU, B sequences decoding, C their mean
context. Figures: ``reference/roofline.md`` (H100 SXM5, H200 SXM, Llama-3.1-8B/70B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvroute.simulator.engine.latency import LatencyModel

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
ACTIVATION_BYTES_PER_GPU = 2e9  # roofline.md: "minus ~2 GB activations per GPU"


@dataclass(frozen=True)
class ModelFigures:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    params: float
    bytes_per_weight: float = 2.0  # bf16
    bytes_per_kv: float = 2.0  # bf16 KV cache


@dataclass(frozen=True)
class HardwareFigures:
    name: str
    hbm_bytes: float  # per GPU
    hbm_bandwidth: float  # per GPU, bytes/s
    bf16_flops: float  # per GPU, dense
    fp8_flops: float  # per GPU, dense
    gpus_per_node: int
    tensor_parallel: int  # GPUs per replica

    @property
    def replicas_per_node(self) -> int:
        return self.gpus_per_node // self.tensor_parallel


@dataclass(frozen=True)
class Quantity:
    """One step of the arithmetic: ``name = formula = value unit`` (value in SI units)."""

    name: str
    formula: str
    value: float
    unit: str
    scale: float = 1.0  # shown value = value / scale
    digits: int = 2

    @property
    def shown(self) -> str:
        v = self.value / self.scale
        return f"{v:,.{self.digits}f} {self.unit}".rstrip()

    def line(self) -> str:
        return f"{self.name} = {self.formula} = {self.shown}"


# Figures the latency presets do not carry (reference/roofline.md): attention heads, HBM size,
# FP8 peak, and 8 GPUs per HGX node.
_HEADS = {"llama-3.1-8b": 32, "llama-3.1-70b": 64}
_GPUS = {
    # fragment: (HBM bytes, FP8 FLOP/s)
    "h100": (80e9, 1979e12),
    "h200": (141e9, 1979e12),
}
GPUS_PER_NODE = 8


def figures_for_preset(latency: LatencyModel) -> tuple[ModelFigures, HardwareFigures] | None:
    """The model and hardware figures of a GPU latency preset; None for others (tiny-cpu)."""
    model = next((m for m in _HEADS if latency.name.startswith(m)), None)
    gpu = next((g for g in _GPUS if latency.name.endswith(g)), None)
    if model is None or gpu is None:
        return None
    hbm, fp8 = _GPUS[gpu]
    return (
        ModelFigures(
            name=model,
            layers=latency.num_layers,
            hidden=latency.hidden_size,
            heads=_HEADS[model],
            kv_heads=latency.num_kv_heads,
            head_dim=latency.head_dim,
            params=latency.num_params,
            bytes_per_weight=latency.bytes_per_param,
            bytes_per_kv=latency.kv_bytes_per_element,
        ),
        HardwareFigures(
            name=gpu.upper(),
            hbm_bytes=hbm,
            hbm_bandwidth=latency.mem_bandwidth,
            bf16_flops=latency.peak_flops,
            fp8_flops=fp8,
            gpus_per_node=GPUS_PER_NODE,
            tensor_parallel=latency.num_gpus,
        ),
    )


def _g(x: float) -> str:
    """A figure inside a formula: compact, exact enough to redo by hand."""
    if abs(x) >= 1e9:
        return f"{x:.4g}"
    if x == int(x):
        return f"{int(x):,}"
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.4g}"


def weight_bytes_per_gpu(m: ModelFigures, hw: HardwareFigures) -> Quantity:
    return Quantity(
        "weights per GPU",
        f"params x bytes/weight / TP = {_g(m.params)} x {_g(m.bytes_per_weight)} B / "
        f"{hw.tensor_parallel}",
        m.params * m.bytes_per_weight / hw.tensor_parallel,
        "GB",
        1e9,
    )


def kv_bytes_per_token(m: ModelFigures) -> Quantity:
    value = 2 * m.layers * m.kv_heads * m.head_dim * m.bytes_per_kv
    return Quantity(
        "KV per token",
        f"2 (K,V) x layers x KV heads x head dim x bytes = 2 x {m.layers} x {m.kv_heads} x "
        f"{m.head_dim} x {_g(m.bytes_per_kv)} B",
        value,
        "B",
        1.0,
        0,
    )


def kv_capacity_tokens(m: ModelFigures, hw: HardwareFigures) -> Quantity:
    weights = m.params * m.bytes_per_weight
    free = (
        hw.tensor_parallel * (hw.hbm_bytes * GPU_MEMORY_UTILIZATION - ACTIVATION_BYTES_PER_GPU)
        - weights
    )
    kv = kv_bytes_per_token(m).value
    return Quantity(
        "KV capacity per replica",
        f"(TP x (HBM x {GPU_MEMORY_UTILIZATION:g} - activations) - weights) / KV per token = "
        f"({hw.tensor_parallel} x ({_g(hw.hbm_bytes)} x {GPU_MEMORY_UTILIZATION:g} - "
        f"{_g(ACTIVATION_BYTES_PER_GPU)}) - {_g(weights)}) B / {_g(kv)} B",
        float(max(0, math.floor(free / kv))),
        "tokens",
        1.0,
        0,
    )


def weight_read_s(m: ModelFigures, hw: HardwareFigures) -> Quantity:
    w = weight_bytes_per_gpu(m, hw).value
    return Quantity(
        "decode step floor (weights read once per step)",
        f"weights per GPU / HBM bandwidth = {_g(w)} B / {_g(hw.hbm_bandwidth)} B/s",
        w / hw.hbm_bandwidth,
        "ms",
        1e-3,
    )


def kv_read_s_per_token(m: ModelFigures, hw: HardwareFigures) -> Quantity:
    kv = kv_bytes_per_token(m).value
    return Quantity(
        "KV read per context token",
        f"KV per token / (TP x HBM bandwidth) = {_g(kv)} B / ({hw.tensor_parallel} x "
        f"{_g(hw.hbm_bandwidth)} B/s)",
        kv / (hw.tensor_parallel * hw.hbm_bandwidth),
        "ns",
        1e-9,
        3,
    )


def decode_flops_per_token(m: ModelFigures, context: float) -> Quantity:
    return Quantity(
        "decode FLOP per token",
        f"2 x params + 4 x layers x hidden x C = 2 x {_g(m.params)} + 4 x {m.layers} x "
        f"{m.hidden} x {_g(context)}",
        2 * m.params + 4 * m.layers * m.hidden * context,
        "GFLOP",
        1e9,
    )


def ridge_point(hw: HardwareFigures) -> Quantity:
    return Quantity(
        "ridge point",
        f"BF16 FLOP/s / HBM bandwidth = {_g(hw.bf16_flops)} / {_g(hw.hbm_bandwidth)}",
        hw.bf16_flops / hw.hbm_bandwidth,
        "FLOP/B",
        1.0,
        0,
    )


def decode_step_s(m: ModelFigures, hw: HardwareFigures, batch: float, context: float) -> Quantity:
    """The module docstring's step(B, C): the larger of memory time and compute time."""
    tp, bw = hw.tensor_parallel, hw.hbm_bandwidth
    w = weight_bytes_per_gpu(m, hw).value
    kv = kv_bytes_per_token(m).value
    memory = w / bw + batch * context * kv / (tp * bw)
    compute = batch * decode_flops_per_token(m, context).value / (tp * hw.bf16_flops)
    bound = "memory" if memory >= compute else "compute"
    return Quantity(
        f"decode step at B={_g(batch)}, C={_g(context)}",
        f"max(W/(TP x BW) + B x C x KV/(TP x BW), B x FLOP per token/(TP x F)) = "
        f"max({memory * 1e3:.3f} ms, {compute * 1e3:.3f} ms) ({bound}-bound)",
        max(memory, compute),
        "ms",
        1e-3,
        3,
    )


def decode_intensity(
    m: ModelFigures, hw: HardwareFigures, batch: float, context: float
) -> Quantity:
    w = m.params * m.bytes_per_weight
    kv = kv_bytes_per_token(m).value
    flops = batch * decode_flops_per_token(m, context).value
    return Quantity(
        f"decode arithmetic intensity at B={_g(batch)}",
        f"B x FLOP per token / (weights + B x C x KV) = {_g(flops)} / "
        f"({_g(w)} + {_g(batch)} x {_g(context)} x {_g(kv)})",
        flops / (w + batch * context * kv),
        "FLOP/B",
        1.0,
        1,
    )


def kv_batch_limit(m: ModelFigures, hw: HardwareFigures, context: float) -> Quantity:
    cap = kv_capacity_tokens(m, hw).value
    return Quantity(
        "largest batch the KV cache holds",
        f"floor(KV capacity / C) = floor({_g(cap)} / {_g(context)})",
        float(math.floor(cap / context)),
        "sequences",
        1.0,
        0,
    )


def decode_tokens_per_s(
    m: ModelFigures, hw: HardwareFigures, batch: float, context: float, label: str
) -> Quantity:
    step = decode_step_s(m, hw, batch, context).value
    return Quantity(
        label,
        f"B / step(B, C) = {_g(batch)} / {step * 1e3:.3f} ms",
        batch / step,
        "tokens/s",
        1.0,
        0,
    )


def max_decode_tokens_per_s_per_node(
    m: ModelFigures, hw: HardwareFigures, context: float
) -> Quantity:
    """Decode ceiling of a node: every replica at the batch its KV cache holds at context C."""
    batch = kv_batch_limit(m, hw, context).value
    per_replica = decode_tokens_per_s(m, hw, batch, context, "").value
    n = hw.replicas_per_node
    return Quantity(
        "max decode tokens/s per node",
        f"replicas per node x B_kv / step(B_kv, C) = {n} x {_g(batch)} / "
        f"{decode_step_s(m, hw, batch, context).value * 1e3:.3f} ms",
        n * per_replica,
        "tokens/s",
        1.0,
        0,
    )


def tpot_batch_limit(
    m: ModelFigures, hw: HardwareFigures, context: float, tpot_s: float
) -> Quantity:
    """The largest B with step(B, C) <= TPOT: both the memory and the compute term must fit."""
    tp, bw = hw.tensor_parallel, hw.hbm_bandwidth
    w = weight_bytes_per_gpu(m, hw).value
    kv = kv_bytes_per_token(m).value
    by_memory = (tpot_s - w / bw) * tp * bw / (context * kv)
    by_compute = tpot_s * tp * hw.bf16_flops / decode_flops_per_token(m, context).value
    return Quantity(
        f"largest batch with step <= TPOT {tpot_s * 1e3:g} ms",
        f"floor(min((TPOT - W/BW) x TP x BW / (C x KV), TPOT x TP x F / FLOP per token)) = "
        f"floor(min({by_memory:,.1f}, {by_compute:,.1f}))",
        float(max(0, math.floor(min(by_memory, by_compute)))),
        "sequences",
        1.0,
        0,
    )


def prefill_tokens_per_s(
    m: ModelFigures, hw: HardwareFigures, prompt_context: float, mfu: float
) -> Quantity:
    """Prefill of one replica, compute-bound, at ``mfu`` of the BF16 peak.

    ``prompt_context``: the mean context a prompt token attends to (about half the prompt).
    """
    flops = 2 * m.params + 4 * m.layers * m.hidden * prompt_context
    return Quantity(
        f"prefill per replica at MFU {mfu:g}",
        f"TP x F x MFU / (2 x params + 4 x layers x hidden x C_prefill) = {hw.tensor_parallel}"
        f" x {_g(hw.bf16_flops)} x {mfu:g} / {_g(flops)}",
        hw.tensor_parallel * hw.bf16_flops * mfu / flops,
        "tokens/s",
        1.0,
        0,
    )


def replicas_for_rate(
    rate_rps: float,
    input_tokens: float,
    output_tokens: float,
    prefill_tps: float,
    decode_tps: float,
) -> Quantity:
    """Replicas whose GPU time covers the prefill and the decode the rate brings, no headroom."""
    busy = rate_rps * input_tokens / prefill_tps + rate_rps * output_tokens / decode_tps
    return Quantity(
        "replicas",
        f"ceil(rate x (input / prefill tokens/s + output / decode tokens/s)) = ceil("
        f"{rate_rps:,.2f} x ({input_tokens:,.0f} / {prefill_tps:,.0f} + {output_tokens:,.0f} / "
        f"{decode_tps:,.0f}))",
        float(max(1, math.ceil(busy - 1e-9))),
        "",
        1.0,
        0,
    )


@dataclass(frozen=True)
class Workload:
    """What the explanation needs of a trace (computed by the caller)."""

    rate_rps: float
    mean_input_tokens: float
    mean_output_tokens: float
    decode_context: float  # mean context over decode steps (output-token weighted)
    prefill_context: float  # mean context over prompt tokens (prompt-token weighted)


def workload(
    requests: list[tuple[int, int]], duration_s: float, rate_rps: float | None = None
) -> Workload:
    """From (input, output) token counts: means and the contexts decode and prefill see."""
    n = len(requests)
    out = sum(o for _, o in requests)
    inp = sum(i for i, _ in requests)
    return Workload(
        rate_rps=rate_rps if rate_rps is not None else (n / duration_s if duration_s > 0 else 0.0),
        mean_input_tokens=inp / n,
        mean_output_tokens=out / n,
        # Decode token j of a request attends to input + j tokens: average over all of them.
        decode_context=sum(o * (i + (o + 1) / 2) for i, o in requests) / out,
        # Prompt token j (1-based) attends to j tokens: (i + 1) / 2 on average, prompt-weighted.
        prefill_context=sum(i * (i + 1) / 2 for i, _ in requests) / inp,
    )


@dataclass(frozen=True)
class Explanation:
    lines: tuple[str, ...]
    replicas: int
    nodes: int
    decode_ceiling_per_node: float


def explain(
    m: ModelFigures,
    hw: HardwareFigures,
    load: Workload,
    *,
    tpot_s: float | None,
    mfu: float,
    max_num_seqs: int,
) -> Explanation:
    """The whole derivation, line by line, ending in replicas and nodes for ``load``."""
    c = load.decode_context
    kv_limit = kv_batch_limit(m, hw, c)
    ceiling = max_decode_tokens_per_s_per_node(m, hw, c)
    steps: list[Quantity] = [
        weight_bytes_per_gpu(m, hw),
        kv_bytes_per_token(m),
        kv_capacity_tokens(m, hw),
        weight_read_s(m, hw),
        kv_read_s_per_token(m, hw),
        decode_flops_per_token(m, c),
        ridge_point(hw),
        decode_intensity(m, hw, 1, c),
        kv_limit,
        decode_intensity(m, hw, kv_limit.value, c),
        decode_step_s(m, hw, kv_limit.value, c),
        decode_tokens_per_s(m, hw, kv_limit.value, c, "max decode tokens/s per replica"),
        ceiling,
    ]
    batch = min(kv_limit.value, float(max_num_seqs))
    limits = [f"KV {kv_limit.value:,.0f}", f"--max-num-seqs {max_num_seqs}"]
    if tpot_s is not None:
        tpot_limit = tpot_batch_limit(m, hw, c, tpot_s)
        steps.append(tpot_limit)
        batch = min(batch, tpot_limit.value)
        limits.insert(0, f"TPOT {tpot_limit.value:,.0f}")
    if batch < 1:
        batch = 1.0  # the TPOT target is under one step's floor: one sequence still decodes
    steps.append(Quantity("serving batch", f"min({', '.join(limits)})", batch, "sequences", 1.0, 0))
    steps.append(decode_step_s(m, hw, batch, c))
    decode = decode_tokens_per_s(m, hw, batch, c, "decode per replica at the serving batch")
    steps.append(decode)
    prefill = prefill_tokens_per_s(m, hw, load.prefill_context, mfu)
    steps.append(prefill)
    replicas = replicas_for_rate(
        load.rate_rps, load.mean_input_tokens, load.mean_output_tokens, prefill.value, decode.value
    )
    steps.append(replicas)
    per_node = hw.replicas_per_node
    nodes = math.ceil(replicas.value / per_node)
    steps.append(
        Quantity(
            "nodes",
            f"ceil(replicas / replicas per node) = ceil({replicas.value:,.0f} / {per_node})",
            float(nodes),
            "",
            1.0,
            0,
        )
    )
    head = [
        f"model {m.name}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, {m.kv_heads} KV "
        f"heads, head dim {m.head_dim}, {m.params / 1e9:g}B params, {_g(m.bytes_per_weight)} "
        f"B/weight, {_g(m.bytes_per_kv)} B/KV element",
        f"hardware {hw.name}: {hw.hbm_bytes / 1e9:g} GB HBM at {hw.hbm_bandwidth / 1e12:g} TB/s, "
        f"BF16 {hw.bf16_flops / 1e12:,g} TFLOP/s, FP8 {hw.fp8_flops / 1e12:,g} TFLOP/s (dense); "
        f"TP {hw.tensor_parallel}, "
        f"{hw.gpus_per_node} GPUs per node = {per_node} replica(s) per node",
        f"workload: {load.rate_rps:,.2f} req/s, mean input {load.mean_input_tokens:,.0f} tokens,"
        f" mean output {load.mean_output_tokens:,.0f} tokens; decode context C = "
        f"{c:,.0f} tokens (mean over decode steps), prefill context C_prefill = "
        f"{load.prefill_context:,.0f} tokens",
        "step(B, C) = max(W/(TP x BW) + B x C x KV/(TP x BW), B x (2 x P + 4 x L x h x C)/(TP x F))"
        " at datasheet peaks (no efficiency, no per-step overhead)",
    ]
    return Explanation(
        lines=tuple(head + [q.line() for q in steps]),
        replicas=int(replicas.value),
        nodes=nodes,
        decode_ceiling_per_node=ceiling.value,
    )
