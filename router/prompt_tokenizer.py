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
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime
from typing import Any

from kvroute.kvcore.tokenizer import (
    PromptBlocks,
    Tokenizer,
    load_tokenizer,
    prompt_blocks,
    render_chat,
)

log = logging.getLogger(__name__)


# -- the worker processes --------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    # Ctrl-C reaches the whole process group: the router shuts its pool down, the workers
    # must not die mid-prompt with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer = load_tokenizer(spec, clock=datetime.now)


def _encode_in_worker(
    text: str, add_special_tokens: bool, block_size: int, extra_key: str | None
) -> PromptBlocks:
    assert _worker_tokenizer is not None
    return prompt_blocks(_worker_tokenizer, text, add_special_tokens, block_size, extra_key)


def _chat_in_worker(
    messages: list[dict[str, Any]],
    options: dict[str, Any],
    add_special_tokens: bool,
    block_size: int,
    extra_key: str | None,
) -> PromptBlocks:
    assert _worker_tokenizer is not None
    text = render_chat(_worker_tokenizer, messages, options)
    return prompt_blocks(_worker_tokenizer, text, add_special_tokens, block_size, extra_key)


class PromptTokenizer:
    """The router's tokenizer: inline for short prompts, a process pool for long ones."""

    def __init__(self, spec: str, inline_chars: int = 4096, processes: int = 1) -> None:
        self.spec = spec
        self.tokenizer = load_tokenizer(spec, clock=datetime.now)
        self.inline_chars = inline_chars
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self.offloaded = 0  # prompts encoded in the pool

    def render_chat(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
        """The chat template applied as vLLM applies it (raises ChatTemplateError)."""
        return render_chat(self.tokenizer, messages, options)

    async def blocks(
        self, text: str, add_special_tokens: bool, block_size: int, extra_key: str | None
    ) -> PromptBlocks | None:
        """A completion prompt's blocks; None when the worker pool broke (it is restarted)."""
        if len(text) <= self.inline_chars or self.processes < 1:
            return prompt_blocks(self.tokenizer, text, add_special_tokens, block_size, extra_key)
        return await self._offload(
            _encode_in_worker, text, add_special_tokens, block_size, extra_key
        )

    async def chat_blocks(
        self,
        messages: list[dict[str, Any]],
        options: dict[str, Any],
        size_chars: int,
        add_special_tokens: bool,
        block_size: int,
        extra_key: str | None,
    ) -> PromptBlocks | None:
        """A chat's blocks: rendering and encoding both leave the loop when it is long."""
        if size_chars <= self.inline_chars or self.processes < 1:
            text = self.render_chat(messages, options)
            return prompt_blocks(self.tokenizer, text, add_special_tokens, block_size, extra_key)
        return await self._offload(
            _chat_in_worker, messages, options, add_special_tokens, block_size, extra_key
        )

    async def _offload(self, fn: Callable[..., PromptBlocks], *args: Any) -> PromptBlocks | None:
        pool = self._ensure_pool()
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool, fn, *args)
        except BrokenProcessPool:
            # A worker died (killed, out of memory): start a new pool for the next prompt and
            # route this one on its estimate.
            log.warning("a tokenizer worker process died; restarting the pool")
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            return None

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
