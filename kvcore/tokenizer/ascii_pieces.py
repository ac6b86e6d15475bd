"""ASCII text encoded by cached pre-tokens: the same ids as the ``tokenizers`` library, faster.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, ...) encodes a text without added tokens in
it as: normalize, split into pre-tokens by a regex, map each pre-token's bytes to characters,
run the BPE model on each pre-token alone, add the post-processor's special tokens. Nothing
crosses a pre-token's edges, so a text's ids are its pre-tokens' ids in a row, and a prompt's
pre-tokens are mostly words seen before. The library spends most of a 1 KB prompt's ~0.15 ms on
bookkeeping a router never reads (offsets, alignments, the Encoding): here the split runs in
Python's ``re`` and each pre-token's ids come from a dict, about 3x faster, and only a
pre-token not seen yet goes to the library's own BPE model (so the merges are its own).

Exact only where the split is: for ASCII text a Unicode property is its ASCII members, and the
regex means the same in Python's ``re`` as in the library's engine (Oniguruma), so only ASCII
texts take this path, and only a pattern made of constructs that mean the same in both is
translated (anything else, and the tokenizer is not served here: see :func:`plan_for`). Added
tokens split a text where they stand, as the library splits it, unless one that takes
whitespace or whole words (lstrip, rstrip, single_word) is in it. A text with non-ASCII
characters or such a token, and every tokenizer of another shape (normalizers that change ASCII,
other pre-tokenizers, BPE dropout, truncation or padding), goes to the library as before.
Tests compare both on random texts.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The pattern of ByteLevel's own split (``use_regex``), as the library writes it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Normalizers that leave ASCII text as it is.
_ASCII_IDENTITY_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
MAX_CACHED_PIECES = 1 << 16  # then the cache starts over (short strings and id lists: 10-20 MB)
MAX_CACHED_PIECE_CHARS = 64  # longer pre-tokens (runs of spaces, blobs) are not kept


def _byte_chars() -> list[str]:
    """ByteLevel's byte -> character table (GPT-2's): printable bytes stand for themselves,
    the others for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# ``str.translate`` table for ASCII text (the only text this path sees).
BYTE_LEVEL_ASCII = {b: c for b, c in enumerate(_byte_chars()[:128])}


# Unicode's general categories and their one-letter groups: the properties translated.
_CATEGORY_NAMES = "L Lu Ll Lt Lm Lo M Mn Mc Me N Nd Nl No P Pc Pd Ps Pe Pi Pf Po S Sm Sc Sk So Z Zs Zl Zp C Cc Cf Cs Co Cn"
_CATEGORIES = frozenset(_CATEGORY_NAMES.split())


def _ascii_members(category: str) -> str | None:
    """The ASCII characters of a Unicode general category (``L``, ``Lu``, ``N``, ...),
    escaped for a class; None for any other property name (a script, a long name)."""
    if category not in _CATEGORIES:
        return None
    members = [chr(c) for c in range(128) if unicodedata.category(chr(c)).startswith(category)]
    return "".join(re.escape(c) for c in members)


# Escapes that mean the same in Oniguruma (Ruby syntax, as the library compiles) and in
# Python's re with re.ASCII, for ASCII subjects.
_SAME_ESCAPES = frozenset("sSdDwWrntfv")
# Anchors and flags differ (Ruby's ``^``/``$`` match at lines, its ``\Z`` before a final
# newline, ``(?m)`` is Python's ``(?s)``): a pattern with any of them is not translated.
_GROUP_OPENERS = ("(?:", "(?i:", "(?=", "(?!")


def translate(pattern: str) -> str | None:
    """``pattern`` in Python's ``re`` for ASCII subjects, or None where a construct might not
    mean the same there (the tokenizer then keeps the library's path)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    class_start = class_out = 0
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                return None
            e = pattern[i + 1]
            if e == "p":
                m = re.match(r"\{([A-Za-z]+)\}", pattern[i + 2 :])
                if m is None:
                    return None
                members = _ascii_members(m.group(1))
                if members is None:
                    return None
                if in_class:
                    out.append(members)
                else:
                    out.append(f"[{members}]" if members else "(?!)")
                i += 2 + m.end()
                continue
            if e in _SAME_ESCAPES or (not e.isalnum() and e.isascii()):
                out.append(c + e)
                i += 2
                continue
            return None  # \P, \A, \Z, \b, \h, \R, back-references, \x.., \u....
        if in_class:
            if c == "]":
                if i == class_start:
                    return None  # ']' first in a class: the engines read it differently
                in_class = False
                if "".join(out[class_out:]) in ("[", "[^"):
                    return None  # a class left empty: Python cannot write it
            elif c == "[" or pattern.startswith("&&", i):
                return None  # nested classes, POSIX brackets, intersections: Ruby's own
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            class_out = len(out)
            out.append(c)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            class_start = i
            continue
        if c in "^$":
            return None
        if c == "(":
            opener = next((g for g in _GROUP_OPENERS if pattern.startswith(g, i)), None)
            if opener is None:
                if pattern.startswith("(?", i):
                    return None  # inline flags, lookbehind, named and atomic groups
                out.append("(?:")  # a capture only groups: findall must see whole matches
                i += 1
                continue
            out.append(opener)
            i += len(opener)
            continue
        out.append(c)
        i += 1
    if in_class:
        return None
    translated = "".join(out)
    try:
        re.compile(translated, re.ASCII)
    except re.error:
        return None
    return translated


@dataclass(frozen=True)
class Plan:
    """How a tokenizer splits ASCII text: regexes applied in turn (each piece of one split by
    the next, matches and what lies between kept), and whether ByteLevel adds a space first."""

    splits: tuple[re.Pattern[str], ...]
    add_prefix_space: bool


def _split_of(spec: Mapping[str, Any]) -> re.Pattern[str] | None:
    kind = spec.get("type")
    if kind != "Split" or spec.get("behavior") != "Isolated" or spec.get("invert"):
        return None
    pattern = spec.get("pattern") or {}
    if "Regex" in pattern:
        translated = translate(str(pattern["Regex"]))
    elif "String" in pattern:
        translated = re.escape(str(pattern["String"]))
    else:
        return None
    return re.compile(translated, re.ASCII) if translated is not None else None


def plan_for(tokenizer_json: Mapping[str, Any]) -> tuple[Plan | None, str]:
    """The split of this ``tokenizer.json`` for ASCII text, or None and why not."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        return None, "not a BPE model"
    if model.get("dropout") not in (None, 0, 0.0):
        return None, "BPE dropout"
    if tokenizer_json.get("truncation") or tokenizer_json.get("padding"):
        return None, "truncation or padding configured"
    normalizer = tokenizer_json.get("normalizer")
    if normalizer is not None:
        parts = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else None
        kinds = [p.get("type") for p in parts] if parts is not None else [normalizer.get("type")]
        if not all(k in _ASCII_IDENTITY_NORMALIZERS for k in kinds):
            return None, "a normalizer that may change ASCII text"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not steps or steps[-1].get("type") != "ByteLevel":
        return None, "not a byte-level pre-tokenizer"
    byte_level = steps[-1]
    splits = []
    for step in steps[:-1]:
        split = _split_of(step)
        if split is None:
            return None, f"a pre-tokenizer step not translated: {step.get('type')}"
        splits.append(split)
    add_prefix_space = bool(byte_level.get("add_prefix_space", False))
    if add_prefix_space and splits:
        # ByteLevel would put a space before every piece the splits made: not done here.
        return None, "a prefix space after a split"
    if byte_level.get("use_regex", True):
        gpt2 = translate(GPT2_PATTERN)
        assert gpt2 is not None
        splits.append(re.compile(gpt2, re.ASCII))
    if not splits:
        return None, "no split: a whole text is one pre-token"
    return Plan(tuple(splits), add_prefix_space), ""


def _isolated(pattern: re.Pattern[str], text: str) -> list[str]:
    """Split ``text`` at ``pattern``'s matches, keeping them and what lies between."""
    found = pattern.findall(text)
    if sum(map(len, found)) == len(text):
        return found  # the matches cover the text (the usual pattern): nothing between
    pieces = []
    at = 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if start == end:
            continue
        if start > at:
            pieces.append(text[at:start])
        pieces.append(m.group())
        at = end
    if at < len(text):
        pieces.append(text[at:])
    return pieces


@dataclass(frozen=True)
class AddedToken:
    """What the encoder needs of one of the tokenizer's added tokens."""

    content: str
    id: int
    raw: bool  # matched on the text as written (not ``normalized``); else after normalizing
    plain: bool  # no lstrip, rstrip or single_word: it splits exactly where it stands


def _alternation(texts: Iterable[str]) -> re.Pattern[str] | None:
    """Leftmost, then longest, as the library's matcher finds them."""
    unique = sorted(set(texts), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, unique))) if unique else None


class AsciiPieceEncoder:
    """Encodes ASCII text by cached pre-tokens (module doc); ``encode`` answers None for a
    text it does not take, which the caller then gives to the library."""

    def __init__(
        self,
        plan: Plan,
        model_ids: Callable[[str], list[int]],
        added: Iterable[AddedToken],
        special_before: Sequence[int],
        special_after: Sequence[int],
    ) -> None:
        self.plan = plan
        self._model_ids = model_ids  # one byte-level-mapped pre-token -> its ids
        self._cache: dict[str, list[int]] = {}
        tokens = [t for t in added if t.content]
        self._added_ids = {t.content: t.id for t in tokens}
        # The library splits a text at its raw added tokens first, then each piece left at
        # the others; a token that takes whitespace or whole words is not followed here.
        self._any_added = _alternation(t.content for t in tokens)
        self._fancy = _alternation(t.content for t in tokens if not t.plain)
        self._raw = _alternation(t.content for t in tokens if t.plain and t.raw)
        self._normal = _alternation(t.content for t in tokens if t.plain and not t.raw)
        self._before = list(special_before)
        self._after = list(special_after)

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        if not text or not text.isascii():
            return None
        ids: list[int] = list(self._before) if add_special_tokens else []
        any_added = self._any_added
        if any_added is None or any_added.search(text) is None:
            self._encode_text(text, ids)
        elif not self._split_at_added(text, ids):
            return None
        if add_special_tokens:
            ids += self._after
        return ids

    def _split_at_added(self, text: str, ids: list[int]) -> bool:
        """``text``'s ids into ``ids``, split at added tokens as the library splits it;
        False (``ids`` then unusable) where a token that is not plain stands in it."""
        if self._fancy is not None and self._fancy.search(text) is not None:
            return False
        added_ids = self._added_ids
        for piece, is_raw in _split_by(self._raw, text):
            if is_raw:
                ids.append(added_ids[piece])
                continue
            for part, is_added in _split_by(self._normal, piece):
                if is_added:
                    ids.append(added_ids[part])
                else:
                    self._encode_text(part, ids)
        return True

    def pretokens(self, text: str) -> list[str] | None:
        """The pre-tokens ``encode(text, False)`` gives ids of, one by one; None for a text it
        does not take or that holds an added token. Each pre-token's ids depend on it alone,
        so two texts whose pre-tokens are the same have the same ids."""
        if not text or not text.isascii():
            return None
        if self._any_added is not None and self._any_added.search(text) is not None:
            return None
        return self._pretokens(text)

    def _pretokens(self, text: str) -> list[str]:
        plan = self.plan
        if plan.add_prefix_space and not text.startswith(" "):
            text = " " + text
        pieces = _isolated(plan.splits[0], text)
        for split in plan.splits[1:]:
            pieces = [p for piece in pieces for p in _isolated(split, piece)]
        return pieces

    def _encode_text(self, text: str, ids: list[int]) -> None:
        """A text with no added token in it: its pre-tokens' ids, cached."""
        pieces = self._pretokens(text)
        cache = self._cache
        get = cache.get
        for piece in pieces:
            found = get(piece)
            if found is None:
                found = self._model_ids(piece.translate(BYTE_LEVEL_ASCII))
                if len(piece) <= MAX_CACHED_PIECE_CHARS:
                    if len(cache) >= MAX_CACHED_PIECES:
                        cache.clear()
                    cache[piece] = found
            ids += found


def _split_by(pattern: re.Pattern[str] | None, text: str) -> Iterable[tuple[str, bool]]:
    """``text`` cut at ``pattern``'s matches: (piece, is a match), empty pieces left out."""
    if pattern is None:
        yield text, False
        return
    at = 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if start > at:
            yield text[at:start], False
        yield m.group(), True
        at = end
    if at < len(text):
        yield text[at:], False


def special_ids_around(
    with_specials: Sequence[int], plain: Sequence[int]
) -> tuple[list[int], list[int]] | None:
    """The post-processor's ids before and after a text's own (``plain`` found inside
    ``with_specials`` once, as a run), or None when they are not simply around it."""
    n = len(plain)
    spots = [
        i
        for i in range(len(with_specials) - n + 1)
        if list(with_specials[i : i + n]) == list(plain)
    ]
    if len(spots) != 1:
        return None
    i = spots[0]
    return list(with_specials[:i]), list(with_specials[i + n :])
