"""Prompt text that reproduces a trace's prefix structure on a real tokenizer (pure).

Each block id maps to a fixed run of words, each a space and three lowercase letters. Words
start with a space, so tokenizers that split before spaces (the built-in one, and the BPE
pre-tokenizers of GPT-2-style vocabularies) never merge across a block boundary: equal id
prefixes give equal token prefixes, and different blocks diverge at their first word. With the
built-in tokenizer every word is exactly one token, so a block is exactly ``tokens_per_block``
tokens; a BPE vocabulary spends one to three tokens per word, so prompts get longer than the
trace says while keeping its structure.

``tokens_per_block`` scales the trace down for small test models (e.g. 512-token Mooncake
blocks as 16 words) and ``max_prompt_tokens`` caps a prompt; a prefix of a prompt is still a
prefix, so both keep what is shared shared.
"""

from __future__ import annotations

import random
import string
from functools import lru_cache

from .model import TraceRequest

_LETTERS = string.ascii_lowercase


@lru_cache(maxsize=65_536)  # bounded: replays of any length hold at most this many blocks
def _block_words(block_id: int, words: int) -> tuple[str, ...]:
    # Int seeds drop their sign, so ids of requests without prefix data (negative) seed by text.
    rng = random.Random(block_id if block_id >= 0 else f"own{block_id}")
    letters = rng.choices(_LETTERS, k=3 * words)
    return tuple(" " + "".join(letters[i : i + 3]) for i in range(0, 3 * words, 3))


class PromptBuilder:
    """Builds the prompt of a trace request, scaled to ``tokens_per_block`` words a block."""

    def __init__(
        self, block_tokens: int, tokens_per_block: int, max_prompt_tokens: int | None = None
    ) -> None:
        if block_tokens < 1 or tokens_per_block < 1:
            raise ValueError("block_tokens and tokens_per_block must be at least 1")
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be at least 1")
        self.block_tokens = block_tokens
        self.tokens_per_block = tokens_per_block
        self.max_prompt_tokens = max_prompt_tokens

    def words(self, request: TraceRequest) -> int:
        """How many words (built-in tokens) the request's prompt gets."""
        scaled = max(1, round(request.input_tokens * self.tokens_per_block / self.block_tokens))
        return min(scaled, self.max_prompt_tokens) if self.max_prompt_tokens else scaled

    def prompt(self, request: TraceRequest, salt: int = 0) -> str:
        """The prompt text: its blocks' words, the last block cut to length.

        A request without block ids gets words of its own (``salt`` keeps two such requests
        apart), as if each block were new.
        """
        remaining = self.words(request)
        ids = request.block_ids or tuple(
            -(salt * 1_000_003 + k) - 1 for k in range(-(-remaining // self.tokens_per_block))
        )
        parts: list[str] = []
        for block_id in ids:
            if remaining <= 0:
                break
            take = min(remaining, self.tokens_per_block)
            parts.extend(_block_words(block_id, self.tokens_per_block)[:take])
            remaining -= take
        if remaining > 0:  # more tokens than the ids cover: text of the request's own
            parts.extend(_block_words(-(salt * 1_000_003) - 10**12, remaining))
        return "".join(parts)
