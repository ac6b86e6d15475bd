"""Capacity arithmetic from a model's and a GPU's public figures: what ``kvroute plan --explain``
prints before it simulates anything.

Every function is pure (no I/O, no clock) and returns a ``Quantity``: a value with the formula
that produced it, so the explanation shows its arithmetic as ``name = formula = value unit``.
The decode model is a roofline at datasheet peaks (no efficiency factor, no per-step overhead):

    step(B, C) = max(W / (TP * BW) + B * C * KV / (TP * BW),  B * (2 * P + 4 * L * h * C) / (TP * F))

W weight bytes, KV bytes per token, P parameters, L layers, h hidden size, TP tensor-parallel
GPUs per replica, BW HBM bytes/s and F BF16 FLOP/s per GPU, B sequences decoding, C their mean
context. Figures: the public H100 SXM5 / H200 SXM datasheets and the Llama-3.1-8B/70B configs
(the preset table in docs/simulator.md lists them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvroute.simulator.engine.latency import PRESETS, LatencyModel

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
    params: float  # all of them: what memory holds
    bytes_per_weight: float = 2.0  # bf16
    bytes_per_kv: float = 2.0  # bf16 KV cache
    # Mixture of experts: a token runs through the shared layers and experts_per_token of
    # routed_experts experts per MoE layer; routed_params is all routed experts' parameters.
    active_params: float | None = None
    routed_experts: int = 0
    experts_per_token: int = 0
    routed_params: float = 0.0
    # MLA caches one compressed latent (plus a RoPE key) per layer instead of K and V per head.
    kv_elements_per_layer: int | None = None
    kv_layout: str = ""  # how kv_elements_per_layer is made up, for the formula
    # Attention FLOP per decoded token per layer per context token; None: 4 x hidden (QK^T, PV).
    attention_flops_per_layer: float | None = None
    # The same in prefill, where MLA runs unabsorbed (per-head 192-dim keys, 128-dim values).
    prefill_attention_flops_per_layer: float | None = None

    @property
    def flop_params(self) -> float:
        """Parameters each token's matmuls run through: the active ones for a MoE."""
        return self.active_params if self.active_params is not None else self.params

    @property
    def attention_coefficient(self) -> float:
        a = self.attention_flops_per_layer
        return a if a is not None else 4.0 * self.hidden

    @property
    def mha_kv_elements_per_layer(self) -> int:
        """What full multi-head attention would cache: K and V for every head."""
        return 2 * self.heads * self.head_dim


@dataclass(frozen=True)
class HardwareFigures:
    name: str
    hbm_bytes: float  # per GPU
    hbm_bandwidth: float  # per GPU, bytes/s
    bf16_flops: float  # per GPU, dense
    fp8_flops: float  # per GPU, dense
    gpus_per_node: int
    tensor_parallel: int  # GPUs per replica (with experts spread over them for a MoE)
    fp8_compute: bool = False  # matmuls at the FP8 peak (FP8 weights)
    # Attention data-parallel ranks over those GPUs (vLLM --data-parallel-size with experts
    # parallel): each rank attends over its own sequences with its own KV cache. 1: attention
    # tensor-parallel over all of them.
    attention_data_parallel: int = 1

    @property
    def flops(self) -> float:
        """F: the peak the matmuls run at."""
        return self.fp8_flops if self.fp8_compute else self.bf16_flops

    @property
    def precision(self) -> str:
        return "FP8" if self.fp8_compute else "BF16"

    @property
    def replicas_per_node(self) -> int:
        return self.gpus_per_node // self.tensor_parallel

    @property
    def layout(self) -> str:
        if self.attention_data_parallel > 1:
            return (
                f"attention DP {self.attention_data_parallel}, experts over "
                f"{self.tensor_parallel} GPUs"
            )
        return f"TP {self.tensor_parallel}"


def kv_copies(m: ModelFigures, hw: HardwareFigures) -> int:
    """How many GPUs hold each token's KV. MLA caches one latent per layer, with no heads to
    split, so tensor-parallel attention keeps it whole on every GPU of the group (vLLM does);
    data-parallel attention gives each rank its own sequences instead. Per-head KV (MHA, GQA)
    is split over tensor-parallel GPUs: one copy."""
    if m.kv_elements_per_layer is None:
        return 1
    return max(1, hw.tensor_parallel // hw.attention_data_parallel)


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
    # fragment: (HBM bytes, BF16 FLOP/s, FP8 FLOP/s), dense
    "h100": (80e9, 989e12, 1979e12),
    "h200": (141e9, 989e12, 1979e12),
}
GPUS_PER_NODE = 8
FP8_SUFFIX = "-fp8"  # latency presets with FP8 weights and FP8 KV


def figures_for_preset(latency: LatencyModel) -> tuple[ModelFigures, HardwareFigures] | None:
    """The model and hardware figures of a GPU latency preset; None for others (tiny-cpu)."""
    base = latency.name.removesuffix(FP8_SUFFIX)
    model = next((m for m in _HEADS if base.startswith(m)), None)
    gpu = next((g for g in _GPUS if base.endswith(g)), None)
    if model is None or gpu is None:
        return None
    hbm, bf16, fp8 = _GPUS[gpu]
    return (
        ModelFigures(
            name=model + (FP8_SUFFIX if latency.name.endswith(FP8_SUFFIX) else ""),
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
            bf16_flops=bf16,
            fp8_flops=fp8,
            gpus_per_node=GPUS_PER_NODE,
            tensor_parallel=latency.num_gpus,
            fp8_compute=latency.name.endswith(FP8_SUFFIX),
        ),
    )


# DeepSeek-V3, from its public config.json and technical report (arXiv 2412.19437):
# 671B parameters in all (the 14B multi-token-prediction module left out), 37B active per
# token; 61 layers, hidden 7168, 128 heads; the first 3 layers dense, the other 58 MoE with
# 256 routed experts (8 per token, plus 1 shared) of 3 x 7168 x 2048 parameters each;
# MLA caches kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements per token per layer;
# weights released in FP8. Absorbed MLA decode attends over the 576-dim keys and 512-dim
# latent values for each of 128 heads: 2 x 128 x (576 + 512) FLOP per context token per layer;
# prefill runs it unabsorbed, 192-dim keys and 128-dim values: 2 x 128 x (192 + 128).
# Served as one replica over an 8xH200 node (the FP8 weights, 671 GB, exceed 8 x 80 GB), experts
# spread over the 8 GPUs (expert parallelism), KV in BF16 (vLLM's default for MLA).
DEEPSEEK_V3 = ModelFigures(
    name="deepseek-v3",
    layers=61,
    hidden=7168,
    heads=128,
    kv_heads=128,
    head_dim=128,
    params=671e9,
    bytes_per_weight=1.0,
    bytes_per_kv=2.0,
    active_params=37e9,
    routed_experts=256,
    experts_per_token=8,
    routed_params=58 * 256 * 3 * 7168 * 2048,
    kv_elements_per_layer=512 + 64,
    kv_layout="(kv_lora_rank 512 + rope dim 64)",
    attention_flops_per_layer=2 * 128 * (576 + 512),
    prefill_attention_flops_per_layer=2 * 128 * (192 + 128),
)
# Served as DeepSeek serves it: data-parallel attention (each of the 8 GPUs attends over its
# own sequences with its own MLA cache; vLLM --data-parallel-size 8 --enable-expert-parallel,
# kvroute routing to each rank) and the experts spread over the node. The -tp8 preset runs
# attention tensor-parallel instead, where every GPU holds the same latent: 1/8 the KV.
H200_NODE_EP8 = HardwareFigures(
    name="H200",
    hbm_bytes=141e9,
    hbm_bandwidth=4.8e12,
    bf16_flops=989e12,
    fp8_flops=1979e12,
    gpus_per_node=GPUS_PER_NODE,
    tensor_parallel=8,
    fp8_compute=True,
    attention_data_parallel=8,
)
H200_NODE_TP8 = dataclasses.replace(H200_NODE_EP8, attention_data_parallel=1)
# Presets with capacity figures but no engine latency model: `plan --explain` and `plan --kv`
# take them; a simulation cannot (the engine model has no MoE or MLA).
CAPACITY_PRESETS: dict[str, tuple[ModelFigures, HardwareFigures]] = {
    "deepseek-v3-8xh200": (DEEPSEEK_V3, H200_NODE_EP8),
    "deepseek-v3-8xh200-tp8": (DEEPSEEK_V3, H200_NODE_TP8),
}


def figures_by_name(name: str) -> tuple[ModelFigures, HardwareFigures] | None:
    """Figures of a capacity preset or of a latency preset called ``name``; None if neither."""
    if name in CAPACITY_PRESETS:
        return CAPACITY_PRESETS[name]
    latency = PRESETS.get(name)
    return figures_for_preset(latency) if latency is not None else None


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
    if m.kv_elements_per_layer is not None:
        return Quantity(
            "KV per token",
            f"layers x {m.kv_layout} x bytes = {m.layers} x {m.kv_elements_per_layer} x "
            f"{_g(m.bytes_per_kv)} B",
            m.layers * m.kv_elements_per_layer * m.bytes_per_kv,
            "B",
            1.0,
            0,
        )
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
    free = kv_available_bytes(m, hw).value
    kv = kv_bytes_per_token(m).value
    copies = kv_copies(m, hw)
    held = f" / {copies} copies (MLA under TP)" if copies > 1 else ""
    return Quantity(
        "KV capacity per replica",
        f"(TP x (HBM x {GPU_MEMORY_UTILIZATION:g} - activations) - weights){held} / KV per "
        f"token = ({hw.tensor_parallel} x ({_g(hw.hbm_bytes)} x {GPU_MEMORY_UTILIZATION:g} - "
        f"{_g(ACTIVATION_BYTES_PER_GPU)}) - {_g(weights)}) B{held} / {_g(kv)} B",
        float(max(0, math.floor(free / kv))),
        "tokens",
        1.0,
        0,
    )


def weights_read_bytes(m: ModelFigures, batch: float) -> float:
    """Weight bytes one decode step reads, over all GPUs of the replica.

    Dense: all of them. MoE: the shared part, plus each routed expert that at least one of the
    B tokens picks: a fraction 1 - (1 - k/E)^B of them (uniform routing), so a lone token reads
    about the active parameters and a batch of a few hundred reads nearly all of them.
    """
    if not m.routed_experts:
        return m.params * m.bytes_per_weight
    touched = 1.0 - math.pow(1.0 - m.experts_per_token / m.routed_experts, max(batch, 1.0))
    return (m.params - m.routed_params + m.routed_params * touched) * m.bytes_per_weight


def weight_read_s(m: ModelFigures, hw: HardwareFigures) -> Quantity:
    if m.routed_experts:
        w1 = weights_read_bytes(m, 1) / hw.tensor_parallel
        return Quantity(
            "decode step floor at B=1 (shared weights + one token's experts read)",
            f"(params - routed + routed x k/E) x bytes/weight / TP / HBM bandwidth = "
            f"({_g(m.params)} - {_g(m.routed_params)} + {_g(m.routed_params)} x "
            f"{m.experts_per_token}/{m.routed_experts}) x {_g(m.bytes_per_weight)} B / "
            f"{hw.tensor_parallel} / {_g(hw.hbm_bandwidth)} B/s",
            w1 / hw.hbm_bandwidth,
            "ms",
            1e-3,
        )
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
    copies = kv_copies(m, hw)
    held = f"{copies} copies x " if copies > 1 else ""
    return Quantity(
        "KV read per context token",
        f"{held}KV per token / (TP x HBM bandwidth) = {held}{_g(kv)} B / ({hw.tensor_parallel} x "
        f"{_g(hw.hbm_bandwidth)} B/s)",
        copies * kv / (hw.tensor_parallel * hw.hbm_bandwidth),
        "ns",
        1e-9,
        3,
    )


def decode_flops_per_token(m: ModelFigures, context: float) -> Quantity:
    if m.active_params is not None or m.attention_flops_per_layer is not None:
        a = m.attention_coefficient
        return Quantity(
            "decode FLOP per token",
            f"2 x active params + layers x attention FLOP per layer x C = 2 x "
            f"{_g(m.flop_params)} + {m.layers} x {_g(a)} x {_g(context)}",
            2 * m.flop_params + m.layers * a * context,
            "GFLOP",
            1e9,
        )
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
        f"{hw.precision} FLOP/s / HBM bandwidth = {_g(hw.flops)} / {_g(hw.hbm_bandwidth)}",
        hw.flops / hw.hbm_bandwidth,
        "FLOP/B",
        1.0,
        0,
    )


def decode_step_s(m: ModelFigures, hw: HardwareFigures, batch: float, context: float) -> Quantity:
    """The module docstring's step(B, C): the larger of memory time and compute time."""
    tp, bw = hw.tensor_parallel, hw.hbm_bandwidth
    w = weights_read_bytes(m, batch) / tp
    kv = kv_bytes_per_token(m).value * kv_copies(m, hw)  # read from every copy
    memory = w / bw + batch * context * kv / (tp * bw)
    compute = batch * decode_flops_per_token(m, context).value / (tp * hw.flops)
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
    w = weights_read_bytes(m, batch)
    kv = kv_bytes_per_token(m).value * kv_copies(m, hw)  # read from every copy
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
    if m.routed_experts:
        # The weights read grow with B: search the largest B whose step fits.
        lo, hi = 0, 1
        while decode_step_s(m, hw, hi, context).value <= tpot_s and hi < 1 << 24:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if decode_step_s(m, hw, mid, context).value <= tpot_s else (lo, mid)
        return Quantity(
            f"largest batch with step <= TPOT {tpot_s * 1e3:g} ms",
            "largest B with step(B, C) <= TPOT (searched: a MoE step reads more experts as B "
            "grows)",
            float(lo),
            "sequences",
            1.0,
            0,
        )
    w = weight_bytes_per_gpu(m, hw).value
    kv = kv_bytes_per_token(m).value * kv_copies(m, hw)  # read from every copy
    by_memory = (tpot_s - w / bw) * tp * bw / (context * kv)
    by_compute = tpot_s * tp * hw.flops / decode_flops_per_token(m, context).value
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
    a = m.prefill_attention_flops_per_layer or m.attention_coefficient
    flops = 2 * m.flop_params + m.layers * a * prompt_context
    per_token = (
        "2 x params + 4 x layers x hidden x C_prefill"
        if m.active_params is None and m.attention_flops_per_layer is None
        else "2 x active params + layers x attention FLOP per layer x C_prefill"
    )
    return Quantity(
        f"prefill per replica at MFU {mfu:g}",
        f"TP x F x MFU / ({per_token}) = {hw.tensor_parallel}"
        f" x {_g(hw.flops)} x {mfu:g} / {_g(flops)}",
        hw.tensor_parallel * hw.flops * mfu / flops,
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
    gpu_price: float | None = None,
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
    # vLLM's --max-num-seqs bounds each engine core: every attention data-parallel rank.
    ranks = hw.attention_data_parallel
    seqs = max_num_seqs * ranks
    per_rank = f" x {ranks} ranks" if ranks > 1 else ""
    batch = min(kv_limit.value, float(seqs))
    limits = [f"KV {kv_limit.value:,.0f}", f"--max-num-seqs {max_num_seqs}{per_rank}"]
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
    if gpu_price is not None:
        steps += cost_per_million_tokens(m, hw, load, replicas.value, ceiling.value, gpu_price)
    head = [
        f"model {m.name}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, {m.kv_heads} KV "
        f"heads, head dim {m.head_dim}, {m.params / 1e9:g}B params, {_g(m.bytes_per_weight)} "
        f"B/weight, {_g(m.bytes_per_kv)} B/KV element" + _moe_note(m),
        f"hardware {hw.name}: {hw.hbm_bytes / 1e9:g} GB HBM at {hw.hbm_bandwidth / 1e12:g} TB/s, "
        f"BF16 {hw.bf16_flops / 1e12:,g} TFLOP/s, FP8 {hw.fp8_flops / 1e12:,g} TFLOP/s (dense); "
        f"{hw.layout}, {'matmuls at FP8, ' if hw.fp8_compute else ''}"
        f"{hw.gpus_per_node} GPUs per node = {per_node} replica(s) per node",
        f"workload: {load.rate_rps:,.2f} req/s, mean input {load.mean_input_tokens:,.0f} tokens,"
        f" mean output {load.mean_output_tokens:,.0f} tokens; decode context C = "
        f"{c:,.0f} tokens (mean over decode steps), prefill context C_prefill = "
        f"{load.prefill_context:,.0f} tokens",
        "step(B, C) = max(W/(TP x BW) + B x C x KV/(TP x BW), B x (2 x P + 4 x L x h x C)/(TP x F))"
        " at datasheet peaks (no efficiency, no per-step overhead)"
        + (
            "; for a MoE W = weights read at B (shared + experts touched), P active params, "
            "4h the model's attention FLOP per layer"
            if m.routed_experts
            else ""
        ),
    ]
    return Explanation(
        lines=tuple(head + [q.line() for q in steps]),
        replicas=int(replicas.value),
        nodes=nodes,
        decode_ceiling_per_node=ceiling.value,
    )


def _moe_note(m: ModelFigures) -> str:
    if not m.routed_experts:
        return ""
    kv = m.kv_layout or f"{m.kv_elements_per_layer} elements"
    return (
        f"; MoE: {_g(m.flop_params / 1e9)}B active, {m.experts_per_token} of "
        f"{m.routed_experts} routed experts per token ({_g(m.routed_params / 1e9)}B routed "
        f"params); KV per layer {kv}"
    )


# -- the KV budget (`kvroute plan --kv`) ----------------------------------------------------

# Assumptions, not reference figures, printed with the numbers they produce:
PCIE_BYTES_PER_S = 64e9  # PCIe Gen5 x16, one direction, per GPU (each GPU has its own link)
HOST_BYTES_PER_NODE = 2e12  # host DRAM of an 8-GPU HGX server, typically 2 TB
NETWORK_BYTES_PER_S = 50e9  # one 400 Gb/s NIC per GPU, between nodes
NETWORK_LATENCY_S = 10e-6  # per collective across nodes
PREFILL_MFU = 0.53  # the engine presets' calibration (reference/roofline.md)


@dataclass(frozen=True)
class Lever:
    """One way to make the KV cache hold the batch: what it multiplies capacity by, and at what
    price."""

    name: str
    factor: float  # capacity bought (or need removed), x
    buys: str
    cost: str
    already: bool = False  # in the model already (GQA/MLA): shown for scale, nothing to pull


@dataclass(frozen=True)
class KvBudget:
    lines: tuple[str, ...]
    needed_bytes: float
    available_bytes: float
    fits: bool
    largest_batch: int
    levers: tuple[Lever, ...]  # ranked: most capacity first


def kv_needed_bytes(m: ModelFigures, context: float, batch: float) -> Quantity:
    kv = kv_bytes_per_token(m).value
    return Quantity(
        "KV needed",
        f"batch x context x KV per token = {_g(batch)} x {_g(context)} x {_g(kv)} B",
        batch * context * kv,
        "GB",
        1e9,
    )


def kv_available_bytes(m: ModelFigures, hw: HardwareFigures) -> Quantity:
    """Memory for distinct tokens' KV: with MLA under TP, every GPU holds the same latent."""
    weights = m.params * m.bytes_per_weight
    copies = kv_copies(m, hw)
    free = (
        hw.tensor_parallel * (hw.hbm_bytes * GPU_MEMORY_UTILIZATION - ACTIVATION_BYTES_PER_GPU)
        - weights
    ) / copies
    held = f" / {copies} copies (MLA under TP)" if copies > 1 else ""
    return Quantity(
        "KV available per replica",
        f"(TP x (HBM x {GPU_MEMORY_UTILIZATION:g} - activations) - weights){held} = "
        f"({hw.tensor_parallel} x ({_g(hw.hbm_bytes)} x {GPU_MEMORY_UTILIZATION:g} - "
        f"{_g(ACTIVATION_BYTES_PER_GPU)}) - {_g(weights)}) B{held}",
        max(0.0, free),
        "GB",
        1e9,
    )


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def _fits(need: float, avail: float) -> str:
    if need <= avail:
        return f"fits ({_gb(avail - need)} spare)"
    return f"still short by {_gb(need - avail)}"


def kv_levers(
    m: ModelFigures, hw: HardwareFigures, context: float, batch: int
) -> tuple[Lever, ...]:
    """Each lever worked out for this case, ranked by the capacity it buys."""
    kv = kv_bytes_per_token(m).value
    need = kv_needed_bytes(m, context, batch).value
    avail = kv_available_bytes(m, hw).value
    fit = int(avail // (context * kv))
    short = max(0.0, need - avail)
    tp = hw.tensor_parallel
    levers: list[Lever] = []

    if m.bytes_per_kv > 1:
        f = m.bytes_per_kv / 1.0
        levers.append(
            Lever(
                "FP8 KV cache",
                f,
                f"KV per token {_g(kv)} B x 1/{_g(f)} = {_g(kv / f)} B; KV needed "
                f"{_gb(need / f)}: {_fits(need / f, avail)}; largest batch "
                f"{int(avail // (context * kv / f))}",
                "K and V rounded to 8 bits (vLLM --kv-cache-dtype fp8): a small accuracy risk, "
                "worst on long contexts; check on your own evals",
            )
        )
    else:
        levers.append(Lever("FP8 KV cache", 1.0, "already 1 byte per KV element", "taken already"))

    mha = m.mha_kv_elements_per_layer
    own = m.kv_elements_per_layer or 2 * m.kv_heads * m.head_dim
    kind = "MLA" if m.kv_elements_per_layer is not None else f"GQA ({m.kv_heads} KV heads)"
    levers.append(
        Lever(
            f"{kind} vs MHA",
            mha / own,
            f"already in this model: MHA ({m.heads} heads x head dim {m.head_dim}, K and V) "
            f"caches {mha:,} elements per layer per token vs {own:,}, x{mha / own:.3g}: it would "
            f"need {_gb(need * mha / own)}",
            "none at serving time; it is fixed in training (an MHA model cannot be switched "
            "without uptraining)",
            already=True,
        )
    )

    full = decode_step_s(m, hw, batch, context).value
    if fit >= batch:
        levers.append(
            Lever(
                "smaller batch",
                1.0,
                f"not needed: batch {batch} fits; the largest that fits is {fit}",
                "-",
            )
        )
    elif fit >= 1:
        step = decode_step_s(m, hw, fit, context).value
        tps_fit, tps_full = fit / step, batch / full
        levers.append(
            Lever(
                f"smaller batch ({fit})",
                batch / fit,
                f"batch {fit} needs {_gb(fit * context * kv)} of {_gb(avail)}",
                f"decode {tps_fit:,.0f} tokens/s per replica at B={fit} vs {tps_full:,.0f} at "
                f"B={batch} if it fitted ({(tps_fit / tps_full - 1):+.0%}; step "
                f"{step * 1e3:,.1f} ms vs {full * 1e3:,.1f} ms): more replicas for the same "
                "load",
            )
        )
    else:
        levers.append(
            Lever(
                "smaller batch",
                0.0,
                f"none: one sequence of {_g(context)} tokens needs {_gb(context * kv)}, more "
                f"than the {_gb(avail)} available",
                "-",
            )
        )

    copies = kv_copies(m, hw)
    if copies > 1:
        levers.append(
            Lever(
                "data-parallel attention",
                float(copies),
                f"each of {copies} ranks attends over its own sequences with its own cache, "
                f"instead of every GPU holding the same MLA latent: {_gb(avail * copies)} "
                f"available; largest batch {int(avail * copies // (context * kv))}",
                "vLLM --data-parallel-size with --enable-expert-parallel: experts' all-to-all "
                "between ranks each layer, and a prefix cached on one rank only: route per rank "
                "(kvroute does: a replica's data_parallel_size) or lose most hits",
            )
        )

    prefill = prefill_tokens_per_s(m, hw, (context + 1) / 2, PREFILL_MFU).value
    levers.append(
        Lever(
            "paging with preemption",
            1.0,
            f"no bytes: vLLM pages the cache in blocks and runs at most {min(fit, batch)} of the "
            f"{batch} sequences at full context at once; the rest queue, or are preempted when "
            "the running ones grow",
            f"a preempted sequence drops its KV and recomputes its prefill: {_g(context)} tokens "
            f"at {prefill:,.0f} tokens/s (MFU {PREFILL_MFU:g}) = {context / prefill:,.1f} s "
            "added to its latency, and the replica's time spent twice",
        )
    )

    host = HOST_BYTES_PER_NODE * tp / hw.gpus_per_node
    per_step = short / (tp * PCIE_BYTES_PER_S)
    levers.append(
        Lever(
            "offload KV to host memory",
            (avail + host) / avail if avail else math.inf,
            f"up to {_gb(host)} of host DRAM per replica (assumed {_gb(HOST_BYTES_PER_NODE)} "
            f"per 8-GPU node) holds the {_gb(short)} shortfall",
            "nothing to offload: the batch fits in HBM"
            if not short
            else f"every decode step reads the whole batch's KV: {_gb(short)} over {tp} PCIe Gen5 "
            f"x16 links at an assumed {_g(PCIE_BYTES_PER_S / 1e9)} GB/s each = "
            f"{per_step * 1e3:,.0f} ms added per step, i.e. per output token (step "
            f"{full * 1e3:,.1f} ms in HBM)",
        )
    )

    k = max(2, math.ceil(need / avail)) if avail else 2
    b_shard = batch
    exchange = m.layers * b_shard * m.hidden * 2 * (k - 1) / tp  # bf16 partials, per GPU
    cp_s = exchange / NETWORK_BYTES_PER_S + m.layers * NETWORK_LATENCY_S
    levers.append(
        Lever(
            f"context parallelism over {k} replicas' GPUs",
            float(k),
            f"{k} x {tp} = {k * tp} GPUs each hold 1/{k} of every sequence's KV: "
            f"{_gb(k * avail)} available, {_fits(need, k * avail)}",
            f"{k}x the GPUs for one batch (weights held {k} times), and every layer of every "
            f"step gathers the partial attention outputs: layers x B x hidden x 2 B x (k-1) / "
            f"TP = {_g(exchange)} B per GPU at an assumed {_g(NETWORK_BYTES_PER_S / 1e9)} GB/s "
            f"plus {m.layers} x {NETWORK_LATENCY_S * 1e6:g} us = {cp_s * 1e3:,.2f} ms added per "
            "step",
        )
    )
    return tuple(sorted(levers, key=lambda lv: -lv.factor))


def kv_budget(m: ModelFigures, hw: HardwareFigures, context: int, batch: int) -> KvBudget:
    """Does batch x context of KV fit one replica, by how much not, and what each lever buys."""
    per_token = kv_bytes_per_token(m)
    needed = kv_needed_bytes(m, context, batch)
    available = kv_available_bytes(m, hw)
    need, avail = needed.value, available.value
    largest = int(avail // (context * per_token.value))
    if need <= avail:
        verdict = (
            f"fits: {_gb(avail - need)} spare ({(avail - need) / need:.0%} of the need); "
            f"largest batch at this context {largest}"
        )
    else:
        verdict = (
            f"does not fit: short by {_gb(need - avail)} ({(need - avail) / need:.1%} of the "
            f"need); largest batch at this context {largest}"
        )
    levers = kv_levers(m, hw, context, batch)
    lines = [
        f"KV budget: {m.name} on {tp_label(hw)}, context {context:,} tokens, batch {batch}",
        per_token.line(),
        needed.line(),
        available.line(),
        verdict,
        "levers, ranked by capacity bought (x = capacity multiplied, or need divided):",
    ]
    for i, lv in enumerate(levers, 1):
        lines.append(f"{i}. {lv.name}: x{lv.factor:,.2f}: {lv.buys}")
        lines.append(f"   cost: {lv.cost}")
    return KvBudget(tuple(lines), need, avail, need <= avail, largest, levers)


def tp_label(hw: HardwareFigures) -> str:
    return f"{hw.tensor_parallel}x{hw.name} ({hw.layout})"


def cost_per_million_tokens(
    m: ModelFigures,
    hw: HardwareFigures,
    load: Workload,
    replicas: float,
    node_ceiling: float,
    gpu_price: float,
) -> list[Quantity]:
    """What a million tokens cost: of the analytic fleet at the load, and of pure decode at the
    node's ceiling (the floor of what an output token can cost on this hardware)."""
    gpus = replicas * hw.tensor_parallel
    tokens_per_s = load.rate_rps * (load.mean_input_tokens + load.mean_output_tokens)
    return [
        Quantity(
            "analytic cost per million tokens",
            f"replicas x TP x price / 3600 / (rate x (input + output)) x 1e6 = {_g(replicas)} x "
            f"{hw.tensor_parallel} x ${gpu_price:g} / 3600 / {tokens_per_s:,.0f} tokens/s x 1e6",
            gpus * gpu_price / 3600 / tokens_per_s * 1e6 if tokens_per_s else math.inf,
            "USD",
            1.0,
            3,
        ),
        Quantity(
            "decode cost per million output tokens at the node ceiling",
            f"GPUs per node x price / 3600 / max decode tokens/s per node x 1e6 = "
            f"{hw.gpus_per_node} x ${gpu_price:g} / 3600 / {node_ceiling:,.0f} x 1e6",
            hw.gpus_per_node * gpu_price / 3600 / node_ceiling * 1e6 if node_ceiling else math.inf,
            "USD",
            1.0,
            3,
        ),
    ]
