"""The endpoint picker's decisions: the routing core's, for one gateway request at a time.

``pick`` parses the body as ``kvroute serve`` does (same validation, same errors), tokenizes
it, asks the dispatch ledger for the policy's ranking and dispatches to the first endpoint
the gateway may use; the ranking becomes the ordered fallback list Envoy retries down.
``served`` moves the dispatch when the gateway's retry landed elsewhere, ``first_byte`` and
``finish`` close it in the ledger as the response passes through.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvroute.backends.handle import ReplicaHandle
from kvroute.kvcore.agent_identity import Identity
from kvroute.kvcore.fair_queue import Ticket
from kvroute.kvcore.ledger import Dispatch, Route
from kvroute.kvcore.reuse import decompose
from kvroute.policies import RouteRequest

from .. import errors
from ..admission import Admission, AdmissionRefused
from ..agent_request import parse_count_tokens, parse_messages, parse_responses
from ..chat_parse import chat_parser_for
from ..config import Config, ReplicaConfig, replica_name_from_url
from ..core import RoutingCore
from ..dp_ranks import expand_ranks
from ..ledger_bus import LedgerBus
from ..metrics import Histogram, RouterMetrics
from ..openai_request import CHARS_PER_TOKEN, ParsedRequest, parse_completion
from ..proxy import replica_fault
from ..sessions import SessionMetrics, identify
from ..tenant_metrics import TenantMetrics
from ..tenants import Tenants, fairness_params
from ..tokenizer_cache_metrics import TokenizerCacheMetrics
from .endpoints import address_of_url, in_subset

log = logging.getLogger(__name__)

DECISION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


@dataclass(slots=True)
class Pick:
    """One gateway request from its pick to its last response byte."""

    route: Route
    dispatch: Dispatch
    destinations: tuple[str, ...]  # addresses, best first: the fallback list
    arrived: float
    # The data-parallel rank picked on the first destination (sent as X-data-parallel-rank),
    # None: it is not a data-parallel replica.
    rank: int | None
    stream: bool
    fairness_id: str | None = None
    objective: str | None = None
    first_byte_at: float | None = None
    status: int = 0
    admitted: bool = False
    ticket: Ticket | None = None  # its tenant's place in admission (tenants.py)
    usage: Mapping[str, int] | None = None  # the replica's, when the response carried it


class EndpointPicker:
    def __init__(self, config: Config, *, destinations: int = 4) -> None:
        self.config = config
        self.core = RoutingCore(config, _Hooks(self), forwards=False)
        self.registry = self.core.registry
        self.ledger = self.core.ledger
        self.destinations = destinations
        # The gateway's path for each OpenAI endpoint the picker reads; any other POST is
        # placed by load alone (its body is not a prompt the index knows).
        self.chat_parser = chat_parser_for(config.routing)
        self.parsers: dict[str, Callable[[bytes], ParsedRequest]] = {
            "/v1/completions": parse_completion,
            "/v1/chat/completions": self.chat_parser,
            # The agent APIs: their conversation as vLLM renders it (router/agent_request.py).
            "/v1/messages": parse_messages,
            "/v1/messages/count_tokens": parse_count_tokens,
            "/v1/responses": parse_responses,
        }
        # Endpoint address (ip:port) <-> replica name; static endpoints are named by address.
        self.address: dict[str, str] = {}
        self.name_at: dict[str, str] = {}
        self._remember(config.replicas)
        limits = config.limits
        # The same tenants, budgets and fair admission as ``kvroute serve`` (no locality: the
        # picker tokenizes after admission only).
        self.tenants = Tenants(config, TenantMetrics())
        self.admission = Admission(
            limits.max_concurrent_requests,
            limits.max_queued_requests,
            limits.queue_timeout_s,
            fairness_params(config),
            self.tenants.limits,
        )
        registry = self.registry
        self.metrics = RouterMetrics(
            lambda: self.core.fleet.replicas,
            kv_sources=self.core.kv_events.stats_by_source,
            index_entries=lambda: self.core.index.entries,
            replica_reports=lambda: self.core.scraper.reports,
            breaker_states=lambda: {n: h.breaker.state.value for n, h in registry.handles.items()},
            admission=lambda: (self.admission.active, self.admission.queued),
        )
        self.metrics.parts["tenants"] = self.tenants.metrics
        self.session_metrics = SessionMetrics()
        self.metrics.parts["sessions"] = self.session_metrics
        pools = self.core.pools
        self.metrics.parts["tokenizer_caches"] = TokenizerCacheMetrics(
            lambda: [self.chat_parser.counts(), *pools.tokenizer_cache_counts()]
        )
        self.decisions = _DecisionStats()
        self.metrics.registry.register(_PickerCollector(self))
        self._rng = random.Random()
        # Other pickers' dispatches, and this one's for them (epp.ledger_bus; off by default).
        self.bus: LedgerBus | None = None

    async def start(self) -> None:
        await self.core.start()

    async def close(self) -> None:
        await self.core.close()

    async def set_endpoints(self, replicas: list[ReplicaConfig], *, ready: bool) -> None:
        """Discovery's endpoint set (each replica named, its URL the pod's ip:port)."""
        self.address.clear()
        self.name_at.clear()
        self._remember(replicas)
        await self.core.set_replicas(replicas, ready=ready)

    def _remember(self, replicas: Iterable[ReplicaConfig]) -> None:
        # A data-parallel pod is one endpoint per rank, all at its one address.
        for replica in expand_ranks(replicas):
            addr = address_of_url(replica.url)
            # Named as the registry names it (an unnamed replica by its URL's host:port).
            name = replica.name or replica_name_from_url(replica.url)
            self.address[name] = addr
            self.name_at[addr] = name

    # -- the request path ---------------------------------------------------------------

    async def pick(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        subset: frozenset[str] | None,
    ) -> Pick:
        """The ranking for this request as an ordered fallback list; ApiError when none.
        (The stream refuses a body over ``limits.max_body_bytes`` as it arrives.)"""
        arrived = time.monotonic()
        started = time.perf_counter()
        parse = self.parsers.get(path.partition("?")[0])
        parsed = parse(body) if parse is not None else None
        if parsed is not None:
            self.metrics.observe_api(parsed.api)
            self.core.catalog.check(parsed.model)
        estimate = parsed.prompt_tokens if parsed is not None else len(body) // CHARS_PER_TOKEN
        # The gateway authenticates: the tenant is its fairness id (or X-Tenant-Id).
        tenant, priority = self.tenants.identify(headers, None)
        ticket = self.tenants.ticket(tenant, priority, estimate, arrived)
        identity = None
        if parsed is not None:  # before admission: the fair queue orders programs
            identity = identify(headers, parsed, self.config.routing.session_header)
            self.session_metrics.count(identity)
            ticket.program = identity.program or ""
        try:
            await self.admission.acquire(ticket)
        except BaseException as exc:
            reason = exc.reason if isinstance(exc, AdmissionRefused) else "cancelled"
            self.tenants.refused(ticket, reason, time.monotonic())
            raise
        self.tenants.admitted(ticket, time.monotonic())
        try:
            route = await self._route(parsed, body, identity, arrived)
            ranked = self._eligible(route.ranked, subset, arrived)
            if not ranked:
                raise _no_endpoint(subset)
        except BaseException:
            self.admission.release(ticket)
            self.tenants.finished(ticket, 0, 0, "error", time.monotonic())
            raise
        # Predicted in ``placed``, once the answer is on its way.
        dispatch = self.ledger.dispatch(route, ranked[0], arrived, predict=False)
        if self.bus is not None:
            self.bus.dispatched(dispatch)
        if route.estimate is not None:  # kv_aware's estimate, as ``kvroute serve`` exports it
            self.metrics.observe_estimate(route.estimate)
        self.registry.dispatched(self.registry.handles[ranked[0]])
        if ranked[0] in self.registry.panicking:
            self.metrics.observe_panic_routed(ranked[0])
        self.decisions.latency.observe(time.perf_counter() - started)
        self.metrics.observe_routed(
            dispatch.replica, dispatch.request.prompt_tokens, dispatch.cached_tokens
        )
        # Each address once (a pod's ranks share it), best rank first.
        addresses = tuple(dict.fromkeys(self.address[name] for name in ranked))
        return Pick(
            route,
            dispatch,
            addresses[: self.destinations],
            arrived,
            self.registry.handles[ranked[0]].data_parallel_rank,
            parsed.stream if parsed is not None else False,
            headers.get("x-gateway-inference-fairness-id"),
            headers.get("x-gateway-inference-objective"),
            admitted=True,
            ticket=ticket,
        )

    async def _route(
        self,
        parsed: ParsedRequest | None,
        body: bytes,
        identity: Identity | None,
        now: float,
    ) -> Route:
        keys = self.core.keys
        blocks = await keys.blocks(parsed) if parsed is not None else None
        if parsed is not None:
            tokens = blocks.tokens if blocks is not None else parsed.prompt_tokens
            request = RouteRequest(
                tokens,
                parsed.max_tokens,
                parsed.model,
                identity.session if identity is not None else None,
                blocks.hashes if blocks is not None else [],
                cache_ttl_s=parsed.cache_ttl_s,
            )
        else:
            request = RouteRequest(max(1, len(body) // CHARS_PER_TOKEN), 0)
        self.registry.before_decision(now)
        return self.ledger.route(request, now, keys.block_size())

    def placed(self, pick: Pick) -> None:
        """Predict the pick's prompt where it went: its answer need not wait for that. The
        caller runs it right after the answer is written, before any other request is picked
        (a stream gone before its answer is not predicted: closed, it will not prefill)."""
        self.ledger.predict_prompt(pick.route, pick.dispatch, pick.arrived)

    def _eligible(
        self, ranked: tuple[str, ...], subset: frozenset[str] | None, now: float
    ) -> list[str]:
        handles = self.registry.handles
        out = []
        for name in ranked:
            handle = handles.get(name)
            if handle is None or not self.registry.may_take(handle, now):
                continue
            if subset is not None and not in_subset(self.address[name], subset):
                continue
            out.append(name)
        return out

    def pick_any(self, subset: frozenset[str] | None) -> str:
        """A header-only request (GET /v1/models, ...): any endpoint that may take it."""
        now = time.monotonic()
        names = self._eligible(tuple(self.registry.handles), subset, now)
        if not names:
            raise _no_endpoint(subset)
        return self.address[self._rng.choice(names)]

    def served(self, pick: Pick, addr: str) -> None:
        """The gateway says which endpoint served: if its retry moved on, so does the ledger."""
        name = self.name_at.get(addr)
        d = pick.dispatch
        # A data-parallel pod's ranks share its address: served there is served as picked.
        if name is None or addr == self.address.get(d.replica) or not d.open:
            return
        self.decisions.served_elsewhere += 1
        now = time.monotonic()
        first = self.registry.handles.get(d.replica)
        if first is not None:
            # The gateway went down the list: the first endpoint refused or failed.
            self.registry.record(first, False, "gateway_retry")
        self.ledger.finish(d, now)
        if self.bus is not None:
            self.bus.finished(d)
        if name in self.registry.handles:
            pick.dispatch = self.ledger.dispatch(pick.route, name, now, "retry")
            if self.bus is not None:
                self.bus.dispatched(pick.dispatch)

    def first_byte(self, pick: Pick, status: int) -> None:
        """The served endpoint's first response body bytes: its prefill is over."""
        if pick.first_byte_at is not None:
            return
        pick.first_byte_at = time.monotonic()
        ok = status < 400
        if self.ledger.first_token(pick.dispatch, pick.first_byte_at, ok=ok) and self.bus:
            self.bus.first_token(pick.dispatch, ok)

    def finish(self, pick: Pick, completed: bool) -> None:
        """The response ended (``completed``) or the stream was torn down: close the request."""
        if not pick.admitted:
            return
        pick.admitted = False
        d = pick.dispatch
        self._settle(pick, completed)
        now = time.monotonic()
        self.ledger.finish(d, now)
        if self.bus is not None:
            self.bus.finished(d)
        handle = self.registry.handles.get(d.replica)
        status = pick.status
        if handle is not None and status:
            fault = replica_fault(status)
            self.registry.record(handle, not fault, f"status {status}" if fault else "")
        ttfb = (pick.first_byte_at or now) - pick.arrived
        code = status if completed else 499  # nginx's "client closed request"
        self.metrics.observe_request(d.replica, code, d.reason, ttfb, now - pick.arrived)
        if 0 < status < 400:  # the replica answered: it prefilled this prompt
            reuse = decompose(
                d.request, d.ranked, d.cached_tokens, d.confirmed_tokens, pick.route.block_tokens
            )
            self.metrics.observe_reuse(d.replica, reuse)

    def _settle(self, pick: Pick, completed: bool) -> None:
        """Its slot to the next request; its tenant charged the replica's counts (a stream's
        only when the client asked for include_usage: else the estimate, and no output)."""
        usage, ticket = pick.usage, pick.ticket
        served = 0 < pick.status < 400
        prompt = usage.get("prompt") if usage else None
        output = usage.get("completion", 0) if usage else 0
        self.admission.release(ticket, prompt, output, pick.dispatch.replica)
        if ticket is not None:
            charged = prompt if prompt is not None else (ticket.input_tokens if served else 0)
            outcome = "ok" if served and completed else "cancelled" if served else "error"
            self.tenants.finished(ticket, charged, output, outcome, time.monotonic())

    def observe_usage(self, usage: Mapping[str, int], pick: Pick | None = None) -> None:
        """A response's usage; with its ``pick``, its cached tokens confirm that pick's reuse
        (read when the request finishes)."""
        for kind, count in usage.items():
            self.decisions.usage[kind] = self.decisions.usage.get(kind, 0) + count
        if pick is not None:
            pick.dispatch.confirmed_tokens = usage.get("cached")
            pick.usage = usage


def _no_endpoint(subset: frozenset[str] | None) -> errors.ApiError:
    if subset is not None:
        message = "No ready endpoint in the gateway's subset hint: " + ",".join(sorted(subset))
    else:
        message = "No ready endpoint in the pool."
    return errors.ApiError(503, message, error_type="service_unavailable", code="no_ready_endpoint")


class _Hooks:
    """What the replica registry asks of the picker (no upstream client of its own)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    def ejected(self, handle: ReplicaHandle, kind: str) -> None:
        self._picker.metrics.observe_ejection(handle.name, kind)

    def abandon_waiting(self, handle: ReplicaHandle, why: str) -> int:
        return 0  # the gateway holds the connections

    async def responds(self, handle: ReplicaHandle) -> bool:
        return await self._picker.core.prober.responds(handle.base_url)


@dataclass(slots=True)
class _DecisionStats:
    latency: Histogram = field(default_factory=lambda: Histogram(DECISION_BUCKETS))
    served_elsewhere: int = 0
    usage: dict[str, int] = field(default_factory=dict)


class _PickerCollector(Collector):
    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        picker = self._picker
        stats = picker.decisions
        yield HistogramMetricFamily(
            "kvroute_epp_decision_seconds",
            "Time from the request's last body byte to the pick (parse, tokenize, route).",
            buckets=stats.latency.buckets(),
            sum_value=stats.latency.total,
        )
        served = CounterMetricFamily(
            "kvroute_epp_served_elsewhere",
            "Requests the gateway served on a later endpoint of the fallback list.",
        )
        served.add_metric([], stats.served_elsewhere)
        yield served
        usage = CounterMetricFamily(
            "kvroute_epp_usage_tokens",
            "Tokens the pods reported in responses' usage, by kind.",
            labels=["kind"],
        )
        for kind, count in sorted(stats.usage.items()):
            usage.add_metric([kind], count)
        yield usage
        age = GaugeMetricFamily(
            "kvroute_epp_metrics_scrape_age_seconds",
            "Seconds since each endpoint's /metrics was last scraped successfully.",
            labels=["replica"],
        )
        for name, seconds in sorted(picker.core.scrape_ages().items()):
            age.add_metric([name], seconds)
        yield age
        endpoints = GaugeMetricFamily(
            "kvroute_epp_endpoints", "Endpoints known to the picker, by state.", labels=["state"]
        )
        in_rotation = picker.registry.in_rotation()
        endpoints.add_metric(["ready"], in_rotation)
        endpoints.add_metric(["not_ready"], len(picker.registry) - in_rotation)
        yield endpoints
