"""Two ``kvroute serve`` routers sharing their dispatches over a real NATS server (Debian's
nats-server), as two pickers do with epp.ledger_bus: what one router has in flight on a
replica, the other counts there too, so it sends its own request to the idle replica."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvroute.router.config import ConfigError, config_from_dict

from .conftest import RunningRouter, StartReplica, StartRouter
from .helpers import wait_until


async def _send(http: aiohttp.ClientSession, router: RunningRouter) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": "hold", "max_tokens": 3}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("X-Kvroute-Replica", "")


def _in_flight(router: RunningRouter) -> dict[str, int]:
    return {s.replica_id: s.in_flight for s in router.router.fleet.replicas}


@pytest.mark.parametrize("shared", [True, False], ids=["bus", "no-bus"])
async def test_a_request_in_flight_on_one_router_counts_on_the_other(
    start_replica: StartReplica, start_router: StartRouter, nats_url: str, shared: bool
) -> None:
    replicas = [await start_replica(name) for name in ("a", "b")]
    routing = {"ledger_bus": nats_url, "ledger_bus_subject": "kvroute.test.serve"} if shared else {}
    one, other = [await start_router(replicas, routing=routing) for _ in range(2)]
    async with aiohttp.ClientSession() as http:
        held = asyncio.create_task(_send(http, one))  # "hold": answered once the gate opens
        await wait_until(lambda: sum(_in_flight(one).values()) == 1, what="one's dispatch")
        (busy,) = [name for name, n in _in_flight(one).items() if n == 1]
        if not shared:
            assert sum(_in_flight(other).values()) == 0  # the other router knows nothing
            for r in replicas:
                r.gate.set()
            assert (await held)[0] == 200
            return
        await wait_until(lambda: _in_flight(other)[busy] == 1, what="one's dispatch on other")
        second = asyncio.create_task(_send(http, other))
        await wait_until(lambda: sum(len(r.seen) for r in replicas) == 2, what="both requests")
        for r in replicas:
            r.gate.set()
        (status_1, replica_1), (status_2, replica_2) = await asyncio.gather(held, second)
    assert (status_1, status_2) == (200, 200)
    assert replica_1 == busy and replica_2 != busy  # the other router went to the idle one
    # Both answers ended: each router's count of the other's request ended too.
    for router in (one, other):
        await wait_until(
            lambda router=router: sum(_in_flight(router).values()) == 0, what="finishes"
        )


def test_a_ledger_bus_needs_one_worker_and_a_nats_url() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "listen": {"workers": 2},
                "routing": {"ledger_bus": "redis://x", "ledger_bus_subject": " "},
            }
        )
    problems = "\n".join(info.value.problems)
    assert "routing.ledger_bus: expected a nats:// URL" in problems, problems
    assert "routing.ledger_bus_subject: must be a NATS subject" in problems, problems
    assert "routing.ledger_bus: not with listen.workers 2" in problems, problems


async def test_a_session_routed_by_one_router_is_claimed_on_the_other(
    start_replica: StartReplica, start_router: StartRouter, nats_url: str
) -> None:
    """kv_aware's session claim travels with the dispatch: the router that did not route the
    session's turn knows its home (and its tokens there) as if it had, over a real NATS."""
    replicas = [await start_replica(name) for name in ("a", "b")]
    routing = {"ledger_bus": nats_url, "ledger_bus_subject": "kvroute.test.sessions"}
    one, other = [await start_router(replicas, routing=routing) for _ in range(2)]
    for r in replicas:
        r.gate.set()

    def home(router: RunningRouter) -> tuple[str, float] | None:
        sessions = getattr(router.router.policy, "_sessions", None)
        assert sessions is not None, "kv_aware with live sessions is the default policy"
        return sessions.home("conversation-9", asyncio.get_running_loop().time())

    (bus_one,) = [pool.bus for pool in one.router.core.pools]
    (bus_other,) = [pool.bus for pool in other.router.core.pools]
    assert bus_one is not None and bus_other is not None
    # Subscribed both ways (a heartbeat heard), so the turn's dispatch is not published into
    # a subscription still on its way to the server.
    await wait_until(lambda: bus_one.origin in bus_other._heard, what="one's heartbeat")
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 3}
    async with aiohttp.ClientSession() as http:
        headers = {"X-Session-ID": "conversation-9"}
        async with http.post(one.url + "/v1/completions", json=body, headers=headers) as resp:
            await resp.read()
            assert resp.status == 200
            replica = resp.headers["X-Kvroute-Replica"]
    mine = home(one)
    assert mine is not None and mine[0] == replica
    await wait_until(lambda: home(other) is not None, what="the claim on the other router")
    assert home(other) == mine
