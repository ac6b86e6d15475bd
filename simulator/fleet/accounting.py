"""The router's load accounting on ``ReplicaState``, as ``router/server.py`` does it.

Kept as small pure functions so the live router could call the very same ones (today
``Router._forward`` updates the fields inline; see docs/simulator.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.policies import ReplicaState, RouteRequest


@dataclass(slots=True)
class Dispatch:
    """One request sent to one replica, as the router tracks it until it finishes."""

    replica: int
    cost: int  # prompt + max output tokens: in_flight_tokens while it runs
    prefill: int  # uncached prompt tokens: prefill_tokens until its first token
    prefilling: bool = True


def dispatched(state: ReplicaState, request: RouteRequest, replica: int) -> Dispatch:
    """The request was sent: count it in flight and its uncached prompt as queued prefill."""
    prefix = request.prefix_tokens or {}
    cached = min(prefix.get(state.replica_id, 0), request.prompt_tokens)
    d = Dispatch(replica, request.token_cost, max(1, request.prompt_tokens - cached))
    state.in_flight += 1
    state.in_flight_tokens += d.cost
    state.prefilling += 1
    state.prefill_tokens += d.prefill
    return d


def prefill_done(state: ReplicaState, d: Dispatch) -> bool:
    """The first token arrived (or the attempt failed first); False if it was counted already."""
    if not d.prefilling:
        return False
    d.prefilling = False
    state.prefilling -= 1
    state.prefill_tokens -= d.prefill
    return True


def finished(state: ReplicaState, d: Dispatch) -> None:
    """The request left the replica (done, or its replica failed)."""
    prefill_done(state, d)
    state.in_flight -= 1
    state.in_flight_tokens -= d.cost
