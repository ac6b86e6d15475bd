"""From a parsed request to (prompt token count, router block hashes), off the event loop when long.

The ``tokenizers`` library holds the GIL while it encodes (measured: a worker thread encoding
1.1M characters stalled the event loop for the whole 1.6 s), so a thread pool would not keep the
loop responsive. Prompts longer than ``inline_chars`` are encoded in a small pool of spawned
processes that each load the tokenizer once; the worker returns only the token count and the
block hashes, so what crosses the process boundary is small. Short prompts are encoded inline:
a round trip to another process costs more than encoding them.

A long conversation seen for the first time (and cached by kvcore incremental) is the
exception: it is cut into chunks at verified cut points and encoded in this process, no copy
of the text and ids crossing to another one. With ``THREADS_OVER_ASCII`` cores or more, by the
library's batch encoder (which does release the GIL) on a thread per core: its wall time falls
with cores. With fewer, and a tokenizer served by the ASCII pre-token path (ascii_pieces.py,
about 3x the library's speed on one core), chunk by chunk on the event loop, which runs other
requests between chunks (~1 ms each): measured on a 2-core box, threads gained nothing there.
With fewer cores and no ASCII path, the pool encodes it whole, as for any long prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import signal
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime
from typing import Any, TypeVar

from kvroute.kvcore.agent_apis import needs_system_first
from kvroute.kvcore.tokenizer import (
    HFTokenizerFiles,
    PromptBlocks,
    Tokenizer,
    load_tokenizer,
    prompt_blocks,
    render_chat,
)
from kvroute.kvcore.tokenizer.incremental import (
    Chunks,
    Pieces,
    Plan,
    PrefixTokenCache,
    prefix_cache_for,
    tokenize_plan,
)
from kvroute.router.malloc_tuning import tune_malloc
from kvroute.router.tokenizer_cache_metrics import CacheCounts, Counts

log = logging.getLogger(__name__)

# The most /ready waits for the tokenizer pool's first worker (PromptTokenizer.warming).
WARM_MAX_S = 60.0

T = TypeVar("T")

# ``routing.tokenizer_cache_mb``, shared: 1/RENDER_SHARE keeps rendered chat templates (kvcore
# chat_render), 1/PARSE_SHARE parsed request bodies (router chat_parse), the rest token ids.
# Thirds: a 225 KB conversation's latest turn takes about 0.5 MB in each (measured: ids 0.47,
# rendering 0.45, parsed 0.53), so each holds about as many conversations as the others.
RENDER_SHARE = 3
PARSE_SHARE = 3


PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"

# Cores from which a new conversation's chunks go to threads (the library's encoder) rather
# than the ASCII path on the loop: ascii_pieces does about 3 cores' worth of the library.
THREADS_OVER_ASCII = 4


def serial_tokenizers() -> bool:
    """Have the ``tokenizers`` library encode batches on the calling thread, unless the
    environment says otherwise; True if it does. The router encodes one prompt at a time: a
    thread pool would only hand each one to another thread and wait (and fork warnings, as
    the launched vLLM replicas are spared them: backends/vllm_args.py)."""
    os.environ.setdefault(PARALLELISM_ENV, "false")
    return os.environ[PARALLELISM_ENV].strip().lower() in _OFF


_OFF = frozenset(("", "off", "false", "f", "no", "n", "0"))  # as the library reads it


# -- the worker processes --------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    # Ctrl-C reaches the whole process group: the router shuts its pool down, the workers
    # must not die mid-prompt with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tune_malloc()  # a whole conversation's text and ids, like the router's
    _worker_tokenizer = load_tokenizer(spec, clock=datetime.now, serial_batches=serial_tokenizers())


def _encode_in_worker(
    text: str, add_special_tokens: bool, block_size: int, extra_key: str | None, keep_ids: bool
) -> PromptBlocks:
    assert _worker_tokenizer is not None
    blocks = prompt_blocks(
        _worker_tokenizer, text, add_special_tokens, block_size, extra_key, keep_ids
    )
    return _compact(blocks)


def _compact(blocks: PromptBlocks) -> PromptBlocks:
    """Ids cross the process boundary as an array: a quarter of a pickled list's bytes."""
    if blocks.ids is None or isinstance(blocks.ids, array):
        return blocks
    return dataclasses.replace(blocks, ids=array("I", blocks.ids))


def _plan_in_worker(plan: Plan) -> Pieces:
    """The uncached part of a conversation (the plan carries no cached ids across)."""
    assert isinstance(_worker_tokenizer, HFTokenizerFiles)
    mid, tail = tokenize_plan(_worker_tokenizer.encode_plain, plan)
    return array("I", mid), array("I", tail)


def _chat_in_worker(
    messages: list[dict[str, Any]],
    options: dict[str, Any],
    add_special_tokens: bool,
    block_size: int,
    extra_key: str | None,
    keep_ids: bool,
) -> PromptBlocks:
    assert _worker_tokenizer is not None
    text = render_chat(_worker_tokenizer, messages, options)
    blocks = prompt_blocks(
        _worker_tokenizer, text, add_special_tokens, block_size, extra_key, keep_ids
    )
    return _compact(blocks)


class PromptTokenizer:
    """The router's tokenizer: inline for short prompts, a process pool for long ones."""

    def __init__(
        self, spec: str, inline_chars: int = 4096, processes: int = 1, cache_bytes: int = 0
    ) -> None:
        self.spec = spec
        self.tokenizer = load_tokenizer(
            spec, clock=datetime.now, serial_batches=serial_tokenizers()
        )
        self.inline_chars = inline_chars
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        # The pool's first worker loading the tokenizer (start): until then a long prompt waits
        # seconds for it (a process spawned, the library imported), so /ready waits for it.
        self._warming: Future[int] | None = None
        self._warm_deadline = 0.0
        # Threads that encode a new conversation's chunks (one per core, up to 8).
        self.threads = max(1, min(8, len(os.sched_getaffinity(0))))
        self._threads: ThreadPoolExecutor | None = None
        self.chunked = 0  # conversations encoded in chunks on the threads
        self.offloaded = 0  # prompts encoded in the pool
        self._system_first: bool | None = None
        # Long conversations: only each turn's new messages are tokenized (kvcore incremental).
        self.prefix_cache: PrefixTokenCache | None = None
        tok = self.tokenizer
        if cache_bytes > 0 and isinstance(tok, HFTokenizerFiles):
            # Shares of the budget for rendered chat templates (their text) and for the parser
            # (chat_parse, which the router holds), the rest for token ids.
            render_bytes = cache_bytes // RENDER_SHARE
            ids_bytes = cache_bytes - render_bytes - cache_bytes // PARSE_SHARE
            # A template that emits no special token is cut after verified newlines.
            self.prefix_cache, why = prefix_cache_for(
                tok.cut_tokens(),
                tok.encode_plain,
                ids_bytes,
                line_cuts=True,
                pretokens=tok.pretokens_plain,
            )
            if self.prefix_cache is None:
                log.warning("conversations are tokenized whole each turn (%s): %s", spec, why)
            why = tok.enable_render_cache(render_bytes) if tok.chat_template else ""
            if why:
                log.info("conversations are rendered whole each turn (%s): %s", spec, why)

    def needs_system_first(self) -> bool:
        """Whether vLLM merges an agent request's inline system messages into the first for
        this tokenizer's chat template (it probes the template once, as done here)."""
        if self._system_first is None:
            template = getattr(self.tokenizer, "chat_template", None)
            self._system_first = needs_system_first(template)
        return self._system_first

    def render_chat(
        self, messages: list[dict[str, Any]], options: dict[str, Any], *, incremental: bool = True
    ) -> str:
        """The chat template applied as vLLM applies it (raises ChatTemplateError); only the
        conversation's new messages where the tokenizer can (on the event loop's thread only),
        unless not ``incremental``."""
        return render_chat(self.tokenizer, messages, options, incremental=incremental)

    async def blocks(
        self,
        text: str,
        add_special_tokens: bool,
        block_size: int,
        extra_key: str | None,
        keep_ids: bool = False,
    ) -> PromptBlocks | None:
        """A completion prompt's blocks; None when the worker pool broke (it is restarted)."""
        if len(text) <= self.inline_chars or self.processes < 1:
            return prompt_blocks(
                self.tokenizer, text, add_special_tokens, block_size, extra_key, keep_ids
            )
        return await self._offload(
            _encode_in_worker, text, add_special_tokens, block_size, extra_key, keep_ids
        )

    async def chat_blocks(
        self,
        messages: list[dict[str, Any]],
        options: dict[str, Any],
        size_chars: int,
        add_special_tokens: bool,
        block_size: int,
        extra_key: str | None,
        keep_ids: bool = False,
    ) -> PromptBlocks | None:
        """A chat's blocks (and ids when ``keep_ids``): rendering and encoding both leave the
        loop when it is long."""
        cache = self.prefix_cache
        if cache is not None and not add_special_tokens and size_chars >= cache.min_prefix_chars:
            return await self._incremental(
                cache, messages, options, block_size, extra_key, keep_ids
            )
        if size_chars <= self.inline_chars or self.processes < 1:
            text = self.render_chat(messages, options)
            return prompt_blocks(
                self.tokenizer, text, add_special_tokens, block_size, extra_key, keep_ids
            )
        return await self._offload(
            _chat_in_worker, messages, options, add_special_tokens, block_size, extra_key, keep_ids
        )

    async def _incremental(
        self,
        cache: PrefixTokenCache,
        messages: list[dict[str, Any]],
        options: dict[str, Any],
        block_size: int,
        extra_key: str | None,
        keep_ids: bool = False,
    ) -> PromptBlocks | None:
        """Only what the cache does not hold is tokenized: on the loop when that is short (a
        new turn), in chunks on the threads otherwise (a conversation seen for the first
        time), or whole in the pool if a chunk came out wrong. Rendering stays on the loop:
        it is cheap next to tokenizing (0.4 ms for 220 KB)."""
        plan = cache.plan(self.render_chat(messages, options))
        pieces: Pieces | None
        tok = self.tokenizer
        assert isinstance(tok, HFTokenizerFiles)
        if plan.uncached_chars <= self.inline_chars or self.processes < 1:
            pieces = tokenize_plan(tok.encode_plain, plan)
        elif self._chunks_here(tok) and (
            (pieces := await self._in_chunks(tok, cache.chunks(plan))) is not None
        ):
            self.chunked += 1
        else:
            shipped = dataclasses.replace(plan, entry=None, data=b"")  # ids and bytes stay here
            pieces = await self._offload(_plan_in_worker, shipped)
            if pieces is None:
                return None
        tokens, hashes, ids = cache.commit_ids(plan, pieces, block_size, extra_key, keep_ids)
        return PromptBlocks(tokens, hashes, ids)

    def _chunks_here(self, tok: HFTokenizerFiles) -> bool:
        """Whether a new conversation is encoded in this process: on the threads from
        ``THREADS_OVER_ASCII`` cores, or by the ASCII path on the loop. Otherwise (fewer cores,
        the library's encoder) the pool encodes it whole, as before chunks: threads gained
        nothing on 2 cores, and the text and its ids would then peak in the router's memory
        (+33 MiB over the hostile-body fuzz test's examples, tests/test_hostile_requests.py)."""
        return self.threads >= THREADS_OVER_ASCII or tok.ascii_pieces is not None

    async def _in_chunks(self, tok: HFTokenizerFiles, chunks: Chunks) -> Pieces | None:
        """The chunks encoded on the threads (a share each, in order), or on the loop between
        other requests (see the module docstring), joined; None if they do not join (the
        caller tokenizes the plan whole)."""
        if tok.ascii_pieces is not None and self.threads < THREADS_OVER_ASCII:
            encoded_one: list[list[int]] = []
            for text in chunks.texts:
                encoded_one.append(tok.encode_plain(text))
                await asyncio.sleep(0)
            return chunks.join(encoded_one)
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.threads, thread_name_prefix="kvroute-tok")
        texts = chunks.texts
        share = -(-len(texts) // self.threads)  # ceiling
        loop = asyncio.get_running_loop()
        encoded = await asyncio.gather(
            *(
                loop.run_in_executor(self._threads, tok.encode_batch_plain, texts[i : i + share])
                for i in range(0, len(texts), share)
            )
        )
        return chunks.join([ids for group in encoded for ids in group])

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T | None:
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

    def cache_counts(self) -> Counts:
        """Lookups and bytes of its caches of conversations (tokenizer_cache_metrics)."""
        out: Counts = {}
        ids = self.prefix_cache
        if ids is not None:
            out["token_ids"] = CacheCounts(
                ids.stats.hits, ids.stats.misses, ids.bytes, ids.max_bytes
            )
        tok = self.tokenizer
        render = tok.render_cache if isinstance(tok, HFTokenizerFiles) else None
        if render is not None:
            stats = render.stats
            out["rendering"] = CacheCounts(stats.hits, stats.misses, render.bytes, render.max_bytes)
        return out

    def start(self) -> None:
        """Start the pool now, so the first long prompt does not wait for it."""
        if self.processes >= 1:
            self._warming = self._ensure_pool().submit(int)
            self._warm_deadline = time.monotonic() + WARM_MAX_S

    @property
    def warming(self) -> bool:
        """The pool's worker is still loading the tokenizer (at most WARM_MAX_S after start:
        a pool that cannot start must not keep the router unready; long prompts then route on
        estimates, as when a worker dies)."""
        warming = self._warming
        if warming is None or warming.done():
            return False
        if time.monotonic() < self._warm_deadline:
            return True
        log.warning("the tokenizer pool is not up %.0f s after start: ready anyway", WARM_MAX_S)
        self._warming = None
        return False

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
