"""The shape of a disaggregated (P/D) fleet: its two pools, the split rule and the KV link."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvroute.kvcore.pd import DisaggregationRule, link_bytes_per_s

# What kvroute replay --pd-mode offers: "never" would leave the prefill pool idle (that fleet
# is the aggregated one: leave out --pd).
PD_MODES = ("conditional", "always")


@dataclass(frozen=True)
class PdSetup:
    """``prefill`` replicas that only prefill the requests ``rule`` splits off, and ``decode``
    replicas that decode every request (and prefill the ones not split); a split request's KV
    moves over ``link`` ('nvlink', 'rdma' or GB/s as text, as ``kvcore.pd.link_bytes_per_s``).
    Replicas 0..prefill-1 of the fleet are the prefill pool, the rest the decode pool."""

    prefill: int
    decode: int
    rule: DisaggregationRule = field(default_factory=DisaggregationRule)
    link: str = "rdma"

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode

    def link_bytes_per_s(self, gpus: int) -> float:
        """The link's bytes per second for replicas of ``gpus`` GPUs (rdma: a NIC per GPU)."""
        return link_bytes_per_s(self.link, gpus)

    def describe(self, gpus: int) -> str:
        rule = self.rule
        when = (
            "every request split"
            if rule.mode == "always"
            else f"split when >= {rule.min_uncached_tokens:,} prompt tokens are not cached on "
            "the decode replica"
        )
        gbps = self.link_bytes_per_s(gpus) / 1e9
        return (
            f"{self.prefill} prefill + {self.decode} decode replicas, {rule.mode} ({when}), "
            f"KV over {self.link} at {gbps:,.0f} GB/s"
        )

    def problems(self) -> list[str]:
        """What is wrong with this setup, one sentence each (empty: nothing)."""
        problems = []
        for label, count in (("prefill", self.prefill), ("decode", self.decode)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                problems.append(f"{label} replicas: at least 1, got {count!r}")
        if self.rule.mode not in PD_MODES:
            problems.append(f"mode: one of {', '.join(PD_MODES)}, got {self.rule.mode!r}")
        if self.rule.min_uncached_tokens < 0:
            problems.append(f"min uncached tokens: at least 0, got {self.rule.min_uncached_tokens}")
        try:
            speed = link_bytes_per_s(self.link)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            if not math.isfinite(speed):
                problems.append(f"a link's speed must be finite, not {self.link!r}")
        return problems
