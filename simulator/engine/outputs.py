"""What the engine reports: per-request outputs, per-step results and cumulative stats."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.kvcore.kv_events import KVEvent


@dataclass
class RequestOutput:
    """What one request produced in one step (at most one token: no speculative decoding)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit tokens, known after the request's first schedule


@dataclass
class StepOutput:
    """One scheduler iteration: its modelled duration, outputs and KV events in creation order."""

    duration_s: float
    outputs: list[RequestOutput]
    events: list[KVEvent]


@dataclass
class EngineStats:
    """Gauges and counters that vLLM exports on /metrics (counters are cumulative)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 1 - free/total; evictable cached blocks count as free
    prefix_cache_queries: int  # tokens queried (vllm:prefix_cache_queries)
    prefix_cache_hits: int  # tokens hit (vllm:prefix_cache_hits)
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # LoRA adapters of the running and waiting requests (vllm:lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
