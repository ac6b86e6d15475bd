"""Parsing OpenAI bodies (router/openai_request.py): the fast path for plain chat histories
counts and refuses exactly as the message-by-message check does."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.errors import ApiError
from kvroute.router.openai_request import (
    _checked_chars,
    _estimate_tokens,
    _plain_chars,
    parse_chat,
)

values = st.one_of(
    st.text(max_size=20),
    st.none(),
    st.integers(-3, 3),
    st.booleans(),
    st.lists(
        st.one_of(
            st.text(max_size=5),
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}),
            st.fixed_dictionaries({"text": st.one_of(st.none(), st.integers())}),
        ),
        max_size=3,
    ),
)
message = st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls"]), values, max_size=4
)
plain_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(st.text(), st.none())}
)


def checked(messages: list[dict[str, Any]]) -> int | str:
    try:
        return _checked_chars(messages, 0)
    except ApiError as exc:
        return str(exc)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(message, plain_message, plain_message), min_size=1, max_size=6))
def test_the_fast_count_is_the_checked_count(messages: list[dict[str, Any]]) -> None:
    fast = _plain_chars(messages)
    if fast is not None:
        assert fast == checked(messages)
    body = json.dumps({"model": "m", "messages": messages}).encode()
    try:
        parsed = parse_chat(body)
    except ApiError as exc:
        assert checked(messages) == str(exc)
        return
    chars = checked(messages)
    assert isinstance(chars, int)
    assert parsed.prompt_tokens == _estimate_tokens(chars) + 4 * len(messages)
