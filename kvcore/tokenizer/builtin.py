"""Tokenizers shared by the emulated replica and the router, so both count the same tokens.

The built-in tokenizer needs no files or packages: words (with their leading whitespace)
are cut into pieces of at most four characters, about one token per four characters as
with real BPE vocabularies, and each piece maps to a stable id by hashing. Decoding
generated ids yields pronounceable filler words. ``hf.HFTokenizerFiles`` reads real tokenizer files,
chat template included, exactly as vLLM does, for replicas that
mimic a real model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import xxhash

BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
_FIRST_ID = 3
_PIECE = 4
_WORDS = re.compile(r"\s*\S+|\s+")
_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]


class SimpleTokenizer:
    """Dependency-free, deterministic, ~4 characters per token."""

    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size <= _FIRST_ID:
            raise ValueError("vocab_size too small")
        self.vocab_size = vocab_size
        # Pieces seen while encoding, so decode(encode(text)) gives the text back.
        self._pieces: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; the built-in tokenizer has no special tokens to add."""
        ids = []
        span = self.vocab_size - _FIRST_ID
        for word in _WORDS.findall(text):
            for start in range(0, len(word), _PIECE):
                piece = word[start : start + _PIECE]
                token = _FIRST_ID + xxhash.xxh32_intdigest(piece.encode()) % span
                if len(self._pieces) < 1_000_000:
                    self._pieces.setdefault(token, piece)
                ids.append(token)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self._pieces.get(t) or self.filler(t) for t in token_ids)

    @staticmethod
    def filler(token_id: int) -> str:
        """A pronounceable word for a generated token id."""
        n = len(_SYLLABLES)
        return " " + _SYLLABLES[token_id % n] + _SYLLABLES[(token_id // n) % n]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
    ) -> str:
        parts = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            parts.append(f"<|{message.get('role', 'user')}|>\n{content or ''}\n")
        if continue_final_message:
            # Leave the final message open for the model to continue (no generation prompt).
            return "".join(parts).rstrip("\n")
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)
