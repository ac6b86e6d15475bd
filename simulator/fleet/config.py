"""How a simulated fleet is built: replicas, their engine, and the router's timings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvroute.simulator.engine.config import EngineConfig
from kvroute.simulator.engine.latency import LatencyModel

ENGINE_MODELS = ("fast", "exact")

# GPU memory per device, for the default KV capacity of a preset (name fragment -> bytes).
_GPU_MEMORY = {"h100": 80e9, "h200": 141e9}
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
TINY_CPU_KV_TOKENS = 64 * 32  # what the real-vLLM tests give the tiny model (64 blocks of 32)


def default_kv_capacity_tokens(latency: LatencyModel) -> int:
    """KV tokens one replica holds: vLLM's share of GPU memory, less the weights.

    Activation memory is ignored (a few GiB on these models): a slight overestimate.
    """
    memory = next((m for frag, m in _GPU_MEMORY.items() if frag in latency.name), None)
    if memory is None:
        return TINY_CPU_KV_TOKENS
    free = memory * latency.num_gpus * GPU_MEMORY_UTILIZATION - latency.weight_bytes
    return max(1, int(free // latency.kv_bytes_per_token))


@dataclass(frozen=True)
class FleetConfig:
    """A fleet of identical replicas behind one simulated router."""

    replicas: int
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_model: str = "fast"  # "fast" (unit-granular, decode runs) or "exact" (simulator.engine)
    event_lag_s: float = 0.01  # KV events reach the router's index this long after their step
    scrape_interval_s: float = 1.0  # how often replicas' queue depth and KV usage are read
    prediction_ttl_s: float = 10.0  # the router's routing.prediction_ttl_s
    failures: tuple[tuple[int, float], ...] = ()  # (replica index, time in s): removed then

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.engine_model not in ENGINE_MODELS:
            raise ValueError(
                f"engine model must be one of {', '.join(ENGINE_MODELS)}, got {self.engine_model!r}"
            )
        for label, value in (
            ("event_lag_s", self.event_lag_s),
            ("scrape_interval_s", self.scrape_interval_s),
            ("prediction_ttl_s", self.prediction_ttl_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be a finite number >= 0, got {value}")
        if self.scrape_interval_s == 0:
            raise ValueError("scrape_interval_s must be > 0")
        for replica, at in self.failures:
            if not 0 <= replica < self.replicas:
                raise ValueError(
                    f"cannot fail replica {replica}: replicas are numbered 0..{self.replicas - 1}"
                )
            if not (math.isfinite(at) and at >= 0):
                raise ValueError(f"failure time must be a finite number >= 0, got {at}")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.num_blocks * self.engine.block_size


def engine_config(
    latency: LatencyModel,
    kv_capacity_tokens: int | None = None,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
) -> EngineConfig:
    """One replica's engine: vLLM's defaults for online serving on a large GPU, unless given."""
    tokens = (
        kv_capacity_tokens
        if kv_capacity_tokens is not None
        else (default_kv_capacity_tokens(latency))
    )
    num_blocks = max(1, tokens // block_size)
    return EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=num_blocks * block_size,
        latency=latency,
        seed=seed,
    )
