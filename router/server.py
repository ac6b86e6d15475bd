"""The router: an aiohttp application that validates, decides and forwards."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvroute.backends.handle import ReplicaHandle
from kvroute.health.breaker import BreakerSettings, BreakerState
from kvroute.health.probe import ActiveProber
from kvroute.health.scrape import MetricsScraper
from kvroute.kvcore.block_hashing import extra_key
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.tokenizer import (
    ChatTemplateError,
    PromptBlocks,
    TokenizerError,
    token_id_blocks,
)
from kvroute.policies import FleetView, Policy, RouteRequest, build_policy

from . import errors
from .admission import Admission
from .auth import Auth
from .config import Config, replica_base_url, replica_name_from_url
from .deadlines import Deadlines
from .kv_subscriber import KVEventSubscribers
from .metrics import RouterMetrics
from .openai_request import CHARS_PER_TOKEN, ParsedRequest, parse_chat, parse_completion
from .prompt_tokenizer import PromptTokenizer
from .proxy import (
    Relayed,
    Timeouts,
    UpstreamUnavailable,
    end_broken_stream,
    relay,
    sse_error,
)
from .resume import StreamTranscript, continuation_body, resume_blocker
from .upstream_client import UpstreamClient
from .workers import MetricsExchange, WorkerContext

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"
# Block size assumed until one is configured, seen in a KV event or scraped (vLLM's GPU default).
FALLBACK_BLOCK_SIZE = 16


class Router:
    def __init__(self, config: Config, worker: WorkerContext | None = None) -> None:
        self.config = config
        routing = config.routing
        # Which replica holds which prefix blocks: the replicas' own KV events, plus
        # predictions for requests just routed (all a replica without events has).
        self.index = PrefixIndex()
        # Checked at config load when given; a launched model directory may lack one.
        self.tokenizer = self._load_tokenizer(routing.tokenizer) if routing.tokenizer else None
        self._scraped_block_size: int | None = None
        self._block_size_warned = False
        self.kv_events = KVEventSubscribers(self.index)
        self.replicas: dict[str, ReplicaHandle] = {}
        b = config.breaker
        breaker_settings = BreakerSettings(
            b.consecutive_failures,
            b.failure_rate,
            b.min_requests,
            b.window_s,
            b.cooldown_s,
            b.max_cooldown_s,
            b.half_open_requests,
            b.close_after_successes,
        )
        for index, replica in enumerate(config.replicas):
            name = replica.name or replica_name_from_url(replica.url)
            self.replicas[name] = ReplicaHandle(
                name, replica_base_url(replica.url), index, breaker_settings
            )
            if replica.kv_events:
                self.kv_events.add(name, replica.kv_events, replica.kv_replay)
        self.fleet = FleetView([h.state for h in self.replicas.values()], membership_version=1)
        self.policy: Policy = build_policy(config.policy.name, config.policy.params)
        # With several worker processes: shared load, and each other's counters in /metrics.
        self._board = worker.board if worker is not None else None
        self._worker_index = worker.index if worker is not None else 0
        self._exchange = MetricsExchange(worker) if worker is not None else None
        self.metrics = RouterMetrics(
            lambda: self.fleet.replicas,
            self._exchange.peers if self._exchange else list,
            kv_sources=self.kv_events.stats_by_source,
            index_entries=lambda: self.index.entries,
            replica_reports=lambda: self.scraper.reports,
            breaker_states=lambda: {
                name: h.breaker.state.value for name, h in self.replicas.items()
            },
            admission=lambda: (self.admission.active, self.admission.queued),
        )
        self.prober = ActiveProber(
            lambda: list(self.replicas.values()),
            path=config.health.path,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
            unhealthy_after=config.health.unhealthy_after,
            on_change=self._refresh_models,
        )
        self.scraper = MetricsScraper(
            lambda: list(self.replicas.values()),
            interval_s=routing.scrape_interval_s,
            timeout_s=config.health.timeout_s,
            on_block_size=self._on_scraped_block_size,
        )
        self.models: list[str] = list(config.models)
        self._model_set = frozenset(self.models)
        self._lora_adapters: frozenset[str] = frozenset()  # from the replicas' /v1/models
        self._started_at = int(time.time())
        self._retry_after_s = max(1, math.ceil(config.health.interval_s))
        limits = config.limits
        self.admission = Admission(
            limits.max_concurrent_requests, limits.max_queued_requests, limits.queue_timeout_s
        )
        self.auth = Auth(config.auth)
        t = config.timeouts
        self._timeouts = Timeouts(t.first_byte_s, t.first_token_s, t.idle_s)
        # Replicas whose breaker is not closed: checked before each decision.
        self._tripped: dict[str, ReplicaHandle] = {}
        # timeouts.total_s, checked on a tick of a tenth of it (at most 1 s): see deadlines.py.
        total_s = config.timeouts.total_s
        self._deadlines = Deadlines(min(1.0, total_s / 10)) if total_s else None
        self._checking: set[str] = set()  # replicas being checked after a dropped connection
        self._rng = random.Random()
        # Set when SIGTERM starts the drain: /ready says 503 so load balancers stop sending.
        self.draining = False
        self._client: UpstreamClient | None = None
        # Request ids: a random per-process prefix and a counter (uuid4 costs more per request).
        self._request_id_prefix = os.urandom(6).hex()
        self._request_counter = itertools.count(1)

    # -- lifecycle ---------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        expect = {"expect_handler": _expect_handler}
        app.router.add_post("/v1/completions", self._make_handler(parse_completion), **expect)
        app.router.add_post("/v1/chat/completions", self._make_handler(parse_chat), **expect)
        app.router.add_get("/v1/models", self.handle_models, **expect)
        app.router.add_get("/health", self.handle_health, **expect)
        app.router.add_get("/ready", self.handle_ready, **expect)
        if self.config.metrics.enabled:
            app.router.add_get("/metrics", self.handle_metrics, **expect)
        app.router.add_get("/admin/replicas", self.handle_admin_replicas, **expect)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._client = UpstreamClient(self.config.timeouts.connect_s)
        if self._deadlines is not None:
            self._deadlines.start()
        self.kv_events.start_all()
        if self.tokenizer is not None:
            self.tokenizer.start()
        await self.prober.probe_all()
        self.prober.start()
        await self.scraper.scrape_all()
        self.scraper.start()
        if self._exchange is not None:
            self._exchange.start(self.metrics)

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._deadlines is not None:
            await self._deadlines.close()
        await self.prober.close()
        await self.scraper.close()
        await self.kv_events.close_all()
        if self.tokenizer is not None:
            self.tokenizer.close()
        if self._exchange is not None:
            await self._exchange.close(self.metrics)
        if self._client is not None:
            self._client.close()

    def _load_tokenizer(self, spec: str) -> PromptTokenizer | None:
        routing = self.config.routing
        try:
            return PromptTokenizer(spec, routing.tokenize_inline_chars, routing.tokenizer_processes)
        except TokenizerError as exc:
            log.warning("cannot use the tokenizer at %s (routing on load alone): %s", spec, exc)
            return None

    def _discover_tokenizer(self) -> None:
        """No tokenizer configured: use the model directory a replica on this host reports.

        vLLM lists the path it loaded the model from as ``root`` in /v1/models; when that is a
        local directory with tokenizer files, it is exactly the tokenizer the replica uses.
        """
        for roots in self.prober.model_roots.values():
            for root in roots:
                if not (Path(root) / "tokenizer.json").is_file():
                    continue
                self.tokenizer = self._load_tokenizer(root)
                if self.tokenizer is None:
                    continue
                self.tokenizer.start()
                log.info("tokenizing prompts with the tokenizer in %s (from /v1/models)", root)
                return

    def _new_request_id(self) -> str:
        return f"kvr-{self._request_id_prefix}-{next(self._request_counter):x}"

    def _refresh_models(self) -> None:
        for handle in self.replicas.values():  # a probe changed something: stamp who is out
            out = not handle.state.healthy or handle.state.ejected
            if out and handle.out_since is None:
                handle.out_since = time.time()
            elif not out:
                handle.out_since = None
        if self.tokenizer is None and self.config.routing.tokenizer is None:
            self._discover_tokenizer()
        self._lora_adapters = frozenset().union(*self.prober.lora_adapters.values())
        if self.config.models:
            return
        known: set[str] = set()
        for state in self.fleet.replicas:
            known.update(state.models or ())
        self.models = sorted(known)
        self._model_set = frozenset(known)

    # -- the data path -----------------------------------------------------------------

    def _make_handler(
        self, parse: Callable[[bytes], ParsedRequest]
    ) -> Callable[[web.Request], asyncio.Future[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                return await self._route(request, parse)
            except errors.ApiError as exc:
                self.metrics.observe_rejected(exc.status, exc.code or exc.error_type)
                return exc.response()

        return handler  # type: ignore[return-value]

    async def _route(
        self, request: web.Request, parse: Callable[[bytes], ParsedRequest]
    ) -> web.StreamResponse:
        self.auth.check_client(request)
        # Counted from here: tokenizing a long prompt is work the limit must bound too.
        await self.admission.acquire()
        opened: list[web.StreamResponse] = []  # the client's stream, once one is open
        try:
            deadlines = self._deadlines
            if deadlines is None:
                return await self._route_counted(request, parse, opened)
            total_s = self.config.timeouts.total_s
            task: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
            deadlines.track(task, time.monotonic() + total_s)
            try:
                return await self._route_counted(request, parse, opened)
            except asyncio.CancelledError:
                if not deadlines.release(task):
                    raise  # the client went away
                if not opened:
                    raise errors.gateway_timeout(total_s) from None
                # Too late for a status code: end the stream with an error event instead.
                stream = opened[0]
                message = f"The request did not finish within the router's limit of {total_s:g}s."
                with contextlib.suppress(ConnectionResetError):
                    await stream.write(sse_error(message, "timeout"))
                    await stream.write_eof()
                return stream
            finally:
                deadlines.release(task)  # also when it ended another way
        finally:
            self.admission.release()

    async def _read_body(self, request: web.Request) -> bytes:
        max_body = self.config.limits.max_body_bytes
        if request.content_length is not None and request.content_length > max_body:
            raise errors.body_too_large(max_body)
        try:
            if request.content.is_eof():  # all of it came with the headers: nothing to wait for
                return await request.read()
            async with asyncio.timeout(self.config.timeouts.client_body_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise errors.body_too_large(max_body) from None
        except TimeoutError:
            raise errors.request_timeout("Sending the request body") from None
        except (web.RequestPayloadError, HttpProcessingError) as exc:  # e.g. gzip that is not
            raise errors.bad_request(f"The request body cannot be read: {exc}") from None

    async def _route_counted(
        self,
        request: web.Request,
        parse: Callable[[bytes], ParsedRequest],
        opened: list[web.StreamResponse],
    ) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await self._read_body(request)
        parsed = parse(body)
        if self._model_set and parsed.model not in self._model_set:
            raise errors.model_not_found(parsed.model, self.models)

        routing_key = request.headers.get(SESSION_HEADER) or parsed.user
        blocks = await self._prompt_blocks(parsed)
        hashes = blocks.hashes if blocks is not None else []
        prefix_tokens: dict[str, int] | None = None
        if hashes:
            block_size = self.block_size()
            matches = self.index.match(hashes, time.monotonic())
            prefix_tokens = {rid: m.blocks * block_size for rid, m in matches.items()}
        route_request = RouteRequest(
            blocks.tokens if blocks is not None else parsed.prompt_tokens,
            parsed.max_tokens,
            parsed.model,
            routing_key,
            hashes,
            prefix_tokens,
        )
        if self._board is not None:
            self._board.totals_into(self.fleet.replicas)
        if self._tripped:
            self._reinstate_cooled(time.monotonic())
        decision = self.policy.decide(route_request, self.fleet)
        if not decision.ranked:
            raise errors.no_healthy_replica(self._retry_after_s)

        request_id = request.headers.get("X-Request-Id", "")
        if not _usable_request_id(request_id):
            request_id = self._new_request_id()
        transcript: StreamTranscript | None = None
        if parsed.stream and self.config.retry.resume_streams:
            transcript = StreamTranscript(chat=parsed.messages is not None)
        attempt = _Attempt(
            self, request, request_id, route_request, decision.ranked, arrived, opened
        )
        relayed = await attempt.first(body, decision.reason, parsed.stream, transcript)
        if relayed.broken is not None and relayed.resumable and transcript is not None:
            relayed = await attempt.resume(body, parsed.messages is not None, relayed, transcript)
        return relayed.response

    def _client_headers(self, request: web.Request) -> tuple[tuple[bytes, bytes], ...]:
        """Headers passed on to replicas: with router API keys, never the client's key."""
        if not self.auth.clients_need_key:
            return request.raw_headers
        return tuple(h for h in request.raw_headers if h[0].lower() != b"authorization")

    def _candidate(self, ranked: tuple[str, ...], tried: set[str]) -> str | None:
        """The best replica not tried yet that may take traffic now, else any that may."""
        now = time.monotonic()
        fallback = None
        for replica_id in ranked:
            handle = self.replicas[replica_id]
            if not handle.state.healthy or not handle.breaker.allows(now):
                continue
            if replica_id not in tried:
                return replica_id
            if fallback is None:
                fallback = replica_id
        return fallback

    def _backoff_s(self, retry: int) -> float:
        """Full jitter: a random wait up to the exponential bound for this retry (1, 2, ...)."""
        r = self.config.retry
        return self._rng.random() * min(r.backoff_max_s, r.backoff_base_s * 2 ** (retry - 1))

    # -- breakers ----------------------------------------------------------------------

    def _record(self, handle: ReplicaHandle, ok: bool, kind: str = "") -> None:
        """One outcome of live traffic on a replica, for its breaker."""
        if kind in _CONNECTION_FAILURES and handle.name not in self._checking:
            # A dropped connection may be a dead replica: find out now, not at the next probe.
            self._checking.add(handle.name)
            task = asyncio.create_task(self._check_alive(handle))
            task.add_done_callback(lambda _: self._checking.discard(handle.name))
        if not self.config.breaker.enabled:
            return
        now = time.monotonic()
        breaker = handle.breaker
        if kind == "stalled":
            opened = breaker.trip(now, "sent nothing within timeouts.first_byte_s")
        else:
            opened = breaker.record(now, ok, kind)
        if opened:
            self._eject(handle, kind or "failure")
        elif breaker.state is BreakerState.CLOSED:
            if self._tripped.pop(handle.name, None) is not None:
                log.info("replica %s is back in rotation", handle.name)
                if handle.state.healthy:
                    handle.out_since = None
            handle.state.ejected = False
        else:
            handle.state.ejected = not breaker.allows(now)

    async def _check_alive(self, handle: ReplicaHandle) -> None:
        """Out of rotation at once if the replica no longer answers its health check.

        An HTTP check, not a bare connect: a SIGKILLed vLLM keeps its listening socket (the
        kernel still completes connections) until its multi-GB address space is torn down, 1-2 s
        on a loaded box, but it answers nothing from the moment it dies.
        """
        if await self.prober.responds(handle.base_url):
            return
        if handle.state.healthy:
            handle.state.healthy = False
            handle.out_since = time.time()
            log.warning(
                "replica %s is down (no answer to its health check): out of rotation", handle.name
            )
            if self._client is not None:
                self._client.abandon_waiting(handle.base_url, "the replica is down")

    def _eject(self, handle: ReplicaHandle, kind: str) -> None:
        if handle.out_since is None:
            handle.out_since = time.time()
        handle.state.ejected = True
        self._tripped[handle.name] = handle
        reason = handle.breaker.last_reason
        self.metrics.observe_ejection(handle.name, kind)
        abandoned = 0
        if self._client is not None:
            abandoned = self._client.abandon_waiting(handle.base_url, f"ejected: {reason}")
        log.warning(
            "replica %s ejected for %.1fs: %s (%d waiting requests sent elsewhere)",
            handle.name,
            handle.breaker.open_until - handle.breaker.opened_at,
            reason,
            abandoned,
        )

    def _reinstate_cooled(self, now: float) -> None:
        """Ejected replicas whose cool-down is over take trial requests again (half-open)."""
        for handle in self._tripped.values():
            if handle.state.ejected and handle.breaker.allows(now):
                handle.state.ejected = False

    def block_size(self) -> int:
        """The replicas' KV block size: configured, else seen in events, else scraped."""
        return (
            self.config.routing.block_size
            or self.index.block_size
            or self._scraped_block_size
            or FALLBACK_BLOCK_SIZE
        )

    def _on_scraped_block_size(self, replica_id: str, block_size: int) -> None:
        if self._scraped_block_size is None:
            self._scraped_block_size = block_size
        in_use = self.block_size()
        if block_size != in_use and not self._block_size_warned:
            self._block_size_warned = True
            log.warning(
                "replica %s reports KV block size %d but the router cuts prompts into blocks "
                "of %d: no prefix will match there (set routing.block_size to the replicas')",
                replica_id,
                block_size,
                in_use,
            )

    async def _prompt_blocks(self, parsed: ParsedRequest) -> PromptBlocks | None:
        """The prompt's exact token count and block hashes; None when they cannot be known."""
        block_size = self.block_size()
        # vLLM keys a LoRA request's blocks by the adapter's name (the request's model) and
        # the first block by the cache salt too; its KV events say so, the index keys alike.
        lora = parsed.model if parsed.model in self._lora_adapters else None
        key = extra_key(lora, parsed.cache_salt)
        if parsed.prompt_ids is not None:
            try:
                return token_id_blocks(parsed.prompt_ids, block_size, key)
            except OverflowError:
                return None  # ids beyond uint32: the replica will reject the request
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        if parsed.messages is not None:
            try:
                return await tokenizer.chat_blocks(
                    parsed.messages,
                    parsed.chat_options or {},
                    parsed.prompt_tokens * CHARS_PER_TOKEN,
                    parsed.add_special_tokens,
                    block_size,
                    key,
                )
            except ChatTemplateError as exc:
                # The replica renders the template too and gives the client its own error.
                log.debug("chat template: %s", exc)
                return None
        if parsed.prompt_text is None:
            return None
        return await tokenizer.blocks(
            parsed.prompt_text, parsed.add_special_tokens, block_size, key
        )

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        request_id: str,
        replica_id: str,
        reason: str,
        route_request: RouteRequest,
        *,
        expect_stream: bool,
        retry_status: bool,
        transcript: StreamTranscript | None,
        resume_into: web.StreamResponse | None = None,
        opened: list[web.StreamResponse] | None = None,
    ) -> Relayed | None:
        """Relay to one replica; None when it failed before the first byte."""
        handle = self.replicas[replica_id]
        state = handle.state
        cost = route_request.token_cost
        prefix = route_request.prefix_tokens or {}
        cached = min(prefix.get(replica_id, 0), route_request.prompt_tokens)
        prefill = max(1, route_request.prompt_tokens - cached)
        hashes = route_request.block_hashes
        ttl = self.config.routing.prediction_ttl_s
        if hashes:
            # Until its events arrive, count the prompt as cached there, so the next request
            # with this prefix follows it.
            self.index.predict(replica_id, hashes, time.monotonic(), ttl)
        handle.breaker.dispatched()
        if handle.breaker.state is BreakerState.HALF_OPEN:
            handle.state.ejected = not handle.breaker.allows(time.monotonic())
        state.in_flight += 1
        state.in_flight_tokens += cost
        state.prefilling += 1
        state.prefill_tokens += prefill
        board = self._board
        worker = self._worker_index
        if board is not None:
            board.add(worker, handle.index, 1, cost, 1, prefill)
        prefilling = True

        def prefill_done(status: int | None) -> None:
            """The replica answered (``status``), or failed before answering (None)."""
            nonlocal prefilling
            if not prefilling:
                return
            prefilling = False
            state.prefilling -= 1
            state.prefill_tokens -= prefill
            if board is not None:
                board.add(worker, handle.index, 0, 0, -1, -prefill)
            if status is not None and status < 400:
                self.metrics.observe_routed(replica_id, route_request.prompt_tokens, cached)
                if hashes:
                    # However long it queued, the prompt is cached there now: keep the
                    # prediction until the replica's events confirm it.
                    self.index.predict(replica_id, hashes, time.monotonic(), ttl)
            elif hashes:
                self.index.unpredict(replica_id, hashes)  # nothing was cached there

        extra = [("X-Request-Id", request_id)]
        if self.config.decision_headers:
            extra += (
                ("X-Kvroute-Replica", replica_id),
                ("X-Kvroute-Reason", reason),
                # The prompt tokens the router expects that replica to have cached (index).
                ("X-Kvroute-Prefix-Hit-Tokens", str(cached)),
            )
        started = time.perf_counter()
        assert self._client is not None
        try:
            relayed = await relay(
                self._client,
                request,
                handle.base_url,
                body,
                b"X-Request-Id: " + request_id.encode() + b"\r\n",
                extra,
                self._timeouts,
                prefill_done,
                client_headers=self._client_headers(request),
                expect_stream=expect_stream,
                retry_status=retry_status,
                transcript=transcript,
                resume_into=resume_into,
                opened=opened,
            )
        except UpstreamUnavailable as exc:
            self.metrics.observe_upstream_error(replica_id, exc.kind)
            if exc.kind == "connect":
                # Out of rotation until a probe passes again.
                if state.healthy:
                    handle.out_since = time.time()
                state.healthy = False
            if exc.kind != "ejected" and (exc.status or 500) >= 500:
                self._record(handle, False, exc.kind)  # transport errors and 5xx only
            log.warning("replica %s failed before first byte: %s", replica_id, exc)
            return None
        finally:
            prefill_done(None)  # a no-op once the replica answered
            state.in_flight -= 1
            state.in_flight_tokens -= cost
            if board is not None:
                board.add(worker, handle.index, -1, -cost)
        if relayed.broken is not None:
            self.metrics.observe_upstream_error(replica_id, "broken_stream")
            self._record(handle, False, "broken_stream")
        elif relayed.status not in (408, 429):
            self._record(handle, relayed.status < 500)
        self.metrics.observe_request(
            replica_id, relayed.status, reason, relayed.ttfb_s, time.perf_counter() - started
        )
        return relayed

    # -- router endpoints --------------------------------------------------------------

    async def handle_models(self, request: web.Request) -> web.Response:
        data = [
            {"id": model, "object": "model", "created": self._started_at, "owned_by": "kvroute"}
            for model in self.models
        ]
        return _json({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        healthy = sum(1 for r in self.fleet.replicas if r.healthy and not r.ejected)
        ready = healthy > 0 and not self.draining
        body = {
            "ready": ready,
            "healthy_replicas": healthy,
            "replicas": len(self.replicas),
            "draining": self.draining,
        }
        return _json(body, status=200 if ready else 503)

    async def handle_admin_replicas(self, request: web.Request) -> web.Response:
        """What the router knows about each replica: health, breaker, load."""
        try:
            self.auth.check_admin(request)
        except errors.ApiError as exc:
            return exc.response()
        now = time.monotonic()
        rows = []
        for name, handle in self.replicas.items():
            state, breaker = handle.state, handle.breaker
            rows.append(
                {
                    "name": name,
                    "url": handle.base_url,
                    "healthy": state.healthy,
                    "ejected": state.ejected,
                    "breaker": breaker.state.value,
                    "breaker_reason": breaker.last_reason or None,
                    "ejected_for_s": round(max(0.0, breaker.open_until - now), 3)
                    if breaker.state is BreakerState.OPEN
                    else 0.0,
                    # Unix time it left rotation (null while in rotation).
                    "out_since": handle.out_since,
                    "in_flight": state.in_flight,
                    "models": sorted(state.models) if state.models is not None else None,
                }
            )
        return _json({"replicas": rows, "draining": self.draining})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        try:
            self.auth.check_admin(request, open_without_key=True)
        except errors.ApiError as exc:
            return exc.response()
        if self._board is not None:
            self._board.totals_into(self.fleet.replicas)
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response


# Failures that may mean the replica process is gone (see Router._check_alive).
_CONNECTION_FAILURES = frozenset({"broken_stream", "protocol"})


class _Attempt:
    """One client request's tries: replicas in ranked order with backoff, then resumes."""

    def __init__(
        self,
        router: Router,
        request: web.Request,
        request_id: str,
        route_request: RouteRequest,
        ranked: tuple[str, ...],
        arrived: float,
        opened: list[web.StreamResponse],
    ) -> None:
        self.router = router
        self.opened = opened
        self.request = request
        self.request_id = request_id
        self.route_request = route_request
        self.ranked = ranked
        self.tried: set[str] = set()
        self.started = arrived

    async def first(
        self, body: bytes, reason: str, stream: bool, transcript: StreamTranscript | None
    ) -> Relayed:
        relayed = await self._try(body, reason, stream, transcript, None)
        if relayed is None:
            if not self.tried:  # every ranked replica was ejected or down by now
                raise errors.no_healthy_replica(self.router._retry_after_s)
            raise errors.upstream_unavailable(self.router._retry_after_s)
        return relayed

    async def _try(
        self,
        body: bytes,
        reason: str,
        stream: bool,
        transcript: StreamTranscript | None,
        resume_into: web.StreamResponse | None,
    ) -> Relayed | None:
        router = self.router
        retry = router.config.retry
        deadline = self.started + retry.budget_s
        for attempt in range(retry.max_attempts):
            replica_id = router._candidate(self.ranked, self.tried)
            if replica_id is None:
                return None
            if attempt:
                delay = router._backoff_s(attempt)
                if time.monotonic() + delay >= deadline:
                    return None
                if delay:
                    await asyncio.sleep(delay)
                router.metrics.observe_retry("resume" if resume_into is not None else "retry")
                if resume_into is None:
                    reason = "retry"
            self.tried.add(replica_id)
            last = attempt + 1 >= retry.max_attempts or time.monotonic() >= deadline
            relayed = await router._forward(
                self.request,
                body,
                self.request_id,
                replica_id,
                reason,
                self.route_request,
                expect_stream=stream,
                retry_status=not last or resume_into is not None,
                transcript=transcript,
                resume_into=resume_into,
                opened=self.opened,
            )
            if relayed is not None:
                return relayed
        return None

    async def resume(
        self, body: bytes, chat: bool, relayed: Relayed, transcript: StreamTranscript
    ) -> Relayed:
        """Continue a broken stream on other replicas, spliced into the client's stream."""
        router = self.router
        original = msgspec.json.decode(body)
        blocker = resume_blocker(original, chat) if isinstance(original, dict) else "not JSON"
        while relayed.broken is not None and relayed.resumable:
            stream, broken = relayed.response, relayed.broken
            if blocker is not None or transcript.resumes >= router.config.retry.max_resumes:
                why = blocker or f"retry.max_resumes ({router.config.retry.max_resumes}) reached"
                router.metrics.observe_resume("impossible")
                return await end_broken_stream(
                    stream, relayed.status, relayed.ttfb_s, f"{broken}; not resumed: {why}"
                )
            new_body = continuation_body(original, chat, transcript)
            if new_body is None:  # every token it asked for was sent: end it as vLLM would
                router.metrics.observe_resume("completed")
                await stream.write(transcript.length_finish())
                await stream.write_eof()
                return Relayed(stream, relayed.status, relayed.ttfb_s)
            transcript.start_continuation()
            self.started = time.monotonic()
            log.info("resuming a broken stream (%s) elsewhere", broken)
            nxt = await self._try(new_body, "resume", True, transcript, stream)
            if nxt is None:
                router.metrics.observe_resume("failed")
                return await end_broken_stream(
                    stream, relayed.status, relayed.ttfb_s, f"{broken}; no replica could resume it"
                )
            router.metrics.observe_resume("resumed")
            relayed = nxt
        return relayed


def _usable_request_id(value: str) -> bool:
    """A client's X-Request-Id worth passing on: short printable ASCII (it goes into headers)."""
    return 0 < len(value) <= 200 and value.isascii() and value.isprintable()


async def _expect_handler(request: web.Request) -> web.Response | None:
    """Answer ``Expect: 100-continue``; refuse any other expectation with an OpenAI-shaped 417."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None
    message = "Only 'Expect: 100-continue' is supported."
    return errors.ApiError(417, message, param="Expect", code="expectation_failed").response()


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )
