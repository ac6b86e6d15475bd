"""What a simulation produced, per request and per replica, and the numbers people read."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .loss import LossBreakdown

if TYPE_CHECKING:  # batch.py reads SimResult: only the type comes this way
    from .batch import BatchOutcome
    from .pd_outcome import PdOutcome

NAN = float("nan")


@dataclass(frozen=True)
class Slo:
    """Per-request targets: a request meets the SLO when both hold (None: no target)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft: float, tpot: float) -> bool:
        if self.ttft_s is not None and not ttft <= self.ttft_s:
            return False
        return self.tpot_s is None or math.isnan(tpot) or tpot <= self.tpot_s


@dataclass
class SimResult:
    """Per request (by trace index) and per replica outcomes of one simulated run."""

    policy: str
    replicas: int
    kv_capacity_tokens: int
    arrival_s: list[float]
    input_tokens: list[int]
    output_tokens: list[int]
    first_token_s: list[float]  # NaN: never got a token
    finish_s: list[float]  # NaN: did not finish (rejected, or no replica left)
    replica: list[int]  # the replica that finished it (-1: none)
    queried_tokens: list[int]  # prompt tokens looked up in prefix caches (every engine it met)
    hit_tokens: list[int]  # of them, found cached
    reroutes: list[int]  # times it was moved off a failed replica
    rejected: list[bool]  # larger than one replica's KV cache
    routed_requests: list[int]  # per replica: dispatches
    routed_tokens: list[int]  # per replica: prompt tokens dispatched
    failed_replicas: list[int]
    reasons: Counter[str] = field(default_factory=Counter)
    engine_steps: int = 0
    decode_runs: int = 0
    preemptions: int = 0
    routers: int = 1  # pickers that routed the trace (FleetConfig.routers)
    share: str = "none"  # what they shared (FleetConfig.share)
    loss: LossBreakdown | None = None  # the shortfall against the pooled LRU, by cause
    # Each request's program (admission.program_of) and, behind an admission limit, its time
    # in the router's queue (NaN: never admitted); None where not recorded.
    programs: list[str] | None = None
    queue_wait_s: list[float] | None = None
    fairness: str | None = None  # the admission's order (admission.FAIRNESS); None: no limit
    max_in_flight: int | None = None
    programs_in_flight: int | None = None  # agent programs at a time (None: recorded starts)
    # Per request, the policy's TTFT estimate (s) at its first decision, on its choice and on
    # round robin's / power of two's (policies/regret.py): choice -> list; None without one.
    estimated_ttft_s: dict[str, list[float]] | None = None
    # With an autoscaler: replica-seconds started or serving or draining, and each action
    # (time, "up" | "down", replica); without, the fixed fleet's replicas x the run.
    replica_seconds: float | None = None
    scale_actions: list[tuple[float, str, int]] = field(default_factory=list)
    # With a batch job beside the trace: how it went (its lines are not in the lists above).
    batch: BatchOutcome | None = None
    # A P/D fleet's splits and transfers (pd_fleet.py); None for an aggregated fleet.
    pd: PdOutcome | None = None
    # Prompt tokens loaded from an offload tier instead of computed, per medium (in hit_tokens).
    loaded_tokens: dict[str, int] = field(default_factory=dict)

    # -- derived ----------------------------------------------------------------------

    @property
    def requests(self) -> int:
        return len(self.arrival_s)

    @property
    def completed(self) -> int:
        return sum(1 for f in self.finish_s if not math.isnan(f))

    def ttfts(self) -> list[float]:
        return [
            f - a
            for a, f, d in zip(self.arrival_s, self.first_token_s, self.finish_s, strict=True)
            if not math.isnan(d)
        ]

    def tpots(self) -> list[float]:
        """Time per output token after the first, of finished requests with 2+ tokens."""
        return [
            (d - f) / (n - 1)
            for f, d, n in zip(self.first_token_s, self.finish_s, self.output_tokens, strict=True)
            if not math.isnan(d) and n > 1
        ]

    def hit_rate(self) -> float:
        queried = sum(self.queried_tokens)
        return sum(self.hit_tokens) / queried if queried else NAN

    def makespan_s(self) -> float:
        """From the first arrival to the last finish."""
        done = [f for f in self.finish_s if not math.isnan(f)]
        if not done or not self.arrival_s:
            return 0.0
        return max(done) - min(self.arrival_s)

    def goodput(self, slo: Slo) -> tuple[int, float]:
        """Requests that finished within the SLO, and their rate over the makespan."""
        good = 0
        for a, f, d, n in zip(
            self.arrival_s, self.first_token_s, self.finish_s, self.output_tokens, strict=True
        ):
            if math.isnan(d):
                continue
            tpot = (d - f) / (n - 1) if n > 1 else NAN
            if slo.met(f - a, tpot):
                good += 1
        span = self.makespan_s()
        return good, (good / span if span > 0 else NAN)

    def replica_hours(self) -> float:
        """Replica-hours the run used: the autoscaler's count, else every replica throughout
        (from the first arrival to the last finish)."""
        if self.replica_seconds is not None:
            return self.replica_seconds / 3600
        return self.replicas * self.makespan_s() / 3600

    def load_max_over_mean(self) -> float:
        """max / mean of the requests each replica that stayed up was sent (1.0 is even); in a
        P/D fleet, over its decode pool (every request goes through it)."""
        pool = self.pd.decode_replicas() if self.pd is not None else range(self.replicas)
        counts = [self.routed_requests[i] for i in pool if i not in self.failed_replicas]
        total = sum(counts)
        return max(counts) / (total / len(counts)) if counts and total else NAN
