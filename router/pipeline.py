"""A request's path through the router: parse, tokenize, route, try replicas, relay, resume.

``RequestPipeline.serve`` reads on one screen; each step is a call into the component that
owns it, in the model pool serving the requested model (``Pools.for_model``): its
``PromptKeys`` (tokens and block hashes), its ``DispatchLedger`` (the decision),
``try_in_order`` (retries over the ranking, within the pool) and the ``Forwarder`` (one try on
one replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from kvroute.kvcore import pd, token_path
from kvroute.kvcore.agent_identity import Identity
from kvroute.kvcore.fair_queue import Priority, Ticket
from kvroute.kvcore.ledger import Route
from kvroute.kvcore.tokenizer import PromptBlocks
from kvroute.policies import RouteRequest

from . import errors
from .admission import Admission, AdmissionRefused
from .agent_request import AGENT_APIS, COUNT_TOKENS
from .agent_resume import (
    CONTINUATION_PATH,
    AgentStreamTranscript,
    agent_continuation_body,
    agent_resume_blocker,
)
from .attempts import RetryPlan, try_in_order
from .auth import Auth
from .client_faults import CLIENT_FAULTS, unreadable
from .config import Config
from .deadlines import Deadlines
from .disaggregation import Disaggregation, PdMetrics, decode_body, transferred
from .forward import Forwarder, Try
from .metrics import RouterMetrics
from .openai_request import ParsedRequest
from .parity import ParityChecker
from .pools import PoolRouting, Pools
from .prompt_keys import rendered_messages
from .proxy import ClientExchange, ClientRequest, Relayed, end_broken_stream
from .registry import ReplicaRegistry
from .resume import StreamTranscript, Transcript, continuation_body, resume_blocker
from .sessions import SessionMetrics, identify
from .sse import sse_error
from .stored_responses import StoredResponses
from .tenants import DEFAULT_TENANT, Tenants
from .token_path import (
    NEEDS_TEXT,
    NOT_TOKENIZED,
    REPLICA_TAKES_TEXT,
    TOKENS,
    TokenPathMetrics,
    TokenPaths,
    TokenRequest,
    blocker,
    request_fields,
)
from .usage import asking_usage

log = logging.getLogger(__name__)

# Where a client presents its key to the router (router/auth.py): never passed on.
_CLIENT_KEY_HEADERS = frozenset((b"authorization", b"x-api-key"))

# The reason of a route pinned to the replica that stores a Responses request's history.
STORED_RESPONSE = "stored_response"


class ModelCatalog:
    """The models the router serves: configured, else what the replicas list."""

    def __init__(self, configured: list[str]) -> None:
        self.configured = bool(configured)
        self.names: list[str] = list(configured)
        self.known = frozenset(configured)

    def update(self, names: set[str]) -> None:
        if not self.configured:
            self.names = sorted(names)
            self.known = frozenset(names)

    def check(self, model: str) -> None:
        if self.known and model not in self.known:
            raise errors.model_not_found(model, self.names)


class RequestPipeline:
    def __init__(
        self,
        config: Config,
        *,
        auth: Auth,
        admission: Admission,
        deadlines: Deadlines | None,
        catalog: ModelCatalog,
        pools: Pools,
        registry: ReplicaRegistry,
        forwarder: Forwarder,
        metrics: RouterMetrics,
        retry_after_s: int,
        parity: ParityChecker | None = None,
        tenants: Tenants | None = None,
        token_paths: TokenPaths | None = None,
    ) -> None:
        self.config = config
        self.auth = auth
        self.admission = admission
        self.deadlines = deadlines
        self.catalog = catalog
        self.pools = pools
        self.registry = registry
        self.forwarder = forwarder
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.parity = parity
        self.tenants = tenants
        # Tokens sent once (routing.send_tokens): where a replica takes a model's requests as
        # token ids (the health probe finds out), else None.
        self.token_paths = token_paths
        self.token_metrics = TokenPathMetrics()  # exported (empty) with send_tokens off too
        metrics.parts["send_tokens"] = self.token_metrics
        self.session_metrics = SessionMetrics()
        metrics.parts["sessions"] = self.session_metrics
        # Which replica holds each Responses answer it relayed (for previous_response_id).
        self.stored_responses = StoredResponses()
        r = config.retry
        self.retry = RetryPlan(r.max_attempts, r.budget_s, r.backoff_base_s, r.backoff_max_s)
        # Request ids: a random per-process prefix and a counter (uuid4 costs more per request).
        self._id_prefix = os.urandom(6).hex()
        self._ids = itertools.count(1)
        # Prefill/decode pairs among the pools: their requests may be split.
        self.disaggregation: Disaggregation | None = None
        if any(pools.prefill_for(p) is not None for p in pools):
            pd_metrics = PdMetrics()
            metrics.parts["disaggregation"] = pd_metrics
            self.disaggregation = Disaggregation(registry, forwarder, self.retry, pd_metrics)

    def handler(
        self, parse: Callable[[bytes], ParsedRequest], error_shape: str = errors.OPENAI
    ) -> Callable[[web.Request], asyncio.Future[web.StreamResponse]]:
        """The endpoint for one API: its parser, and the shape its errors take."""

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return await self.admit(request, parse)
            except errors.ApiError as exc:
                self.metrics.observe_rejected(exc.status, exc.code or exc.error_type)
                return exc.response(error_shape)

        return handle  # type: ignore[return-value]

    async def admit(
        self, request: web.Request, parse: Callable[[bytes], ParsedRequest]
    ) -> web.StreamResponse:
        """Authenticate, check the tenant's budget, admit (bounded concurrency, in fair order)
        and bound the whole request's time."""
        key_tenant = self.auth.check_client(request)
        tenants = self.tenants
        tenant, priority = (
            tenants.identify(request.headers, key_tenant)
            if tenants is not None
            else (DEFAULT_TENANT, Priority.STANDARD)
        )
        full = self.admission.refuses(priority)
        if full is not None:  # turned away before its body is read, as cheaply as can be
            if tenants is not None:
                tenants.refused(Ticket(tenant, priority, 0), full.reason, time.monotonic())
            raise full
        # Read and parsed before admission: the budget is checked against the prompt, a bad
        # request is refused without queueing, and a queued one can be tokenized while it waits
        # (locality). Tokenizing stays after admission on the unsaturated path: the limit bounds
        # it, and the queue's length bounds what queued requests tokenize.
        body = await self._read_body(request)
        parsed = parse(body)
        self.metrics.observe_api(parsed.api)
        self.catalog.check(parsed.model)
        return await self._admit_parsed(
            request, self._client_headers(request), body, parsed, tenant, priority
        )

    async def serve_internal(
        self,
        request: InternalRequest,
        parse: Callable[[bytes], ParsedRequest],
        tenant: str,
        priority: Priority,
    ) -> web.StreamResponse:
        """A request the router makes itself (a batch line): checked, admitted in the class
        ``priority``, routed, forwarded and retried exactly as a client's, with no client
        connection. Its answer is whole (a ``web.Response``). Raises ApiError as ``admit``."""
        parsed = parse(request.body)
        self.catalog.check(parsed.model)
        full = self.admission.refuses(priority)
        if full is not None:
            raise full
        return await self._admit_parsed(
            request, request.raw_headers, request.body, parsed, tenant, priority
        )

    async def _admit_parsed(
        self,
        request: ClientRequest,
        client_headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        parsed: ParsedRequest,
        tenant: str,
        priority: Priority,
    ) -> web.StreamResponse:
        """Check the tenant's budget, wait for admission, serve within the total timeout."""
        tenants = self.tenants
        now = time.monotonic()
        ticket = (
            tenants.ticket(tenant, priority, parsed.prompt_tokens, now)
            if tenants is not None
            else Ticket(tenant, priority, parsed.prompt_tokens, now)
        )
        # Found before admission: the fair queue orders programs (fairness.by: program).
        identity = self._identify(request, parsed)
        ticket.program = identity.program or ""
        admitted = Admitted(body, parsed, ticket, identity=identity)
        self._plan_token_path(admitted)
        try:
            admitted.ticket = await self.admission.acquire(
                ticket, functools.partial(self._tokenize_queued, admitted)
            )
        except BaseException as exc:
            if ticket is not None and self.tenants is not None:
                reason = exc.reason if isinstance(exc, AdmissionRefused) else "cancelled"
                self.tenants.refused(ticket, reason, time.monotonic())
            raise
        if ticket is not None and self.tenants is not None:
            self.tenants.admitted(ticket, time.monotonic())
        exchange = ClientExchange(request, client_headers, False, None)
        try:
            if self.deadlines is None:
                return await self.serve(exchange, admitted)
            return await self._within_total_timeout(exchange, admitted, self.deadlines)
        finally:
            self._settle(admitted)

    async def serve(self, exchange: ClientExchange, admitted: Admitted) -> web.StreamResponse:
        """The request's path: tokenize, route, try replicas in order, resume."""
        arrived = time.monotonic()
        request = exchange.request
        body, parsed = admitted.body, admitted.parsed
        openai_stream = parsed.stream and parsed.api not in AGENT_APIS
        if openai_stream:  # the agent APIs' streams always end with their usage
            body, exchange.strip_usage = asking_usage(body, parsed.include_usage)
        exchange.api = parsed.api
        route = await self._route(request, parsed, admitted)
        admitted.prompt_tokens = route.request.prompt_tokens
        exchange.expect_stream = parsed.stream
        exchange.retry_until = arrived + self.retry.budget_s - self.retry.backoff_max_s
        if parsed.stream and self.config.retry.resume_streams and parsed.api != COUNT_TOKENS:
            tracked: Transcript = (
                AgentStreamTranscript(parsed.api)
                if parsed.api in AGENT_APIS
                else StreamTranscript(chat=parsed.messages is not None)
            )
            exchange.transcript = tracked
            exchange.resume_check = functools.partial(self._resumable, tracked, body, parsed)
        request_id = self._request_id(request)
        tried: set[str] = set()
        first_route, first_body = await self._disaggregate(
            exchange, route, parsed, body, request_id
        )
        if first_route.transferred:  # a decode leg: its own retry budget from now
            arrived = time.monotonic()
            exchange.retry_until = arrived + self.retry.budget_s - self.retry.backoff_max_s
        tokens = self._token_request(admitted) if first_route is route else None
        relayed = await self._try_replicas(
            exchange, first_route, tried, first_body, request_id, arrived, tokens=tokens
        )
        if relayed is None:
            if not tried:  # every ranked replica was ejected or down by now
                raise errors.no_healthy_replica(self.retry_after_s)
            raise errors.upstream_unavailable(self.retry_after_s)
        if relayed.response_id is not None:
            self.stored_responses.remember(relayed.response_id, relayed.replica)
        if self.parity is not None and relayed.status < 400:
            self.parity.offer(parsed, route, relayed.replica, admitted.body)
        transcript = exchange.transcript
        if relayed.broken is not None and relayed.resumable and transcript is not None:
            if relayed.response_id is not None:
                # vLLM stores a response when it finishes there: one resumed elsewhere is
                # stored nowhere, and a follow-up naming it is told so.
                self.stored_responses.lost(relayed.response_id)
            relayed = await self._resume(exchange, route, tried, body, request_id, parsed, relayed)
        admitted.served(relayed, transcript)
        return relayed.response

    async def _disaggregate(
        self,
        exchange: ClientExchange,
        route: Route,
        parsed: ParsedRequest,
        body: bytes,
        request_id: str,
    ) -> tuple[Route, bytes]:
        """For a decode pool's request worth splitting: its prefill leg on the paired prefill
        pool, and the decode leg's route and body (router/disaggregation.py). Anything else, or
        a prefill leg that failed: the route and body as they were (prefilled where decoded).
        Resumes and continuations never carry the transfer parameters."""
        disaggregation = self.disaggregation
        if disaggregation is None:
            return route, body
        decode = self._pool(parsed.model)
        prefill = self.pools.prefill_for(decode)
        if prefill is None or disaggregation.decide(decode, prefill, route) != pd.SPLIT:
            return route, body
        original = msgspec.json.decode(body)
        # Its decode replica is counted as busy with it while the prefill runs, as the
        # simulator does: else every request arriving meanwhile sees that replica idle.
        split = transferred(route)
        hold = decode.ledger.dispatch(split, route.ranked[0], time.monotonic(), "pd_hold")
        try:
            params = await disaggregation.prefill(
                prefill, exchange.request, exchange.headers, parsed, original, request_id
            )
        finally:
            decode.ledger.finish(hold, time.monotonic())
        if params is None:
            return route, body
        return split, decode_body(original, params)

    def _resumable(self, transcript: Transcript, body: bytes, parsed: ParsedRequest) -> bool:
        """Whether ``_resume`` would continue this stream if it broke now (asked by a drain
        only, so the body is decoded only then)."""
        if not transcript.resumable() or transcript.resumes >= self.config.retry.max_resumes:
            return False
        return _resume_blocker(msgspec.json.decode(body), parsed) is None

    async def _tokenize_queued(self, admitted: Admitted) -> None:
        """While it waits for a slot: its block hashes, for the queue to weigh locality by."""
        if not self._pool(admitted.parsed.model).keys.wanted:
            return
        blocks = await self._tokenize(admitted.parsed, admitted.token_fields is not None)
        admitted.blocks, admitted.tokenized = blocks, True
        if blocks is not None and admitted.ticket is not None:
            admitted.ticket.block_hashes = blocks.hashes

    def _settle(self, admitted: Admitted) -> None:
        """The request left: its slot goes to the next, its tenant is charged what it used."""
        ticket = admitted.ticket
        usage = admitted.usage
        input_tokens = usage.get("prompt") if usage else None
        output_tokens = usage.get("completion", 0) if usage else admitted.output_tokens
        if admitted.parsed.api == COUNT_TOKENS:
            input_tokens = output_tokens = 0  # counting tokens spends none
        self.admission.release(ticket, input_tokens, output_tokens, admitted.replica)
        if ticket is not None and self.tenants is not None:
            if input_tokens is None:
                input_tokens = admitted.prompt_tokens if admitted.outcome != "error" else 0
            now = time.monotonic()
            self.tenants.finished(ticket, input_tokens, output_tokens, admitted.outcome, now)

    async def _route(
        self, request: ClientRequest, parsed: ParsedRequest, admitted: Admitted | None = None
    ) -> Route:
        if admitted is not None and admitted.tokenized:
            blocks = admitted.blocks  # tokenized while it queued
        else:
            keep_ids = admitted is not None and admitted.token_fields is not None
            blocks = await self._tokenize(parsed, keep_ids)
            if admitted is not None:
                admitted.blocks = blocks
        identity = (
            admitted.identity
            if admitted is not None and admitted.identity is not None
            else self._identify(request, parsed)
        )
        route_request = RouteRequest(
            blocks.tokens if blocks is not None else parsed.prompt_tokens,
            parsed.max_tokens,
            parsed.model,
            identity.session,
            blocks.hashes if blocks is not None else [],
            cache_ttl_s=parsed.cache_ttl_s,
        )
        route = self._decide(route_request)
        if parsed.previous_response_id is not None:
            route = self._to_stored_response(route, parsed.previous_response_id)
        return route

    def _identify(self, request: ClientRequest, parsed: ParsedRequest) -> Identity:
        """The request's session (kv_aware's key) and program, counted by how it was found."""
        identity = identify(request.headers, parsed, self.config.routing.session_header)
        self.session_metrics.count(identity)
        return identity

    def _to_stored_response(self, route: Route, response_id: str) -> Route:
        """A Responses follow-up goes where its previous response is stored (vLLM keeps it in
        that server's memory), or nowhere: another replica would answer without the history.
        A response this router has not seen (another router's, or from before a restart) is
        routed as decided; its replica answers 404 if it does not hold it."""
        replica = self.stored_responses.replica_of(response_id)
        if replica is None:
            return route
        handle = self.registry.handles.get(replica) if replica else None
        if handle is None:
            where = (
                f"is stored on replica {replica!r}, which has left the fleet"
                if replica
                else "was stored nowhere: its stream was resumed on another replica"
            )
            raise errors.ApiError(
                404,
                f"The previous response {errors.shown(response_id)} {where}; its conversation "
                "cannot be continued elsewhere. Send the whole conversation as input instead.",
                param="previous_response_id",
                code="previous_response_unavailable",
            )
        if not self.registry.may_take(handle, time.monotonic()):
            # Out of rotation for now (a breaker, a health flap, a drain): not gone.
            raise errors.ApiError(
                503,
                f"The previous response {errors.shown(response_id)} is stored on replica "
                f"{replica!r}, which cannot take requests right now; try again shortly.",
                error_type="service_unavailable_error",
                param="previous_response_id",
                code="previous_response_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        return dataclasses.replace(route, ranked=(replica,), reason=STORED_RESPONSE)

    # Tokenizing and deciding are methods of their own so that tracing (traced.py) can wrap
    # each in a span; a plain call returning the awaitable adds no coroutine frame here.
    def _tokenize(
        self, parsed: ParsedRequest, keep_ids: bool = False
    ) -> Awaitable[PromptBlocks | None]:
        return self._pool(parsed.model).keys.blocks(parsed, keep_ids)

    # -- tokens sent once (routing.send_tokens; router/token_path.py) -------------------------

    def _plan_token_path(self, admitted: Admitted) -> None:
        """Whether this request may go as token ids: its top-level fields read (not its
        conversation) and checked; counted at once when it may not."""
        parsed = admitted.parsed
        metrics = self.token_metrics
        if parsed.api not in token_path.APIS or not self._pool(parsed.model).token_path_live:
            return
        fields = request_fields(admitted.body)
        why = blocker(parsed.api, fields) if fields is not None else "not a JSON object"
        if why is not None:
            log.debug("sent as text: %s", why)
            metrics.count(parsed.api, NEEDS_TEXT)
            return
        admitted.token_fields = fields

    def _token_request(self, admitted: Admitted) -> TokenRequest | None:
        """What every try needs to send this request as token ids; None: it goes as text."""
        fields, metrics = admitted.token_fields, self.token_metrics
        if fields is None:
            return None
        parsed = admitted.parsed
        blocks = admitted.blocks
        if blocks is None or blocks.ids is None:
            metrics.count(parsed.api, NOT_TOKENIZED)
            return None
        if parsed.messages is not None and token_path.media_in(parsed.messages):
            metrics.count(parsed.api, NEEDS_TEXT)  # images and such: the replica's to load
            return None
        return TokenRequest(
            parsed.api, fields, parsed.model, blocks.ids, parsed.stream, parsed.cache_salt
        )

    def _token_try(
        self, tokens: TokenRequest, replica: str, first: bool
    ) -> tuple[bytes, str, token_path.Answer] | None:
        """The body, path and answer writer of a try as token ids on ``replica``; None where
        that replica takes text only (or its context length is not known yet)."""
        paths = self.token_paths
        found = paths(replica, tokens.model) if paths is not None else None
        metrics = self.token_metrics
        if found is None:
            if first:
                metrics.count(tokens.api, REPLICA_TAKES_TEXT)
            return None
        made = tokens.body(found)
        if first:
            metrics.count(tokens.api, TOKENS if made is not None else NEEDS_TEXT)
        if made is None:
            return None
        body, max_tokens = made
        return body, token_path.GENERATE_PATH, tokens.answer(max_tokens)

    def _decide(self, route_request: RouteRequest) -> Route:
        pool = self._pool(route_request.model)
        now = time.monotonic()
        self.registry.before_decision(now)
        route = pool.ledger.route(route_request, now, pool.keys.block_size())
        if not route.ranked:
            raise errors.no_healthy_replica(self.retry_after_s)
        if self.registry.panicking and route.ranked[0] in self.registry.panicking:
            self.metrics.observe_panic_routed(route.ranked[0])
        return route

    def _pool(self, model: str | None) -> PoolRouting:
        """The pool serving ``model`` (the catalog admitted it already)."""
        pool = self.pools.for_model(model)
        if pool is None:
            raise errors.model_not_found(model or "", self.catalog.names)
        return pool

    def _try_replicas(
        self,
        exchange: ClientExchange,
        route: Route,
        tried: set[str],
        body: bytes,
        request_id: str,
        started: float,
        resume: bool = False,
        path: str | None = None,
        tokens: TokenRequest | None = None,
    ) -> Awaitable[Relayed | None]:
        """The ranked replicas in order until one answers (retries before the first byte),
        at ``path`` (None: the client's); as token ids where ``tokens`` and the replica takes
        them. Plain functions returning awaitables: a coroutine frame less per try and request."""

        def try_one(replica: str, attempt: int, last: bool) -> Awaitable[Relayed | None]:
            tried.add(replica)
            exchange.tries += 1
            reason = "resume" if resume else ("retry" if attempt else route.reason)
            # A continuation's error cannot be relayed into the open stream: always retry it.
            retry_status = not last or resume
            as_tokens = self._token_try(tokens, replica, attempt == 0) if tokens else None
            if as_tokens is not None:
                token_body, token_path_, answer = as_tokens
                try_ = Try(
                    token_body, request_id, reason, retry_status, path=token_path_, answer=answer
                )
            else:
                try_ = Try(body, request_id, reason, retry_status, resume=resume, path=path)
            return self.forwarder.forward(exchange, route, replica, try_)

        def retried() -> None:
            self.metrics.observe_retry("resume" if resume else "retry")

        members: Container[str] = self._pool(route.request.model).members  # never outside it
        if route.reason == STORED_RESPONSE:
            members = route.ranked  # only where the previous response is stored

        def pick() -> str | None:
            return self.registry.candidate(route.ranked, tried, members)

        return try_in_order(self.retry, started, pick, try_one, retried)

    async def _resume(
        self,
        exchange: ClientExchange,
        route: Route,
        tried: set[str],
        body: bytes,
        request_id: str,
        parsed: ParsedRequest,
        relayed: Relayed,
    ) -> Relayed:
        """Continue a broken stream on other replicas, spliced into the client's stream (an
        agent API's through a replica's chat endpoint: router/agent_resume.py)."""
        transcript = exchange.transcript
        assert transcript is not None
        max_resumes = self.config.retry.max_resumes
        original = msgspec.json.decode(body)
        blocker = _resume_blocker(original, parsed)
        api = parsed.api
        path = CONTINUATION_PATH if api in AGENT_APIS else None
        while relayed.broken is not None and relayed.resumable:
            stream, broken = relayed.response, relayed.broken
            if blocker is not None or transcript.resumes >= max_resumes:
                why = blocker or f"retry.max_resumes ({max_resumes}) reached"
                self.metrics.observe_resume("impossible")
                why = f"{broken}; not resumed: {why}"
                return await end_broken_stream(
                    stream, relayed.status, relayed.ttfb_s, why, api, transcript
                )
            if isinstance(transcript, AgentStreamTranscript):
                conversation = self._conversation(parsed)
                new_body = agent_continuation_body(original, parsed, transcript, conversation)
            else:
                assert isinstance(transcript, StreamTranscript)
                new_body = continuation_body(original, parsed.messages is not None, transcript)
            if new_body is None:  # every token it asked for was sent: end it as vLLM would
                self.metrics.observe_resume("completed")
                await stream.write(transcript.length_finish())
                await stream.write_eof()
                return Relayed(stream, relayed.status, relayed.ttfb_s)
            transcript.start_continuation()
            log.info("resuming a broken stream (%s) elsewhere", broken)
            nxt = await self._try_replicas(
                exchange, route, tried, new_body, request_id, time.monotonic(), True, path
            )
            if nxt is None:
                self.metrics.observe_resume("failed")
                why = f"{broken}; no replica could resume it"
                return await end_broken_stream(
                    stream, relayed.status, relayed.ttfb_s, why, api, transcript
                )
            self.metrics.observe_resume("resumed")
            relayed = nxt
        return relayed

    def _conversation(self, parsed: ParsedRequest) -> list[dict[str, Any]]:
        """An agent request's conversation as its pool's replicas render it (inline system
        messages merged for a system-first template); merged when no tokenizer says."""
        tokenizer = self._pool(parsed.model).keys.tokenizer
        if tokenizer is not None and parsed.messages is not None:
            return rendered_messages(parsed, tokenizer)
        return parsed.merged_messages or parsed.messages or []

    # -- edges of the path ------------------------------------------------------------

    async def _within_total_timeout(
        self,
        exchange: ClientExchange,
        admitted: Admitted,
        deadlines: Deadlines,
    ) -> web.StreamResponse:
        total_s = self.config.timeouts.total_s
        task: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
        deadlines.track(task, time.monotonic() + total_s)
        try:
            return await self.serve(exchange, admitted)
        except asyncio.CancelledError:
            if not deadlines.release(task):
                raise  # the client went away
            stream = exchange.stream
            if stream is None:
                raise errors.gateway_timeout(total_s) from None
            # Too late for a status code: end the stream with an error event instead.
            message = f"The request did not finish within the router's limit of {total_s:g}s."
            with contextlib.suppress(ConnectionResetError):
                await stream.write(sse_error(message, "timeout", exchange.api))
                await stream.write_eof()
            return stream
        finally:
            deadlines.release(task)  # also when it ended another way

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
        except CLIENT_FAULTS as exc:  # e.g. gzip that is not
            raise unreadable(exc) from None

    def _client_headers(self, request: web.Request) -> tuple[tuple[bytes, bytes], ...]:
        """Headers passed on to replicas: with router API keys, never the client's key."""
        if not self.auth.clients_need_key:
            return request.raw_headers
        return tuple(h for h in request.raw_headers if h[0].lower() not in _CLIENT_KEY_HEADERS)

    def _request_id(self, request: ClientRequest) -> str:
        request_id = request.headers.get("X-Request-Id", "")
        if usable_request_id(request_id):
            return request_id
        return f"kvr-{self._id_prefix}-{next(self._ids):x}"


@dataclass(slots=True)
class InternalRequest:
    """A request the router makes itself: the path it would have come on, its headers (the
    X-Request-Id the replica gets, a session key) and its body."""

    raw_path: str
    headers: CIMultiDict[str]
    body: bytes

    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return tuple((k.encode(), v.encode()) for k, v in self.headers.items())


@dataclass(slots=True)
class Admitted:
    """A request let in: its body and parse, its tenant's ticket, and what it used."""

    body: bytes
    parsed: ParsedRequest
    ticket: Ticket | None
    blocks: PromptBlocks | None = None
    tokenized: bool = False  # ``blocks`` were found while it queued
    # Its top-level fields when it may go as token ids (routing.send_tokens), else None.
    token_fields: dict[str, Any] | None = None
    prompt_tokens: int = 0  # as routed: exact when tokenized, else the estimate
    replica: str | None = None  # the replica that answered last
    usage: dict[str, int] | None = None  # the replica's own counts
    output_tokens: int = 0  # without usage: the tokens streamed to the client
    outcome: str = "error"  # ok, error or cancelled
    identity: Identity | None = None  # its session and program, found once

    def served(self, relayed: Relayed, transcript: Transcript | None) -> None:
        self.replica = relayed.replica
        if relayed.client_gone:
            self.outcome = "cancelled"
        elif relayed.status < 400 and relayed.broken is None:
            self.outcome = "ok"
        if transcript is not None and transcript.resumes:
            # A resumed stream's usage as the client saw it: the whole answer, spliced.
            usage = transcript.usage or {}
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                self.usage = {"prompt": prompt, "completion": completion}
        elif relayed.status < 400:
            self.usage = relayed.usage
        if self.usage is None and transcript is not None:
            self.output_tokens = transcript.generated_tokens


def _resume_blocker(original: object, parsed: ParsedRequest) -> str | None:
    """Why this request's stream could not be continued elsewhere, or None."""
    if not isinstance(original, dict):
        return "not JSON"
    if parsed.api in AGENT_APIS:
        return agent_resume_blocker(original, parsed.api)
    return resume_blocker(original, parsed.messages is not None)


def usable_request_id(value: str) -> bool:
    """A client's X-Request-Id worth passing on: short printable ASCII (it goes into headers)."""
    return 0 < len(value) <= 200 and value.isascii() and value.isprintable()
