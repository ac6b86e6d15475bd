"""Incremental chat-template rendering (kvcore/tokenizer/chat_render.py) gives exactly the whole
rendering.

Generated conversations that grow, branch, repeat and change their render context, through
templates that are separable (their bodies are reused) and templates that are not (loop
variables, the first message read outside the loop, namespaces, the clock, a top-level set):
every rendering with the cache is compared with the same tokenizer's rendering without one.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.backends.launcher import ensure_tiny_model
from kvroute.kvcore.tokenizer import ChatTemplateError, HFTokenizerFiles, render_chat
from kvroute.kvcore.tokenizer.chat_render import END, START

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Separable, with what real templates do in their loop: locals, inner loops over tool calls
# (their own loop variable), filters, tests, raise_exception, context names.
RICH = """{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}
{%- for message in messages %}
  {%- set content = message['content'] if message['content'] is string else '' %}
  {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('bad role ' + message['role']) }}
  {%- endif %}
  {{- '<|' + message['role'] + '|>' + (message.name ~ ': ' if message.name is defined else '') }}
  {{- content | trim }}
  {%- if message.tool_calls is defined and message.tool_calls %}
    {%- for call in message.tool_calls %}
      {{- '[' ~ loop.index ~ ']' ~ call.function.name ~ (call.function.arguments | tojson) }}
      {%- if not loop.last %},{% endif %}
    {%- endfor %}
  {%- endif %}
  {{- eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined %}think={{ enable_thinking }}{% endif %}{% endif %}"""
# Not separable: each reads the conversation other than message by message.
NOT_SEPARABLE = {
    "loop.last": (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if loop.last and add_generation_prompt %}<gen>{% endif %}\n{% endfor %}"
    ),
    "loop.index": "{% for m in messages %}{{ loop.index }}. {{ m.content }}\n{% endfor %}",
    "messages[0]": (
        "{% if messages[0].role == 'system' %}[{{ messages[0].content }}]{% endif %}"
        "{% for m in messages %}{{ m.content }}|{% endfor %}"
    ),
    "system moved to the last user turn": (
        "{% set ns = namespace(system='') %}{% for m in messages %}"
        "{% if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m.role != 'system' %}{{ m.content }}"
        "{% if m.role == 'user' %}{{ ns.system }}{% endif %}|{% endif %}{% endfor %}"
    ),
    "namespace in the body": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ m.content }}{% endfor %}"
    ),
    "top-level set read in the body": (
        "{% set sep = '|' %}{% for m in messages %}{{ m.content }}{{ sep }}{% endfor %}"
    ),
    "clock in the body": "{% for m in messages %}{{ strftime_now('%Y') }}{{ m.content }}{% endfor %}",
    "break": "{% for m in messages %}{% if m.content == 'stop' %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "joiner": "{% set j = joiner(',') %}{% for m in messages %}{{ j() }}{{ m.content }}{% endfor %}",
    "messages filtered": (
        "{% for m in messages if m.role != 'system' %}{{ m.content }}|{% endfor %}"
    ),
    "length": "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
}


def tokenizer_with(template: str, directory: Path, cache_bytes: int | None) -> HFTokenizerFiles:
    """The tiny model's tokenizer with another chat template; a render cache when asked."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny = ensure_tiny_model()
    shutil.copy(tiny / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizerFiles(directory, clock=datetime.now)
    if cache_bytes is not None:
        tok.enable_render_cache(cache_bytes)
    return tok


@pytest.fixture(scope="module")
def rich_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[HFTokenizerFiles, HFTokenizerFiles]:
    """RICH with a render cache (shared by every example: one cache, many conversations)
    and without."""
    directory = tmp_path_factory.mktemp("rich")
    return tokenizer_with(RICH, directory / "a", 1 << 30), tokenizer_with(
        RICH, directory / "b", None
    )


def tiny_pair() -> tuple[HFTokenizerFiles, HFTokenizerFiles]:
    cached = HFTokenizerFiles(ensure_tiny_model(), clock=datetime.now)
    assert cached.enable_render_cache(1 << 30) == ""
    return cached, HFTokenizerFiles(ensure_tiny_model(), clock=datetime.now)


def same(cached: HFTokenizerFiles, whole: HFTokenizerFiles, messages: Any, options: Any) -> str:
    """Both render alike (or raise alike); the rendering."""
    try:
        expected = render_chat(whole, messages, options)
    except ChatTemplateError as exc:
        with pytest.raises(ChatTemplateError) as got:
            render_chat(cached, messages, options)
        assert str(got.value) == str(exc)
        return ""
    assert render_chat(cached, messages, options) == expected
    return expected


WORDS = ["hello", " world", "\n", "  ", "</s>", "<|user|>", "日本語", "😀", "x", "\t", START]
contents = st.lists(st.sampled_from(WORDS), max_size=10).map("".join)
roles = st.sampled_from(["system", "user", "assistant", "user", "assistant", "bogus"])
plain = st.builds(lambda r, c: {"role": r, "content": c}, roles, contents)
unusual = st.one_of(
    st.builds(lambda c: {"content": c, "role": "user"}, contents),  # keys in the other order
    st.builds(lambda c, n: {"role": "user", "content": c, "name": n}, contents, contents),
    st.builds(lambda: {"role": "assistant", "content": None}),
    st.builds(
        lambda n, a: {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": n, "arguments": a}}],
        },
        contents,
        st.sampled_from(['{"a": 1}', '{"a": 1.0}', '{"a": true}', "[]", ""]),
    ),
    st.builds(lambda c: {"role": "user", "content": [{"type": "text", "text": c}]}, contents),
)
message = st.one_of(plain, plain, plain, unusual)
options = st.fixed_dictionaries(
    {},
    optional={
        "add_generation_prompt": st.booleans(),
        "tools": st.sampled_from([None, [{"type": "function", "function": {"name": "f"}}]]),
        "chat_template_kwargs": st.sampled_from([None, {"enable_thinking": False}, {"x": 1}]),
        "reasoning_effort": st.sampled_from([None, "low", "none"]),
    },
)


@settings(max_examples=400, deadline=None)
@given(
    turns=st.lists(st.lists(message, min_size=1, max_size=4), min_size=1, max_size=6),
    branch=st.integers(0, 5),
    opts=st.lists(options, min_size=1, max_size=3),
)
def test_growing_branching_conversations_render_exactly(
    rich_pair: tuple[HFTokenizerFiles, HFTokenizerFiles],
    turns: list[list[dict[str, Any]]],
    branch: int,
    opts: list[dict[str, Any]],
) -> None:
    for cached, whole in (tiny_pair(), rich_pair):
        conversation: list[dict[str, Any]] = []
        history = []
        for i, turn in enumerate(turns):
            conversation += turn
            history.append(list(conversation))
            same(cached, whole, conversation, opts[i % len(opts)])
            same(cached, whole, list(conversation), opts[i % len(opts)])  # again, same turn
        back = list(history[branch % len(history)])
        same(cached, whole, back, opts[0])
        back.append({"role": "user", "content": "another way"})
        same(cached, whole, back, opts[-1])


def test_an_agent_conversation_renders_only_its_new_messages() -> None:
    cached, whole = tiny_pair()
    rng = random.Random(7)
    conversation = [{"role": "system", "content": "s" * 5000}]
    for _ in range(30):
        conversation.append({"role": "user", "content": f"question {rng.random()}"})
        # A fresh copy of every message each turn, as a request's parse gives them.
        copy = json.loads(json.dumps(conversation))
        same(cached, whole, copy, {"add_generation_prompt": True})
        conversation.append({"role": "assistant", "content": f"answer {rng.random()}"})
    cache = cached.render_cache
    assert cache is not None
    assert (cache.stats.misses, cache.stats.hits) == (1, 29)
    # Each turn reused every message but its last two, and left one entry behind.
    assert cache.stats.reused_messages == sum(2 * t for t in range(1, 30))
    assert cache.entries == 1


def test_a_message_that_looks_alike_but_differs_is_rendered_anew(tmp_path: Path) -> None:
    """1, 1.0 and true are equal in Python and render differently (a tool call's arguments
    reach the template as they came); key order matters to a template that iterates items."""
    template = (
        "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v | tojson }};"
        "{% endfor %}|{% endfor %}"
    )
    cached = tokenizer_with(template, tmp_path / "a", 1 << 30)
    whole = tokenizer_with(template, tmp_path / "b", None)
    seen = set()
    for value in (1, 1.0, True, "1", 1, True):
        call = {"function": {"name": "f", "arguments": {"a": value}}}
        conversation = [
            {"role": "assistant", "content": "a", "tool_calls": [call]},
            {"role": "user", "content": "b"},
        ]
        seen.add(same(cached, whole, conversation, {}))
    assert len(seen) == 4
    for first in ({"role": "user", "content": "a"}, {"content": "a", "role": "user"}):
        same(cached, whole, [first, {"role": "user", "content": "b"}], {})


def test_marker_text_in_a_message_falls_back_to_the_whole_rendering() -> None:
    cached, whole = tiny_pair()
    for text in (START, END, START + END, END + START):
        same(cached, whole, [{"role": "user", "content": text}], {})
    cache = cached.render_cache
    assert cache is not None
    assert cache.stats.split_failures == 4


@pytest.mark.parametrize("name", sorted(NOT_SEPARABLE))
def test_templates_that_are_not_separable_render_whole(name: str, tmp_path: Path) -> None:
    template = NOT_SEPARABLE[name]
    cached = tokenizer_with(template, tmp_path / "a", None)
    assert cached.enable_render_cache(1 << 20) != ""  # refused, with the reason
    assert cached.render_cache is None
    whole = tokenizer_with(template, tmp_path / "b", None)
    rng = random.Random(name)
    conversation: list[dict[str, Any]] = []
    for _ in range(6):
        conversation.append({"role": rng.choice(["system", "user"]), "content": str(rng.random())})
        same(cached, whole, conversation, {"add_generation_prompt": True})


@pytest.mark.parametrize("template", [CHATML, RICH])
def test_separable_templates_are_recognised(template: str, tmp_path: Path) -> None:
    tok = tokenizer_with(template, tmp_path, None)
    assert tok.enable_render_cache(1 << 20) == ""


def test_continue_final_message_and_developer_roles_render_exactly() -> None:
    cached, whole = tiny_pair()
    base = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    same(cached, whole, base, {})
    tail = [*base, {"role": "assistant", "content": "partial"}]
    opts = {"add_generation_prompt": False, "continue_final_message": True}
    same(cached, whole, tail, opts)
    same(cached, whole, [*tail, {"role": "developer", "content": "dev"}], {})
    same(cached, whole, [{"role": "developer", "content": "dev"}, *base], {})


def test_the_cache_stays_within_its_bytes() -> None:
    tok = HFTokenizerFiles(ensure_tiny_model(), clock=datetime.now)
    assert tok.enable_render_cache(200_000) == ""
    cache = tok.render_cache
    assert cache is not None
    make: Callable[[int], list[dict[str, Any]]] = lambda i: [  # noqa: E731
        {"role": "user", "content": f"{i} " + "x" * 20_000}
    ]
    for i in range(40):
        render_chat(tok, make(i), {})
        assert cache.bytes <= cache.max_bytes
    assert 0 < cache.entries < 40
