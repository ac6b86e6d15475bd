"""A conversation's next turn parsed from its new messages (router/chat_parse.py): whatever the
earlier turns were, the result and the errors are parse_chat's, and an extended conversation's
earlier messages are the earlier turn's own objects."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.chat_parse import ChatParser
from kvroute.router.errors import ApiError
from kvroute.router.openai_request import ParsedRequest, parse_chat


def outcome(parse: Any, body: bytes) -> ParsedRequest | tuple[int, str, str | None]:
    try:
        return parse(body)
    except ApiError as exc:
        return (exc.status, str(exc), exc.param)


def body(messages: list[Any], **fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **fields}).encode()


def chat(n: int, tag: str = "") -> list[dict[str, Any]]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag}turn {i}"}
        for i in range(n)
    ]


# Messages that are fine, odd (more keys, content parts, null) or wrong (a number as content,
# a missing role, not an object at all).
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": st.sampled_from(["a", "b"])}
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none(), "tool_calls": st.just([])}
    ),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.just([{"type": "text", "text": "c"}])}
    ),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.integers(0, 2)}),
    st.fixed_dictionaries({"content": st.just("d")}),
    st.sampled_from(["text", 3, None, []]),
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.sampled_from([5, -1, "x"]),
        "stream": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
    },
)


@st.composite
def conversations(draw: st.DrawFn) -> list[bytes]:
    """Turns of a few conversations: each turn extends, resends or branches an earlier one's
    messages, and now and then a body is not even JSON."""
    histories: list[list[Any]] = [[]]
    bodies = []
    for _ in range(draw(st.integers(1, 8))):
        base = draw(st.sampled_from(histories))
        keep = draw(st.integers(0, len(base)))
        messages = base[:keep] + draw(st.lists(message, max_size=3))
        histories.append(messages)
        data = body(messages, **draw(fields))
        if draw(st.integers(0, 9)) == 0:
            data = data[: len(data) // 2]
        bodies.append(data)
    return bodies


@settings(max_examples=400, deadline=None)
@given(conversations(), st.sampled_from([1 << 20, 300]))
def test_every_turn_parses_as_parse_chat_parses_it(bodies: list[bytes], budget: int) -> None:
    parser = ChatParser(budget)
    for data in bodies:
        assert outcome(parser, data) == outcome(parse_chat, data)
    assert parser.bytes <= budget


def test_the_next_turn_reuses_the_earlier_messages_objects() -> None:
    parser = ChatParser(1 << 20)
    first = parser(body(chat(5)))
    second = parser(body(chat(7), max_tokens=9))
    assert second == parse_chat(body(chat(7), max_tokens=9))
    assert all(
        a is b for a, b in zip(first.messages or [], (second.messages or [])[:5], strict=True)
    )
    assert (parser.hits, parser.misses) == (1, 1)
    assert parser.turns == 1  # the first turn was superseded by its continuation


def test_an_earlier_message_that_differs_is_not_reused() -> None:
    # The same last message (and count), another history before it: nothing is taken over.
    parser = ChatParser(1 << 20)
    parser(body([*chat(2, "x"), *chat(3)[2:]]))
    parsed = parser(body([*chat(3), {"role": "user", "content": "new"}]))
    assert parsed.messages == [*chat(3), {"role": "user", "content": "new"}]
    assert (parser.hits, parser.misses) == (0, 2)


def test_an_error_in_a_new_message_is_numbered_in_the_whole_conversation() -> None:
    parser = ChatParser(1 << 20)
    parser(body(chat(4)))
    wrong = body([*chat(4), {"role": "user", "content": 7}])
    assert outcome(parser, wrong) == outcome(parse_chat, wrong)
    assert outcome(parser, wrong)[2] == "messages[4].content"  # type: ignore[index]


def test_turns_are_kept_within_the_budget_and_none_when_off() -> None:
    big = [{"role": "user", "content": "x" * 1000}]
    parser = ChatParser(10_000)
    for i in range(20):
        parser(body([*big, {"role": "user", "content": str(i)}]))
        assert parser.bytes <= 10_000
    assert 0 < parser.turns < 20
    off = ChatParser(0)
    assert off(body(chat(3))) == parse_chat(body(chat(3)))
    assert off.turns == 0


def test_a_body_that_is_not_bytes_is_parsed_whole() -> None:
    parser = ChatParser(1 << 20)
    data = bytearray(body(chat(3)))
    assert parser(data) == parse_chat(bytes(data))  # type: ignore[arg-type]
    assert parser.turns == 0  # its raw messages would be views of a buffer that may change
