"""Durations of runs of identical decode steps, in closed form.

Between two events, a replica whose batch only decodes runs steps that differ only in context
length: step ``i`` of ``m`` decoding sequences whose lengths sum to ``c0`` at the first step has
``num_tokens = m`` and ``attention_context = kv_tokens_read = c0 + m * i``. The roofline
``LatencyModel.step_time`` is then ``overhead + max(compute_i, memory_i) + tp(m)`` with both
terms linear in ``i``, so ``k`` steps sum in O(1). ``tests/test_fleet_sim.py`` checks the sum
against ``step_time`` step by step for every preset.
"""

from __future__ import annotations

import math

from kvroute.simulator.engine.latency import LatencyModel


class DecodeTimer:
    """Sums of ``LatencyModel.step_time`` over decode-only runs of ``k`` steps."""

    def __init__(self, latency: LatencyModel) -> None:
        self.latency = latency
        g = latency.num_gpus
        self._compute_per_flop = 1.0 / (g * latency.peak_flops * latency.mfu)
        self._memory_per_byte = 1.0 / (g * latency.mem_bandwidth * latency.bandwidth_efficiency)
        self._param_flops = 2.0 * latency.num_params
        self._attn_flops = 4.0 * latency.num_layers * latency.hidden_size

    def _tp(self, m: int) -> float:
        lat = self.latency
        g = lat.num_gpus
        if g == 1:
            return 0.0
        ring_bytes = m * lat.hidden_size * 2.0 * 2.0 * (g - 1) / g
        return (
            2 * lat.num_layers * (lat.allreduce_latency_s + ring_bytes / lat.interconnect_bandwidth)
        )

    def run_time(self, m: int, c0: int, k: int) -> float:
        """Seconds for ``k`` decode steps of ``m`` sequences with ``c0`` context at the first."""
        if k <= 0 or m <= 0:
            return 0.0
        lat = self.latency
        cf, mf = self._compute_per_flop, self._memory_per_byte
        # compute_i = ac + bc * i ; memory_i = am + bm * i
        ac = (self._param_flops * m + self._attn_flops * c0) * cf
        bc = self._attn_flops * m * cf
        am = (lat.weight_bytes + lat.kv_bytes_per_token * c0) * mf
        bm = lat.kv_bytes_per_token * m * mf
        fixed = k * (lat.step_overhead_s + self._tp(m))
        # Steps [0, s) are led by the term that leads at step 0, steps [s, k) by the other.
        s = k
        if bc != bm:
            cross = (am - ac) / (bc - bm)  # where the two lines meet
            if 0 < cross < k:
                s = math.ceil(cross)
        if ac >= am:
            first_a, first_b, second_a, second_b = ac, bc, am, bm
        else:
            first_a, first_b, second_a, second_b = am, bm, ac, bc
        total = _series(first_a, first_b, 0, s) + _series(second_a, second_b, s, k)
        return fixed + total

    def steps_within(self, m: int, c0: int, elapsed: float, k: int) -> int:
        """How many of ``k`` steps are complete ``elapsed`` seconds after the first started."""
        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.run_time(m, c0, mid) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _series(a: float, b: float, i0: int, i1: int) -> float:
    """Sum over i in [i0, i1) of a + b * i."""
    n = i1 - i0
    if n <= 0:
        return 0.0
    return n * a + b * (i0 + i1 - 1) * n / 2.0
