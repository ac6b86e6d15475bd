"""The router's OpenAI API as a client sees it, through the real ``openai`` client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from kvroute.kvcore.stats import parse_metrics

from .conftest import StartReplica, StartRouter
from .helpers import wait_until


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


async def test_completion_through_openai_client(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    raw = await client_for(r.url).completions.with_raw_response.create(
        model="tiny", prompt="Say hi", max_tokens=5
    )
    completion = raw.parse()
    assert completion.choices[0].text == "hello from a"
    assert raw.headers["x-kvroute-replica"] == "a"
    assert raw.headers["x-kvroute-reason"] == "kv_least_cost"
    # The body reached the replica as the client sent it.
    assert a.seen[-1].body == {"model": "tiny", "prompt": "Say hi", "max_tokens": 5}


async def test_chat_through_openai_client(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    chat = await client_for(r.url).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert chat.choices[0].message.content == "hello from a"
    assert a.seen[-1].path == "/v1/chat/completions"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_streaming_is_relayed_chunk_by_chunk(
    chat: bool, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    client = client_for(r.url)
    if chat:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "gate"}], stream=True
        )
    else:
        stream = await client.completions.create(model="tiny", prompt="gate", stream=True)
    pieces = []
    async with asyncio.timeout(5):  # a buffering proxy would never deliver the first chunk
        async for chunk in stream:
            piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            pieces.append(piece)
            # The replica holds the rest until the client has seen the first chunk.
            a.gate.set()
    assert "".join(pieces) == "hello from a"


async def test_models_is_the_union_of_replicas(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a", models=("tiny",))
    b = await start_replica("b", models=("tiny", "big"))
    r = await start_router([a, b])
    models = await client_for(r.url).models.list()
    assert sorted(m.id for m in models.data) == ["big", "tiny"]


async def test_requests_go_only_to_replicas_serving_the_model(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a", models=("tiny",))
    b = await start_replica("b", models=("big",))
    r = await start_router([a, b], policy={"name": "round_robin"})
    client = client_for(r.url)
    for _ in range(6):
        completion = await client.completions.create(model="big", prompt="x", max_tokens=1)
        assert completion.choices[0].text == "hello from b"
    assert not a.seen


async def test_unknown_model_is_404_in_openai_shape(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    with pytest.raises(openai.NotFoundError) as info:
        await client_for(r.url).completions.create(model="nope", prompt="x")
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "tiny" in error["message"]
    assert not a.seen


BAD_BODIES = [
    pytest.param(b"{not json", None, id="malformed-json"),
    pytest.param(b"", None, id="empty-body"),
    pytest.param(b"\xff\xfe{}", None, id="invalid-utf8"),
    pytest.param(b"[1, 2]", None, id="not-an-object"),
    pytest.param(b'{"prompt": "x"}', "model", id="missing-model"),
    pytest.param(b'{"model": 7, "prompt": "x"}', "model", id="model-not-string"),
    pytest.param(b'{"model": "tiny"}', "prompt", id="missing-prompt"),
    pytest.param(b'{"model": "tiny", "prompt": [true, false]}', "prompt", id="prompt-of-bools"),
    pytest.param(b'{"model": "tiny", "prompt": []}', "prompt", id="empty-prompt-list"),
    pytest.param(
        b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}',
        "max_tokens",
        id="max-tokens-string",
    ),
    pytest.param(
        b'{"model": "tiny", "prompt": "x", "max_tokens": -1}',
        "max_tokens",
        id="negative-max-tokens",
    ),
    pytest.param(
        b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "stream", id="stream-not-bool"
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
async def test_bad_completion_bodies_are_400(
    body: bytes, param: str | None, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        async with http.post(
            r.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param
    assert not a.seen


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "tiny", "messages": []}',
        b'{"model": "tiny", "messages": "hi"}',
        b'{"model": "tiny", "messages": [{"content": "no role"}]}',
        b'{"model": "tiny"}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x", "n": '
        + b"[" * 50_000
        + b"]" * 50_000
        + b"}]}",
    ],
    ids=[
        "no-messages",
        "messages-not-list",
        "message-without-role",
        "missing-messages",
        "text-part-not-string",
        "content-not-string",
        "nested-too-deep",
    ],
)
async def test_bad_chat_bodies_are_400(
    body: bytes, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/chat/completions", data=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert (error["param"] or "messages").startswith("messages"), error
    assert not a.seen


async def test_oversized_body_is_413(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], limits={"max_body_bytes": 1000})
    body = b'{"model": "tiny", "prompt": "' + b"x" * 2000 + b'"}'

    async def chunked() -> object:
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/completions", data=body) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "request_too_large"
        # Without a Content-Length the limit still holds while reading.
        async with http.post(r.url + "/v1/completions", data=chunked()) as resp:
            assert resp.status == 413
    assert not a.seen


async def test_no_healthy_replica_is_503_with_retry_after(start_router: StartRouter) -> None:
    r = await start_router(["http://127.0.0.1:9"])  # nothing listens on the discard port
    async with aiohttp.ClientSession() as http:
        async with http.post(
            r.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
        ) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_healthy_replica"
        async with http.get(r.url + "/ready") as resp:
            assert resp.status == 503
        async with http.get(r.url + "/health") as resp:
            assert resp.status == 200


async def test_upstream_4xx_passes_through_unchanged(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        async with http.post(
            r.url + "/v1/completions", json={"model": "tiny", "prompt": "status:422"}
        ) as resp:
            assert resp.status == 422
            assert await resp.json() == {
                "object": "error",
                "message": "scripted 422",
                "type": "BadRequestError",
                "code": 422,
            }


async def test_request_id_is_propagated_or_generated(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        async with http.post(
            r.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers={"X-Request-Id": "abc-123"},
        ) as resp:
            assert resp.headers["X-Request-Id"] == "abc-123"
        assert a.seen[-1].headers["X-Request-Id"] == "abc-123"
        async with http.post(
            r.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
        ) as resp:
            generated = resp.headers["X-Request-Id"]
        assert generated and generated != "abc-123"
        assert a.seen[-1].headers["X-Request-Id"] == generated


async def test_client_disconnect_closes_the_upstream_request(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            r.url + "/v1/completions", json={"model": "tiny", "prompt": "slow", "stream": True}
        )
        assert resp.status == 200
        await resp.content.readany()
        assert a.running == 1
        resp.close()  # the client goes away mid-stream
    async with asyncio.timeout(2):
        await a.client_gone.wait()
    await wait_until(lambda: a.running == 0, what="the replica to stop generating")
    await wait_until(
        lambda: r.router.fleet.replicas[0].in_flight == 0,
        what="the router to release the replica's in-flight slot",
    )


async def test_connect_failure_retries_another_replica(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    b = await start_replica("b")
    r = await start_router([a, b], policy={"name": "round_robin"}, health={"interval_s": 60})
    await a.stop()  # down, but the router has not probed since
    client = client_for(r.url)
    for _ in range(4):
        completion = await client.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert completion.choices[0].text == "hello from b"
    state = {s.replica_id: s for s in r.router.fleet.replicas}
    assert not state["a"].healthy and state["b"].healthy


async def test_broken_stream_that_cannot_be_resumed_ends_with_an_sse_error_and_done(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with asyncio.timeout(5), aiohttp.ClientSession() as http:
        # n=2 cannot be continued from one text: the client must get an error, not a cut stream.
        body = {"model": "tiny", "prompt": "break", "stream": True, "n": 2}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            text = (await resp.read()).decode()
    events = [line for line in text.split("\n\n") if line]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "stream_broken"
    assert "n > 1" in error["message"]
    assert events[-1] == "data: [DONE]"
    assert len(a.seen) == 1  # not re-sent


async def test_broken_stream_is_resumed_into_the_same_client_stream(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with asyncio.timeout(5), aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "break", "stream": True, "max_tokens": 10}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            text = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    # One stream id throughout, the first replica's two pieces then the continuation's.
    assert {c["id"] for c in chunks} == {"cmpl-x"} or len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello fromhello from a"
    # The continuation carried the text already sent, and only the tokens still owed.
    assert [s.body["prompt"] for s in a.seen] == ["break", "breakhello from"]
    assert a.seen[1].body["max_tokens"] == 8


async def test_session_header_keeps_a_session_on_one_replica(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    replicas = [await start_replica(name) for name in "abcd"]
    r = await start_router(replicas, policy={"name": "consistent_hash"})
    chosen: dict[str, set[str]] = {}
    async with aiohttp.ClientSession() as http:
        for session in ("alice", "bob", "carol", "dave", "erin"):
            for _ in range(3):
                async with http.post(
                    r.url + "/v1/completions",
                    json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                    headers={"X-Session-ID": session},
                ) as resp:
                    assert resp.headers["X-Kvroute-Reason"] == "hash_home"
                    chosen.setdefault(session, set()).add(resp.headers["X-Kvroute-Replica"])
    assert all(len(replicas_seen) == 1 for replicas_seen in chosen.values())


async def test_decision_headers_can_be_turned_off(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], decision_headers=False)
    async with aiohttp.ClientSession() as http:
        async with http.post(
            r.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
        ) as resp:
            assert resp.status == 200
            assert "X-Kvroute-Replica" not in resp.headers
            assert "X-Kvroute-Reason" not in resp.headers


async def test_concurrency_limit_answers_429(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], limits={"max_concurrent_requests": 2})
    async with aiohttp.ClientSession() as http:
        held = [
            asyncio.create_task(
                http.post(r.url + "/v1/completions", json={"model": "tiny", "prompt": "hold"})
            )
            for _ in range(2)
        ]
        await wait_until(lambda: a.running == 2, what="two requests held by the replica")
        async with http.post(
            r.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
        ) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
        a.gate.set()
        for task in held:
            resp = await task
            assert resp.status == 200
            resp.release()


async def test_metrics_count_requests_per_replica(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    b = await start_replica("b")
    r = await start_router([a, b], policy={"name": "round_robin"})
    client = client_for(r.url)
    for _ in range(4):
        await client.completions.create(model="tiny", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x")
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_metrics(text).samples
    }
    for name in ("a", "b"):
        key = (
            "kvroute_requests_total",
            (("reason", "round_robin"), ("replica", name), ("status", "200")),
        )
        assert samples[key] == 2
        assert samples[("kvroute_time_to_first_byte_seconds_count", (("replica", name),))] == 2
        assert samples[("kvroute_in_flight_requests", (("replica", name),))] == 0
        assert samples[("kvroute_replica_healthy", (("replica", name),))] == 1
    assert (
        samples[
            ("kvroute_rejected_requests_total", (("code", "model_not_found"), ("status", "404")))
        ]
        == 1
    )


async def test_replica_coming_back_is_probed_healthy(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    a.healthy = False
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/ready") as resp:
            assert resp.status == 503
        a.healthy = True
        await wait_until(
            lambda: r.router.fleet.replicas[0].healthy, what="the probe to see the replica healthy"
        )
        async with http.get(r.url + "/ready") as resp:
            assert resp.status == 200
            assert (await resp.json())["healthy_replicas"] == 1


async def test_a_replica_leaves_rotation_only_after_consecutive_failed_probes(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], health={"unhealthy_after": 3})
    state = r.router.fleet.replicas[0]
    assert state.healthy
    a.healthy = False
    failing_since = a.health_checks
    await wait_until(lambda: not state.healthy, what="the replica to leave rotation")
    assert a.health_checks - failing_since >= 3
