"""Admission's slot counting (router/admission.py) over the fair queue, on its own: no router,
no sockets; requests are tickets that acquire and release."""

from __future__ import annotations

import asyncio

from kvroute.kvcore.fair_queue import FairnessParams, Priority, Ticket
from kvroute.router.admission import Admission

from .helpers import wait_until

STANDARD = Priority.STANDARD


def ticket(tenant: str) -> Ticket:
    return Ticket(tenant, STANDARD, 100)


async def test_a_sparse_tenant_starts_above_the_limit_and_the_slot_is_given_back() -> None:
    """Two slots held by a flooding tenant with more of its requests waiting: the light
    tenant's request starts at once on the reserved slot, its second waits (the reserve is
    taken). The next slot to free is not refilled (three ran, the limit is two); the one
    after goes to the light tenant's second (behind in service), the next to the flood."""
    admission = Admission(2, 100, 30.0, FairnessParams(reserved_slots=1))
    held = [await admission.acquire(ticket("heavy")) for _ in range(2)]
    waiting = [asyncio.create_task(admission.acquire(ticket("heavy"))) for _ in range(3)]
    await wait_until(lambda: admission.queued == 3, what="the flood queued")
    assert admission.active == 2

    light = await asyncio.wait_for(admission.acquire(ticket("light")), 1)
    assert admission.active == 3 and admission.queued == 3
    # The reserve is taken: a second light request waits for a slot.
    second = asyncio.create_task(admission.acquire(ticket("light")))
    await wait_until(lambda: admission.queued == 4, what="the second light request queued")

    admission.release(held[0], 100, 10)
    assert admission.active == 2 and admission.queued == 4  # not refilled: given back
    admission.release(held[1], 100, 10)
    assert admission.active == 2 and admission.queued == 3  # under the limit: refilled
    await asyncio.wait_for(second, 1)
    admission.release(light, 100, 10)
    assert admission.active == 2 and admission.queued == 2
    done, _ = await asyncio.wait(waiting, timeout=1, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1  # the flood's oldest
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_without_reserved_slots_every_request_waits_for_a_slot() -> None:
    admission = Admission(1, 100, 30.0, FairnessParams(reserved_slots=0))
    held = await admission.acquire(ticket("heavy"))
    flood = asyncio.create_task(admission.acquire(ticket("heavy")))
    light = asyncio.create_task(admission.acquire(ticket("light")))
    await wait_until(lambda: admission.queued == 2, what="both queued")
    assert admission.active == 1
    admission.release(held, 100, 10)
    # The light tenant was lifted level with the flood and is lighter: it goes first.
    await asyncio.wait_for(light, 1)
    assert not flood.done() and admission.active == 1
    flood.cancel()
    await asyncio.gather(flood, return_exceptions=True)
