"""Incremental exact tokenization: a long conversation costs only its new turn.

An agent's conversation grows by a few hundred tokens a turn on top of 50-150k, and the
rendered chat template of turn N+1 starts with the rendered text of turn N up to its last
message. Its token ids do too, up to a *cut point*: a place right after a special token
(``</s>``, ``<|im_end|>``, ``<|eot_id|>``...). HF tokenizers split a text at special tokens
first and tokenize the pieces between them independently, so the ids up to a cut point do not
depend on what follows.

``PrefixTokenCache`` keeps, for rendered prefixes that end at cut points, their token ids and
the router hashes of their full blocks, keyed by the prefix's length and an xxh3-128 hash of
its text, bounded in bytes with LRU eviction. For a new text it finds the longest cached
prefix (checking only lengths it holds entries of), tokenizes only the rest, hashes only the
new blocks, and stores the text up to its last cut point for the next turn.

A piece after a cut point is tokenized as ``special + piece`` with the special token's id
dropped, so it is tokenized as it is inside the whole text: behind a special token, never as
the start of the input (SentencePiece-style tokenizers mark the start, ``Metaspace`` with
``prepend_scheme: first``). Special tokens that strip neighbouring whitespace or are normalized
are never cut at. ``check_cuts`` tests a tokenizer on probe texts when the cache is built: one
that does not tokenize at its cut points as the pieces do gets no cache (full tokenization,
and the reason says why). Exactness is property-tested against full tokenization with the
tiny model's tokenizer and real ones (tests/test_incremental_tokenization.py).

A chat template that emits no special token (``role: content`` lines) gets *line cuts*
instead: right after a newline, where the piece after it is tokenized alone. Whether a
tokenizer splits there depends on the text around it (a space before the newline, what starts
the next line), so every line cut is verified on the text it is used in: the ids of a window of
``WINDOW`` characters on each side must be the ids of its two halves (``line_cut_ok``: where
the tokenizer says how it pre-tokenizes, by its pre-tokens, since each has ids of its own); a
cached prefix whose end fails that on the new text is not used, a last cut that fails gives
way to an earlier newline. ``check_line_cuts`` tests the tokenizer on probe lines first (a
SentencePiece-style tokenizer that marks the start of its input fails and gets no cache).

A long uncached part (a conversation's first turn) is cut at the same verified points into
``Chunks`` of about ``CHUNK_CHARS``, which the caller encodes as a batch, on threads if it
likes (the library's batch encoders release the GIL), then joins.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from xxhash import xxh3_128_digest

from kvroute.kvcore.block_hashing import chain_hashes, root_seed

# A prefix shorter than this is not worth an entry (its tokenization is cheap).
MIN_PREFIX_CHARS = 2048
# Line cuts (templates without special tokens): what a cut is after, the ``after_id`` that
# marks a piece tokenized alone, the characters on each side a cut is verified on, and how
# many newlines back from a text's end a last cut is looked for.
LINE = "\n"
ALONE = -2
WINDOW = 256
LINE_TRIES = 8
# A long uncached part is encoded in chunks of about this many characters.
CHUNK_CHARS = 16_384

Encode = Callable[[str], Sequence[int]]  # text -> ids, without special tokens added
# text -> the pre-tokens ``Encode`` gives the ids of one by one (each's ids its own), or None
# where it cannot tell (then a line cut is verified by encoding).
Pretokens = Callable[[str], Sequence[str] | None]
HASH_BYTES = 48  # a 64-bit hash as an int object and a pointer to it
HashKey = tuple[int, str | None]  # (block size, extra key)


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    cached_tokens: int = 0  # tokens taken from the cache instead of tokenized


Pieces = tuple[Sequence[int], Sequence[int]]  # ids up to the last cut point, and after it


@dataclass(slots=True)
class Plan:
    """A text, its longest cached prefix and its last cut point: what is left to tokenize
    (``tokenize_plan``, which may run in another process) before ``commit``."""

    text: str
    start: int  # the cached prefix's end (0: nothing cached)
    after: str  # the special token it ends with ("" at the start)
    after_id: int
    last: int  # the text's last cut point (>= start)
    last_token: str
    last_id: int
    entry: _Entry | None = None
    data: bytes = b""  # the text in UTF-8, for digests of its prefixes (not for tokenize_plan)

    @property
    def uncached_chars(self) -> int:
        return len(self.text) - self.start


def tokenize_plan(encode: Encode, plan: Plan) -> Pieces:
    """The ids of the plan's text from its cached prefix to its last cut point, and after it."""
    text = plan.text
    if not plan.last_token:  # no special token in the text: nothing cached, nothing to cut
        return [], encode(text)
    mid = encode_piece(encode, text, plan.start, plan.last, plan.after, plan.after_id)
    return mid, encode_piece(encode, text, plan.last, len(text), plan.last_token, plan.last_id)


@dataclass(slots=True)
class _Entry:
    length: int  # of the prefix, in characters
    # The prefix's token ids are ids[:count] ('I'): the next turn of the conversation appends
    # its own to the same array (no copy of the history), a branch copies.
    ids: array[int]
    count: int
    after: str  # the special token it ends with
    # Router hashes of its full blocks, per (block size, extra key): tuples of the same int
    # objects as the next turn's (a tuple of ints is no garbage collector's work).
    hashes: dict[HashKey, tuple[int, ...]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Bytes it may keep alive: its ids, and its hashes as ints and pointers."""
        return 4 * self.count + sum(HASH_BYTES * len(h) for h in self.hashes.values())


class PrefixTokenCache:
    def __init__(
        self,
        encode: Encode,
        split_tokens: dict[str, int],
        max_bytes: int,
        min_prefix_chars: int = MIN_PREFIX_CHARS,
        *,
        line_cuts: bool = False,
        pretokens: Pretokens | None = None,
    ) -> None:
        self._encode = encode
        self._pretokens = pretokens
        self._split = dict(split_tokens)
        # Verified line cuts instead of special tokens (a template that emits none).
        self.line_cuts = line_cuts and not self._split
        self.max_bytes = max_bytes
        self.min_prefix_chars = min_prefix_chars
        self._entries: OrderedDict[tuple[int, bytes], _Entry] = OrderedDict()
        self._lengths: dict[int, int] = {}  # prefix length -> entries of that length
        self.bytes = 0
        self.stats = CacheStats()

    @property
    def entries(self) -> int:
        return len(self._entries)

    def plan(self, text: str) -> Plan:
        """Where ``text``'s cached prefix ends and what is left to tokenize (no tokenization:
        a hash of the text up to each cached length that is one of its cut points)."""
        data = _utf8(text)
        start, entry = self._longest_cached(text, data)
        last, last_token = self._last_cut(text, start)
        after = entry.after if entry is not None else ""
        if last == start:
            last_token = after
        return Plan(
            text,
            start,
            after,
            self._id(after),
            last,
            last_token,
            self._id(last_token),
            entry,
            data,
        )

    def _id(self, token: str) -> int:
        return ALONE if token == LINE and self.line_cuts else self._split.get(token, -1)

    def chunks(self, plan: Plan, chunk_chars: int = CHUNK_CHARS) -> Chunks:
        """The plan's uncached text cut into chunks of about ``chunk_chars`` at cut points
        (verified line cuts, or special tokens), to encode as a batch: ``Chunks.join`` gives
        what ``tokenize_plan`` gives."""
        text, start, last = plan.text, plan.start, plan.last
        if not plan.last_token:  # no cut point: one piece, the tail
            return Chunks([text], [-1], 0)
        bounds = [(start, plan.after, plan.after_id)]
        target = start + chunk_chars
        while target < last - chunk_chars // 4:
            cut = self._cut_after(text, target, last)
            if cut is None:
                break
            bounds.append(cut)
            target = cut[0] + chunk_chars
        bounds.append((last, plan.last_token, plan.last_id))
        texts, drop = [], []
        ends = [b for b, _, _ in bounds[1:]] + [len(text)]
        for (a, after, after_id), b in zip(bounds, ends, strict=True):
            if after_id >= 0:  # behind its special token, whose id is dropped
                texts.append(after + text[a:b])
                drop.append(after_id)
            else:  # alone, or from the start of the text
                texts.append(text[a:b] if after else text[:b])
                drop.append(-1)
        return Chunks(texts, drop, len(texts) - 1)

    def _cut_after(self, text: str, at: int, below: int) -> tuple[int, str, int] | None:
        """The first cut point at or after ``at`` and before ``below``, or None."""
        if self.line_cuts:
            for _ in range(LINE_TRIES):
                found = text.find(LINE, at, below - 1)
                if found < 0:
                    return None
                at = found + 1
                if line_cut_ok(self._encode, text, at, pretokens=self._pretokens):
                    return at, LINE, ALONE
            return None
        best: tuple[int, str, int] | None = None
        for token, token_id in self._split.items():
            found = text.find(token, at, below)
            end = found + len(token)
            if found >= 0 and end < below and (best is None or end < best[0]):
                best = (end, token, token_id)
        return best

    def commit(
        self, plan: Plan, pieces: Pieces, block_size: int, extra_key: str | None
    ) -> tuple[int, list[int]]:
        """The plan's text's token count and the router hashes of its full blocks, from the
        pieces ``tokenize_plan`` gave; its prefix up to the last cut point is stored."""
        count, hashes, _ = self.commit_ids(plan, pieces, block_size, extra_key, keep_ids=False)
        return count, hashes

    def commit_ids(
        self,
        plan: Plan,
        pieces: Pieces,
        block_size: int,
        extra_key: str | None,
        keep_ids: bool = True,
    ) -> tuple[int, list[int], array[int] | None]:
        """``commit``, and the text's whole ids when ``keep_ids`` (a copy: the cache's array
        grows in place with later turns)."""
        mid, tail = pieces
        entry = plan.entry
        ids, count = _extended(plan, mid)
        whole = None
        if keep_ids:
            whole = ids[:count]
            whole.extend(tail)
        key = (block_size, extra_key)
        known = entry.hashes.get(key) if entry is not None else None
        hashes = _hashes(ids, count, tail, block_size, extra_key, known)
        blocks = count // block_size
        if known is not None:
            full = known + tuple(hashes[len(known) : blocks])
        else:
            full = tuple(hashes[:blocks])
        if self._worth_storing(plan):
            self._store(plan, _Entry(plan.last, ids, count, plan.last_token, {key: full}))
        elif entry is not None and known is None:
            self._add_hashes(entry, key, full)
        return count + len(tail), hashes, whole

    def encode(self, text: str) -> list[int]:
        """``text``'s ids (no special tokens added), as full tokenization gives them."""
        plan = self.plan(text)
        mid, tail = tokenize_plan(self._encode, plan)
        ids, count = _extended(plan, mid)
        if self._worth_storing(plan):
            self._store(plan, _Entry(plan.last, ids, count, plan.last_token))
        out = ids[:count].tolist()
        out.extend(tail)
        return out

    def blocks(self, text: str, block_size: int, extra_key: str | None) -> tuple[int, list[int]]:
        """``text``'s token count and the router hashes of its full blocks, exactly as
        ``block_hashes(full tokenization, block_size, extra_key)`` gives them."""
        plan = self.plan(text)
        return self.commit(plan, tokenize_plan(self._encode, plan), block_size, extra_key)

    # -- lookups ----------------------------------------------------------------------

    def _longest_cached(self, text: str, data: bytes) -> tuple[int, _Entry | None]:
        """The longest cached prefix of ``text`` that ends at one of its cut points.

        Walks the text's cut points from its end (the previous turn's is a few messages back),
        hashing the prefix only where an entry of that length exists; each special token's
        occurrences are searched once, so a miss costs one pass over the text.
        """
        lengths = self._lengths
        if len(text) >= self.min_prefix_chars and lengths:
            shortest = min(lengths)
            for end in self._cuts_from_end(text, shortest):
                if end not in lengths:
                    continue
                key = (end, _digest(text, data, end))
                entry = self._entries.get(key)
                if entry is not None and (
                    not self.line_cuts
                    or line_cut_ok(self._encode, text, end, pretokens=self._pretokens)
                ):
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    self.stats.cached_tokens += entry.count
                    return end, entry
        self.stats.misses += 1
        return 0, None

    def _cuts_from_end(self, text: str, lowest: int) -> Iterator[int]:
        """The text's cut points, last first, down to ``lowest``."""
        if self.line_cuts:  # after each newline, unverified
            at = text.rfind(LINE)
            while at >= 0 and at + 1 >= lowest:
                yield at + 1
                at = text.rfind(LINE, 0, at)
            return
        start = max(0, lowest - max(map(len, self._split)))
        nxt = {t: text.rfind(t, start) for t in self._split}  # each token's last occurrence
        while True:
            token = max(nxt, key=lambda t: (nxt[t] + len(t) if nxt[t] >= 0 else -1, len(t)))
            at = nxt[token]
            end = at + len(token)
            if at < 0 or end < lowest:
                return
            yield end
            nxt[token] = text.rfind(token, 0, end - 1)

    def _last_cut(self, text: str, start: int) -> tuple[int, str]:
        """The end of the text's last special token at or after ``start`` (a cut point), and
        that token; (start, "") when there is none after ``start``. Line cuts: the last
        newline after ``start`` (of the last few) where the tokenizer splits this text."""
        if self.line_cuts:
            at = len(text)
            for _ in range(LINE_TRIES):
                at = text.rfind(LINE, start, at)
                if at < 0:
                    break
                if line_cut_ok(self._encode, text, at + 1, pretokens=self._pretokens):
                    return at + 1, LINE
            return start, ""
        best, best_token = start, ""
        for token in self._split:
            at = text.rfind(token, max(0, start - len(token)))
            end = at + len(token)
            if at >= 0 and (end > best or (end == best and len(token) > len(best_token))):
                best, best_token = end, token
        return best, best_token

    # -- storage ----------------------------------------------------------------------

    def _worth_storing(self, plan: Plan) -> bool:
        """The text reaches a cut point past its cached prefix, far enough in to keep."""
        return plan.last > plan.start and plan.last >= self.min_prefix_chars

    def _store(self, plan: Plan, entry: _Entry) -> None:
        size = entry.size
        if size > self.max_bytes:
            return
        key = (entry.length, _digest(plan.text, plan.data or _utf8(plan.text), entry.length))
        old = self._entries.pop(key, None)
        if old is not None:
            self._forget(old)
        self._entries[key] = entry
        self._lengths[entry.length] = self._lengths.get(entry.length, 0) + 1
        self.bytes += size
        self.stats.stored += 1
        self._evict()

    def _add_hashes(self, entry: _Entry, key: HashKey, hashes: tuple[int, ...]) -> None:
        entry.hashes[key] = hashes
        self.bytes += HASH_BYTES * len(hashes)
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            _, gone = self._entries.popitem(last=False)
            self._forget(gone)
            self.stats.evicted += 1

    def _forget(self, entry: _Entry) -> None:
        self.bytes -= entry.size
        if self._lengths[entry.length] == 1:
            del self._lengths[entry.length]
        else:
            self._lengths[entry.length] -= 1


def _extended(plan: Plan, mid: Sequence[int]) -> tuple[array[int], int]:
    """The ids up to the plan's last cut point (the cached prefix's, then ``mid``), as an
    array and how many of its ids they are: the cached prefix's array extended in place
    when no other turn has extended it yet (its entry still reads only its own count)."""
    entry = plan.entry
    if entry is None:
        return array("I", mid), len(mid)
    ids, count = entry.ids, entry.count
    if not len(mid):
        return ids, count
    if len(ids) != count:  # a turn that branched off this prefix
        ids = ids[:count]
    ids.extend(mid)
    return ids, count + len(mid)


def _hashes(
    ids: array[int],
    count: int,
    tail: Sequence[int],
    block_size: int,
    extra_key: str | None,
    known: tuple[int, ...] | None,
) -> list[int]:
    """Router hashes of the full blocks of ``ids[:count] + tail``; ``known`` are those of
    its first blocks."""
    done = list(known) if known is not None else []
    rest = ids[len(done) * block_size : count].tolist()
    rest.extend(tail)
    parent = done[-1] if done else root_seed(extra_key)
    done.extend(chain_hashes(rest, block_size, parent))
    return done


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _digest(text: str, data: bytes, length: int) -> bytes:
    """xxh3-128 of ``text[:length]`` in UTF-8, read in place from ``data`` (the whole text's
    UTF-8): slicing and encoding a 300 KB prefix per lookup cost more than the hash."""
    # ASCII: a character is a byte; else only the (short) rest is encoded again to find the
    # prefix's byte offset.
    ascii_only = len(data) == len(text)
    end = length if ascii_only else len(data) - len(_utf8(text[length:]))
    return xxh3_128_digest(memoryview(data)[:end])


def encode_piece(
    encode: Encode, text: str, start: int, end: int, after: str, after_id: int
) -> Sequence[int]:
    """``text[start:end]`` tokenized as it is inside ``text``: behind the special token
    ``after`` (id ``after_id``) that ends at ``start``, or from the start (``after`` "")."""
    if not after:
        return encode(text[:end])
    if start == end:
        return []
    if after_id == ALONE:  # a verified line cut: the piece is tokenized alone
        return encode(text[start:end])
    ids = encode(after + text[start:end])
    if not ids or ids[0] != after_id:
        raise AssertionError(f"special token {after!r} was not tokenized alone")
    return ids[1:]


# Probe texts for check_cuts: what comes after a special token in chat templates.
_PROBES = (
    "\n",
    "\nuser\nHello, world!",
    " leading space",
    "  two spaces\n\n",
    "assistant\n<think>\n\n</think>\n\nOK",
    "日本語のテキスト 😀",
    "x",
    "\t tab",
)


def check_cuts(encode: Encode, split_tokens: dict[str, int]) -> str | None:
    """Why tokenizing at these special tokens would differ from whole texts, or None.

    For each token and probe texts before and after it: the whole text's ids must be the ids
    of the part before it (ending with it) followed by those of the part after it tokenized
    behind it.
    """
    for token, token_id in split_tokens.items():
        for before in ("Hi", "a b\n", "xxx"):
            for after in _PROBES:
                whole = list(encode(before + token + after))
                head = list(encode(before + token))
                tail = list(encode(token + after))
                if not tail or tail[0] != token_id or whole != head + tail[1:]:
                    return (
                        f"{token!r} does not split texts: "
                        f"{before + token + after!r} tokenizes differently as a whole"
                    )
    return None


def line_cut_ok(
    encode: Encode,
    text: str,
    at: int,
    window: int = WINDOW,
    *,
    pretokens: Pretokens | None = None,
) -> bool:
    """Whether the tokenizer splits ``text`` at ``at``: the ids of up to ``window``
    characters on each side are the ids of the part before it then those of the part after.
    With ``pretokens``, a cut whose halves' pre-tokens are the whole's is accepted without
    encoding: each pre-token's ids are its own, so equal pre-tokens give equal ids. Otherwise
    the ids decide (" \n" is one pre-token at a text's end and two before a word, with the
    same ids)."""
    left = text[max(0, at - window) : at]
    right = text[at : at + window]
    if not left or not right:
        return True
    if pretokens is not None:
        whole = pretokens(left + right)
        if whole is not None and list(whole) == [
            *(pretokens(left) or ()),
            *(pretokens(right) or ()),
        ]:
            return True
    return list(encode(left + right)) == [*encode(left), *encode(right)]


# Probe lines for check_line_cuts: how plain templates' messages end and start.
_LINE_ENDS = ("Hi", "a b.", "x = [1, 2]", "日本語", "end 42")
_LINE_STARTS = ("user: Hello", "assistant: ok", "System: be brief", "x", "Tool 1: done", "😀 hi")


def check_line_cuts(encode: Encode) -> str | None:
    """Why cutting after newlines would differ from whole texts for this tokenizer, or None."""
    for before in _LINE_ENDS:
        for after in _LINE_STARTS:
            text = before + LINE + after
            if not line_cut_ok(encode, text, len(before) + 1):
                return f"it does not split lines: {text!r} tokenizes differently as a whole"
    return None


@dataclass(slots=True)
class Chunks:
    """A plan's uncached text in pieces to encode as a batch (``PrefixTokenCache.chunks``)."""

    texts: list[str]
    drop: list[int]  # the special token id each text's ids start with (dropped), or -1
    tail: int  # the chunk after the text's last cut point (the rest are its middle)

    def join(self, encoded: Sequence[Sequence[int]]) -> Pieces | None:
        """The pieces ``tokenize_plan`` gives, from each chunk's ids; None if a chunk did
        not start with its special token (then tokenize the plan as a whole)."""
        mid: list[int] = []
        for i, (ids, first) in enumerate(zip(encoded, self.drop, strict=True)):
            if first >= 0:
                if not len(ids) or ids[0] != first:
                    return None
                ids = ids[1:]
            if i == self.tail:
                return mid, list(ids)
            mid.extend(ids)
        return None


def prefix_cache_for(
    split_tokens: dict[str, int],
    encode: Encode,
    max_bytes: int,
    *,
    line_cuts: bool = False,
    pretokens: Pretokens | None = None,
) -> tuple[PrefixTokenCache | None, str]:
    """A cache for a tokenizer, or None and why not (its special tokens do not split texts).
    ``line_cuts``: its chat template emits no special token; cut after newlines instead."""
    if not split_tokens:
        if not line_cuts:
            return None, "its chat template emits no special token to cut at"
        problem = check_line_cuts(encode)
        if problem is not None:
            return None, problem
        return PrefixTokenCache(encode, {}, max_bytes, line_cuts=True, pretokens=pretokens), ""
    problem = check_cuts(encode, split_tokens)
    if problem is not None:
        return None, problem
    return PrefixTokenCache(encode, split_tokens, max_bytes), ""
