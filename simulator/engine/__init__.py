"""The engine model: a pure-Python vLLM v1 engine core in virtual time.

Paged KV cache with prefix caching and LRU eviction (``block_pool``), per-request block tables
(``kv_cache_manager``), continuous batching with chunked prefill and preemption (``scheduler``),
a roofline step-latency model (``latency``); the KV events it emits are vLLM's, in their exact
wire encoding (``kvroute.kvcore.kv_events``, shared with the router). ``Engine`` ties them
together; nothing here does I/O or reads a clock.
"""

from .config import EngineConfig
from .engine import Engine
from .latency import DEFAULT_PRESET, PRESETS, LatencyModel, latency_preset
from .outputs import PROMPT_SOURCES, EngineStats, RequestOutput, StepOutput
from .request import EngineRequest

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "PROMPT_SOURCES",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineStats",
    "LatencyModel",
    "RequestOutput",
    "StepOutput",
    "latency_preset",
]
