"""The agent APIs through the router, as the vendors' own clients see them: Anthropic
Messages (``anthropic``) and OpenAI Responses (``openai``), against scripted replicas."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import anthropic
import openai
import pytest

from kvroute.kvcore.client_text import shown
from kvroute.kvcore.stats import parse_metrics

from .conftest import StartReplica, StartRouter
from .fake_replica import FAKE_PROMPT_TOKENS
from .helpers import wait_until


def anthropic_client(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=10)


def openai_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


async def test_messages_plain_and_with_tools(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    client = anthropic_client(r.url)
    message = await client.messages.create(
        model="tiny",
        max_tokens=64,
        system=[{"type": "text", "text": "You are a coding agent."}],
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert message.content[0].type == "text" and message.content[0].text == "hello from a"
    assert message.usage.input_tokens == FAKE_PROMPT_TOKENS
    assert a.seen[-1].path == "/v1/messages"
    # A turn after a tool call: the body reaches the replica as the client sent it.
    turns = [
        {"role": "user", "content": "Read setup.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "read_file",
                    "input": {"path": "setup.py"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "print()"}],
        },
    ]
    message = await client.messages.create(
        model="tiny",
        max_tokens=64,
        tools=TOOLS,
        messages=turns,  # type: ignore[arg-type]
    )
    assert message.content[0].text == "hello from a"  # type: ignore[union-attr]
    assert a.seen[-1].body["messages"] == turns and a.seen[-1].body["tools"] == TOOLS


async def test_messages_stream_through_the_anthropic_client(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with anthropic_client(r.url).messages.stream(
        model="tiny", max_tokens=64, messages=[{"role": "user", "content": "gate"}]
    ) as stream:
        pieces = []
        async for text in stream.text_stream:
            pieces.append(text)
            a.gate.set()  # the replica holds the rest until the client has seen the first piece
        final = await stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == "hello from a"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3
    # The router asked the replica for nothing of its own (no stream_options spliced in).
    assert "stream_options" not in a.seen[-1].body


async def test_count_tokens(start_replica: StartReplica, start_router: StartRouter) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    counted = await anthropic_client(r.url).messages.count_tokens(
        model="tiny", messages=[{"role": "user", "content": "How many?"}]
    )
    assert counted.input_tokens == FAKE_PROMPT_TOKENS
    assert a.seen[-1].path == "/v1/messages/count_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]},
         "messages[0].role"),
        ({"model": "tiny", "max_tokens": 8,
          "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
         "messages[0].content[0]"),
        ({"model": "tiny", "max_tokens": "8", "messages": []}, "max_tokens"),
    ],
    ids=["no max_tokens", "bad role", "unknown block", "wrong type"],
)  # fmt: skip
async def test_messages_bad_input_gets_anthropic_errors(
    body: dict[str, object], param: str, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    with pytest.raises(anthropic.BadRequestError) as caught:
        await anthropic_client(r.url).post("/v1/messages", body=body, cast_to=object)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]
    assert a.seen == []  # refused before any replica


async def test_messages_errors_in_anthropic_shape(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as session:
        async with session.post(r.url + "/v1/messages", data=b"{not json") as response:
            assert response.status == 400
            body = await response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    client = anthropic_client(r.url)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(
            model="nope", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    # The replica's own error (vLLM's type names) reaches the client in Anthropic's shape.
    with pytest.raises(anthropic.BadRequestError) as relayed:
        await client.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "status:400"}]
        )
    assert relayed.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "scripted 400"},
    }


async def test_responses_plain_and_streamed(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    client = openai_client(r.url)
    response = await client.responses.create(
        model="tiny", instructions="Be brief.", input="Hi", max_output_tokens=32
    )
    assert response.output_text == "hello from a"
    assert response.usage is not None and response.usage.input_tokens == FAKE_PROMPT_TOKENS
    assert a.seen[-1].path == "/v1/responses"
    stream = await client.responses.create(model="tiny", input="Hi", stream=True)
    kinds, text = [], []
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text.append(event.delta)
    assert "".join(text) == "hello from a"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


async def test_responses_bad_input_gets_openai_errors(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    # No probe during the test: it marks the replica down by hand at the end.
    r = await start_router([a], health={"interval_s": 60})
    client = openai_client(r.url)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "x"}])
    assert caught.value.body["param"] == "input"  # type: ignore[index]
    assert "Unsupported input item type" in caught.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        await client.post("/responses", body={"model": "tiny"}, cast_to=object)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="nope", input="x")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    # A content part's text that is not a string (it was a 500 once), in a message and in a
    # tool's output.
    for item, param in (
        ({"role": "user", "content": [{"type": "input_text", "text": 5}]}, "input[0].content[0]"),
        ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text",
          "text": True}]}, "input[0].output[0]"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as typed:
            await client.post("/responses", body={"model": "tiny", "input": [item]}, cast_to=object)
        assert typed.value.body["param"] == f"{param}.text"  # type: ignore[index]
        assert "must be a string" in typed.value.body["message"]  # type: ignore[index]
    assert a.seen == []
    # Errors quote a client's value cut short, and a lookup with no replica up is a 503.
    with pytest.raises(openai.NotFoundError) as huge:
        await client.responses.create(model="m" * 100_000, input="x")
    message = huge.value.body["message"]  # type: ignore[index]
    assert len(message) < 400 and "(100000 chars)" in message
    with pytest.raises(openai.BadRequestError) as kind:
        await client.post("/responses", body={"model": "tiny", "input": [{"type": "k" * 50_000}]},
                          cast_to=object)  # fmt: skip
    assert len(kind.value.body["message"]) < 400  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.responses.retrieve("resp_" + "z" * 5_000)
    assert len(unknown.value.body["message"]) < 400  # type: ignore[index]
    for handle in r.router.replicas.values():
        handle.state.healthy = False  # nobody to ask where the response is stored
    with pytest.raises(openai.InternalServerError) as down:
        await client.responses.retrieve("resp_somewhere")
    assert down.value.status_code == 503


async def test_a_response_not_found_where_a_replica_could_not_be_asked_is_a_503(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """A 404 says the response is gone for good: only when every replica was asked."""
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b], health={"interval_s": 60})
    client = openai_client(r.url)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_nowhere")
    r.router.replicas["b"].state.healthy = False  # b may hold it, and is not asked
    with pytest.raises(openai.InternalServerError) as unsure:
        await client.responses.retrieve("resp_nowhere")
    assert unsure.value.status_code == 503
    assert unsure.value.body["code"] == "response_lookup_incomplete"  # type: ignore[index]


async def test_a_follow_up_goes_where_its_previous_response_is_stored(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b], policy={"name": "round_robin"})
    client = openai_client(r.url)
    first = await client.responses.create(model="tiny", input="Hi", store=True)
    holder = a if first.id.startswith("resp_a") else b
    other = b if holder is a else a
    for _ in range(4):  # round robin would alternate; the follow-ups stay with the history
        follow = await client.responses.create(
            model="tiny", input="And then?", previous_response_id=first.id
        )
        assert follow.output_text == f"hello from {holder.name}"
    assert all(s.body.get("previous_response_id") is None for s in other.seen)
    # Streamed answers are remembered too (their id is in the first event).
    stream = await client.responses.create(model="tiny", input="Hi", stream=True)
    streamed_id = None
    async for event in stream:
        if event.type == "response.created":
            streamed_id = event.response.id
    assert streamed_id is not None
    follow = await client.responses.create(
        model="tiny", input="More", previous_response_id=streamed_id
    )
    assert follow.output_text.endswith(streamed_id.split("_")[1])
    # An id in a body that holds "data:" too, and one in a response.created larger than one
    # read (a long instructions, echoed): both remembered.
    for instructions, stream_it in (("Images come as data:image/png;base64,...", False),
                                    ("Follow the repository's conventions. " * 3000, True)):  # fmt: skip
        if stream_it:
            events = await client.responses.create(
                model="tiny", input="Hi", instructions=instructions, stream=True
            )
            seen = [e async for e in events]  # the whole stream: its answer is then stored
            answer_id = seen[0].response.id  # type: ignore[union-attr]
        else:
            answer = await client.responses.create(
                model="tiny", input="Hi", instructions=instructions
            )
            answer_id = answer.id
        follow = await client.responses.create(
            model="tiny", input="More", previous_response_id=answer_id
        )
        assert follow.output_text.endswith(answer_id.split("_")[1])
    # The holder out of rotation: try again later (503), not an answer without the history.
    holder.healthy = False
    await wait_until(lambda: r.router.registry.in_rotation() == 1, timeout_s=5)
    with pytest.raises(openai.InternalServerError) as away:
        await client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert away.value.status_code == 503 and "retry-after" in away.value.response.headers
    assert away.value.body["code"] == "previous_response_unavailable"  # type: ignore[index]
    assert away.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_a_broken_messages_stream_is_resumed_on_another_replica(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b], policy={"name": "round_robin"})
    client = anthropic_client(r.url)
    kinds: list[str] = []
    async with client.messages.stream(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "break"}]
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_message()
    second = b if a.seen[0].path == "/v1/messages" else a
    # The client got one message: the first replica's two pieces, then the continuation's.
    assert final.content[0].text == "hello from" + f"hello from {second.name}"  # type: ignore[union-attr]
    assert [k for k in kinds if k.startswith("message_")] == [
        "message_start", "message_delta", "message_stop"
    ]  # fmt: skip
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == FAKE_PROMPT_TOKENS and final.usage.output_tokens == 2 + 3
    # Continued through the chat endpoint: the partial answer as the message to continue.
    seen = second.seen[-1]
    assert seen.path == "/v1/chat/completions"
    assert seen.body["messages"][-1] == {"role": "assistant", "content": "hello from"}
    assert seen.body["continue_final_message"] is True and seen.body["max_tokens"] == 8 - 2


async def test_a_broken_responses_stream_is_resumed_on_another_replica(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b], policy={"name": "round_robin"})
    stream = await openai_client(r.url).responses.create(
        model="tiny", input=[{"role": "user", "content": "break"}], stream=True
    )
    events = [event async for event in stream]
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))  # one stream, numbered without a gap
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    second = b if a.seen[0].path == "/v1/responses" else a
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == f"hello fromhello from {second.name}"
    completed = events[-1].response  # type: ignore[union-attr]
    assert completed.output_text == text and completed.status == "completed"
    assert completed.id == events[0].response.id  # type: ignore[union-attr]
    assert completed.usage is not None and completed.usage.output_tokens == 2 + 3
    assert second.seen[-1].body["add_special_tokens"] is True  # as vLLM tokenizes Responses


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_broken_tool_call_is_not_resumed_and_ends_in_its_apis_error_event(
    api: str, start_replica: StartReplica, start_router: StartRouter
) -> None:
    """Resume on (the default): a stream cut during a tool call cannot be continued from text;
    the client's stream still ends well-formed, in its own API's error event."""
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b])
    if api == "messages":
        body = {"model": "tiny", "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": "break-tool"}]}  # fmt: skip
    else:
        body = {"model": "tiny", "stream": True, "input": "break-tool"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{r.url}/v1/{api}", json=body) as response:
            raw = await response.read()
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1].startswith("event: error\ndata: ") and b"[DONE]" not in raw
    error = json.loads(events[-1].split("data: ", 1)[1])
    if api == "responses":  # numbered after the stream's own events
        numbers = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in events]
        assert numbers == list(range(len(events)))
    assert "failed mid-stream" in json.dumps(error)
    assert not r.router.metrics.resumes  # nothing was tried: a tool call is not text


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_stream_broken_mid_way_ends_in_its_apis_error_event(
    api: str, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], retry={"resume_streams": False})
    if api == "messages":
        body = {"model": "tiny", "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": "break"}]}  # fmt: skip
    else:
        body = {"model": "tiny", "stream": True, "input": [{"role": "user", "content": "break"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{r.url}/v1/{api}", json=body) as response:
            assert response.status == 200
            raw = await response.read()
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1].startswith("event: error\ndata: ")
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error["type"] == "error"
    message = error["error"]["message"] if api == "messages" else error["message"]
    assert "failed mid-stream" in message
    assert b"[DONE]" not in raw


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_client_that_goes_away_aborts_the_replica_request(
    api: str, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    if api == "messages":
        body = {"model": "tiny", "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": "gate"}]}  # fmt: skip
    else:
        body = {"model": "tiny", "stream": True, "input": "gate"}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{r.url}/v1/{api}", json=body)
        await response.content.readany()
        response.close()
    async with asyncio.timeout(5):
        await a.client_gone.wait()


async def test_tenants_are_charged_each_apis_usage_and_over_budget_is_a_429_in_its_shape(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    limits = {"output_tokens_per_minute": 6}
    r = await start_router([a], tenants={"by_name": {"agent": limits, "codex": limits}})
    claude = anthropic.AsyncAnthropic(
        base_url=r.url, api_key="x", max_retries=0, default_headers={"X-Tenant-Id": "agent"}
    )
    turn = [{"role": "user", "content": "Hi"}]
    await claude.messages.count_tokens(model="tiny", messages=turn)  # type: ignore[arg-type]
    await claude.messages.create(model="tiny", max_tokens=8, messages=turn)  # type: ignore[arg-type]
    async with claude.messages.stream(model="tiny", max_tokens=8, messages=turn) as stream:  # type: ignore[arg-type]
        await stream.get_final_message()
    codex = openai.AsyncOpenAI(
        base_url=r.url + "/v1", api_key="x", max_retries=0, default_headers={"X-Tenant-Id": "codex"}
    )
    await codex.responses.create(model="tiny", input="Hi")
    async with aiohttp.ClientSession() as http, http.get(r.url + "/admin/tenants") as resp:
        tenants = {row["tenant"]: row for row in (await resp.json())["tenants"]}
    # The replica's own counts, read from each API's usage (3 in, 3 out each), whole and
    # streamed; counting tokens is charged nothing.
    assert tenants["agent"]["tokens"] == {"input": 2 * FAKE_PROMPT_TOKENS, "output": 6}
    assert tenants["codex"]["tokens"] == {"input": FAKE_PROMPT_TOKENS, "output": 3}
    with pytest.raises(anthropic.RateLimitError) as spent:
        await claude.messages.create(model="tiny", max_tokens=8, messages=turn)  # type: ignore[arg-type]
    assert spent.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


async def test_metrics_count_requests_by_api(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    turn = [{"role": "user", "content": "Hi"}]
    claude = anthropic_client(r.url)
    await claude.messages.create(model="tiny", max_tokens=8, messages=turn)  # type: ignore[arg-type]
    await claude.messages.count_tokens(model="tiny", messages=turn)  # type: ignore[arg-type]
    oa = openai_client(r.url)
    await oa.responses.create(model="tiny", input="Hi")
    await oa.responses.create(model="tiny", input="Hi again")
    await oa.chat.completions.create(model="tiny", messages=turn)  # type: ignore[arg-type]
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        page = parse_metrics(await resp.text())
    by_api = {
        s.labels["api"]: s.value for s in page.samples if s.name == "kvroute_api_requests_total"
    }
    assert by_api == {"messages": 1, "count_tokens": 1, "responses": 2, "chat": 1}


def test_errors_quote_a_clients_value_cut_short() -> None:
    """One rule for the router's and the agent conversion's messages (kvcore/client_text.py)."""
    assert shown("gpt-4o") == "'gpt-4o'"
    assert shown("m" * 300) == repr("m" * 200) + "... (300 chars)"
    assert shown("k" * 300, quote=False) == "k" * 200 + "... (300 chars)"
    assert shown(["x"] * 100) == repr(["x"] * 100)[:200] + f"... ({len(repr(['x'] * 100))} chars)"
    assert shown(None) == "None"
