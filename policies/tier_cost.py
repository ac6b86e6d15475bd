"""What a prefix held below a replica's GPU costs, in prefill-token equivalents (kv_aware's unit).

vLLM serves such a prefix by loading its blocks back to the GPU (the offloading connector)
instead of computing them. Two ways to price that:

* ``time`` (default): the load's expected seconds, tokens x KV bytes per token / that tier's
  load bandwidth, over the replica's own seconds per prefill token (its learnt TTFT line): the
  expected time to first token is queue + load + compute for the rest, all in one unit.
* ``weights``: fixed credits per tier, as llm-d scores them (GPU 1.0, CPU 0.8; Dynamo credits
  disk 0.25): a held token costs ``1 - weight`` of a computed one, whatever the model and link.

``flat`` prices nothing: a block on any tier counts as on the GPU (kvroute before tiers).
Pure; kv_aware calls it per replica that holds part of the prompt below its GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .latency import ReplicaLatency

TIER_MODES = ("time", "weights", "flat")
_REMOTE = ":REMOTE"


class TierCost:
    """Prices the (tier, tokens) a replica would load instead of compute."""

    def __init__(
        self,
        mode: str,
        weights: Mapping[str, float],
        kv_bytes_per_token: int,
        load_gbps: Mapping[str, float],
    ) -> None:
        if mode not in TIER_MODES:
            raise ValueError(f"tier_mode must be one of {', '.join(TIER_MODES)}, got {mode!r}")
        for tier, weight in weights.items():
            if not 0 <= weight <= 1:
                raise ValueError(f"{tier.lower()}_weight must be in [0, 1], got {weight}")
        if isinstance(kv_bytes_per_token, bool) or not kv_bytes_per_token > 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
        for tier, gbps in load_gbps.items():
            if not (math.isfinite(gbps) and gbps > 0):
                raise ValueError(f"{tier.lower()}_load_gbps must be a number > 0, got {gbps}")
        self.mode = mode
        self.weights = dict(weights)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.load_gbps = dict(load_gbps)

    def seconds(self, held: tuple[tuple[str, int], ...]) -> float:
        """Expected seconds to load ``held`` back to the GPU (any mode: the SLO forecast)."""
        total = 0.0
        per_token = self.kv_bytes_per_token
        for tier, tokens in held:
            total += tokens * per_token / (self._gbps(tier) * 1e9)
        return total

    def tokens(self, held: tuple[tuple[str, int], ...], latency: ReplicaLatency) -> float:
        """What loading ``held`` adds to a replica's cost, in prefill-token equivalents."""
        mode = self.mode
        if mode == "flat":
            return 0.0
        if mode == "weights":
            return sum(n * (1.0 - self.weights.get(_medium(t), 0.0)) for t, n in held)
        per_token = latency.ttft(1.0) - latency.ttft(0.0)  # the TTFT line's slope
        if per_token <= 0:
            return 0.0
        return self.seconds(held) / per_token

    def _gbps(self, tier: str) -> float:
        if tier.endswith(_REMOTE):
            return self.load_gbps["REMOTE"]
        return self.load_gbps.get(tier, self.load_gbps["STORAGE"])

    def describe(self) -> dict[str, Any]:
        return {
            "tier_mode": self.mode,
            "cpu_weight": self.weights["CPU"],
            "storage_weight": self.weights["STORAGE"],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "cpu_load_gbps": self.load_gbps["CPU"],
            "storage_load_gbps": self.load_gbps["STORAGE"],
            "remote_load_gbps": self.load_gbps["REMOTE"],
        }


def _medium(tier: str) -> str:
    return tier[: -len(_REMOTE)] if tier.endswith(_REMOTE) else tier
