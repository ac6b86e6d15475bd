"""Admission control: at most N requests at once, a bounded queue, 429 beyond it.

Who goes next when a slot frees is decided by the pure fair queue (kvcore/fair_queue.py:
priority classes, token-weighted fairness between tenants, locality within a bound, shedding);
this module is its asyncio shell: it parks each queued request on a future, wakes the one the
queue picks, and turns the queue's refusals into 429s. With nothing queued a request passes at
once, as cheaply as a counter check. A request the fair queue would admit next anyway, arriving
with every slot taken while other tenants' requests wait (its ``sparse``), passes at once on one
of its ``reserved_slots`` above the limit instead of waiting for a slot to free; the next slots
to free then go unfilled until the count is back under the limit.

With ``fairness.share_slots`` (``share_slots``), each tenant is admitted up to its part of the
fleet's slots here (kvcore/fleet_slots.py), recomputed as the other routers' reports arrive
(router/budget_bus.py ``refresh``), and the limit is the ceiling (``max_factor`` x it) while a
peer is heard from: a tenant that sends to this router only may take the slots the others'
tenants leave, and one spread over the routers is held to its share here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kvroute.kvcore.fair_queue import (
    FairnessParams,
    FairQueue,
    Priority,
    QueueFull,
    TenantLimits,
    Ticket,
)
from kvroute.kvcore.fleet_slots import FleetSlots
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.queue_prefix import held_on, uncached

from . import errors

# How a freed slot's replica scores a queued request: prompt tokens of it the replica holds.
Locality = Callable[[str], Callable[[Ticket], int]]
# What a queued request would cost now: its prompt tokens no replica holds (fairness.by program).
Cost = Callable[[], Callable[[Ticket], int]]


class AdmissionRefused(errors.ApiError):
    """A 429 from admission, with why (a metric label): queue_full, queue_timeout or shed."""

    def __init__(self, error: errors.ApiError, reason: str) -> None:
        super().__init__(
            error.status,
            error.message,
            error_type=error.error_type,
            param=error.param,
            code=error.code,
            headers=error.headers,
        )
        self.reason = reason


class Admission:
    """``limit`` requests in service at once (0: no limit), and up to the fair queue's
    ``reserved_slots`` more for sparse tenants; ``queue`` more may wait for a slot."""

    def __init__(
        self,
        limit: int,
        queue: int,
        queue_timeout_s: float,
        fairness: FairnessParams | None = None,
        tenant_limits: Callable[[str], TenantLimits] | None = None,
        locality: Locality | None = None,
        cost: Cost | None = None,
    ) -> None:
        self.limit = limit
        self.queue = queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self.fair = FairQueue(
            fairness or FairnessParams(), tenant_limits or _no_limits, capacity=queue
        )
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._locality = locality
        self._cost = cost
        # fairness.share_slots: the fleet's slots, as the budget bus hears of them.
        self.fleet: FleetSlots | None = None

    def share_slots(self, origin: str, max_factor: float, stale_s: float) -> FleetSlots:
        """Admit each tenant up to its part of the fleet's slots (fairness.share_slots)."""
        self.fleet = FleetSlots(origin, self.limit, self.fair.weight, max_factor, stale_s)
        return self.fleet

    def refresh(self, now: float, demand: dict[str, int] | None = None) -> None:
        """Recompute each tenant's part of the fleet's slots here from this router's
        ``demand`` (what it tells the others; now's without it) and its peers' reports, and
        admit whom it now lets in; with no peer heard from, this router's own limit again."""
        if self.fleet is None:
            return
        if demand is None:
            demand = self.fair.demand()
        self.fair.allowed = self.fleet.allowances(demand, now)
        self._pump(None)

    @property
    def ceiling(self) -> int:
        """Requests in service at once, at most (before reserved slots): the limit, or with the
        fleet's slots shared and peers heard from, the ceiling (max_factor x the limit)."""
        if self.fleet is not None and self.fair.allowed is not None:
            return self.fleet.ceiling
        return self.limit

    @property
    def queued(self) -> int:
        return self.fair.queued

    def refuses(self, priority: Priority) -> AdmissionRefused | None:
        """The 429 a request of class ``priority`` would get now, before anything is read of
        it: every slot taken and no place for it in the queue. None: it may try."""
        if not (self.limit and self.active >= self.ceiling and self.fair.would_refuse(priority)):
            return None
        return self._refused(Ticket("", priority, 0), "queue_full")

    async def acquire(
        self,
        ticket: Ticket | None = None,
        while_queued: Callable[[], Awaitable[None]] | None = None,
    ) -> Ticket:
        """Take a slot, waiting in the queue if there is room; AdmissionRefused (429) otherwise.

        ``while_queued`` runs only when the request must wait (tokenizing it, so the queue
        can weigh its prefix): the unsaturated path never pays for it."""
        if ticket is None:
            ticket = Ticket("default", Priority.STANDARD, 0, time.monotonic())
        fair = self.fair
        ceiling = self.ceiling
        if (not self.limit or self.active < ceiling) and fair.may_start(ticket):
            self._start(ticket)
            return ticket
        if self.active < ceiling + fair.params.reserved_slots and fair.sparse(ticket):
            # Its turn anyway: it starts above the limit rather than wait for a slot to free;
            # ``_pump`` refills none until the count is back under the limit.
            self._start(ticket)
            return ticket
        try:
            victim = fair.offer(ticket)
        except QueueFull:
            raise self._refused(ticket, "queue_full") from None
        if victim is not None:
            self._shed(victim)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = waiter
        self._pump(None)  # a slot may be free for it: those queued may all be at their caps
        try:
            async with asyncio.timeout(fair.max_wait_s(ticket.priority, self.queue_timeout_s)):
                if while_queued is not None and not waiter.done():
                    await while_queued()
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(ticket)  # handed a slot just as it gave up: pass the slot on
            else:
                waiter.cancel()
                self._waiters.pop(ticket, None)
                fair.remove(ticket)
            if isinstance(exc, TimeoutError):
                raise self._timed_out(ticket) from None
            raise
        # The releasing request handed its slot over: ``active`` already counts this one.
        return ticket

    def release(
        self,
        ticket: Ticket | None = None,
        input_tokens: int | None = None,
        output_tokens: int = 0,
        replica: str | None = None,
    ) -> None:
        """The request left: charge its tenant what it used, and give its slot to the request
        the fair queue picks (preferring one whose prefix ``replica``, freed now, holds)."""
        self.active -= 1
        if ticket is not None:
            self.fair.finished(ticket, input_tokens, output_tokens)
        self._pump(replica)

    def _start(self, ticket: Ticket) -> None:
        self.active += 1
        self.fair.started(ticket)

    def _pump(self, replica: str | None) -> None:
        if not self.fair.queued:
            return
        locality = self._locality(replica) if replica and self._locality is not None else None
        cost = self._cost() if self._cost is not None and self.fair.by_program else None
        ceiling = self.ceiling
        while not self.limit or self.active < ceiling:
            ticket = self.fair.pick(locality, time.monotonic(), cost)
            if ticket is None:
                return
            waiter = self._waiters.pop(ticket)
            if waiter.done():
                # Its request gave up (cancelled) and has not left the queue yet: not started.
                continue
            self._start(ticket)
            waiter.set_result(None)

    def _shed(self, victim: Ticket) -> None:
        waiter = self._waiters.pop(victim, None)
        if waiter is not None and not waiter.done():
            why = "a higher-priority request took its place in the full queue"
            error = errors.shed(victim.priority.name.lower(), why, self._retry_after_s())
            waiter.set_exception(AdmissionRefused(error, "shed"))

    def _refused(self, ticket: Ticket, reason: str) -> AdmissionRefused:
        if ticket.priority == Priority.SHEDDABLE and self.queue:
            error = errors.shed("sheddable", "the queue is full", self._retry_after_s())
            return AdmissionRefused(error, "shed")
        return AdmissionRefused(errors.too_many_requests(self.limit, self._retry_after_s()), reason)

    def _timed_out(self, ticket: Ticket) -> AdmissionRefused:
        if self.fair.max_wait_s(ticket.priority, self.queue_timeout_s) < self.queue_timeout_s:
            why = "it waited past fairness.sheddable_max_wait_s"
            error = errors.shed("sheddable", why, self._retry_after_s())
            return AdmissionRefused(error, "shed")
        error = errors.too_many_requests(self.limit, self._retry_after_s())
        return AdmissionRefused(error, "queue_timeout")

    def _retry_after_s(self) -> int:
        # Slots turn over as fast as requests finish; a second is a fair wait to suggest.
        return 1


def _no_limits(name: str) -> TenantLimits:
    return TenantLimits()


def prefix_cost(
    indexes: Callable[[], list[tuple[PrefixIndex, int]]], now: Callable[[], float]
) -> Cost:
    """A queued request's prompt tokens that no replica holds, by the prefix indexes (with their
    block sizes) of the router's pools; all of them for one not tokenized yet."""

    def at_now() -> Callable[[Ticket], int]:
        at, pools = now(), indexes()

        return lambda ticket: uncached(pools, ticket, at)

    return at_now


def prefix_locality(
    index: PrefixIndex, block_size: Callable[[], int], now: Callable[[], float]
) -> Locality:
    """Locality from the prefix index: the leading prompt tokens a replica holds of a queued
    request (0 for one not tokenized yet, or without a tokenizer)."""

    def on(replica: str) -> Callable[[Ticket], int]:
        at, tokens = now(), block_size()
        return lambda ticket: held_on(index, replica, ticket, at, tokens)

    return on
