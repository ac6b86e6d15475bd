"""Changing the fleet while it serves: the drain, rolling upgrades, POST/DELETE /admin/replicas
and the autoscaler, on launched emulated replicas with real clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from kvroute.backends.launcher import LaunchedFleet, LaunchSpec
from kvroute.kvcore.autoscale import AutoscaleSettings, ReplicaSignal
from kvroute.router.autoscaling import AutoscaleLoop
from kvroute.router.config import config_from_dict
from kvroute.router.runner import app_runner
from kvroute.router.server import Router

from .helpers import alive, wait_until

# Slow enough (about 25 ms a token) that a long answer is still streaming when its replica is
# drained; short answers still finish in well under a second.
TIME_SCALE = 10.0


def _spec(tmp_path: Path, count: int) -> LaunchSpec:
    return LaunchSpec(
        engine="emulated", count=count, model="tiny", model_path=None, tokenizer=None,
        block_size=16, num_gpu_blocks=256, max_num_seqs=16, preset="tiny-cpu",
        time_scale=TIME_SCALE, kv_events=True, host="127.0.0.1",
        log_dir=str(tmp_path / "logs"), startup_timeout_s=60, max_restarts=1,
    )  # fmt: skip


@dataclass
class Fleet:
    router: Router
    url: str
    launched: LaunchedFleet

    def names(self) -> list[str]:
        return sorted(self.router.replicas)

    async def admin(
        self, method: str, path: str, body: Any = None, expect: int | None = None
    ) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, self.url + path, json=body) as resp,
        ):
            data = await resp.json()
            if expect is not None:
                assert resp.status == expect, data
            return resp.status, data


StartFleet = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def start_fleet(tmp_path: Path) -> AsyncIterator[StartFleet]:
    started: list[tuple[web.AppRunner, LaunchedFleet]] = []

    async def start(count: int = 3, **overrides: Any) -> Fleet:
        launched = LaunchedFleet(_spec(tmp_path, count))
        await asyncio.to_thread(launched.start)
        raw: dict[str, Any] = {
            "replicas": [
                {"url": r.url, "name": r.name, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
                for r in launched.replicas
            ],
            "routing": {"tokenizer": "builtin", "block_size": 16},
            "health": {"interval_s": 0.5, "timeout_s": 1.0},
            "rollout": {"drain_timeout_s": 2.0, "readiness_timeout_s": 60.0},
            **overrides,
        }
        router = Router(config_from_dict(raw), launched=launched)
        runner = app_runner(router)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        started.append((runner, launched))
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fleet = Fleet(router, f"http://127.0.0.1:{port}", launched)
        await wait_until(
            lambda: all(h.state.healthy for h in router.replicas.values()), 10, "healthy replicas"
        )
        return fleet

    yield start
    for runner, launched in started:
        await runner.cleanup()
        await asyncio.to_thread(launched.stop, 5.0)


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str]:
    """One streamed completion as a client reads it: (text, finish_reason); raises if cut."""
    text, finish = [], None
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
    assert finish is not None, "the stream ended without a finish_reason"
    return "".join(text), finish


def _client(fleet: Fleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0)


async def test_a_drained_replica_finishes_short_requests_and_moves_an_open_stream(
    start_fleet: StartFleet,
) -> None:
    fleet = await start_fleet(2)
    client = _client(fleet)
    victim = fleet.names()[0]
    # Pin the long stream to the victim: the other replica is out of rotation until it starts.
    other = fleet.router.replicas[fleet.names()[1]].state
    other.draining = True
    long = asyncio.create_task(_stream(client, "A long story: " + "once " * 20, 200))
    handle = fleet.router.replicas[victim]
    await wait_until(lambda: handle.state.in_flight == 1, 5, "the stream on the victim")
    other.draining = False
    status, body = await fleet.admin("DELETE", f"/admin/replicas/{victim}?drain_timeout_s=0.3")
    assert status == 200, body
    assert body["drain"]["moved"] == 1 and body["drain"]["lost"] == 0
    text, finish = await long
    assert finish == "length" and len(text) > 0  # one complete answer, spliced
    assert victim not in fleet.router.replicas
    assert victim not in [r.name for r in fleet.launched.replicas]
    metrics = fleet.router.metrics.resumes
    assert metrics.get(("resumed",)) == 1
    # A request in flight that finishes within the drain time stays where it is.
    survivor = fleet.names()[0]
    status, body = await fleet.admin("POST", "/admin/replicas", {"launch": True}, expect=201)
    added = body["name"]
    assert body["healthy"] and body["phase"] == "serving"
    short = asyncio.create_task(_stream(client, "Hi", 40))
    await wait_until(lambda: fleet.router.replicas[survivor].state.in_flight
                     + fleet.router.replicas[added].state.in_flight >= 1, 5, "a request")  # fmt: skip
    busy = next(n for n in (survivor, added) if fleet.router.replicas[n].state.in_flight)
    status, body = await fleet.admin("DELETE", f"/admin/replicas/{busy}?drain_timeout_s=10")
    assert status == 200 and body["drain"]["finished"] == 1 and body["drain"]["moved"] == 0
    assert (await short)[1] == "length"


async def test_readiness_timeout_s_bounds_an_added_replicas_start_unless_the_request_says(
    start_fleet: StartFleet,
) -> None:
    """rollout.readiness_timeout_s is the default wait for a replica added (or replaced) while
    serving, its start included: one that is not up in time is stopped, and the fleet keeps its
    size. The request's own readiness_timeout_s wins over it."""
    fleet = await start_fleet(1, rollout={"readiness_timeout_s": 0.05})
    status, body = await fleet.admin("POST", "/admin/replicas", {"launch": True})
    assert status == 504, body
    assert "not ready within readiness_timeout_s 0.05s" in body["error"]["message"]
    assert len(fleet.launched.replicas) == 1 and len(fleet.router.replicas) == 1
    status, body = await fleet.admin(
        "POST", "/admin/replicas", {"launch": True, "readiness_timeout_s": 60}, expect=201
    )
    assert body["healthy"] and body["phase"] == "serving"
    assert len(fleet.launched.replicas) == 2


async def test_a_replacement_not_ready_in_time_is_rolled_back_within_the_launchs_own_time(
    start_fleet: StartFleet,
) -> None:
    """The rollout's readiness timeout fails a replacement that is slower than it; the slot
    starts again on its previous arguments with at least launch.startup_timeout_s, so the
    fleet keeps its size."""
    fleet = await start_fleet(2)
    before = fleet.names()
    body = {"readiness_timeout_s": 0.05, "drain_timeout_s": 0.3}
    await fleet.admin("POST", "/admin/rollout", body, expect=202)
    progress = await _rollout_done(fleet, 120)
    assert progress["state"] == "failed", progress
    assert "not ready within readiness_timeout_s 0.05s" in progress["error"], progress
    assert "runs its previous arguments again" in progress["error"], progress
    assert fleet.names() == before and len(fleet.launched.replicas) == 2
    await wait_until(
        lambda: all(h.state.healthy for h in fleet.router.replicas.values()),
        30,
        "both replicas serving",
    )


async def test_admin_replicas_refuses_bad_requests_with_the_reason(
    start_fleet: StartFleet,
) -> None:
    fleet = await start_fleet(2)
    status, body = await fleet.admin("DELETE", "/admin/replicas/nope")
    assert status == 404 and "nope" in body["error"]["message"]
    bad: object
    for bad in ({}, {"url": "http://a:1", "launch": True}, {"url": 5}, {"bogus": 1}, []):
        status, body = await fleet.admin("POST", "/admin/replicas", bad)
        assert status == 400, (bad, body)
        assert body["error"]["message"]
    status, body = await fleet.admin("POST", "/admin/replicas", {"url": "ftp://x"})
    assert status == 400 and "url" in body["error"]["message"]
    status, body = await fleet.admin(
        "POST", "/admin/replicas", {"url": "http://127.0.0.1:9", "kv_events": "nonsense"}
    )
    assert status == 400 and "kv_events" in body["error"]["message"]
    status, body = await fleet.admin("POST", "/admin/rollout", {"max_unavailable": 0})
    assert status == 400
    status, body = await fleet.admin("POST", "/admin/rollout", {"model_path": "/x"})
    assert status == 400 and "vllm" in body["error"]["message"]
    status, body = await fleet.admin("POST", "/admin/rollout/pause")
    assert status == 409 and "no rollout" in body["error"]["message"]
    # A static replica: registered, then removed; removing the last one in rotation is refused.
    a, b = fleet.names()
    url = fleet.router.replicas[a].base_url
    status, body = await fleet.admin("POST", "/admin/replicas", {"url": url, "name": "again"})
    assert status == 201 and body["name"] == "again"
    status, body = await fleet.admin("POST", "/admin/replicas", {"url": url, "name": "again"})
    assert status == 409
    await fleet.admin("DELETE", "/admin/replicas/again", expect=200)
    await fleet.admin("DELETE", f"/admin/replicas/{a}", expect=200)
    status, body = await fleet.admin("DELETE", f"/admin/replicas/{b}")
    assert status == 409 and "no replica in rotation" in body["error"]["message"]


async def test_fleet_changes_on_a_router_without_launch_say_why(
    start_replica: Any, start_router: Any
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        for path, body in (("/admin/replicas", {"launch": True}), ("/admin/rollout", {})):
            async with http.post(r.url + path, json=body) as resp:
                assert resp.status == 409
                assert "launch:" in (await resp.json())["error"]["message"]
        async with http.get(r.url + "/admin/replicas") as resp:
            data = await resp.json()
    assert data["rollout"] is None
    assert data["replicas"][0]["phase"] == "serving" and data["replicas"][0]["draining"] is False


async def _load(fleet: Fleet, stop: asyncio.Event) -> list[BaseException | tuple[str, str]]:
    """Streams and whole answers, a few at a time, until ``stop``: what each client got."""
    client = _client(fleet)
    results: list[BaseException | tuple[str, str]] = []

    async def one(i: int) -> None:
        try:
            if i % 2:
                results.append(await _stream(client, f"Question {i}: " + "why " * 10, 40))
            else:
                answer = await client.completions.create(model="tiny", prompt=f"Q{i}", max_tokens=8)
                results.append((answer.choices[0].text, answer.choices[0].finish_reason or ""))
        except Exception as exc:
            results.append(exc)

    i = 0
    tasks: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        task = asyncio.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        await asyncio.sleep(0.1)  # 10 requests a second: the load's rate, not synchronisation
    await asyncio.gather(*tasks)
    return results


async def _rollout_done(fleet: Fleet, timeout_s: float) -> dict[str, Any]:
    progress: dict[str, Any] = {}

    async def poll() -> None:
        nonlocal progress
        while True:
            _, body = await fleet.admin("GET", "/admin/replicas")
            progress = body["rollout"]
            if progress["state"] not in ("running", "paused"):
                return
            await asyncio.sleep(0.1)

    await asyncio.wait_for(poll(), timeout_s)
    return progress


@pytest.mark.slow
async def test_a_rollout_under_load_replaces_every_replica_and_loses_nothing(
    start_fleet: StartFleet,
) -> None:
    fleet = await start_fleet(3)
    old_pids = {r.name: r.process.pid for r in fleet.launched.replicas}
    stop = asyncio.Event()
    load = asyncio.create_task(_load(fleet, stop))
    await wait_until(lambda: sum(h.state.in_flight for h in fleet.router.replicas.values()) > 0)
    new_args = ["--max-num-seqs", "12"]
    body = {"args": new_args, "drain_timeout_s": 0.3}  # short: open streams are moved
    await fleet.admin("POST", "/admin/rollout", body, expect=202)
    status, _ = await fleet.admin("POST", "/admin/rollout", {})
    assert status == 409  # one at a time
    progress = await _rollout_done(fleet, 120)
    stop.set()
    results = await load
    assert progress["state"] == "done", progress
    assert sorted(r["name"] for r in progress["replaced"]) == sorted(old_pids)
    assert all(r["seconds"] > 0 and r["lost"] == 0 for r in progress["replaced"])
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert len(results) > 20 and all(finish for _, finish in results)  # type: ignore[misc]
    for replica in fleet.launched.replicas:
        assert replica.process.pid != old_pids[replica.name]
        assert not alive(old_pids[replica.name])
        assert replica.process.argv[-2:] == new_args
    assert fleet.launched.spec.extra_args == tuple(new_args)
    assert sorted(fleet.router.replicas) == sorted(old_pids)
    assert all(h.state.healthy and not h.state.draining for h in fleet.router.replicas.values())
    assert all(fleet.router.core.follows_events(n) for n in fleet.router.replicas)


@pytest.mark.slow
async def test_a_rollout_pauses_resumes_and_aborts(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(3)
    await fleet.admin("POST", "/admin/rollout", {"drain_timeout_s": 1}, expect=202)
    _, body = await fleet.admin("POST", "/admin/rollout/pause", expect=200)
    assert body["rollout"]["state"] == "paused"
    rollout = fleet.router.fleet_control.rollout
    assert rollout is not None
    # The step under way finishes; no other starts while paused.
    await wait_until(lambda: len(rollout.replaced) == 1 and not rollout.current, 60, "one step")
    _, body = await fleet.admin("GET", "/admin/rollout", expect=200)
    assert body["rollout"]["state"] == "paused" and len(body["rollout"]["remaining"]) == 2
    await fleet.admin("POST", "/admin/rollout/resume", expect=200)
    await wait_until(lambda: len(rollout.replaced) == 2, 60, "a second step")
    _, body = await fleet.admin("POST", "/admin/rollout/abort", expect=200)
    progress = await _rollout_done(fleet, 60)
    assert progress["state"] == "aborted" and len(progress["replaced"]) in (2, 3)
    status, _ = await fleet.admin("POST", "/admin/rollout/resume")
    assert status == 409
    await fleet.admin("POST", "/admin/rollout/bogus", expect=404)


@pytest.mark.slow
async def test_the_autoscaler_adds_on_a_queue_and_drains_when_quiet(
    start_fleet: StartFleet,
) -> None:
    fleet = await start_fleet(1)
    waiting = [0]

    def signals(handles: list[Any]) -> list[ReplicaSignal]:
        return [ReplicaSignal(waiting[0], 0.1) for _ in handles]

    settings = AutoscaleSettings(
        min=1, max=2, target_queue_per_replica=2, scale_down_idle_s=1.0, interval_s=0.1
    )
    scaler = AutoscaleLoop(
        fleet.router.fleet_control.membership,
        settings,
        drain_timeout_s=2.0,
        readiness_timeout_s=60.0,
        signals=signals,
        on_action=fleet.router.fleet_control.metrics.action,
    )
    waiting[0] = 5
    assert scaler.tick(0.0) == 1
    assert scaler.tick(0.1) == 0  # one is starting: no second ask
    await scaler.settle()
    assert len(fleet.router.replicas) == 2 and len(fleet.launched.replicas) == 2
    assert scaler.tick(0.2) == 0  # at max
    waiting[0] = 0
    assert scaler.tick(1.0) == 0  # the quiet spell begins
    assert scaler.tick(2.5) == -1
    await scaler.settle()
    assert len(fleet.router.replicas) == 1 and len(fleet.launched.replicas) == 1
    assert scaler.tick(10.0) == 0  # never below min
    assert fleet.router.fleet_control.metrics.actions == {"up": 1, "down": 1}
    async with aiohttp.ClientSession() as http, http.get(fleet.url + "/metrics") as resp:
        page = await resp.text()
    assert 'kvroute_fleet_replicas{state="serving"} 1.0' in page
    assert 'kvroute_autoscale_actions_total{action="up"} 1.0' in page
    await scaler.close()


async def test_a_drain_that_must_not_lose_streams_keeps_the_replica(
    start_fleet: StartFleet,
) -> None:
    """The autoscaler's drain (keep_unmovable): a stream that could not be resumed elsewhere
    (n > 1 here) keeps its replica in the fleet and back in rotation."""
    fleet = await start_fleet(2)
    membership = fleet.router.fleet_control.membership
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "n": 2, "stream": True}
        async with http.post(fleet.url + "/v1/completions", json=body) as resp:
            await resp.content.readline()
            busy = resp.headers["X-Kvroute-Replica"]
            report = await membership.remove(busy, 0.2, keep_unmovable=True)
            assert report.kept and busy in fleet.router.replicas
            assert not fleet.router.replicas[busy].state.draining
            assert membership.phase(busy) == "serving"
            rest = await resp.read()
    assert rest.rstrip().endswith(b"data: [DONE]")


async def test_the_rollout_command_talks_to_the_router_and_says_why_it_cannot(
    start_replica: Any, start_router: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvroute.cli import main

    a = await start_replica("a")
    r = await start_router([a])
    assert await asyncio.to_thread(main, ["rollout", "--url", r.url, "--status"]) == 0
    assert "no rollout has run" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["rollout", "--url", r.url, "--args=--x 1"]) == 2
    assert "409" in capsys.readouterr().err  # this router launched nothing
    assert await asyncio.to_thread(main, ["rollout", "--url", "http://127.0.0.1:9"]) == 2
    assert "cannot reach the router" in capsys.readouterr().err
