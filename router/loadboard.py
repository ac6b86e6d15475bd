"""In-flight load shared by the router's worker processes.

With ``--workers N`` several processes accept connections on one port (SO_REUSEPORT),
and each must route by the load of all of them (principle 5: load is what the router
knows now). Each worker owns one row of an anonymous shared memory map, created before the
workers are forked, and only ever writes its own row, so no locks are needed; a decision
reads the sum over rows. With one worker there is no board and no cost.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

from kvroute.policies import ReplicaState

_SLOT_BYTES = 8  # int64
_FIELDS = 4  # in-flight requests, in-flight tokens, prefilling requests, their prefill tokens


class LoadBoard:
    def __init__(self, workers: int, replicas: int) -> None:
        self.workers = workers
        self.replicas = replicas
        self._row = replicas * _FIELDS
        self._map = mmap.mmap(-1, max(1, workers * self._row * _SLOT_BYTES))
        self._slots = memoryview(self._map).cast("q")

    def add(
        self,
        worker: int,
        replica: int,
        requests: int,
        tokens: int,
        prefilling: int = 0,
        prefill_tokens: int = 0,
    ) -> None:
        base = worker * self._row + replica * _FIELDS
        slots = self._slots
        slots[base] += requests
        slots[base + 1] += tokens
        slots[base + 2] += prefilling
        slots[base + 3] += prefill_tokens

    def clear_row(self, worker: int) -> None:
        """Forget a worker's load (it exited, and its requests with it)."""
        start = worker * self._row
        for i in range(start, start + self._row):
            self._slots[i] = 0

    def totals_into(self, states: Sequence[ReplicaState], first: int = 0) -> None:
        """Write the load summed over all workers into ``states`` (in replica order, from
        replica ``first``: a model pool's replicas follow the pools before it)."""
        slots = self._slots
        row = self._row
        rows = range(0, self.workers * row, row)
        for i, state in enumerate(states, first):
            base = i * _FIELDS
            state.in_flight = sum(slots[r + base] for r in rows)
            state.in_flight_tokens = sum(slots[r + base + 1] for r in rows)
            state.prefilling = sum(slots[r + base + 2] for r in rows)
            state.prefill_tokens = sum(slots[r + base + 3] for r in rows)
