"""The soak's traffic: mixed requests at a fixed rate, and the clients that misbehave.

Normal traffic is an open-loop plan (``kvroute.simulator.loadgen``, the one load generator of
live runs): chat and completions, streamed and not. Chats are multi-turn conversations of a
few tenants, each turn resending the history, so they share prefixes (the tenant's system
prompt, the conversation so far); conversations end and new ones start, and completions carry
a question of their own, so new blocks keep coming and the replicas' caches keep evicting.

The misbehaving clients are faults on their own schedule: a client that hangs up a stream
after a few chunks, and bad input (malformed JSON, a wrong type, an unknown model, a body over
the router's limit) that must get a 4xx answer, never a 5xx.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.simulator.loadgen import Outcome, Planned
from kvroute.simulator.workload import filler

TENANTS = 6
LIVE_CONVERSATIONS = 12  # conversations going on at once; a finished one is replaced
TURNS = 5  # user turns per conversation
SYSTEM_PROMPT_CHARS = 1200  # the tenant's shared prefix, several KV blocks
TURN_CHARS = 600  # a user turn or a scripted reply: new blocks every turn
# KV blocks of 32 tokens a replica needs to take the longest conversation's last turn and its
# answer (a replica refuses a prompt larger than its cache with a 400).
MIN_BLOCKS = 100
MAX_TOKENS = (8, 32)  # answers' lengths, drawn per request
# A hung-up stream: long enough to still be running after CUT_AFTER_CHUNKS chunks.
CUT_MAX_TOKENS = 400
CUT_AFTER_CHUNKS = 3
UNKNOWN_MODEL = "no-such-model"
MAX_ERRORS_KEPT = 10


@dataclass
class Tally:
    """Every request of the soak by outcome, as a client saw it."""

    ok: int = 0  # normal requests answered whole
    rejected: int = 0  # bad input answered 4xx, as it must be
    cut: int = 0  # streams the client hung up on after a few chunks, as planned
    unexpected: int = 0  # anything else: a lost request, a 5xx for bad input, ...
    errors: list[str] = field(default_factory=list)  # the first few unexpected ones
    normal: Counter[str] = field(default_factory=Counter)  # "chat streamed", ... -> sent
    bad_input: Counter[str] = field(default_factory=Counter)  # "malformed JSON -> 400", ...

    def fail(self, what: str) -> None:
        self.unexpected += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(what[:300])

    def on_normal(self, index: int, outcome: Outcome) -> None:
        if outcome.ok:
            self.ok += 1
        else:
            self.fail(f"request {index} at t={outcome.sent_at:.1f}s: {outcome.error}")

    @property
    def total(self) -> int:
        return self.ok + self.rejected + self.cut + self.unexpected


class Conversations:
    """Chat turns of rolling multi-turn conversations (scripted replies, so the plan is fixed)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._prompts = [
            f"You are the assistant of tenant {t}. " + filler(rng, SYSTEM_PROMPT_CHARS)
            for t in range(TENANTS)
        ]
        self._started = 0
        self._live = [self._new() for _ in range(LIVE_CONVERSATIONS)]

    def _new(self) -> list[dict[str, str]]:
        tenant = self._started % TENANTS
        self._started += 1
        return [{"role": "system", "content": self._prompts[tenant]}]

    def next_turn(self) -> list[dict[str, str]]:
        """The messages of some conversation's next turn (a copy: the plan keeps it)."""
        slot = self._rng.randrange(LIVE_CONVERSATIONS)
        history = self._live[slot]
        history.append({"role": "user", "content": filler(self._rng, TURN_CHARS)})
        messages = list(history)
        history.append({"role": "assistant", "content": filler(self._rng, TURN_CHARS)})
        if len(history) >= 1 + 2 * TURNS:
            self._live[slot] = self._new()
        return messages

    def tenant_prompt(self) -> str:
        return self._prompts[self._rng.randrange(TENANTS)]


def normal_plan(
    url: str, model: str, rate: float, duration_s: float, seed: int, tally: Tally
) -> Iterator[Planned]:
    """``rate`` requests a second for ``duration_s``: chat and completions alternate, and each
    kind alternates streamed and not."""
    rng = random.Random(seed)
    chats = Conversations(rng)
    for i in range(int(rate * duration_s)):
        chat = i % 2 == 0
        stream = (i // 2) % 2 == 0
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": rng.randint(*MAX_TOKENS),
            "stream": stream,
        }
        if chat:
            body["messages"] = chats.next_turn()
        else:
            body["prompt"] = chats.tenant_prompt() + " Question: " + filler(rng, TURN_CHARS)
        kind = "chat" if chat else "completions"
        tally.normal[f"{kind}, {'streamed' if stream else 'not streamed'}"] += 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        yield Planned(i / rate, url + path, body)


async def hang_up(
    http: aiohttp.ClientSession, url: str, model: str, prompt: str, tally: Tally
) -> None:
    """A client that reads a few chunks of a long stream, then closes the connection."""
    body = {"model": model, "prompt": prompt, "max_tokens": CUT_MAX_TOKENS, "stream": True}
    chunks = 0
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                tally.fail(f"hang-up stream: HTTP {resp.status}")
                return
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                if chunks == CUT_AFTER_CHUNKS:
                    resp.close()  # closes the connection itself, not back to the pool
                    tally.cut += 1
                    return
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.fail(f"hang-up stream, after {chunks} chunks: {type(exc).__name__}: {exc}")
        return
    tally.fail(f"hang-up stream ended after {chunks} chunks, before the client hung up")


def bad_inputs(model: str, max_body_bytes: int) -> list[tuple[str, str, bytes]]:
    """(what is wrong, path, body) of each kind of bad input the soak sends."""

    def encode(body: dict[str, Any]) -> bytes:
        return json.dumps(body).encode()

    oversized = {"model": model, "prompt": "x" * (max_body_bytes + 1024)}
    return [
        ("malformed JSON", "/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),
        ("wrong type", "/v1/chat/completions", encode({"model": model, "messages": "hi"})),
        ("wrong type", "/v1/completions", encode({"model": model, "prompt": "hi", "max_tokens": "8"})),
        ("unknown model", "/v1/completions", encode({"model": UNKNOWN_MODEL, "prompt": "hi"})),
        ("oversized body", "/v1/completions", encode(oversized)),
    ]  # fmt: skip


async def send_bad(
    http: aiohttp.ClientSession, url: str, bad: tuple[str, str, bytes], tally: Tally
) -> None:
    """Bad input must be answered 4xx (OpenAI's error shape), whatever is wrong with it."""
    what, path, data = bad
    headers = {"Content-Type": "application/json"}
    try:
        async with http.post(url + path, data=data, headers=headers) as resp:
            await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.fail(f"{what}: no answer: {type(exc).__name__}: {exc}")
        return
    tally.bad_input[f"{what} -> {status}"] += 1
    if 400 <= status < 500:
        tally.rejected += 1
    else:
        tally.fail(f"{what}: HTTP {status}, expected 4xx")
