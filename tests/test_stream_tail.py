"""The stream tail finds a stream's last usage object as its chunks pass, whatever the API and
however the replica's bytes are cut, and answers what reading the whole stream would."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.usage import StreamTail, usage_of


def _chat_token(i: int, usage: str) -> bytes:
    return (
        f'data: {{"choices": [{{"delta": {{"content": "t{i}"}}}}], "usage": {usage}}}\n\n'.encode()
    )


_CHAT_USAGE = (
    'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 9, '
    '"prompt_tokens_details": {"cached_tokens": 16}}}\n\ndata: [DONE]\n\n'
)
_MESSAGES = (
    'event: message_start\ndata: {"type": "message_start", "message": {"id": "m", "usage": '
    '{"input_tokens": 12, "cache_read_input_tokens": 30, "output_tokens": 1}}}\n\n'
    + "".join(
        'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
        f'"delta": {{"type": "text_delta", "text": "w{i} \\"usage\\" {{x}}"}}}}\n\n'
        for i in range(30)
    )
    + 'event: message_delta\ndata: {"type": "message_delta", "delta": {"stop_reason": '
    '"end_turn"}, "usage": {"output_tokens": 31}}\n\n'
    'event: message_stop\ndata: {"type": "message_stop"}\n\n'
)


def _responses(text: str) -> str:
    done = {
        "type": "response.completed",
        "response": {
            "id": "r",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
            "usage": {
                "input_tokens": 50,
                "input_tokens_details": {"cached_tokens": 48},
                "output_tokens": 7,
            },
            "user": None,
        },
    }
    return f"event: response.completed\ndata: {json.dumps(done)}\n\n"


_STREAMS = st.sampled_from(
    [
        b"".join(_chat_token(i, "null") for i in range(50)) + _CHAT_USAGE.encode(),
        b"".join(
            _chat_token(i, f'{{"prompt_tokens": 40, "completion_tokens": {i}}}') for i in range(50)
        ),
        b"".join(_chat_token(i, "null") for i in range(50)) + b"data: [DONE]\n\n",
        _MESSAGES.encode(),
        _responses("a long answer " * 900).encode(),  # the completed event is ~13 KB
        b": keep-alive\n\n" + _responses("").encode(),
    ]
)


@settings(max_examples=200, deadline=None)
@given(stream=_STREAMS, cuts=st.lists(st.integers(min_value=1, max_value=97), max_size=400))
def test_the_tail_reads_what_the_whole_stream_says(stream: bytes, cuts: list[int]) -> None:
    tail = StreamTail()
    start = 0
    for size in [*cuts, len(stream)]:
        if start >= len(stream):
            break
        tail.add(stream[start : start + size])
        start += size
    assert tail.usage() == usage_of(stream, sse=True)
    assert len(tail._last or b"") + len(tail._open) + len(tail._carry) < 400


def test_each_api_s_usage_is_read() -> None:
    cases = {
        _CHAT_USAGE.encode(): {"prompt": 40, "completion": 9, "cached": 16},
        _MESSAGES.encode(): {"prompt": 0, "completion": 31},
        _responses("x").encode(): {"prompt": 50, "completion": 7, "cached": 48},
    }
    for stream, expected in cases.items():
        tail = StreamTail()
        for i in range(0, len(stream), 5):
            tail.add(stream[i : i + 5])
        assert tail.usage() == expected
    empty = StreamTail()
    empty.add(_chat_token(0, "null"))
    assert empty.usage() is None and empty.cached_tokens() is None
