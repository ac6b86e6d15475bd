"""What clients see when replicas fail, stall or slow down (emulated replicas, in process).

Each test injects one fault through the emulated replica's fault switch and asserts on what a
client receives (status, whole streams, latency bounds) and on what the operator sees (breaker
state, ejections, retries and resumes in /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.simulator.replica.faults import FaultSpec

from .conftest import Running, StartEmulated, StartReplica, StartRouter
from .helpers import wait_until


def entry(running: Running, name: str) -> dict[str, Any]:
    return {"url": running.url, "name": name}


async def two_replicas(
    start_emulated: StartEmulated, start_router: StartRouter, **overrides: Any
) -> tuple[Running, Running, Any]:
    a, b = await start_emulated(kv_events=False), await start_emulated(kv_events=False)
    overrides.setdefault("policy", {"name": "round_robin"})
    r = await start_router([entry(a, "a"), entry(b, "b")], **overrides)
    await wait_until(lambda: all(s.healthy for s in r.router.fleet.replicas), what="replicas up")
    return a, b, r


async def test_an_error_burst_is_retried_and_the_failing_replica_ejected_then_readmitted(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    a, _, r = await two_replicas(
        start_emulated,
        start_router,
        # Long enough for the rest of the 12 requests to finish before a half-open trial
        # (a second ejection) on a loaded box.
        breaker={"consecutive_failures": 3, "cooldown_s": 3.0, "close_after_successes": 1},
    )
    a.replica.faults.update(FaultSpec(error_rate=1.0))
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    served = []
    for _ in range(12):
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt="hello there", max_tokens=2
        )
        assert raw.parse().choices[0].text  # every request answered, none lost
        served.append(raw.headers["X-Kvroute-Replica"])
    assert set(served) == {"b"}
    handle = r.router.replicas["a"]
    assert handle.state.ejected and handle.breaker.state.value == "open"
    assert r.router.metrics.ejections[("a", "http_500")] == 1
    assert r.router.metrics.retries[("retry",)] == 3  # a got 3 tries before its breaker opened
    # The fault clears; after the cool-down a trial request goes to a and closes its breaker.
    a.replica.faults.update(FaultSpec())
    await wait_until(
        lambda: time.monotonic() >= handle.breaker.open_until, 10, what="the cool-down"
    )
    seen = set()
    for _ in range(4):
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt="hello there", max_tokens=2
        )
        seen.add(raw.headers["X-Kvroute-Replica"])
    assert "a" in seen
    assert handle.breaker.state.value == "closed" and not handle.state.ejected


@pytest.mark.parametrize("status", [400, 501])
async def test_client_errors_are_relayed_not_retried_and_do_not_count_against_a_replica(
    start_replica: StartReplica, start_router: StartRouter, status: int
) -> None:
    """A 4xx, and a 501 (vLLM's answer to a feature it does not implement, such as Responses'
    background mode, on every replica alike): a client sending them cannot get healthy
    replicas ejected (it could, with 501s, until 2026-12-07)."""
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router(
        [a, b], policy={"name": "round_robin"}, breaker={"consecutive_failures": 2}
    )
    async with aiohttp.ClientSession() as http:
        for _ in range(8):
            body = {"model": "tiny", "prompt": f"status:{status}"}
            async with http.post(r.url + "/v1/completions", json=body) as resp:
                assert resp.status == status
    assert len(a.seen) + len(b.seen) == 8  # each sent once
    assert all(h.breaker.state.value == "closed" for h in r.router.replicas.values())
    assert not any(h.state.ejected for h in r.router.replicas.values())
    assert not r.router.metrics.retries


@pytest.mark.parametrize("status", [429, 408])
async def test_a_429_or_408_is_tried_on_another_replica_and_relayed_when_all_refuse(
    start_replica: StartReplica, start_router: StartRouter, status: int
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b], retry={"max_attempts": 2})
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": f"status:{status}"}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == status  # the last replica's own answer, relayed
            assert (await resp.json())["message"] == f"scripted {status}"
    assert len(a.seen) == len(b.seen) == 1
    assert r.router.metrics.retries[("retry",)] == 1
    # Overload is not failure: no breaker counted it.
    assert all(h.breaker.state.value == "closed" for h in r.router.replicas.values())


async def test_a_stalled_replica_is_ejected_within_the_first_byte_timeout_and_its_waiting_requests_go_elsewhere(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    # b answers within it too: 0.5 s left no room for a loaded box's stalls.
    a, _, r = await two_replicas(start_emulated, start_router, timeouts={"first_byte_s": 2.0})
    a.replica.faults.update(FaultSpec(stall_s=60))
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    # Round robin: the non-streamed request goes to the stalled replica and waits there ...
    started = time.monotonic()
    waiting = asyncio.create_task(
        client.completions.with_raw_response.create(model="tiny", prompt="one", max_tokens=2)
    )
    await wait_until(lambda: r.router.replicas["a"].state.in_flight == 1, what="a's request")
    second = await client.completions.create(model="tiny", prompt="two", max_tokens=2)
    assert second.choices[0].text
    # ... until a streamed request finds a silent: it is ejected, and both requests end on b.
    stream = await client.completions.create(
        model="tiny", prompt="three", max_tokens=2, stream=True
    )
    text = "".join([chunk.choices[0].text async for chunk in stream])
    detected_s = time.monotonic() - started
    assert text
    raw = await asyncio.wait_for(waiting, 15)
    assert raw.parse().choices[0].text and raw.headers["X-Kvroute-Replica"] == "b"
    assert detected_s < 15.0  # first_byte_s plus some scheduling, not the 60 s stall
    handle = r.router.replicas["a"]
    assert handle.state.ejected
    assert "first_byte_s" in handle.breaker.last_reason
    assert r.router.metrics.ejections[("a", "stalled")] == 1
    assert r.router.metrics.upstream_errors[("a", "ejected")] == 1


@pytest.mark.parametrize("chat", [False, True])
async def test_a_stream_broken_mid_way_is_resumed_on_another_replica_as_one_stream(
    start_emulated: StartEmulated, start_router: StartRouter, chat: bool
) -> None:
    a, b, r = await two_replicas(start_emulated, start_router)
    a.replica.faults.update(FaultSpec(drop_after_chunks=4))
    b.replica.faults.update(FaultSpec(drop_after_chunks=0))
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):  # round robin: one of the two starts on a
        options: dict[str, Any] = {"stream_options": {"include_usage": True}}
        if chat:
            stream: Any = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "tell me a long story"}],
                max_tokens=12,
                stream=True,
                **options,
            )
        else:
            stream = await client.completions.create(
                model="tiny", prompt="tell me a long story", max_tokens=12, stream=True, **options
            )
        chunks = [chunk async for chunk in stream]
        assert len({c.id for c in chunks}) == 1
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and finishes.count("length") == 1
        if chat:
            roles = [
                c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role
            ]
            assert roles == ["assistant"]
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 12
    assert r.router.metrics.resumes[("resumed",)] == 1


async def test_a_stream_silent_past_idle_s_is_cut_and_finished_on_another_replica(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """A replica that stops sending mid-stream (a hung engine) is cut after timeouts.idle_s,
    and the stream goes on from where it was on the other replica, as one stream."""
    a, b = await start_replica("a"), await start_replica("b")
    idle_s = 1.0
    r = await start_router([a, b], policy={"name": "round_robin"}, timeouts={"idle_s": idle_s})
    # "gate": one chunk, then silence until the gate opens (never, here). Whichever replica
    # gets it first goes silent; the continuation's prompt is no longer "gate".
    body = {"model": "tiny", "prompt": "gate", "stream": True, "max_tokens": 10}
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
    elapsed = time.monotonic() - started
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", text
    assert "error" not in text, text
    assert elapsed >= idle_s  # cut by the idle timeout, not before
    assert elapsed < idle_s + 10  # and not by anything longer
    assert r.router.metrics.resumes[("resumed",)] == 1
    silent, other = (a, b) if a.aborted else (b, a)
    assert silent.aborted == 1 and not other.aborted  # the silent one learnt it was cut
    await wait_until(lambda: silent.running == 0 and other.running == 0, what="both settled")


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_an_agent_stream_broken_mid_way_is_resumed_as_one_stream_of_its_api(
    start_emulated: StartEmulated, start_router: StartRouter, api: str
) -> None:
    """On real engines (greedy tokens): the client's own stream parser gets one message,
    its text as long as asked, its usage the whole answer's."""
    a, b, r = await two_replicas(start_emulated, start_router)
    a.replica.faults.update(FaultSpec(drop_after_chunks=4))
    b.replica.faults.update(FaultSpec(drop_after_chunks=0))
    for _ in range(2):  # round robin: one of the two starts on a
        if api == "messages":
            client = anthropic.AsyncAnthropic(base_url=r.url, api_key="x", max_retries=0)
            async with client.messages.stream(
                model="tiny", max_tokens=12, messages=[{"role": "user", "content": "a story"}]
            ) as stream:
                final = await stream.get_final_message()
            assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
            assert len(final.content) == 1 and final.content[0].type == "text"
        else:
            oa = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
            events = [
                e
                async for e in await oa.responses.create(
                    model="tiny", input="a story", max_output_tokens=12, stream=True
                )
            ]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            done = events[-1]
            assert done.type == "response.completed"
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert done.response.output_text == deltas
            assert done.response.usage is not None and done.response.usage.output_tokens == 12
    assert r.router.metrics.resumes[("resumed",)] == 1


async def test_a_client_that_disconnects_aborts_the_replica_request_within_a_second(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replica = await start_emulated(kv_events=False)
    replica.replica.faults.update(FaultSpec(slowdown=50.0))  # a long generation
    r = await start_router([entry(replica, "emu")])
    stats = lambda: replica.replica.engine.stats  # noqa: E731
    for stream in (True, False):
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "a long one", "max_tokens": 500, "stream": stream}
            request = asyncio.create_task(http.post(r.url + "/v1/completions", json=body))
            await wait_until(lambda: stats().num_running == 1, what="the request to run")
            request.cancel()
        left = time.monotonic()
        # 500 tokens at this slowdown take tens of seconds: an abort is what ends it sooner.
        await wait_until(lambda: stats().num_running == 0, timeout_s=10, what="the abort")
        assert time.monotonic() - left <= 5.0
        await wait_until(lambda: r.router.replicas["emu"].state.in_flight == 0, what="cleanup")


async def test_the_queue_holds_requests_beyond_the_limit_and_answers_429_when_full(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router(
        [a], limits={"max_concurrent_requests": 1, "max_queued_requests": 1, "queue_timeout_s": 5}
    )
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "hold"}
        first = asyncio.create_task(http.post(r.url + "/v1/completions", json=body))
        await wait_until(lambda: a.running == 1, what="the first request at the replica")
        second = asyncio.create_task(http.post(r.url + "/v1/completions", json=body))
        await wait_until(lambda: r.router.admission.queued == 1, what="the second to queue")
        async with http.post(r.url + "/v1/completions", json=body) as third:
            assert third.status == 429 and third.headers["Retry-After"] == "1"
            assert (await third.json())["error"]["code"] == "too_many_requests"
        a.gate.set()
        for task in (first, second):
            resp = await task
            assert resp.status == 200
            resp.release()
    assert r.router.admission.active == 0


async def test_a_request_over_the_total_timeout_gets_504(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], timeouts={"total_s": 0.3})
    async with aiohttp.ClientSession() as http:
        async with http.post(
            r.url + "/v1/completions", json={"model": "tiny", "prompt": "hold"}
        ) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "timeout"
    await wait_until(lambda: a.running == 0, what="the replica to see the abort")


async def test_a_stream_over_the_total_timeout_ends_with_an_error_event_and_done(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], timeouts={"total_s": 2.0})  # room for chunks before it
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "slow", "stream": True}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200  # the stream had started when the limit struck
            text = (await resp.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"code":"timeout"' in events[-2]
    assert len(events) > 3  # the chunks sent before the limit came through
    await wait_until(lambda: a.running == 0, what="the replica to see the abort")


async def test_api_keys_guard_the_api_and_a_separate_key_guards_admin_endpoints(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router(
        [a], auth={"api_keys": ["client-key-1", "client-key-2"], "admin_api_key": "admin-key-1"}
    )
    good = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="client-key-2", max_retries=0)
    assert (await good.completions.create(model="tiny", prompt="x")).choices[0].text
    bad = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="wrong-key-1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model="tiny", prompt="x")
    # The client's key is the router's business: it is not passed on to the replica.
    assert "Authorization" not in a.seen[0].headers
    # Anthropic's clients send their key as x-api-key (Claude Code's ANTHROPIC_API_KEY).
    agent = anthropic.AsyncAnthropic(base_url=r.url, api_key="client-key-1", max_retries=0)
    said = await agent.messages.create(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    )
    assert said.content and "x-api-key" not in {k.lower() for k in a.seen[-1].headers}
    stranger = anthropic.AsyncAnthropic(base_url=r.url, api_key="wrong-key-1", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await stranger.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    # The model list is a /v1 route like the others (as vLLM's --api-key and OpenAI keep it).
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    assert [m.id async for m in good.models.list()] == ["tiny"]
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/metrics") as resp:
            assert resp.status == 401
        admin = {"Authorization": "Bearer admin-key-1"}
        client_key = {"Authorization": "Bearer client-key-1"}
        async with http.get(r.url + "/metrics", headers=client_key) as resp:
            assert resp.status == 401
        async with http.get(r.url + "/metrics", headers=admin) as resp:
            assert resp.status == 200
        async with http.get(r.url + "/admin/replicas", headers=admin) as resp:
            rows = (await resp.json())["replicas"]
            assert [(row["name"], row["breaker"]) for row in rows] == [("a", "closed")]
        async with http.get(r.url + "/health") as resp:
            assert resp.status == 200  # probes need no key


async def test_admin_replicas_says_why_each_replica_is_down(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    from kvroute.backends.process import free_ports

    (gone,) = free_ports(1)  # nothing listens there
    sick = await start_replica("sick")
    sick.healthy = False  # answers its health check with 503
    mute = await start_replica("mute")
    mute.mute = True  # accepts, answers nothing
    r = await start_router([f"http://127.0.0.1:{gone}", sick, mute], health={"timeout_s": 0.3})
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(model="tiny", prompt="x")
    assert err.value.status_code == 503

    async def reasons() -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.get(r.url + "/admin/replicas") as resp,
        ):
            rows = (await resp.json())["replicas"]
        assert all("breaker_reason" in row and "out_since" in row for row in rows)
        return {row["name"]: row["down_reason"] for row in rows}

    assert await reasons() == {
        f"127.0.0.1:{gone}": f"connection refused to 127.0.0.1:{gone}",
        "sick": f"GET {sick.url}/health answered 503: {{}}",
        "mute": f"timeout: GET {mute.url}/health got no answer within 0.3s",
    }
    sick.healthy = True
    await wait_until(lambda: r.router.replicas["sick"].state.healthy, what="sick back")
    assert (await reasons())["sick"] is None  # cleared once it passes a probe


async def test_a_replica_that_drops_a_stream_and_stops_answering_leaves_rotation_at_once(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    # Like a SIGKILLed vLLM: its connections drop and its socket still accepts, but it answers
    # nothing. The dropped stream triggers a health check that times out: out of rotation
    # without waiting for the next probe (a minute away here).
    a = await start_replica("a")
    b = await start_replica("b")
    r = await start_router(
        [a, b], policy={"name": "round_robin"}, health={"interval_s": 60.0, "timeout_s": 1.0}
    )
    await wait_until(
        lambda: all(h.state.healthy for h in r.router.replicas.values()), what="both healthy"
    )
    a.mute = True
    checks = a.health_checks
    handle = r.router.replicas["a"]
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # round robin: one of two lands on a
            body = {"model": "tiny", "prompt": "break", "stream": True, "max_tokens": 10}
            async with http.post(r.url + "/v1/completions", json=body) as resp:
                text = (await resp.read()).decode()
            assert text.rstrip().endswith("data: [DONE]")  # resumed on b when it broke on a
    await wait_until(lambda: not handle.state.healthy, 10, what="a out of rotation")
    assert a.health_checks == checks + 1 and handle.out_since is not None
    assert r.router.replicas["b"].state.healthy


async def _panic_setup(
    start_replica: StartReplica, start_router: StartRouter, panic_routing: bool
) -> tuple[Any, Any, Any, openai.AsyncOpenAI]:
    """a ejected by its breaker for a minute (then well again), b down by its health check:
    no replica in rotation."""
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router(
        [a, b],
        policy={"name": "round_robin"},
        retry={"max_attempts": 1},
        breaker={"consecutive_failures": 1, "cooldown_s": 60.0, "panic_routing": panic_routing},
        health={"interval_s": 0.1, "unhealthy_after": 1},
    )
    await wait_until(
        lambda: all(h.state.healthy for h in r.router.replicas.values()), what="both healthy"
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    a.fail_with = 500
    for _ in range(2):  # round robin: one of the two lands on a, which answers 500
        with contextlib.suppress(openai.InternalServerError):
            await client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert r.router.replicas["a"].state.ejected
    a.fail_with = None
    b.healthy = False
    await wait_until(lambda: not r.router.replicas["b"].state.healthy, what="b down")
    return a, b, r, client


async def test_when_no_replica_is_in_rotation_the_ejected_ones_take_traffic_until_one_is_back(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    _, b, r, client = await _panic_setup(start_replica, start_router, panic_routing=True)
    # Panic: a is only ejected (its health check passes), so it answers instead of nobody.
    for _ in range(3):
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt="hello", max_tokens=2
        )
        assert raw.parse().choices[0].text and raw.headers["X-Kvroute-Replica"] == "a"
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/admin/replicas") as resp:
            rows = {row["name"]: row for row in (await resp.json())["replicas"]}
        async with http.get(r.url + "/metrics") as resp:
            page = await resp.text()
    assert (rows["a"]["ejected"], rows["a"]["panic"], rows["a"]["breaker"]) == (True, True, "open")
    assert (rows["b"]["healthy"], rows["b"]["panic"]) == (False, False)
    routed = {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(page)
        if family.name == "kvroute_panic_routed_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert routed == {"a": 3.0}
    # b passes its health check again: panic is over, traffic goes to b, a stays ejected.
    b.healthy = True
    await wait_until(lambda: r.router.replicas["b"].state.healthy, what="b back")
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt="hello", max_tokens=2
    )
    assert raw.headers["X-Kvroute-Replica"] == "b"
    a = r.router.replicas["a"]
    assert a.state.ejected and not a.panic and not r.router.registry.panicking


async def test_without_panic_routing_no_replica_in_rotation_means_503(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    _, _, _, client = await _panic_setup(start_replica, start_router, panic_routing=False)
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert err.value.status_code == 503
