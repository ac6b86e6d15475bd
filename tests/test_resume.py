"""Stream transcripts and continuation requests for mid-stream failover (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute.router.resume import StreamTranscript, continuation_body, resume_blocker


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def completion_chunk(text: str, finish: str | None = None, rid: str = "cmpl-1") -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return sse({"id": rid, "object": "text_completion", "choices": [choice]})


def chat_chunk(delta: dict[str, Any], finish: str | None = None, rid: str = "chat-1") -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return sse({"id": rid, "object": "chat.completion.chunk", "choices": [choice]})


def events(data: bytes) -> list[Any]:
    out = []
    for event in data.split(b"\n\n"):
        if event:
            payload = event.removeprefix(b"data: ")
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def test_only_whole_events_are_forwarded_whatever_the_chunking() -> None:
    t = StreamTranscript(chat=False)
    data = completion_chunk("Hel") + completion_chunk("lo") + completion_chunk(" world")
    forwarded = b"".join(t.feed(data[i : i + 7]) for i in range(0, len(data), 7))
    assert forwarded == data
    assert t.generated_text == "Hello world" and t.generated_tokens == 3
    # A stream cut in the middle of an event forwards nothing of that event.
    t2 = StreamTranscript(chat=False)
    assert t2.feed(completion_chunk("a") + completion_chunk("b")[:10]) == completion_chunk("a")
    assert t2.resumable()


def test_a_finished_or_done_stream_is_not_resumed() -> None:
    t = StreamTranscript(chat=False)
    t.feed(completion_chunk("a", finish="stop"))
    assert t.finished and not t.resumable()
    t2 = StreamTranscript(chat=False)
    t2.feed(b"data: [DONE]\n\n")
    assert t2.done and not t2.resumable()


def test_tool_calls_or_an_error_event_block_resuming() -> None:
    t = StreamTranscript(chat=True)
    t.feed(chat_chunk({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}))
    assert not t.resumable() and "tool calls" in (t.blocker or "")
    t2 = StreamTranscript(chat=False)
    t2.feed(sse({"error": {"message": "boom"}}))
    assert not t2.resumable()


def test_completion_continuation_carries_the_text_and_the_tokens_still_owed() -> None:
    t = StreamTranscript(chat=False)
    t.feed(completion_chunk("Once") + completion_chunk(" upon"))
    body = {"model": "m", "prompt": ["Tell me:"], "max_tokens": 10, "min_tokens": 5, "stream": True}
    new = json.loads(continuation_body(body, False, t) or b"")
    assert new["prompt"] == "Tell me:Once upon"
    assert (new["max_tokens"], new["min_tokens"], new["stream"]) == (8, 3, True)
    # Every token asked for was already sent: nothing to continue.
    assert continuation_body({**body, "max_tokens": 2}, False, t) is None


def test_chat_continuation_continues_the_partial_assistant_message() -> None:
    t = StreamTranscript(chat=True)
    t.feed(chat_chunk({"role": "assistant", "content": ""}) + chat_chunk({"content": "Hi"}))
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    new = json.loads(continuation_body(body, True, t) or b"")
    assert new["messages"][-1] == {"role": "assistant", "content": "Hi"}
    assert new["continue_final_message"] is True and new["add_generation_prompt"] is False
    # A request that was already continuing an assistant message extends that message.
    prefilled = {
        **body,
        "messages": [*body["messages"], {"role": "assistant", "content": "Sure. "}],
        "continue_final_message": True,
    }
    new = json.loads(continuation_body(prefilled, True, t) or b"")
    assert len(new["messages"]) == 2 and new["messages"][-1]["content"] == "Sure. Hi"


def test_a_continuation_is_spliced_in_with_one_id_no_second_role_and_whole_usage() -> None:
    t = StreamTranscript(chat=True)
    first = chat_chunk({"role": "assistant", "content": ""}) + chat_chunk({"content": "A"})
    first += chat_chunk({"content": "B"})
    assert t.feed(first) == first
    t.start_continuation()
    second = chat_chunk({"role": "assistant", "content": ""}, rid="chat-2")
    second += chat_chunk({"content": "C"}, rid="chat-2")
    second += chat_chunk({"content": ""}, finish="length", rid="chat-2")
    second += sse(
        {
            "id": "chat-2",
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        }
    )
    second += b"data: [DONE]\n\n"
    out = events(t.feed(second))
    assert out[-1] == "[DONE]"
    chunks = out[:-1]
    assert {c["id"] for c in chunks} == {"chat-1"}
    assert not any("role" in c["choices"][0]["delta"] for c in chunks if c["choices"])
    assert [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]] == ["C", ""]
    assert chunks[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert t.generated_text == "ABC" and t.finished


@pytest.mark.parametrize(
    ("body", "chat", "why"),
    [
        ({"prompt": "x"}, False, "not streamed"),
        ({"prompt": "x", "stream": True, "n": 2}, False, "n > 1"),
        ({"prompt": "x", "stream": True, "echo": True}, False, "echo"),
        ({"prompt": [1, 2], "stream": True}, False, "prompt is not one string"),
        (
            {
                "messages": [{"role": "user"}],
                "stream": True,
                "response_format": {"type": "json_object"},
            },
            True,
            "structured output",
        ),
    ],
)
def test_requests_that_cannot_be_continued_say_why(
    body: dict[str, Any], chat: bool, why: str
) -> None:
    assert why in (resume_blocker(body, chat) or "")


def test_plain_streamed_requests_can_be_continued() -> None:
    assert resume_blocker({"prompt": ["x"], "stream": True, "n": 1}, False) is None
    text_format = {"type": "text"}
    chat = {"messages": [{"role": "user"}], "stream": True, "response_format": text_format}
    assert resume_blocker(chat, True) is None


def test_a_last_event_without_its_blank_line_still_ends_the_stream() -> None:
    t = StreamTranscript(chat=False)
    assert t.feed(completion_chunk("a", finish="stop") + b"data: [DONE]\n") == completion_chunk(
        "a", finish="stop"
    )
    assert t.end() == b"data: [DONE]\n\n"
    assert t.done and not t.resumable()
    assert StreamTranscript(chat=False).end() == b""


def test_a_long_stream_continues_with_every_piece_of_its_text_in_order() -> None:
    t = StreamTranscript(chat=False)
    pieces = [f"<{i}>" for i in range(1000)]  # long enough for the transcript to join runs
    for piece in pieces:
        t.feed(completion_chunk(piece))
    body = json.loads(continuation_body({"prompt": "P:", "max_tokens": 1500}, False, t) or b"")
    assert body["prompt"] == "P:" + "".join(pieces)
    assert body["max_tokens"] == 500
