"""Settings a user sets in the config change what the router does: each one set away from its
default, and what a client (or /metrics, /admin) then sees. Found by a review for settings that
only a config-parsing test touched (2026-12-07)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
from aiohttp import web

from kvroute.kvcore.stats import parse_metrics
from kvroute.router.config import config_from_dict
from kvroute.router.runner import app_runner
from kvroute.router.server import Router

from .conftest import StartReplica, StartRouter
from .helpers import wait_until


async def _complete(
    http: aiohttp.ClientSession, url: str, prompt: str, **extra: Any
) -> tuple[int, dict[str, Any], str | None]:
    """(status, body, the replica that answered) of a whole completion."""
    headers = extra.pop("headers", {})
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers.get("X-Kvroute-Replica")


async def test_first_token_s_moves_a_whole_answer_from_a_replica_that_does_not_answer(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """timeouts.first_token_s bounds the wait for a whole answer: past it, the request is
    tried on another replica, and the silent one is counted as timing out."""
    a, b = await start_replica("a"), await start_replica("b")
    a.delay_s = 60.0  # busy: its answers would come a minute late
    r = await start_router([a, b], policy={"name": "round_robin"}, timeouts={"first_token_s": 0.5})
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # round robin: one of the two starts on a
            started = time.monotonic()
            status, body, replica = await _complete(http, r.url, "x")
            assert (status, replica) == (200, "b"), body
            assert body["choices"][0]["text"] == "hello from b"
            assert time.monotonic() - started < 10  # not a's minute
    assert r.router.metrics.upstream_errors[("a", "timeout")] == 1
    await wait_until(lambda: a.aborted == 1, what="a to see its request abandoned")


async def test_retry_budget_s_stops_retrying_when_it_is_spent(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """retry.budget_s: no new try once the request has used it, whatever max_attempts allows."""
    for budget_s, tries in ((0.8, 2), (30.0, 3)):
        replicas = [await start_replica(name) for name in ("a", "b", "c")]
        for replica in replicas:
            replica.delay_s = 60.0  # none answers in time: each try times out at 0.5 s
        r = await start_router(
            replicas,
            policy={"name": "round_robin"},
            timeouts={"first_token_s": 0.5},
            retry={"max_attempts": 3, "budget_s": budget_s, "backoff_base_s": 0.0},
        )
        async with aiohttp.ClientSession() as http:
            status, body, _ = await _complete(http, r.url, "x")
        assert status >= 500 and "error" in body, body
        # 0.8 s: a second try at 0.5 s, none at 1.0 s; 30 s: all three.
        assert sum(len(x.seen) for x in replicas) == tries, budget_s


async def test_queue_timeout_s_refuses_a_request_that_waited_too_long_for_a_slot(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router(
        [a],
        limits={"max_concurrent_requests": 1, "max_queued_requests": 4, "queue_timeout_s": 0.5},
        fairness={"reserved_slots": 0},
    )
    async with aiohttp.ClientSession() as http:
        holding = asyncio.create_task(_complete(http, r.url, "hold"))  # takes the one slot
        await wait_until(lambda: a.running == 1, what="the first request at the replica")
        started = time.monotonic()
        body = {"model": "tiny", "prompt": "second", "max_tokens": 2}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            waited = time.monotonic() - started
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"
            error = (await resp.json())["error"]
        assert 0.5 <= waited < 10, waited
        assert "queue" in error["message"].lower(), error
        a.gate.set()
        assert (await holding)[0] == 200
        async with http.get(r.url + "/metrics") as resp:
            page = parse_metrics(await resp.read())
    assert page.sum("kvroute_rejected_requests", status="429") >= 1
    assert [s.body["prompt"] for s in a.seen] == ["hold"]  # the refused one never reached it


async def test_max_resumes_0_ends_a_broken_stream_with_an_error_instead_of_resuming_it(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b], retry={"max_resumes": 0})
    body = {"model": "tiny", "prompt": "break", "stream": True, "max_tokens": 10}
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", text
    assert "retry.max_resumes (0) reached" in events[-2], text
    assert len(a.seen) + len(b.seen) == 1  # not continued anywhere
    assert r.router.metrics.resumes[("impossible",)] == 1


async def test_health_path_is_the_path_probed(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """A replica whose /health fails stays in rotation when the probe asks another path;
    a path it does not serve takes it out, and /admin/replicas says why."""
    a = await start_replica("a")
    a.healthy = False  # only /health answers 503
    r = await start_router([a], health={"path": "/v1/models", "interval_s": 0.1})
    handle = r.router.replicas["a"]
    assert handle.state.healthy and a.health_checks == 0
    b = await start_replica("b")
    r = await start_router([b], health={"path": "/nope", "interval_s": 0.1, "unhealthy_after": 1})
    assert not r.router.replicas["b"].state.healthy
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/admin/replicas") as resp:
            listed = await resp.json()
    (entry,) = listed["replicas"]
    assert "/nope" in entry["down_reason"] and "404" in entry["down_reason"], entry


async def test_breaker_enabled_false_never_ejects_a_failing_replica(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    a.fail_with = 500
    r = await start_router(
        [a, b],
        policy={"name": "round_robin"},
        retry={"max_attempts": 1},
        breaker={"enabled": False, "consecutive_failures": 1},
    )
    statuses = []
    async with aiohttp.ClientSession() as http:
        for _ in range(10):
            statuses.append((await _complete(http, r.url, "x"))[0])
    assert statuses.count(500) == 5 and statuses.count(200) == 5  # a kept its turns
    handle = r.router.replicas["a"]
    assert not handle.state.ejected and handle.breaker.state.value == "closed"


async def test_session_header_keeps_a_session_on_one_replica_and_is_counted(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    replicas = [await start_replica(name) for name in ("a", "b", "c")]
    r = await start_router(
        replicas,
        policy={"name": "kv_aware"},
        routing={"tokenizer": "builtin", "session_header": "X-My-Session"},
    )
    async with aiohttp.ClientSession() as http:
        served = set()
        for turn in range(6):
            status, _, replica = await _complete(
                http, r.url, f"turn {turn} of something new", headers={"X-My-Session": "s1"}
            )
            assert status == 200
            served.add(replica)
        async with http.get(r.url + "/metrics") as resp:
            page = parse_metrics(await resp.read())
    assert len(served) == 1, served
    assert page.sum("kvroute_sessions_detected", source="configured_header") == 6


async def test_tenants_max_tracked_bounds_the_tenant_names_clients_can_make_up(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """Tenant names come from client headers: past tenants.max_tracked distinct ones, new
    names count as "default", in /admin/tenants and in /metrics' labels alike."""
    a = await start_replica("a")
    r = await start_router([a], tenants={"max_tracked": 2})
    async with aiohttp.ClientSession() as http:
        for name in ("t1", "t2", "t3", "t4", "t1"):
            status, _, _ = await _complete(http, r.url, "x", headers={"X-Tenant-Id": name})
            assert status == 200
        async with http.get(r.url + "/admin/tenants") as resp:
            rows = (await resp.json())["tenants"]
        async with http.get(r.url + "/metrics") as resp:
            page = parse_metrics(await resp.read())
    assert {row["tenant"] for row in rows} == {"t1", "t2", "default"}
    counted = {labels["tenant"]: n for labels, n in page.series("kvroute_tenant_requests")}
    assert set(counted) == {"t1", "t2", "default"}, counted
    assert (counted["t1"], counted["t2"], counted["default"]) == (2, 1, 2)


async def test_drain_timeout_s_bounds_how_long_a_stopping_router_waits_for_a_stream(
    start_replica: StartReplica,
) -> None:
    """On SIGTERM the router waits for requests in flight, but no longer than
    shutdown.drain_timeout_s: then a stream still open is cut, and its replica told."""
    a = await start_replica("a")
    drain_s = 1.0
    config = {"replicas": [{"url": a.url, "name": "a"}], "shutdown": {"drain_timeout_s": drain_s}}
    runner = app_runner(Router(config_from_dict(config)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    body = {"model": "tiny", "prompt": "gate", "stream": True, "max_tokens": 10}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            assert b"hello" in await resp.content.readuntil(b"\n\n")  # then silence: "gate"
            started = time.monotonic()
            async with asyncio.timeout(30):
                await runner.cleanup()
            took = time.monotonic() - started
    assert drain_s <= took < drain_s + 8, took  # waited for it, then no longer
    await asyncio.wait_for(a.client_gone.wait(), 10)


def _blackhole(port: int) -> list[socket.socket]:
    """A listener on ``port`` that never accepts, its queue full: a new connection's SYNs are
    dropped and its connect hangs, as to a node that has vanished. Returns the sockets to close."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    held = [listener]
    for _ in range(8):  # connect until one cannot: from then on, every connect hangs
        client = socket.socket()
        client.settimeout(0.5)
        held.append(client)
        try:
            client.connect(("127.0.0.1", port))
        except TimeoutError:
            return held
    raise AssertionError("the listener's queue never filled")


async def test_connect_s_gives_up_on_a_replica_that_does_not_accept_and_tries_another(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router(
        [a, b],
        policy={"name": "round_robin"},
        health={"interval_s": 60.0},  # probed once at start: a is in rotation
        timeouts={"connect_s": 0.5},
    )
    port = int(a.url.rsplit(":", 1)[1])
    await a.stop()  # the node vanishes: its address now drops connections unanswered
    held = await asyncio.to_thread(_blackhole, port)
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):  # round robin: one of the two is first tried on a
                started = time.monotonic()
                status, body, replica = await _complete(http, r.url, "x")
                assert (status, replica) == (200, "b"), body
                assert time.monotonic() - started < 10  # not the kernel's minutes of SYNs
        assert r.router.metrics.upstream_errors[("a", "connect")] == 1
        assert not r.router.replicas["a"].state.healthy  # out until a probe passes
    finally:
        for sock in held:
            sock.close()


async def test_metrics_enabled_false_takes_the_metrics_page_away(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    on = await start_router([a])
    off = await start_router([a], metrics={"enabled": False})
    async with aiohttp.ClientSession() as http:
        async with http.get(on.url + "/metrics") as resp:
            assert resp.status == 200
            assert "kvroute_requests" in parse_metrics(await resp.read())
        async with http.get(off.url + "/metrics") as resp:
            assert resp.status == 404
        assert (await _complete(http, off.url, "x"))[0] == 200  # serving all the same
