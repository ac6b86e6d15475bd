"""From a parsed request to (prompt token count, router block hashes), off the event loop when long.

The ``tokenizers`` library holds the GIL while it encodes (measured: a worker thread encoding
1.1M characters stalled the event loop for the whole 1.6 s), so a thread pool would not keep the
loop responsive. Prompts longer than ``inline_chars`` are encoded in a small pool of spawned
processes that each load the tokenizer once; the worker returns only the token count and the
block hashes, so what crosses the process boundary is small. Short prompts are encoded inline:
a round trip to another process costs more than encoding them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from simulator.tokenizer import SimpleTokenizer, Tokenizer

from .block_hashing import block_hashes
from .tokenization import BUILTIN, HFTokenizerFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """What routing needs from a prompt: its exact token count and full-block hashes."""

    tokens: int
    hashes: list[int]


def load_tokenizer_spec(spec: str) -> Tokenizer:
    """``"builtin"`` (the emulated replica's own tokenizer) or a HF tokenizer path."""
    if spec == BUILTIN:
        return SimpleTokenizer()
    return HFTokenizerFiles(spec)


def prompt_blocks(
    tokenizer: Tokenizer,
    text: str,
    add_special_tokens: bool,
    block_size: int,
    extra_key: str | None,
) -> PromptBlocks:
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return PromptBlocks(len(ids), block_hashes(ids, block_size, extra_key))


def token_id_blocks(ids: Sequence[int], block_size: int, extra_key: str | None) -> PromptBlocks:
    return PromptBlocks(len(ids), block_hashes(ids, block_size, extra_key))


# -- the worker processes --------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer_spec(spec)


def _encode_in_worker(
    text: str, add_special_tokens: bool, block_size: int, extra_key: str | None
) -> PromptBlocks:
    assert _worker_tokenizer is not None
    return prompt_blocks(_worker_tokenizer, text, add_special_tokens, block_size, extra_key)


class PromptTokenizer:
    """The router's tokenizer: inline for short prompts, a process pool for long ones."""

    def __init__(self, spec: str, inline_chars: int = 4096, processes: int = 1) -> None:
        self.spec = spec
        self.tokenizer = load_tokenizer_spec(spec)
        self.inline_chars = inline_chars
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self.offloaded = 0  # prompts encoded in the pool

    def render_chat(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
        """The chat template applied as vLLM applies it (raises ChatTemplateError)."""
        tok = self.tokenizer
        generation = bool(options.get("add_generation_prompt", True))
        continue_final = bool(options.get("continue_final_message", False))
        if isinstance(tok, HFTokenizerFiles):
            return tok.apply_chat_template(
                messages,
                add_generation_prompt=generation,
                continue_final_message=continue_final,
                tools=options.get("tools"),
                template_kwargs=options.get("chat_template_kwargs"),
            )
        return tok.apply_chat_template(messages, generation, continue_final)

    async def blocks(
        self, text: str, add_special_tokens: bool, block_size: int, extra_key: str | None
    ) -> PromptBlocks:
        if len(text) <= self.inline_chars or self.processes < 1:
            return prompt_blocks(self.tokenizer, text, add_special_tokens, block_size, extra_key)
        pool = self._ensure_pool()
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            pool, _encode_in_worker, text, add_special_tokens, block_size, extra_key
        )

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the router process runs an event loop and threads.
            self._pool = ProcessPoolExecutor(
                max_workers=self.processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.spec,),
            )
        return self._pool

    def start(self) -> None:
        """Start the pool now, so the first long prompt does not wait for it."""
        if self.processes >= 1:
            self._ensure_pool().submit(int)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
