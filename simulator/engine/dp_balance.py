"""vLLM's own balancing across data-parallel ranks, for requests without a rank header.

``DPLBAsyncMPClient.get_core_engine_for_request`` (vllm/v1/engine/core_client.py, 0.32): the
rank with the lowest score ``waiting + running``, plus ``6 x waiting x (kv_usage - 0.5)`` when its
KV cache is over half full; the scan starts one rank further each time, so ties rotate. It is
not cache-aware: which rank holds a prompt's prefix plays no part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankLoad:
    waiting: int
    running: int
    kv_usage: float = 0.0


class DPBalancer:
    def __init__(self) -> None:
        self._start = 0

    def pick(self, loads: Sequence[RankLoad]) -> int:
        best, best_score = 0, float("inf")
        n = len(loads)
        for i in range(n):
            rank = (self._start + i) % n
            load = loads[rank]
            score = float(load.waiting + load.running)
            if load.waiting:
                score += load.waiting * 6.0 * max(0.0, load.kv_usage - 0.5)
            if score < best_score:
                best, best_score = rank, score
        self._start = (self._start + 1) % max(n, 1)
        return best
