"""In-flight load that several simulated routers add to and read back at once.

What ``kvroute serve --workers N`` does through shared memory (router/loadboard.py): every
worker writes each dispatch, first token and finish to a board and reads the fleet-wide sums
before each decision, while its predictions stay its own. ``share="load"`` gives the
simulated routers one such board, so the cost of workers not sharing predictions can be
measured apart from the cost of not sharing load.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies import ReplicaState


class SharedTotals:
    """Per replica: requests, tokens, prefilling requests and prefill tokens in flight, summed
    over every router that adds to it (the ledger's ``SharedLoad``)."""

    def __init__(self, replicas: int) -> None:
        self.requests = [0] * replicas
        self.tokens = [0] * replicas
        self.prefilling = [0] * replicas
        self.prefill_tokens = [0] * replicas

    def add(
        self, replica: int, requests: int, tokens: int, prefilling: int, prefill_tokens: int
    ) -> None:
        self.requests[replica] += requests
        self.tokens[replica] += tokens
        self.prefilling[replica] += prefilling
        self.prefill_tokens[replica] += prefill_tokens

    def totals_into(self, states: Sequence[ReplicaState]) -> None:
        for i, state in enumerate(states):
            state.in_flight = self.requests[i]
            state.in_flight_tokens = self.tokens[i]
            state.prefilling = self.prefilling[i]
            state.prefill_tokens = self.prefill_tokens[i]
