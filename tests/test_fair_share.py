"""Tenants' fair shares over several routers (fairness.share_bus): what other routers served a
tenant counts in this router's fair queue. The pure rules on plain tickets, the bus's handling
of messages without NATS, and two live routers on a real NATS server (Debian's nats-server)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest

from kvroute.kvcore.fair_queue import FairnessParams, FairQueue, Priority, TenantLimits, Ticket
from kvroute.router.budget_bus import BudgetBus, Charges, ProgramCharge, TenantCharge
from kvroute.router.config import ConfigError, config_from_dict
from kvroute.router.tenant_metrics import TenantMetrics
from kvroute.router.tenants import Tenants

from .conftest import StartReplica, StartRouter
from .helpers import budget_buses_connected, wait_until

STANDARD = Priority.STANDARD


def make(lead: float = 1000.0, weights: dict[str, float] | None = None) -> FairQueue:
    table = {name: TenantLimits(weight=w) for name, w in (weights or {}).items()}
    params = FairnessParams(share_max_lead_tokens=lead)
    return FairQueue(params, lambda name: table.get(name, TenantLimits()), 100)


def serve(queue: FairQueue, ticket: Ticket, output: int = 0) -> None:
    queue.started(ticket)
    queue.finished(ticket, ticket.input_tokens, output)


# -- the pure part -------------------------------------------------------------------------


def test_service_elsewhere_puts_a_tenant_behind_one_served_here_only() -> None:
    """a and b both wait here, level; another router served a: b goes first here until it has
    received as much, where without the remote service they would alternate."""
    q = make()
    for name in ("a", "b", "a", "b"):
        q.offer(Ticket(name, STANDARD, 100))
    q.apply_remote("a", 300)
    order = []
    for _ in range(4):
        ticket = q.pick()
        assert ticket is not None
        serve(q, ticket)
        order.append(ticket.tenant)
    assert order == ["b", "b", "a", "a"]


def test_remote_service_counts_over_the_tenants_weight_here() -> None:
    q = make(weights={"w": 2.0})
    q.offer(Ticket("x", STANDARD, 1))  # someone waiting: the lead is measured from it
    q.apply_remote("w", 300)
    assert q.counters()["w"] == pytest.approx(150.0)


def test_the_lead_from_other_routers_is_bounded_so_a_silent_one_is_forgotten() -> None:
    """However much another router served a, it goes at most share_max_lead_tokens ahead of
    b here; once b has received that much more (the other router fell silent), they are level
    and alternate again."""
    q = make(lead=250.0)
    for name in ("a", "b"):
        for _ in range(6):
            q.offer(Ticket(name, STANDARD, 100))
    q.apply_remote("a", 10_000)  # a burst, then that router says nothing more
    counters = q.counters()
    assert counters["a"] - counters["b"] == pytest.approx(250.0)
    order = []
    for _ in range(8):
        ticket = q.pick()
        assert ticket is not None
        serve(q, ticket)
        order.append(ticket.tenant)
    # b's 3 requests (300 tokens) take it past a's lead; then they take turns.
    assert order[:3] == ["b", "b", "b"]
    assert order[3:7] in (["a", "b", "a", "b"], ["a", "a", "b", "a"])


def test_a_request_held_back_by_service_elsewhere_waits_at_most_max_wait_s() -> None:
    """a is far ahead here (served elsewhere) and b stays backlogged: a's request would wait
    as long as b's backlog lasts; with max_wait_s it goes first once it has waited that long."""
    params = FairnessParams(share_max_lead_tokens=1e9, max_wait_s=10.0)
    q = FairQueue(params, lambda name: TenantLimits(), 100)
    q.offer(Ticket("b", STANDARD, 100, arrived=0.0))
    q.offer(Ticket("a", STANDARD, 100, arrived=1.0))
    q.apply_remote("a", 1e6)
    for k in range(5):
        q.offer(Ticket("b", STANDARD, 100, arrived=2.0 + k))
    picked = [q.pick(now=t) for t in (5.0, 10.5, 10.6, 11.5)]
    assert [p.tenant if p else None for p in picked] == ["b", "b", "b", "a"]
    # Without the bound (the default) it is still b's turn.
    q2 = FairQueue(FairnessParams(share_max_lead_tokens=1e9), lambda name: TenantLimits(), 100)
    q2.offer(Ticket("b", STANDARD, 100, arrived=0.0))
    q2.offer(Ticket("a", STANDARD, 100, arrived=1.0))
    q2.apply_remote("a", 1e6)
    q2.offer(Ticket("b", STANDARD, 100, arrived=2.0))
    assert [q2.pick(now=100.0).tenant for _ in range(2)] == ["b", "b"]  # type: ignore[union-attr]


def test_the_wait_bound_is_on_with_the_shares_only() -> None:
    from kvroute.router.tenants import fairness_params

    bus = {"budget_bus": "nats://127.0.0.1:4222"}
    on = config_from_dict({"tenants": bus, "fairness": {"share_bus": True}})
    assert fairness_params(on).max_wait_s == 10.0
    off = config_from_dict({"tenants": bus, "fairness": {"share_max_wait_s": 3}})
    assert fairness_params(off).max_wait_s == 0.0


def test_remote_service_never_lowers_a_counter_and_negatives_are_dropped() -> None:
    q = make()
    serve(q, Ticket("a", STANDARD, 500))
    before = q.counters()["a"]
    q.apply_remote("a", -200)  # a peer corrected an estimate down: dropped
    assert q.counters()["a"] == before
    q.offer(Ticket("b", STANDARD, 1))  # b waits at the floor: a's counter when admitted, 0
    q.apply_remote("a", 50_000)
    assert q.counters()["a"] == pytest.approx(1000.0)  # capped 1000 ahead of b
    q.apply_remote("a", 50_000)
    assert q.counters()["a"] == pytest.approx(1000.0)  # and stays there while b waits


def test_what_this_router_served_is_drained_once_for_the_others() -> None:
    q = make()
    assert q.drain_served() == {}  # not shared: nothing kept
    q.served = {}
    serve(q, Ticket("a", STANDARD, 100), output=10)  # 100 + 2 x 10
    ticket = Ticket("b", STANDARD, 50)
    q.started(ticket)
    q.finished(ticket, 30, 0)  # the replica counted 30: net 30
    assert q.drain_served() == {"a": 120.0, "b": 30.0}
    assert q.drain_served() == {}
    assert q.served == {}  # still shared


def test_by_program_what_a_program_received_elsewhere_counts_here() -> None:
    """Two programs of one tenant wait, p1 first; p1's turns were served on another router:
    p2 (less attained service) goes first here."""
    params = FairnessParams(by="program", program_attained_weight=1.0, max_programs=2)
    q = FairQueue(params, lambda name: TenantLimits(), 100)
    q.served = {}
    q.offer(Ticket("t", STANDARD, 100, program="p1"))
    q.offer(Ticket("t", STANDARD, 100, program="p2"))
    q.apply_remote_program("p1", 500)
    first = q.pick(now=0.0)
    assert first is not None and first.program == "p2"
    serve(q, first, output=10)
    assert q.drain_programs() == {"p2": 120.0}  # only what was served here is passed on
    assert q.drain_programs() == {}
    q.apply_remote_program("p3", 1)
    q.apply_remote_program("p4", 1)  # max_programs 2: the least recently served forgotten
    assert list(q.programs) == ["p3", "p4"]
    q.apply_remote_program("p4", -5)  # net negative: dropped
    assert q.attained("p4") == 1
    by_tenant = make()
    by_tenant.apply_remote_program("p1", 500)  # by tenant: programs are not kept
    assert by_tenant.programs == {}


def test_a_late_router_takes_a_tenants_lead_bounded_and_never_lower() -> None:
    old = make(lead=1000.0)
    serve(old, Ticket("b", STANDARD, 100))
    serve(old, Ticket("a", STANDARD, 700))  # a newcomer, from the floor (0) to 700
    serve(old, Ticket("b", STANDARD, 100))
    assert old.lead("a") == pytest.approx(600.0)  # the floor: b's 100 when last admitted
    assert old.lead("b") == pytest.approx(100.0)  # its last request's
    assert old.lead("nobody") == 0.0
    new = make(lead=300.0)
    new.adopt_lead("a", old.lead("a"))
    new.adopt_lead("b", old.lead("b"))
    assert new.counters() == {"a": 300.0, "b": 100.0}  # bounded by its own share_max_lead
    new.adopt_lead("a", 10.0)
    assert new.counters()["a"] == 300.0  # never lower


# -- the bus, without NATS -----------------------------------------------------------------


@dataclass
class _Msg:
    data: bytes


def _bus(**fairness: Any) -> BudgetBus:
    raw = {
        "tenants": {"budget_bus": "nats://127.0.0.1:1"},
        "fairness": {"share_bus": True, **fairness},
    }
    config = config_from_dict(raw)
    tenants = Tenants(config, TenantMetrics())
    fair = FairQueue(FairnessParams(share_max_lead_tokens=5000.0), tenants.limits, 10)
    return BudgetBus("nats://127.0.0.1:1", "s", tenants, 0.02, fair)


def _message(origin: str, started: float, *charges: TenantCharge) -> _Msg:
    return _Msg(msgspec.msgpack.encode(Charges(origin, started, list(charges))))


async def test_the_bus_applies_a_peers_service_and_a_late_router_its_lead_first() -> None:
    bus = _bus()
    fair = bus.fair
    assert fair is not None
    await bus._on_message(_message("peer", bus.started, TenantCharge("a", 0, 0, None, None, 40)))
    assert fair.counters() == {"a": 40.0}  # a peer that started with it: service applied
    # One that ran long before this router started: its lead first (it holds the service)...
    long_ago = bus.started - 3600
    await bus._on_message(
        _message("old", long_ago, TenantCharge("b", 0, 0, None, None, 900, lead=2000.0))
    )
    assert fair.counters()["b"] == 2000.0
    # ... then its service, as any peer's.
    await bus._on_message(
        _message("old", long_ago, TenantCharge("b", 0, 0, None, None, 100, lead=2100.0))
    )
    assert fair.counters()["b"] == 2100.0


class Old(msgspec.Struct, array_like=True):
    """A charge as routers sent it before fairness.share_bus (no service, no lead)."""

    tenant: str
    input_tokens: float
    output_tokens: float
    input_level: float | None
    output_level: float | None


class OldCharges(msgspec.Struct, array_like=True):
    origin: str
    started: float
    charges: list[Old]


async def test_the_bus_applies_a_peers_program_service_by_program() -> None:
    bus = _bus()
    assert bus.fair is not None
    bus.fair.by_program = True  # as FairnessParams(by="program") makes it
    message = Charges("peer", bus.started, [], [ProgramCharge("p1", 70.0)])
    await bus._on_message(_Msg(msgspec.msgpack.encode(message)))
    assert bus.fair.attained("p1") == 70.0


async def test_a_message_of_a_router_without_shares_is_read_and_changes_no_counter() -> None:
    bus = _bus()
    data = msgspec.msgpack.encode(OldCharges("old", bus.started, [Old("a", 10, 5, None, None)]))
    await bus._on_message(_Msg(data))
    assert bus.applied == 1
    assert bus.fair is not None and bus.fair.counters() == {}
    # And an older router reads the new message (the two fields trail: ignored).
    new = msgspec.msgpack.encode(
        Charges("new", 0.0, [TenantCharge("a", 1, 2, None, None, 30.0, 4.0)])
    )
    assert msgspec.msgpack.decode(new, type=OldCharges).charges[0].tenant == "a"


def test_share_bus_without_a_budget_bus_names_both_keys() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {"fairness": {"share_bus": True, "share_max_lead_tokens": -1, "share_max_wait_s": -2}}
        )
    problems = "\n".join(info.value.problems)
    assert "fairness.share_max_wait_s: must be a finite number >= 0" in problems, problems
    assert "fairness.share_bus: true needs tenants.budget_bus" in problems, problems
    assert "fairness.share_max_lead_tokens: must be a finite number >= 0" in problems, problems
    with pytest.raises(ConfigError) as info:
        config_from_dict({"fairness": {"share_bus": "yes"}})
    assert "share_bus" in "\n".join(info.value.problems)


# -- two live routers on NATS --------------------------------------------------------------


async def _send(http: aiohttp.ClientSession, url: str, tenant: str, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3}
    async with http.post(url + "/v1/completions", json=body, headers={"X-Tenant-Id": tenant}) as r:
        await r.read()
        assert r.status == 200, r.status


@pytest.mark.parametrize("shared", [True, False])
async def test_service_on_router_a_moves_a_tenant_behind_another_on_router_b(
    start_replica: StartReplica, start_router: StartRouter, nats_url: str, shared: bool
) -> None:
    """Router B (one slot, held) has "other" then "spread" waiting, level. Router A serves
    "spread" twenty requests. Then "other" queues a second request on B. With the shares on
    the bus, B admits both of "other"'s before "spread"'s; without (the control, the same bus
    for budgets), B counts them level and "spread"'s goes first."""
    replica = await start_replica("r")
    subject = f"kvroute.test.shares.{shared}"
    overrides: dict[str, Any] = {
        "tenants": {"budget_bus": nats_url, "budget_bus_subject": subject},
        "fairness": {"share_bus": shared, "reserved_slots": 0},
        "limits": {"max_concurrent_requests": 1, "max_queued_requests": 10},
    }
    a = await start_router([replica], **overrides)
    b = await start_router([replica], **overrides)
    await budget_buses_connected(a, b)
    queue = b.router.admission.fair
    async with aiohttp.ClientSession() as http:
        held = asyncio.create_task(_send(http, b.url, "blocker", "hold"))
        await wait_until(lambda: replica.running == 1, what="the slot held")
        first = asyncio.create_task(_send(http, b.url, "other", "o1"))
        await wait_until(lambda: queue.queued == 1, what="o1 queued")
        spread = asyncio.create_task(_send(http, b.url, "spread", "s1"))
        await wait_until(lambda: queue.queued == 2, what="s1 queued")
        for _ in range(20):
            await _send(http, a.url, "spread", "elsewhere")
        if shared:
            counters = queue.counters
            await wait_until(
                lambda: counters()["spread"] > counters()["other"] + 50,
                what="router B counted router A's service",
            )
        else:
            # Nothing to wait for: B hears A's budget charges only (none: no budgets here).
            assert a.router._budget_bus is not None and a.router._budget_bus.fair is None
        second = asyncio.create_task(_send(http, b.url, "other", "o2"))
        await wait_until(lambda: queue.queued == 3, what="o2 queued")
        replica.gate.set()
        await asyncio.gather(held, first, spread, second)
    order = [s.body["prompt"] for s in replica.seen if s.body["prompt"] in ("o1", "o2", "s1")]
    # Without the shares the two are level on B, and the one with less waiting goes first.
    assert order == (["o1", "o2", "s1"] if shared else ["s1", "o1", "o2"]), order
