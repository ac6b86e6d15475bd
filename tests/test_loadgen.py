"""``simulator.loadgen``, the one load generator of the live replay, the drill and the demo:
what it records of an answer, how it judges it, and when it sends."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvroute.simulator.loadgen import Outcome, Planned, run_conversations, run_open_loop, send
from kvroute.simulator.workload import Conversation


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Server:
    """Answers completions and chat like vLLM; the prompt (or last user turn) scripts it."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most_in_flight = 0
        self.arrivals: list[float] = []
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.monotonic())
        chat = "messages" in body
        script = body["messages"][-1]["content"] if chat else body["prompt"]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if script.startswith("sleep:"):
                await asyncio.sleep(float(script.split(":")[1]))
            if script == "status:503":
                return web.Response(status=503, text="overloaded")
            if not body.get("stream"):
                if script == "unfinished":
                    return web.json_response({"choices": [{"text": "x", "finish_reason": None}]})
                choice: dict[str, Any] = (
                    {"message": {"role": "assistant", "content": "hi there"}}
                    if chat
                    else {"text": "hi there"}
                )
                return web.json_response(
                    {
                        "choices": [{**choice, "finish_reason": "length"}],
                        "usage": {"completion_tokens": 2},
                    },
                    headers={"X-Kvroute-Replica": "r1"},
                )
            resp = web.StreamResponse(headers={"X-Kvroute-Replica": "r2"})
            await resp.prepare(request)
            if chat:
                await resp.write(
                    _sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
                )
            words = ["one ", "two ", "three"]
            for i, word in enumerate(words):
                last = i == len(words) - 1
                if script == "sse-error" and i == 1:
                    await resp.write(_sse({"error": {"message": "replica lost"}}))
                    return resp
                part = {"delta": {"content": word}} if chat else {"text": word}
                finish = "length" if last and script != "no-finish" else None
                await resp.write(_sse({"choices": [{**part, "finish_reason": finish}]}))
                await asyncio.sleep(0.01)
            if body.get("stream_options", {}).get("include_usage"):
                await resp.write(_sse({"choices": [], "usage": {"completion_tokens": 6}}))
            if script != "no-done":
                await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    state = Server()
    app = web.Application()
    app.router.add_post("/v1/completions", state.handle)
    app.router.add_post("/v1/chat/completions", state.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield state, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def one(url: str, prompt: str, stream: bool = True, **extra: Any) -> Outcome:
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": stream, **extra}
        return await send(http, url + "/v1/completions", body, keep_text=True)


async def test_a_whole_stream_is_ok_with_its_times_tokens_and_replica(
    server: tuple[Server, str],
) -> None:
    _, url = server
    outcome = await one(url, "fine")
    assert outcome.ok and outcome.error == "" and outcome.status == 200
    assert (outcome.finished, outcome.done, outcome.chunks, outcome.tokens) == (True, True, 3, 3)
    assert outcome.replica == "r2" and outcome.text == "one two three"
    assert outcome.ttft_s is not None and outcome.last_token_s is not None
    assert 0 < outcome.ttft_s < outcome.last_token_s <= (outcome.latency_s or 0)
    assert outcome.tpot_s == pytest.approx((outcome.last_token_s - outcome.ttft_s) / 2)
    # The server's usage count wins over counting events (a lagging server packs tokens).
    with_usage = await one(url, "fine", stream_options={"include_usage": True})
    assert with_usage.ok and with_usage.tokens == 6


async def test_answers_that_are_not_whole_are_errors(server: tuple[Server, str]) -> None:
    _, url = server
    cases = {
        "status:503": ("HTTP 503", "HTTP 503: overloaded"),
        "sse-error": ("SSE error", "SSE error: replica lost"),
        "no-done": ("incomplete stream", "stream ended without finish_reason and [DONE]"),
        "no-finish": ("incomplete stream", "stream ended without finish_reason and [DONE]"),
    }
    for prompt, (kind, error) in cases.items():
        outcome = await one(url, prompt)
        assert not outcome.ok, prompt
        assert (outcome.error_kind, outcome.error) == (kind, error), prompt
    # Tokens that came before an error are still recorded (the drill shows them).
    assert (await one(url, "sse-error")).chunks == 1
    unfinished = await one(url, "unfinished", stream=False)
    assert unfinished.error == "answer without a finish_reason"


async def test_a_non_streamed_answer_and_a_dead_server(server: tuple[Server, str]) -> None:
    _, url = server
    outcome = await one(url, "fine", stream=False)
    assert outcome.ok and not outcome.stream and outcome.replica == "r1"
    assert outcome.ttft_s is not None and outcome.ttft_s <= (outcome.latency_s or 0)
    assert (outcome.tokens, outcome.text, outcome.tpot_s) == (2, "hi there", None)
    dead = await one("http://127.0.0.1:1", "fine")
    assert not dead.ok and dead.status == 0
    assert dead.error_kind == "ClientConnectorError" and dead.error.startswith(dead.error_kind)


async def test_open_loop_sends_on_time_whatever_is_in_flight(server: tuple[Server, str]) -> None:
    state, url = server
    plan = [
        Planned(0.1 * i, url + "/v1/completions", {"prompt": "sleep:0.5", "stream": True})
        for i in range(5)
    ]
    done: dict[int, Outcome] = {}
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        sent = await run_open_loop(http, plan, started=started, on_done=done.__setitem__)
    assert sent == 5 and sorted(done) == list(range(5))
    assert all(o.ok for o in done.values())
    assert state.most_in_flight == 5  # none waited for an earlier one to finish
    for i, arrival in enumerate(state.arrivals):
        assert 0.1 * i <= arrival - started < 0.1 * i + 0.08
        assert done[i].sent_at == pytest.approx(0.1 * i, abs=0.05) and done[i].late_s < 0.05


async def test_a_concurrency_cap_delays_and_reports_lateness(server: tuple[Server, str]) -> None:
    state, url = server
    plan = (
        Planned(0.0, url + "/v1/completions", {"prompt": "sleep:0.3", "stream": False})
        for _ in range(4)
    )
    done: list[Outcome] = []
    async with aiohttp.ClientSession() as http:
        await run_open_loop(http, plan, concurrency=2, on_done=lambda i, o: done.append(o))
    assert state.most_in_flight == 2
    late = sorted(o.late_s for o in done)
    assert late[:2] == pytest.approx([0.0, 0.0], abs=0.05)
    assert late[2:] == pytest.approx([0.3, 0.3], abs=0.1)


async def test_conversations_send_each_turn_after_the_last_answer(
    server: tuple[Server, str],
) -> None:
    state, url = server
    conversations = [
        Conversation(t, f"system {t}", ("fine", "fine", "status:503")) for t in range(3)
    ]
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession() as http:
        await run_conversations(
            http,
            lambda tenant: url,
            conversations,
            concurrency=2,
            max_tokens=3,
            scripted_replies=False,
            on_done=outcomes.append,
        )
    assert len(outcomes) == 9 and sum(o.ok for o in outcomes) == 6
    assert state.most_in_flight <= 2
    last = [b for b in state.bodies if b["user"] == "tenant-1"][-1]
    # The model's own replies went back (the chat role chunk carries no content).
    assert [m["role"] for m in last["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert last["messages"][2]["content"] == "one two three"
    assert all(o.ttft_s is not None for o in outcomes if o.ok)
