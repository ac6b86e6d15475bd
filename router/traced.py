"""The request path with OpenTelemetry spans: the plain parts, each step wrapped in a span.

The router picks these subclasses once, when it is built with ``tracing.otlp_endpoint`` set
(server.py). With tracing off it runs the plain ``Admission``, ``RequestPipeline`` and
``Forwarder``: no span object is made on the data path, not even a no-op one, and no check
is made per request.

One request's trace (attribute names: OpenTelemetry's HTTP conventions, kvroute.* for ours):

    POST /v1/chat/completions  SERVER    continues the client's traceparent/tracestate, if any
      kvroute.admission        INTERNAL  waiting for a slot (limits.max_concurrent_requests)
      kvroute.tokenize         INTERNAL  the prompt's exact tokens and block hashes
      kvroute.route            INTERNAL  the decision: policy, reason, replica, predicted prefix
      kvroute.attempt          CLIENT    one per replica tried (first, retries, resumes); the
                                         replica gets its context as traceparent

Children find their parent through OpenTelemetry's context (a contextvar): each aiohttp
request runs in its own task, so concurrent requests' spans never mix. A request the sampler
left out (``tracing.sample_ratio``, or a client's unsampled traceparent) gets its request span
only: the SDK's non-recording child spans would cost almost what recorded ones do (about 25 us
each on the 2-core dev box), and the replica gets the request span's context, marked unsampled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue

from kvroute.backends.handle import ReplicaHandle
from kvroute.kvcore.agent_identity import Identity
from kvroute.kvcore.fair_queue import Ticket
from kvroute.kvcore.ledger import Route
from kvroute.kvcore.tokenizer import PromptBlocks
from kvroute.policies import RouteRequest

from . import errors
from .admission import Admission
from .config import Config
from .forward import Forwarder, Try
from .metrics import RouterMetrics
from .openai_request import ParsedRequest
from .pipeline import RequestPipeline
from .pools import Pools
from .proxy import ClientExchange, ClientRequest, Relayed, Timeouts, UpstreamUnavailable
from .registry import ReplicaRegistry
from .tracing import Tracing, without_trace_headers

# The decision's ranking as a span attribute: the first few are what an operator reads.
RANKED_SHOWN = 8


def sampled() -> bool:
    """Whether the current request's span records (the sampler kept its trace)."""
    return trace.get_current_span().is_recording()


class TracedAdmission(Admission):
    def __init__(self, tracing: Tracing, *args: Any) -> None:
        super().__init__(*args)
        self._tracer = tracing.tracer

    async def acquire(
        self,
        ticket: Ticket | None = None,
        while_queued: Callable[[], Awaitable[None]] | None = None,
    ) -> Ticket:
        if not sampled():
            return await super().acquire(ticket, while_queued)
        attributes: dict[str, AttributeValue] = {
            "kvroute.admission.active": self.active,
            "kvroute.admission.queued": self.queued,
        }
        if ticket is not None:
            attributes["kvroute.tenant"] = ticket.tenant
        with self._tracer.start_as_current_span("kvroute.admission", attributes=attributes):
            return await super().acquire(ticket, while_queued)


class TracedPipeline(RequestPipeline):
    def __init__(self, config: Config, *, tracing: Tracing, **parts: Any) -> None:
        super().__init__(config, **parts)
        self._tracing = tracing
        self._tracer = tracing.tracer

    def handler(
        self, parse: Callable[[bytes], ParsedRequest], error_shape: str = errors.OPENAI
    ) -> Callable[[web.Request], asyncio.Future[web.StreamResponse]]:
        inner = super().handler(parse, error_shape)
        tracing, tracer = self._tracing, self._tracer

        async def handle(request: web.Request) -> web.StreamResponse:
            path = request.path  # one of the few API routes: low cardinality
            attributes = {
                "http.request.method": request.method,
                "http.route": path,
                "url.path": path,
                "client.address": request.remote or "",
            }
            with tracer.start_as_current_span(
                f"{request.method} {path}",
                context=tracing.incoming(request.headers),
                kind=SpanKind.SERVER,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    response = await inner(request)
                except BaseException as exc:
                    # Cancelled: the client went away or the total timeout struck; anything
                    # else is a bug that aiohttp answers with a 500.
                    span.set_attribute("error.type", type(exc).__name__)
                    span.set_status(StatusCode.ERROR)
                    raise
                status = response.status
                span.set_attribute("http.response.status_code", status)
                if status >= 500:  # a server span's 4xx is the client's error, not ours
                    span.set_attribute("error.type", str(status))
                    span.set_status(StatusCode.ERROR)
                return response

        return handle  # type: ignore[return-value]

    def _client_headers(self, request: web.Request) -> tuple[tuple[bytes, bytes], ...]:
        # The replica gets the attempt span's context instead (TracedForwarder).
        return without_trace_headers(super()._client_headers(request))

    def _request_id(self, request: ClientRequest) -> str:
        request_id = super()._request_id(request)
        trace.get_current_span().set_attribute("kvroute.request_id", request_id)
        return request_id

    async def _tokenize(self, parsed: ParsedRequest, keep_ids: bool = False) -> PromptBlocks | None:
        request_span = trace.get_current_span()  # admission's span has ended: the request's
        if not request_span.is_recording():
            return await super()._tokenize(parsed, keep_ids)
        request_span.set_attribute("gen_ai.request.model", parsed.model)
        request_span.set_attribute("kvroute.stream", parsed.stream)
        with self._tracer.start_as_current_span("kvroute.tokenize") as span:
            blocks = await super()._tokenize(parsed, keep_ids)
            if blocks is None:  # no tokenizer, or a policy that reads no prefixes
                span.set_attribute("kvroute.prompt_tokens_estimated", parsed.prompt_tokens)
            else:
                span.set_attribute("kvroute.prompt_tokens", blocks.tokens)
                span.set_attribute("kvroute.prompt_blocks", len(blocks.hashes))
            return blocks

    def _identify(self, request: ClientRequest, parsed: ParsedRequest) -> Identity:
        identity = super()._identify(request, parsed)
        span = trace.get_current_span()  # the request's
        if span.is_recording():
            span.set_attribute("kvroute.session_source", identity.source)
        return identity

    def _decide(self, route_request: RouteRequest) -> Route:
        if not sampled():
            return super()._decide(route_request)
        policy = self._pool(route_request.model).policy.name
        with self._tracer.start_as_current_span(
            "kvroute.route", attributes={"kvroute.policy": policy}
        ) as span:
            route = super()._decide(route_request)
            request, ranked = route.request, route.ranked
            chosen = ranked[0]
            prefix = request.prefix_tokens
            predicted = min(prefix.get(chosen, 0), request.prompt_tokens) if prefix else 0
            span.set_attributes(
                {
                    "kvroute.reason": route.reason,
                    "kvroute.replica": chosen,
                    "kvroute.predicted_prefix_tokens": predicted,
                    "kvroute.prompt_tokens": request.prompt_tokens,
                    "kvroute.candidates": len(ranked),
                    "kvroute.ranked": list(ranked[:RANKED_SHOWN]),
                }
            )
            return route


class TracedForwarder(Forwarder):
    def __init__(
        self,
        tracing: Tracing,
        pools: Pools,
        registry: ReplicaRegistry,
        metrics: RouterMetrics,
        timeouts: Timeouts,
        decision_headers: bool,
    ) -> None:
        super().__init__(pools, registry, metrics, timeouts, decision_headers)
        self._tracing = tracing
        self._tracer = tracing.tracer

    async def forward(
        self, exchange: ClientExchange, route: Route, replica_id: str, attempt: Try
    ) -> Relayed | None:
        if not sampled():  # the replica gets the (unsampled) request span's context
            return await super().forward(exchange, route, replica_id, attempt)
        base_url = self.registry.handles[replica_id].base_url
        url = urlsplit(base_url)
        attributes: dict[str, AttributeValue] = {
            "http.request.method": "POST",
            "url.full": base_url + exchange.request.raw_path,
            "server.address": url.hostname or "",
            "server.port": url.port or (443 if url.scheme == "https" else 80),
            "kvroute.replica": replica_id,
            "kvroute.attempt": exchange.tries,  # 1 for the first replica tried
            "kvroute.retry": attempt.reason == "retry",  # after a failure before the first byte
            "kvroute.resume": attempt.resume,  # continuing a stream that broke
            "kvroute.reason": attempt.reason,
        }
        with self._tracer.start_as_current_span(
            "kvroute.attempt",
            kind=SpanKind.CLIENT,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                relayed = await super().forward(exchange, route, replica_id, attempt)
            except BaseException as exc:  # cancelled: the client went away
                span.set_attribute("error.type", type(exc).__name__)
                span.set_status(StatusCode.ERROR)
                raise
            if relayed is None:  # _unavailable has said why
                return None
            span.set_attribute("http.response.status_code", relayed.status)
            if relayed.client_gone:
                span.set_attribute("kvroute.client_gone", True)
            if relayed.broken is not None:
                span.set_attribute("error.type", "broken_stream")
                span.set_status(StatusCode.ERROR, relayed.broken)
            elif relayed.status >= 400:
                span.set_attribute("error.type", str(relayed.status))
                span.set_status(StatusCode.ERROR)
            return relayed

    def _upstream_headers(self, attempt: Try, handle: ReplicaHandle) -> bytes:
        # Called inside forward's span: the replica's parent is this attempt.
        return super()._upstream_headers(attempt, handle) + self._tracing.outgoing()

    def _unavailable(self, handle: ReplicaHandle, exc: UpstreamUnavailable) -> None:
        span = trace.get_current_span()
        span.set_attribute("error.type", exc.kind)
        if exc.status is not None:
            span.set_attribute("http.response.status_code", exc.status)
        span.set_status(StatusCode.ERROR, str(exc))
        super()._unavailable(handle, exc)
