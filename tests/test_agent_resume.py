"""Agent streams' transcripts and continuations (pure): what the client gets when a Messages
or Responses stream is resumed on another replica."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from kvroute.router.agent_request import parse_messages, parse_responses
from kvroute.router.agent_resume import (
    AgentStreamTranscript,
    agent_continuation_body,
    agent_resume_blocker,
)


def event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def chat_chunk(text: str | None = None, finish: str | None = None, **extra: Any) -> bytes:
    delta = {"content": text} if text is not None else {}
    choice = {"index": 0, "delta": {**delta, **extra}, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


def usage_chunk(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"


def parse_events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for block in data.split(b"\n\n"):
        if block:
            kind, payload = block.split(b"\n", 1)
            obj = json.loads(payload.removeprefix(b"data: "))
            assert kind == b"event: " + obj["type"].encode()
            out.append(obj)
    return out


MESSAGE_START = event(
    "message_start",
    message={"id": "chatcmpl-1", "type": "message", "role": "assistant", "content": [],
             "model": "m", "usage": {"input_tokens": 40, "output_tokens": 0}},
)  # fmt: skip


def test_messages_events_pass_whole_whatever_the_chunking() -> None:
    t = AgentStreamTranscript("messages")
    data = (
        MESSAGE_START
        + event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        + event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hel"})
        + event("content_block_delta", index=0, delta={"type": "text_delta", "text": "lo"})
    )
    forwarded = b"".join(t.feed(data[i : i + 9]) for i in range(0, len(data), 9))
    assert forwarded == data
    assert t.generated_text == "Hello" and t.generated_tokens == 2 and t.resumable()


def test_a_messages_continuation_closes_the_open_block_with_the_whole_usage() -> None:
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START)
    t.feed(event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
    t.feed(event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hel"}))
    t.start_continuation()
    out = t.feed(chat_chunk("", None, role="assistant") + chat_chunk("lo", None))
    out += t.feed(chat_chunk(" there", "length") + usage_chunk(43, 2) + b"data: [DONE]\n\n")
    events = parse_events(out)
    assert [e["type"] for e in events] == [
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop",
    ]  # fmt: skip
    assert all(e["index"] == 0 for e in events[:3])
    assert events[3]["delta"]["stop_reason"] == "max_tokens"
    assert events[3]["usage"] == {"input_tokens": 40, "output_tokens": 1 + 2}
    assert t.done and t.usage == {"prompt_tokens": 40, "completion_tokens": 3}


def test_a_messages_stream_broken_before_its_text_block_gets_one() -> None:
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START)
    t.start_continuation()
    events = parse_events(t.feed(chat_chunk("Hi", "stop") + b"data: [DONE]\n\n"))
    assert [e["type"] for e in events][:2] == ["content_block_start", "content_block_delta"]
    assert events[0]["index"] == 0 and events[-1]["type"] == "message_stop"


@pytest.mark.parametrize(
    "block",
    [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        {"type": "thinking", "thinking": ""},
    ],
)
def test_tool_use_or_thinking_blocks_resuming(block: dict[str, Any]) -> None:
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START + event("content_block_start", index=0, content_block=block))
    assert not t.resumable() and t.blocker is not None


def test_a_finished_stream_is_not_resumed() -> None:
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START + event("message_delta", delta={"stop_reason": "end_turn"}, usage={}))
    assert not t.resumable()
    assert not AgentStreamTranscript("messages").resumable()  # nothing sent: a retry's job


def test_a_responses_continuation_numbers_on_and_completes_the_response() -> None:
    t = AgentStreamTranscript("responses")
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": ""}
    t.feed(
        event("response.created", response=response, sequence_number=0)
        + event("response.in_progress", response=response, sequence_number=1)
        + event("response.output_item.added", output_index=0, item=item, sequence_number=2)
        + event("response.content_part.added", item_id="msg_1", output_index=0,
                content_index=0, part=part, sequence_number=3)
        + event("response.output_text.delta", item_id="msg_1", delta="Hel", sequence_number=4)
    )  # fmt: skip
    t.start_continuation()
    out = t.feed(chat_chunk("lo", "stop") + usage_chunk(21, 1) + b"data: [DONE]\n\n")
    events = parse_events(out)
    assert [e["sequence_number"] for e in events] == list(range(5, 5 + len(events)))
    assert events[0] == {"type": "response.output_text.delta", "item_id": "msg_1",
                         "output_index": 0, "content_index": 0, "delta": "lo", "logprobs": [],
                         "sequence_number": 5}  # fmt: skip
    completed = events[-1]["response"]
    assert completed["id"] == "resp_1" and completed["status"] == "completed"
    assert completed["output"][0]["content"][0]["text"] == "Hello"
    assert completed["usage"]["input_tokens"] == 20 and completed["usage"]["output_tokens"] == 2


def test_a_continuation_that_fails_ends_the_stream_with_an_error_not_a_finish() -> None:
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START)
    t.feed(event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
    t.start_continuation()
    error = {"error": {"message": "engine died", "type": "InternalServerError"}}
    out = t.feed(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
    events = parse_events(out)
    assert [e["type"] for e in events] == ["error"]
    assert t.done and not t.resumable()


def test_a_continuation_that_calls_a_tool_stops_resuming() -> None:
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START)
    t.start_continuation()
    t.feed(chat_chunk(None, None, tool_calls=[{"index": 0}]))
    assert t.blocker is not None


def test_the_length_finish_when_every_token_was_sent() -> None:
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START)
    t.feed(event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
    events = parse_events(t.length_finish())
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


MESSAGES_BODY = {
    "model": "m",
    "max_tokens": 10,
    "stream": True,
    "system": "Be brief.",
    "temperature": 0.2,
    "stop_sequences": ["END"],
    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "messages": [{"role": "user", "content": "Hi"}],
}


def test_a_messages_continuation_is_a_chat_request_for_the_partial_answer() -> None:
    raw = msgspec.json.encode(MESSAGES_BODY)
    parsed = parse_messages(raw)
    t = AgentStreamTranscript("messages")
    t.feed(MESSAGE_START)
    t.feed(event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hel"}))
    body = json.loads(
        agent_continuation_body(MESSAGES_BODY, parsed, t, parsed.messages or []) or b""
    )
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hel"},
    ]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 9 and body["stop"] == ["END"] and body["temperature"] == 0.2
    assert body["tool_choice"] == "none" and body["tools"][0]["function"]["name"] == "f"
    assert body["stream_options"] == {"include_usage": True}


def test_a_continuation_owes_nothing_once_every_token_was_sent() -> None:
    body = {**MESSAGES_BODY, "max_tokens": 1}
    parsed = parse_messages(msgspec.json.encode(body))
    t = AgentStreamTranscript("messages")
    t.feed(event("content_block_delta", index=0, delta={"type": "text_delta", "text": "x"}))
    assert agent_continuation_body(body, parsed, t, []) is None


@pytest.mark.parametrize(
    ("api", "body", "why"),
    [
        ("messages", {"stream": False}, "not streamed"),
        ("messages", {"stream": True, "output_config": {"format": {"type": "json_schema"}}},
         "structured"),
        ("responses", {"stream": True, "previous_response_id": "resp_1"}, "stored"),
        ("responses", {"stream": True, "text": {"format": {"type": "json_object"}}}, "structured"),
    ],
)  # fmt: skip
def test_requests_that_cannot_be_resumed_say_why(api: str, body: dict[str, Any], why: str) -> None:
    blocker = agent_resume_blocker(body, api)
    assert blocker is not None and why in blocker
    assert agent_resume_blocker({"stream": True}, api) is None


def test_a_responses_continuation_keeps_the_special_tokens_and_output_limit() -> None:
    body = {"model": "m", "input": "Hi", "max_output_tokens": 5, "stream": True}
    parsed = parse_responses(msgspec.json.encode(body))
    t = AgentStreamTranscript("responses")
    t.feed(event("response.output_text.delta", delta="a", sequence_number=0))
    new = json.loads(agent_continuation_body(body, parsed, t, parsed.messages or []) or b"")
    assert new["add_special_tokens"] is True and new["max_tokens"] == 4
    assert new["messages"][-1] == {"role": "assistant", "content": "a"}
