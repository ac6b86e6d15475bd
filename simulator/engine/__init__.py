"""The engine model: a pure-Python vLLM v1 engine core in virtual time.

Paged KV cache with prefix caching and LRU eviction (``block_pool``), per-request block tables
(``kv_cache_manager``), continuous batching with chunked prefill and preemption (``scheduler``),
a roofline step-latency model (``latency``) and vLLM's KV events with their exact wire encoding
(``events``). ``Engine`` ties them together; nothing here does I/O or reads a clock.
"""

from kvroute.kvcore.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    MalformedEventBatch,
    decode_event_batch,
    encode_event_batch,
)

from .config import EngineConfig
from .engine import Engine
from .latency import DEFAULT_PRESET, PRESETS, LatencyModel, latency_preset
from .outputs import EngineStats, RequestOutput, StepOutput
from .request import EngineRequest

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineStats",
    "ExternalBlockHash",
    "KVEvent",
    "LatencyModel",
    "MalformedEventBatch",
    "RequestOutput",
    "StepOutput",
    "decode_event_batch",
    "encode_event_batch",
    "latency_preset",
]
