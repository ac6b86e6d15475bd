"""Engine configuration: the knobs of ``vllm serve`` that shape scheduling and caching."""

from __future__ import annotations

from dataclasses import dataclass

from .latency import DEFAULT_PRESET, PRESETS, LatencyModel


@dataclass(frozen=True)
class OffloadTier:
    """A tier below the GPU that vLLM's offloading connector fills (``medium``: CPU, STORAGE):
    its size in KV blocks of ``EngineConfig.block_size`` and the bytes per second a load from
    it moves back to the GPUs (over all of the replica's GPUs)."""

    medium: str
    num_blocks: int
    load_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.medium not in ("CPU", "STORAGE"):
            raise ValueError(f"OffloadTier.medium must be CPU or STORAGE, got {self.medium!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"OffloadTier.num_blocks must be >= 1, got {self.num_blocks!r}")
        if not self.load_bytes_per_s > 0:
            raise ValueError(
                f"OffloadTier.load_bytes_per_s must be > 0, got {self.load_bytes_per_s}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Capacity, batching limits and the hardware/model latency of one replica."""

    block_size: int = 16
    num_blocks: int = 2048  # KV capacity in blocks (vLLM's --num-gpu-blocks-override)
    max_num_seqs: int = 256  # running batch limit
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    latency: LatencyModel = PRESETS[DEFAULT_PRESET]
    vocab_size: int = 32000  # generated token ids lie in [0, vocab_size)
    seed: int = 0
    # Distinct LoRA adapters in one running batch (vLLM's --max-loras); 0: no limit.
    max_loras: int = 0
    # KV offload tiers below the GPU, CPU first (vLLM's OffloadingConnector, then tiering).
    offload: tuple[OffloadTier, ...] = ()

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` (prompt and output; the last output token needs no
        slot) fits this engine's KV cache at all: larger ones are refused at any load."""
        return -(-(tokens - 1) // self.block_size) <= self.num_blocks

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"EngineConfig.max_loras must be >= 0, got {self.max_loras!r}")
