"""The router's admission in front of the simulated fleet: at most ``max_in_flight`` requests in
service, the rest wait in the router's own fair queue (kvcore/fair_queue.py), on the virtual
clock.

It follows router/admission.py's rules: a request starts at once when a slot is free and
nothing waits; else it queues, and each finish hands its slot to the request the fair queue
picks. ``fairness`` chooses the order (``FAIRNESS``):

* ``fcfs``: one queue in strict arrival order (no locality, no reserved slots): the baseline.
* ``tenant``: each program is a tenant of its own, weighted equally (Virtual Token Counter,
  with the router's reserved slots for the program next in fair order): what the router does
  when clients name their program as ``X-Tenant-Id``.
* ``program``: one tenant, programs in least-attained-service order (``fairness.by: program``),
  each request's own cost its prompt tokens no replica holds (``finished``'s ``cost``).

With ``tenant`` a freed slot prefers, within the router's locality bound, the queued request
whose prefix the replica that freed it holds (``finished``'s ``locality``); both read the first
router's prefix index, as the router's admission reads its own.

A request's program is its session up to the first ``/`` (the Claude Code loader names a
sub-agent ``<conversation>/<agent>``: a sub-agent belongs to its parent's program, as the live
router finds it, kvcore/agent_identity.py). The queue never fills (no 429s: a replay measures
waits). Batch lines (the batch lane) do not pass through it. Pure: no I/O, no clock.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.kvcore.fair_queue import FairnessParams, FairQueue, Priority, TenantLimits, Ticket

FAIRNESS = ("fcfs", "tenant", "program")
ONE_TENANT = "default"


@dataclass(frozen=True, slots=True)
class AdmissionSpec:
    max_in_flight: int
    fairness: str = "fcfs"
    program_max_wait_s: float = FairnessParams().program_max_wait_s
    program_attained_weight: float = FairnessParams().program_attained_weight
    output_weight: float = FairnessParams().output_weight
    program_wait_share: float = FairnessParams().program_wait_share

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.fairness not in FAIRNESS:
            raise ValueError(
                f"fairness must be one of {', '.join(FAIRNESS)}, got {self.fairness!r}"
            )
        if not self.program_max_wait_s > 0:
            raise ValueError(f"program_max_wait_s must be > 0, got {self.program_max_wait_s}")


def program_of(session_id: str | None, index: int) -> str:
    """A request's program: its session up to the first "/" (a request without a session is a
    program of its own)."""
    if not session_id:
        return f"#{index}"
    return session_id.split("/", 1)[0]


class SimAdmission:
    """Admission of a replay's requests, by index (``arrive``, ``finished``)."""

    def __init__(self, spec: AdmissionSpec) -> None:
        self.spec = spec
        default = FairnessParams()
        params = FairnessParams(
            output_weight=spec.output_weight,
            reserved_slots=default.reserved_slots if spec.fairness == "tenant" else 0,
            by="program" if spec.fairness == "program" else "tenant",
            program_max_wait_s=spec.program_max_wait_s,
            program_attained_weight=spec.program_attained_weight,
            program_wait_share=spec.program_wait_share,
        )
        self.queue = FairQueue(params, lambda name: TenantLimits(), capacity=sys.maxsize)
        self.active = 0
        self.tickets: dict[int, Ticket] = {}  # admitted or waiting, by request index
        self._waiting: dict[int, int] = {}  # id(ticket) -> request index
        self.waited_s: dict[int, float] = {}  # request index -> time in the queue

    def arrive(
        self, index: int, program: str, input_tokens: int, t: float, hashes: Sequence[int] = ()
    ) -> bool:
        """Request ``index`` arrives at ``t``: True when it starts at once, False when it waits
        (``finished`` hands it a slot later). ``hashes``: its prompt's block hashes, for
        locality."""
        tenant = program if self.spec.fairness == "tenant" else ONE_TENANT
        ticket = Ticket(tenant, Priority.STANDARD, input_tokens, t, hashes, program=program)
        self.tickets[index] = ticket
        queue, limit = self.queue, self.spec.max_in_flight
        reserve = queue.params.reserved_slots
        if (self.active < limit and queue.may_start(ticket)) or (
            self.active < limit + reserve and queue.sparse(ticket)
        ):
            self._start(index, ticket, t)
            return True
        queue.offer(ticket)
        self._waiting[id(ticket)] = index
        return False

    def finished(
        self,
        index: int,
        input_tokens: int,
        output_tokens: int,
        t: float,
        locality: Callable[[Ticket], int] | None = None,
        cost: Callable[[Ticket], int] | None = None,
    ) -> list[int]:
        """Request ``index`` left at ``t`` (its slot frees): the requests that start now.
        ``locality(ticket)``: the prompt tokens the freed replica holds of a queued request;
        ``cost(ticket)``: those no replica holds (the fair queue's, by program)."""
        ticket = self.tickets.pop(index, None)
        if ticket is None or not ticket.running:
            return []
        self.active -= 1
        queue = self.queue
        queue.finished(ticket, input_tokens, output_tokens)
        started = []
        while self.active < self.spec.max_in_flight:
            picked = queue.pick(locality if self.spec.fairness != "fcfs" else None, t, cost)
            if picked is None:
                break
            waiter = self._waiting.pop(id(picked))
            self._start(waiter, picked, t)
            started.append(waiter)
        return started

    def _start(self, index: int, ticket: Ticket, t: float) -> None:
        self.active += 1
        self.queue.started(ticket)
        self.waited_s[index] = t - ticket.arrived
