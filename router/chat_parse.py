"""A conversation's next turn parsed from its new messages only.

An agent resends its whole history each turn: hundreds of messages, hundreds of KB of JSON,
of which the last few are new. ``ChatParser`` decodes the body with each message left as raw
JSON (``msgspec.Raw``: about half the work of decoding it), finds the earlier turn whose raw
messages are this one's first ones, byte for byte, and decodes only the messages after them.
The earlier ones are that turn's very objects: they passed its checks (the same bytes), and
the chat-render cache's check that a cached conversation is this one's prefix becomes an
identity check. A body it cannot take this way (a first turn is fine; not bytes, malformed,
a message in error) is parsed by ``parse_chat``, so its result and its errors are the same.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
from xxhash import xxh3_64_intdigest

from .config import RoutingConfig
from .openai_request import ChatFields, ParsedRequest, chat_request, message_chars, parse_chat
from .prompt_tokenizer import PARSE_SHARE
from .tokenizer_cache_metrics import CacheCounts, Counts

# How many messages back from a body's end an earlier turn's last message is looked for (an
# agent's turn adds a reply and a user message, or a few tool calls and results).
LOOKBACK = 64
# Bytes a kept turn holds besides its body: its decoded messages' objects, per message.
PER_MESSAGE_BYTES = 400


class _RawChatBody(ChatFields, kw_only=True):
    messages: list[msgspec.Raw]


_raw_decoder = msgspec.json.Decoder(_RawChatBody)
_message_decoder = msgspec.json.Decoder(dict[str, Any])
_Failed = (msgspec.MsgspecError, RecursionError)
_Key = tuple[int, int]  # (messages, their last one's digest)


@dataclass(slots=True)
class _Turn:
    raws: list[msgspec.Raw]  # views into the turn's body (kept alive by them)
    messages: list[dict[str, Any]]
    chars: int  # the messages' content characters
    size: int  # bytes kept alive, about


class ChatParser:
    """``parse_chat`` that keeps recent turns' messages (LRU, about ``max_bytes``; 0: off).
    Not thread-safe: one event loop calls it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # bodies that took an earlier turn's messages over
        self.misses = 0  # bodies decoded whole (a first turn, or its earlier turn not kept)
        # Found by its key, a match is checked byte for byte.
        self._turns: OrderedDict[_Key, _Turn] = OrderedDict()

    @property
    def turns(self) -> int:
        return len(self._turns)

    def __call__(self, body: bytes) -> ParsedRequest:
        if self.max_bytes <= 0 or type(body) is not bytes:
            return parse_chat(body)  # zero-copy raw messages need an immutable body
        try:
            req = _raw_decoder.decode(body)
        except _Failed:
            return parse_chat(body)  # its 400, exactly
        raws = req.messages
        if not raws:
            return parse_chat(body)
        found, k, found_key = self._longest(raws)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        try:
            fresh = list(map(_message_decoder.decode, raws[k:]))
        except _Failed:
            return parse_chat(body)
        if found is None:
            messages = fresh
            chars = message_chars(fresh)
        else:
            messages = found.messages + fresh
            chars = found.chars + message_chars(fresh, k)
            # The conversation moved on: its earlier turn is superseded.
            self._drop(found_key)
        parsed = chat_request(req, messages, chars)
        n = len(raws)
        self._store((n, xxh3_64_intdigest(raws[-1])), _Turn(raws, messages, chars, _size(body, n)))
        return parsed

    def counts(self) -> Counts:
        """Its lookups and bytes, for tokenizer_cache_metrics (nothing when off)."""
        if self.max_bytes <= 0:
            return {}
        return {"parsed_messages": CacheCounts(self.hits, self.misses, self.bytes, self.max_bytes)}

    def _longest(self, raws: list[msgspec.Raw]) -> tuple[_Turn | None, int, _Key]:
        """The kept turn that is the longest prefix of these messages, its length and key."""
        turns = self._turns
        n = len(raws)
        for k in range(n, max(0, n - LOOKBACK), -1):
            key = (k, xxh3_64_intdigest(raws[k - 1]))
            turn = turns.get(key)
            if turn is not None and turn.raws == raws[:k]:
                turns.move_to_end(key)
                return turn, k, key
        return None, 0, (0, 0)

    def _store(self, key: _Key, turn: _Turn) -> None:
        if turn.size > self.max_bytes:
            return
        self._drop(key)
        self._turns[key] = turn
        self.bytes += turn.size
        while self.bytes > self.max_bytes:
            _, gone = self._turns.popitem(last=False)
            self.bytes -= gone.size

    def _drop(self, key: _Key) -> None:
        gone = self._turns.pop(key, None)
        if gone is not None:
            self.bytes -= gone.size


def chat_parser_for(routing: RoutingConfig) -> ChatParser:
    """The parser for ``kvroute serve`` and ``kvroute epp``, with its share of
    ``routing.tokenizer_cache_mb`` (0: every body decoded whole)."""
    return ChatParser((routing.tokenizer_cache_mb << 20) // PARSE_SHARE)


def _size(body: bytes, messages: int) -> int:
    """The body (its raw messages' buffer), about as much again in decoded strings, and the
    messages' dicts."""
    return 2 * len(body) + PER_MESSAGE_BYTES * messages
