"""Synthetic workloads (pure): deterministic for a seed.

``multi_tenant_chat``: each tenant has a long system prompt shared by all its
conversations; each conversation is several user turns, every turn resending the whole
history, as chat clients do. This is the shape where routing decides the prefix-cache hit
rate: the system prompt is shared across a tenant, and each turn extends the previous one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "policy",
    "cache",
    "token",
    "replica",
    "router",
    "prefix",
    "block",
    "latency",
    "throughput",
    "request",
    "session",
    "tenant",
    "model",
    "serve",
    "engine",
]


@dataclass(frozen=True)
class Conversation:
    tenant: int
    system_prompt: str
    user_turns: tuple[str, ...]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def filler(rng: random.Random, chars: int) -> str:
    """At least ``chars`` characters of common words (message bodies of synthetic chats)."""
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def multi_tenant_chat(
    tenants: int = 8,
    conversations_per_tenant: int = 4,
    turns: int = 4,
    system_prompt_words: int = 1200,
    user_turn_words: int = 40,
    seed: int = 0,
) -> list[Conversation]:
    """Conversations, interleaved across tenants (as they would arrive)."""
    rng = random.Random(seed)
    system_prompts = [
        f"You are the assistant of tenant {t}. " + _text(rng, system_prompt_words)
        for t in range(tenants)
    ]
    per_tenant = [
        [
            Conversation(
                t, system_prompts[t], tuple(_text(rng, user_turn_words) for _ in range(turns))
            )
            for _ in range(conversations_per_tenant)
        ]
        for t in range(tenants)
    ]
    return [per_tenant[t][c] for c in range(conversations_per_tenant) for t in range(tenants)]
