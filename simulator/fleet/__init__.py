"""The discrete-event fleet simulator: traces through the router's policies onto engine models.

Pure: no I/O, no asyncio, no wall clock; deterministic for a seed. ``prepare`` turns a
``Trace`` into unit keys and router hashes, ``simulate`` replays it through one policy on a
``FleetConfig`` (a disaggregated one with ``PdSetup``), ``bounds`` gives the infinite-cache and
pooled-LRU hit rates of the same trace.
"""

from .bounds import infinite_cache_hit_rate, pooled_lru_hit_rate
from .config import (
    ENGINE_MODELS,
    RANK_ROUTINGS,
    SHARE_MODES,
    FleetConfig,
    default_kv_capacity_tokens,
    engine_config,
)
from .fleet import simulate
from .pd_setup import PdSetup
from .results import SimResult, Slo
from .units import SimRequest, UnitTrace, prepare

__all__ = [
    "ENGINE_MODELS",
    "RANK_ROUTINGS",
    "SHARE_MODES",
    "FleetConfig",
    "PdSetup",
    "SimRequest",
    "SimResult",
    "Slo",
    "UnitTrace",
    "default_kv_capacity_tokens",
    "engine_config",
    "infinite_cache_hit_rate",
    "pooled_lru_hit_rate",
    "prepare",
    "simulate",
]
