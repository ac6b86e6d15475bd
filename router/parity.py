"""The parity check, run: a sample of requests re-checked against the engine that served them.

For each sampled request (``health/parity.py`` says which, and what raises the alarm), after
its answer: the block keys the router routed it by against the keys of the engine's own token
ids (its ``/tokenize`` with the same chat template arguments, or an agent API's render
endpoint), and its token count against theirs; where they differ, the prompt is tokenized again
whole to say from which token on, and whether the tokenizer or the incremental path is to
blame. Then whether the engine's KV events stored the request's first block under the
router's key. A periodic task compares each replica's own prefix-cache hits with the reuse the
router predicted there.

Off the request path: ``offer`` is an O(1) count per request; a sampled one starts a task,
at most ``max_pending`` at once (more are dropped, not queued).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvroute.health.parity import (
    AGREE,
    BLIND,
    BLOCKS,
    ERROR,
    MISMATCH,
    SKIPPED,
    TOKENS,
    BlindWatch,
    Finding,
    ParityVerdicts,
    Sampler,
    first_difference,
)
from kvroute.health.scrape import ReplicaReport
from kvroute.kvcore.block_hashing import extra_key
from kvroute.kvcore.ledger import Route
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.tokenizer import ChatTemplateError, token_id_blocks

from .config import ParityConfig
from .openai_request import ParsedRequest
from .pools import PoolRouting
from .prompt_keys import PromptKeys, rendered_messages

log = logging.getLogger(__name__)

# Chat options /tokenize takes as chat completions do; a request with others set (documents,
# reasoning_effort) renders a template /tokenize cannot reproduce: its tokens are not checked.
_TOKENIZE_CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "tools")
# The agent APIs whose prompts a replica renders on request, and where.
RENDERED_APIS = {"messages": "/v1/messages/render", "responses": "/v1/responses/render"}


@dataclass(frozen=True)
class _Sample:
    parsed: ParsedRequest
    route: Route
    replica: str
    base_url: str
    block_size: int
    key: str | None
    keys: PromptKeys  # the answering replica's pool's: its tokenizer
    index: PrefixIndex  # and its prefix index
    body: bytes = b""  # the client's body: an agent API's is rendered by the replica whole


class ParityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.checks = Counter(
            "kvroute_parity_checks",
            "Sampled requests checked against the replica that served them: check=tokens (the "
            "router's token ids and block keys vs the engine's /tokenize), blocks (the engine's "
            "KV events stored the request's first block under the router's key), blind (the "
            "replica's prefix-cache hits grew while the router predicted no reuse there).",
            ["replica", "check", "result"],
            registry=registry,
        )
        self.alarm = Gauge(
            "kvroute_parity_alarm",
            "1 while router and replicas disagree on tokens or block keys (see /status, the "
            "router's error log): cache-aware routing is then blind.",
            registry=registry,
        )


class ParityChecker:
    def __init__(
        self,
        config: ParityConfig,
        pool_of: Callable[[str], PoolRouting | None],
        base_urls: Callable[[], Mapping[str, str]],
        reports: Callable[[], Mapping[str, ReplicaReport]],
        has_kv_events: Callable[[str], bool],
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self._pool_of = pool_of  # a replica's model pool: the keys and index it is checked by
        self._base_urls = base_urls
        self._reports = reports
        self._has_kv_events = has_kv_events
        self.metrics = ParityMetrics(registry)
        self.sampler = Sampler(config.first_per_replica, config.sample_every)
        self.verdicts = ParityVerdicts(config.blocks_to_alarm, config.clear_after)
        self.blind = BlindWatch(config.blind_min_requests, config.blind_min_hit_tokens)
        self._predicted: dict[str, list[int]] = {}  # replica -> [captured tokens, requests]
        self._pending: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None
        self._blind_task: asyncio.Task[None] | None = None

    # -- on the request path -----------------------------------------------------------

    def offer(self, parsed: ParsedRequest, route: Route, replica: str, body: bytes = b"") -> None:
        """``replica`` answered the request ``route`` routed (``body``: the client's): count
        it, maybe check it."""
        request = route.request
        if not request.block_hashes:
            return  # nothing the router keyed (no tokenizer): nothing to compare
        prefix = request.prefix_tokens
        counts = self._predicted.get(replica)
        if counts is None:
            counts = self._predicted[replica] = [0, 0]
        counts[0] += min(prefix.get(replica, 0), request.prompt_tokens) if prefix else 0
        counts[1] += 1
        if not self.sampler.wants(replica) or len(self._pending) >= self.config.max_pending:
            return
        base_url = self._base_urls().get(replica)
        pool = self._pool_of(replica)
        if base_url is None or pool is None:
            return
        keys = pool.keys
        lora = parsed.model if parsed.model in keys.lora_adapters else None
        sample = _Sample(
            parsed,
            route,
            replica,
            base_url,
            route.block_tokens or keys.block_size(),
            extra_key(lora, parsed.cache_salt),
            keys,
            pool.index,
            body,
        )
        task = asyncio.get_running_loop().create_task(self._check(sample))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.config.timeout_s, trust_env=False)
        self._blind_task = asyncio.create_task(self._watch_blind(), name="kvroute-parity-blind")

    async def close(self) -> None:
        tasks = [*self._pending, *([self._blind_task] if self._blind_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def snapshot(self) -> dict[str, Any]:
        """The alarm and what raised it, for /status and /admin."""
        finding = self.verdicts.finding
        return {
            "alarm": self.verdicts.alarm,
            "finding": None
            if finding is None
            else {
                "replica": finding.replica,
                "check": finding.check,
                "position": finding.position,
                "detail": finding.detail,
            },
            "checks": [
                {"replica": r, "check": c, "result": res, "count": n}
                for (r, c, res), n in sorted(self.verdicts.checks.items())
            ],
            # Each replica's last check, for its row on /status.
            "last": {
                r: {"check": c, "result": res, "detail": detail or None}
                for r, (c, res, detail) in self.verdicts.last.items()
            },
        }

    # -- the checks --------------------------------------------------------------------

    async def _check(self, sample: _Sample) -> None:
        try:
            await self._check_tokens(sample)
            await self._check_blocks(sample)
        except asyncio.CancelledError:
            raise
        except Exception:  # a check must never take the router down
            log.exception("parity check of a request to %s failed", sample.replica)

    async def _check_tokens(self, sample: _Sample) -> None:
        parsed = sample.parsed
        tokenizer = sample.keys.tokenizer
        if tokenizer is None:
            self._record(sample.replica, TOKENS, SKIPPED)
            return
        theirs = await self._rendered(sample) if parsed.api in RENDERED_APIS else None
        if theirs is None:
            messages = rendered_messages(parsed, tokenizer) if parsed.messages is not None else None
            body = _tokenize_body(parsed, messages)
            if body is None:
                self._record(sample.replica, TOKENS, SKIPPED)
                return
            theirs = await self._tokenized(sample, body)
        if not isinstance(theirs, list):
            self._record(sample.replica, TOKENS, ERROR)
            return
        request = sample.route.request
        keyed = request.block_hashes
        expected = token_id_blocks(theirs, sample.block_size, sample.key).hashes
        if request.prompt_tokens == len(theirs) and first_difference(keyed, expected) is None:
            # The keys the router routed by are the engine's own tokens' keys, block for block,
            # and the counts agree: nothing to look into (a 220 KB agent prompt tokenized again
            # whole would cost more router CPU than a hundred of its incremental turns).
            self._record(sample.replica, TOKENS, AGREE)
            return
        # They differ somewhere: tokenize again whole (in a thread) to say where, and whether
        # the tokenizer or the incremental path is to blame.
        try:
            ours = await asyncio.to_thread(_router_ids, tokenizer, parsed)
        except ChatTemplateError:
            self._record(sample.replica, TOKENS, SKIPPED)
            return
        position = first_difference(ours, theirs)
        if position is not None:
            detail = (
                f"router and replica {sample.replica} tokenize this prompt differently from "
                f"token {position} on: router {_window(ours, position)} ({len(ours)} tokens), "
                f"replica {_window(theirs, position)} ({len(theirs)} tokens); check the "
                "tokenizer and chat template the router uses (routing.tokenizer)"
            )
            self._record(
                sample.replica, TOKENS, MISMATCH, Finding(sample.replica, TOKENS, detail, position)
            )
            return
        block = first_difference(keyed, expected)
        if block is not None:
            detail = (
                f"the router keyed a prompt to {sample.replica} with block keys that differ "
                f"from its own tokens' from block {block} on (block size {sample.block_size})"
            )
            self._record(
                sample.replica,
                TOKENS,
                MISMATCH,
                Finding(sample.replica, TOKENS, detail, block * sample.block_size),
            )
            return
        self._record(sample.replica, TOKENS, AGREE)

    async def _tokenized(self, sample: _Sample, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids from the replica's ``/tokenize``; None when it fails."""
        assert self._client is not None
        try:
            response = await self._client.post(
                sample.base_url + "/tokenize",
                content=msgspec.json.encode(body),  # a long conversation: faster than json
                headers={"Content-Type": "application/json"},
            )
            ids = response.json()["tokens"] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return ids if isinstance(ids, list) else None

    async def _rendered(self, sample: _Sample) -> list[int] | None:
        """An agent request's token ids as the replica renders the client's body itself
        (``/v1/messages/render``, ``/v1/responses/render``: vLLM's conversion and template
        both checked), or None where it has no render endpoints (vLLM serves them with
        ``--enable-scale-out``): then ``/tokenize`` checks the template on the conversation."""
        assert self._client is not None
        path = RENDERED_APIS[sample.parsed.api]
        try:
            response = await self._client.post(
                sample.base_url + path,
                content=sample.body,
                headers={"Content-Type": "application/json"},
            )
            ids = response.json().get("token_ids") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return ids if isinstance(ids, list) else None

    async def _check_blocks(self, sample: _Sample) -> None:
        hashes = sample.route.request.block_hashes
        if not self._has_kv_events(sample.replica):
            self._record(sample.replica, BLOCKS, SKIPPED)
            return
        first = hashes[:1]
        deadline = time.monotonic() + self.config.events_wait_s
        while True:
            match = sample.index.match(first, time.monotonic()).get(sample.replica)
            if match is not None and match.confirmed >= 1:
                self._record(sample.replica, BLOCKS, AGREE)
                return
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)  # events arrive on their own socket: poll with a deadline
        detail = (
            f"replica {sample.replica}'s KV events did not store the prompt's first block under "
            f"the router's key within {self.config.events_wait_s:g} s (block size "
            f"{sample.block_size}; a LoRA adapter or cache_salt keys the first block): check "
            "routing.block_size and the replicas' hash settings"
        )
        self._record(sample.replica, BLOCKS, MISMATCH, Finding(sample.replica, BLOCKS, detail))

    async def _watch_blind(self) -> None:
        while True:
            await asyncio.sleep(self.config.blind_interval_s)
            for replica, report in list(self._reports().items()):
                counts = self._predicted.get(replica)
                if report.prefix_hits is None or counts is None:
                    continue
                blind = self.blind.observe(replica, report.prefix_hits, counts[0], counts[1])
                if blind is None:
                    continue
                if blind:
                    detail = (
                        f"replica {replica} reused its prefix cache while the router predicted "
                        f"no reuse there for its last {self.blind.min_requests} requests: the "
                        "router's prefix keys do not match the replica's"
                    )
                    self._record(replica, BLIND, MISMATCH, Finding(replica, BLIND, detail))
                else:
                    self._record(replica, BLIND, AGREE)

    def _record(
        self, replica: str, check: str, result: str, finding: Finding | None = None
    ) -> None:
        self.metrics.checks.labels(replica, check, result).inc()
        raised = self.verdicts.record(replica, check, result, finding)
        if raised and finding is not None:
            log.error("parity alarm: %s", finding.detail)
        elif result == MISMATCH and finding is not None:
            log.warning("parity: %s", finding.detail)
        self.metrics.alarm.set(1 if self.verdicts.alarm else 0)


def _tokenize_body(
    parsed: ParsedRequest, messages: list[dict[str, Any]] | None
) -> dict[str, Any] | None:
    """The /tokenize request that renders the prompt as the replica rendered it; None when
    /tokenize cannot (token-id prompts were not tokenized; some chat options it does not take)."""
    body: dict[str, Any] = {"add_special_tokens": parsed.add_special_tokens}
    if parsed.model is not None:
        body["model"] = parsed.model
    if messages is not None:
        options = parsed.chat_options or {}
        if options.get("documents") is not None or options.get("reasoning_effort") is not None:
            return None
        body["messages"] = messages
        for name in _TOKENIZE_CHAT_OPTIONS:
            if options.get(name) is not None:
                body[name] = options[name]
        if options.get("chat_template_kwargs") is not None:
            body["chat_template_kwargs"] = options["chat_template_kwargs"]
        return body
    if parsed.prompt_text is not None:
        body["prompt"] = parsed.prompt_text
        return body
    return None


def _router_ids(tokenizer: Any, parsed: ParsedRequest) -> list[int]:
    """The prompt's token ids as the router's tokenizer makes them, whole (not incremental)."""
    if parsed.messages is not None:
        messages = rendered_messages(parsed, tokenizer)
        # Whole: this runs in a thread, and checks the incremental rendering too.
        text = tokenizer.render_chat(messages, parsed.chat_options or {}, incremental=False)
    else:
        assert parsed.prompt_text is not None
        text = parsed.prompt_text
    ids: list[int] = tokenizer.tokenizer.encode(text, parsed.add_special_tokens)
    return ids


def _window(ids: list[int], position: int, width: int = 4) -> str:
    return str(ids[position : position + width]) if position < len(ids) else "[end]"
