"""Regret against the simple policies: the TTFT a request would have had elsewhere, estimated.

Cache-aware routing can lose to round robin (peers' users saw it: everything piled on the
replica that held a hot prompt). The guardrail: for every decision, the same cost model that
made it estimates, in seconds, the request's TTFT on

* the chosen replica,
* the replica round robin would have picked: the next eligible one in a rotation kept here
  (one step per decision, as ``RoundRobin`` steps through the fleet),
* a power-of-two choice: two replicas drawn from a hash of the request and a decision
  counter (deterministic: a replay gives the same draws), the less loaded one
  (``load_key``, as ``PowerOfTwo`` compares them).

Regret = estimate(chosen) - estimate(alternative): negative when the choice looks better.
It is an estimate against the fleet as it stood at the decision, not a replay: round robin's
own earlier choices would have left other caches and queues. The simulator checks the
estimate against that counterfactual (``kvroute replay --compare kv_aware,round_robin``).

Cost per decision: three replica estimates and a few hash steps, O(1) in the fleet's size
(an ineligible replica on the rotation is skipped, as rare as a replica that is down).

Pure: no I/O, no clock; the ledger calls it at each ``route``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .kv_aware import KvAware
from .load import load_key
from .types import FleetView, Policy, ReplicaState, RouteRequest

# Seconds to first token of ``request`` on ``replica`` (the policy's own estimate).
TtftModel = Callable[[ReplicaState, RouteRequest], float]

_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """One decision's estimated TTFT (seconds) on the chosen replica and the baselines'."""

    chosen: float
    round_robin: float
    power_of_two: float
    round_robin_replica: str
    power_of_two_replica: str

    @property
    def regret_round_robin(self) -> float:
        return self.chosen - self.round_robin

    @property
    def regret_power_of_two(self) -> float:
        return self.chosen - self.power_of_two


class RegretEstimator:
    """Keeps the round-robin rotation and the draw counter; estimates one decision at a time."""

    __slots__ = ("_decisions", "_next", "_ttft")

    def __init__(self, ttft: TtftModel) -> None:
        self._ttft = ttft
        self._next = 0
        self._decisions = 0

    def estimate(
        self, request: RouteRequest, replicas: Sequence[ReplicaState], chosen: ReplicaState
    ) -> TtftEstimate:
        """``request`` went to ``chosen`` (one of ``replicas``, the fleet in its order)."""
        n = len(replicas)
        model = request.model
        start = self._next % n
        rr = _first_eligible(replicas, start, model) or chosen
        self._next = start + 1
        self._decisions += 1
        p2c = chosen
        if n > 1:
            h = _mix(self._decisions ^ _request_key(request))
            i = h % n
            j = (h >> 32) % (n - 1)
            j += j >= i  # a second, distinct replica
            a = _first_eligible(replicas, i, model)
            b = _first_eligible(replicas, j, model)
            if a is not None and b is not None:
                p2c = a if load_key(a) <= load_key(b) else b
        ttft = self._ttft
        mine = ttft(chosen, request)
        return TtftEstimate(
            mine,
            mine if rr is chosen else ttft(rr, request),
            mine if p2c is chosen else ttft(p2c, request),
            rr.replica_id,
            p2c.replica_id,
        )


def estimator_for(policy: Policy) -> RegretEstimator | None:
    """An estimator with ``policy``'s own TTFT estimate, None for a policy that has none.

    kv_aware's ``forecast``: the replica's latency lines (learnt when an SLO is configured),
    else its prior (``ttft_base_s``, ``prefill_s_per_token``) over the same uncached and queued
    prefill tokens its cost counts.
    """
    if not isinstance(policy, KvAware):
        return None
    forecast = policy.forecast
    return RegretEstimator(lambda replica, request: forecast(replica, request)[0])


def _first_eligible(
    replicas: Sequence[ReplicaState], start: int, model: str | None
) -> ReplicaState | None:
    """The first replica from ``start`` on (wrapping) that may take ``model``: one step unless
    some are out of rotation."""
    n = len(replicas)
    admits = FleetView.admits
    for k in range(n):
        replica = replicas[(start + k) % n]
        if admits(replica, model):
            return replica
    return None


def _request_key(request: RouteRequest) -> int:
    hashes = request.block_hashes
    if hashes:
        return hashes[-1] & _MASK
    return (request.prompt_tokens * 0x9E3779B97F4A7C15) & _MASK


def _mix(x: int) -> int:
    """splitmix64's finaliser: well-spread 64 bits from a counter."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)
