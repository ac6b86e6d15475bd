"""What the engine reports: per-request outputs, per-step results and cumulative stats."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.kvcore.kv_events import KVEvent

# The sources of vllm:prompt_tokens_by_source, in EngineStats.prompt_tokens_by_source's order.
PROMPT_SOURCES: tuple[str, str, str] = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class RequestOutput:
    """What one request produced in one step (at most one token: no speculative decoding)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit tokens, known after the request's first schedule
    # A finished request asked to hold its blocks (P/D prefill side): their ids, still held.
    held_block_ids: list[int] | None = None


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
    # vllm:prompt_tokens_by_source{source} (local_compute, local_cache_hit, external_kv_transfer)
    # and vllm:prompt_tokens_cached, counted as vLLM's PromptTokenStats does.
    prompt_tokens_by_source: tuple[int, int, int] = (0, 0, 0)
    prompt_tokens_cached: int = 0
    # KV offloading (vllm:kv_offload_load_bytes / _load_time / _store_bytes; only with tiers).
    offload_load_bytes: int = 0
    offload_load_seconds: float = 0.0
    offload_store_bytes: int = 0
    offload: bool = False
