"""A tenant's token budget over several routers: each router's charges shared over a real NATS
server (Debian's nats-server), so spreading requests over four routers does not buy four times
the budget. The same load without the bus is the control: there it does."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.kvcore.budgets import ChargeLog, TenantBudget
from kvroute.kvcore.stats import parse_metrics
from kvroute.router.config import ConfigError, config_from_dict

from .conftest import RunningRouter, StartReplica, StartRouter
from .helpers import budget_buses_connected

OUTPUT_PER_MINUTE = 300  # 5 tokens/s; the fake replica answers 3 output tokens a request
ROUTERS = 4
LOAD_S = 3.0


def _tenants(bus: str | None) -> dict[str, Any]:
    tenants: dict[str, Any] = {"by_name": {"acme": {"output_tokens_per_minute": OUTPUT_PER_MINUTE}}}
    if bus is not None:
        tenants |= {"budget_bus": bus, "budget_bus_subject": "kvroute.test.budgets"}
    return tenants


async def _spread_load(routers: list[RunningRouter], senders: int) -> tuple[int, int, float]:
    """Requests from tenant acme, ``senders`` at a time spread round robin over the routers,
    for LOAD_S: (answered, refused with 429, seconds)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
    answered = refused = 0
    started = time.monotonic()
    deadline = started + LOAD_S

    async def sender(http: aiohttp.ClientSession, url: str) -> None:
        nonlocal answered, refused
        while time.monotonic() < deadline:
            async with http.post(
                url + "/v1/completions", json=body, headers={"X-Tenant-Id": "acme"}
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    answered += 1
                else:
                    assert resp.status == 429, resp.status
                    refused += 1

    async with aiohttp.ClientSession() as http:
        urls = [routers[i % len(routers)].url for i in range(senders)]
        await asyncio.gather(*(sender(http, url) for url in urls))
    return answered, refused, time.monotonic() - started


async def test_a_budget_holds_over_four_routers_only_with_the_bus(
    start_replica: StartReplica, start_router: StartRouter, nats_url: str
) -> None:
    """The same load (8 requests at a time) through one router, through four sharing the bus,
    and through four that do not: the tenant's output tokens served in each case."""
    replica = await start_replica("a")
    # Answers take longer than the bus's interval, as real ones do: what the routers admit
    # before they hear of each other is then the lag, not the fake replica's speed.
    replica.delay_s = 0.05
    used: dict[str, float] = {}
    for case, count, bus in (
        ("one", 1, None),
        ("bus", ROUTERS, nats_url),
        ("alone", ROUTERS, None),
    ):
        routers = [await start_router([replica], tenants=_tenants(bus)) for _ in range(count)]
        if bus is not None:  # a router not yet on the bus spends alone
            await budget_buses_connected(*routers)
        answered, refused, elapsed = await _spread_load(routers, senders=2 * ROUTERS)
        assert refused > 0 or case == "alone", case  # the budget was reached
        # Per budget a router allows: a full minute's bucket, plus its refill over the load.
        used[case] = answered * 3 / (OUTPUT_PER_MINUTE * (1 + elapsed / 60))
    # Output is charged when an answer ends, so one router already lets the requests in
    # flight when the bucket runs dry overshoot a little; four on the bus add little to it
    # (the 1.05x target is `kvroute bench budgets`'; here a loaded machine's event-loop lag
    # delays the charges, so the test holds the bus to far below the four budgets of "alone").
    assert used["one"] <= 1.2, used
    assert used["bus"] <= 1.25 * used["one"], used
    assert used["bus"] >= 0.9, used  # and the tenant still got its budget
    assert used["alone"] > 2 * used["one"], used  # each router granted its own


def test_charges_are_netted_per_tenant_and_drained_once() -> None:
    log = ChargeLog()
    log.add("a", 100, 0)  # reserved
    log.add("a", -20, 7)  # corrected to the replica's count, output charged
    log.add("b", 50, 0)
    log.add("b", -50, 0)  # refused in the queue: given back
    assert log.drain() == {"a": (80, 7)}
    assert log.drain() == {}


def test_a_starting_router_takes_a_peers_level_then_its_charges() -> None:
    budget = TenantBudget(600, 60, now=0.0)
    budget.adopt_level(100.0, None)  # a peer has spent 500 of the minute
    assert budget.levels(0.0) == (100.0, 60.0)
    budget.adopt_level(400.0, 10.0)  # never fuller than it is
    assert budget.levels(0.0) == (100.0, 10.0)
    budget.apply_remote(30, 5, now=0.0)
    assert budget.levels(0.0) == (70.0, 5.0)
    assert budget.check(71, now=0.0) is not None  # and it refuses what no longer fits


def test_a_bad_budget_bus_setting_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "tenants": {
                    "budget_bus": "redis://x",
                    "budget_bus_subject": "a b",
                    "budget_bus_interval_s": 0,
                }
            }
        )
    problems = "\n".join(info.value.problems)
    for key in ("tenants.budget_bus:", "tenants.budget_bus_subject:", "budget_bus_interval_s:"):
        assert key in problems, problems


async def test_a_router_whose_nats_is_down_serves_alone_and_joins_when_it_comes(
    start_replica: StartReplica,
    start_router: StartRouter,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from kvroute.backends.process import free_ports
    from kvroute.router import nats_link

    from .helpers import wait_until

    monkeypatch.setattr(nats_link, "RETRY_S", 0.2)
    (port,) = free_ports(1)  # nothing listens there yet
    url = f"nats://127.0.0.1:{port}"
    replica = await start_replica("a")
    r = await start_router([replica], tenants=_tenants(url), routing={"ledger_bus": url})
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200  # served alone
    budgets = r.router._budget_bus
    assert budgets is not None and not budgets.connected
    assert await _bus_connected(r.url) == {"dispatch": 0.0, "budget": 0.0}  # what /metrics says
    from kvroute.bench.harness.nats import nats_server

    with nats_server(tmp_path, port=port):
        await wait_until(lambda: budgets.connected, what="the budget bus connected")
        (pool,) = list(r.router.core.pools)
        await wait_until(
            lambda: pool.bus is not None and pool.bus.connected,
            what="the dispatch bus connected",
        )
        assert await _bus_connected(r.url) == {"dispatch": 1.0, "budget": 1.0}


async def _bus_connected(url: str) -> dict[str, float]:
    """kvroute_bus_connected by bus, from the router's /metrics."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        page = parse_metrics(await resp.read())
    return {s.labels["bus"]: s.value for s in page.samples if s.name == "kvroute_bus_connected"}
