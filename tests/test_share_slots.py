"""Fleet-wide admission of tenants (fairness.share_slots), live: two routers on a real NATS
server (Debian's nats-server) in front of one held replica. A tenant that sends to one router
only takes the idle peer's slots; once the peer's own tenant comes, that router admits no more
of it; once the peer leaves, the router is back to its own limit. And the config's checks."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest

from kvroute.router.admission import Admission
from kvroute.router.budget_bus import BudgetBus, Charges, ProgramCharge, TenantCharge, TenantDemand
from kvroute.router.config import ConfigError, config_from_dict
from kvroute.router.tenant_metrics import TenantMetrics
from kvroute.router.tenants import Tenants

from .conftest import RunningRouter, StartReplica, StartRouter
from .helpers import budget_buses_connected, wait_until


async def _send(http: aiohttp.ClientSession, url: str, tenant: str) -> int:
    body = {"model": "tiny", "prompt": "hold", "max_tokens": 3}  # held until the replica's gate
    async with http.post(url + "/v1/completions", json=body, headers={"X-Tenant-Id": tenant}) as r:
        await r.read()
        return r.status


async def _rows(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, Any]:
    async with http.get(router.url + "/admin/tenants") as r:
        return {row["tenant"]: row for row in (await r.json())["tenants"]}


def _overrides(nats_url: str, subject: str, slots: bool) -> dict[str, Any]:
    return {
        "tenants": {"budget_bus": nats_url, "budget_bus_subject": subject},
        "fairness": {"share_bus": True, "share_slots": slots, "reserved_slots": 0},
        "limits": {"max_concurrent_requests": 2, "max_queued_requests": 20},
    }


@pytest.mark.parametrize("slots", [True, False])
async def test_a_tenant_on_one_router_takes_an_idle_peers_slots_until_the_peer_has_its_own(
    start_replica: StartReplica, start_router: StartRouter, nats_url: str, slots: bool
) -> None:
    """Routers A and B, 2 slots each. "local" sends 6 requests to A only: with share_slots it
    runs 4 at once through A (the fleet's 4, B idle), without it 2 (A's limit). Then "spread"
    sends 2 to B: B runs them (its share), and A admits none more of "local"."""
    replica = await start_replica("r")
    overrides = _overrides(nats_url, f"kvroute.test.slots.{slots}", slots)
    a = await start_router([replica], **overrides)
    b = await start_router([replica], **overrides)
    await budget_buses_connected(a, b)
    bus_a, queue_a = a.router._budget_bus, a.router.admission.fair
    assert bus_a is not None
    async with aiohttp.ClientSession() as http:
        if slots:
            fleet = a.router.admission.fleet
            assert fleet is not None
            await wait_until(lambda: len(fleet.peers) == 1, what="A heard B's slots")
        local = [asyncio.create_task(_send(http, a.url, "local")) for _ in range(6)]
        running = 4 if slots else 2
        await wait_until(lambda: replica.running == running, what=f"{running} running")
        await wait_until(lambda: queue_a.queued == 6 - running, what="the rest queued on A")
        if slots:
            # A few exchanges later, still no more: A holds to its part.
            applied = bus_a.applied
            await wait_until(lambda: bus_a.applied >= applied + 5, what="A heard B again")
        assert replica.running == running
        assert (await _rows(http, a))["local"]["fleet_slots"] == (4 if slots else None)
        spread = [asyncio.create_task(_send(http, b.url, "spread")) for _ in range(2)]
        await wait_until(lambda: replica.running == running + 2, what="B ran spread's two")
        if slots:
            # The fleet's 4 now 2 and 2: A's "local" already holds 4, so A admits no more.
            await wait_until(
                lambda: a.router.admission.fair.allowed == {"local": 2},
                what="A's part for local down to 2",
            )
            assert (await _rows(http, b))["spread"]["fleet_slots"] == 2
            applied = bus_a.applied
            await wait_until(lambda: bus_a.applied >= applied + 5, what="A heard B again")
        assert replica.running == running + 2 and queue_a.queued == 6 - running
        replica.gate.set()
        assert set(await asyncio.gather(*local, *spread)) == {200}


async def test_when_the_peer_leaves_a_router_is_back_to_its_own_limit(
    start_replica: StartReplica, start_router: StartRouter, nats_url: str
) -> None:
    replica = await start_replica("r")
    overrides = _overrides(nats_url, "kvroute.test.slots.leave", True)
    a = await start_router([replica], **overrides)
    b = await start_router([replica], **overrides)
    fleet = a.router.admission.fleet
    assert fleet is not None
    await wait_until(lambda: len(fleet.peers) == 1, what="A heard B's slots")
    async with aiohttp.ClientSession() as http:
        first = [asyncio.create_task(_send(http, a.url, "local")) for _ in range(3)]
        await wait_until(lambda: replica.running == 3, what="3 running through A (limit 2)")
        assert b.router._budget_bus is not None
        await b.router._budget_bus.close()  # B says it leaves
        await wait_until(lambda: not fleet.peers, what="A dropped B")
        assert (await _rows(http, a))["local"]["fleet_slots"] is None
        assert a.router.admission.ceiling == 2
        more = [asyncio.create_task(_send(http, a.url, "local")) for _ in range(2)]
        await wait_until(lambda: a.router.admission.fair.queued == 2, what="A queued the two")
        assert replica.running == 3  # nothing more admitted above A's own limit
        replica.gate.set()
        assert set(await asyncio.gather(*first, *more)) == {200}


def test_share_slots_needs_share_bus_and_a_limit_and_names_the_keys() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "fairness": {
                    "share_slots": True,
                    "share_max_wait_s": 0,
                    "share_slots_max_factor": 0.5,
                }
            }
        )
    problems = "\n".join(info.value.problems)
    assert "fairness.share_slots: true needs fairness.share_bus: true" in problems, problems
    assert "fairness.share_slots: true needs limits.max_concurrent_requests" in problems
    assert "fairness.share_slots: true needs fairness.share_max_wait_s > 0" in problems
    assert "fairness.share_slots_max_factor: must be a number in [1, 16], got 0.5" in problems
    ok = config_from_dict(
        {
            "tenants": {"budget_bus": "nats://127.0.0.1:4222"},
            "fairness": {"share_bus": True, "share_slots": True},
            "limits": {"max_concurrent_requests": 4},
        }
    )
    assert ok.fairness.share_slots and ok.fairness.share_slots_max_factor == 2.5


# -- the wire, without NATS: routers of either version -------------------------------------


@dataclass
class _Msg:
    data: bytes


class _OldCharges(msgspec.Struct, array_like=True):
    """The message as routers sent it before fairness.share_slots (no slots, no demand)."""

    origin: str
    started: float
    charges: list[TenantCharge]
    programs: list[ProgramCharge] = msgspec.field(default_factory=list)


def _slots_bus() -> BudgetBus:
    raw = {
        "tenants": {"budget_bus": "nats://127.0.0.1:1"},
        "fairness": {"share_bus": True, "share_slots": True},
        "limits": {"max_concurrent_requests": 4},
    }
    config = config_from_dict(raw)
    tenants = Tenants(config, TenantMetrics())
    admission = Admission(4, 10, 30.0, tenant_limits=tenants.limits)
    bus = BudgetBus("nats://127.0.0.1:1", "s", tenants, 0.02, admission.fair)
    bus.share_slots(admission, 2.0)
    return bus


async def test_a_peer_without_slots_counts_none_said_once_and_old_routers_read_the_new_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = _slots_bus()
    admission = bus.admission
    assert admission is not None and admission.fleet is not None
    old = msgspec.msgpack.encode(_OldCharges("old", bus.started, []))
    with caplog.at_level(logging.WARNING):
        await bus._on_message(_Msg(old))
        await bus._on_message(_Msg(old))
    assert [r.getMessage() for r in caplog.records if "shares no slots" in r.getMessage()] == [
        "budget bus: router old shares no slots (fairness.share_slots off there, no "
        "limits.max_concurrent_requests, or an older kvroute): its tenants' requests are not "
        "in the fleet's slots this router shares"
    ]
    assert admission.fleet.peers == {} and admission.fair.allowed is None  # alone, as before
    new = Charges("new", bus.started, [], [], 4, [TenantDemand("x", 6)])
    await bus._on_message(_Msg(msgspec.msgpack.encode(new)))
    # Joined: the fleet's 8 slots, all x's 6 at "new"; none of x here, the ceiling 2 x 4.
    assert admission.fleet.peers.keys() == {"new"}
    assert admission.fair.allowed == {} and admission.ceiling == 8
    # An older router reads the new message: the slots trail, ignored.
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=_OldCharges)
    assert decoded.origin == "new"
