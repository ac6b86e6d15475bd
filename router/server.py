"""The router's aiohttp application: its parts wired together, and its own endpoints.

A request's path is ``pipeline.RequestPipeline``; the replicas and their breakers are
``registry.ReplicaRegistry``; decisions, predictions and load are the pure dispatch ledger
(``kvroute.kvcore.ledger``) that the simulator and the endpoint picker call too, one per model
pool (``pools.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvroute.backends.handle import ReplicaHandle
from kvroute.backends.launcher import LaunchedFleet
from kvroute.health.breaker import BreakerState
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import FleetView, Policy

from . import errors, warm_start
from .admission import Admission
from .agent_request import parse_count_tokens, parse_messages, parse_responses
from .auth import Auth
from .batch.api import off_routes
from .batch.lane import BatchLane
from .batch.messages_api import off_routes as messages_off_routes
from .batch.metrics import BatchMetrics
from .budget_bus import BudgetBus
from .bus_metrics import Bus, BusMetrics
from .chat_parse import chat_parser_for
from .config import Config
from .core import RoutingCore
from .deadlines import Deadlines
from .dp_ranks import replica_of
from .fleet_admin import FleetControl
from .forward import Forwarder
from .kv_subscriber import KVEventSubscribers
from .ledger_bus import LedgerBus
from .loop_lag import LoopLagMonitor
from .metrics import RouterMetrics
from .openai_request import parse_completion
from .parity import ParityChecker
from .pipeline import RequestPipeline
from .pools import PoolMetrics, pools_cost, pools_locality
from .prompt_keys import PromptKeys
from .prompt_tokenizer import PromptTokenizer
from .proxy import Timeouts
from .sessions import agents_summary
from .status import StatusFeed, page_html
from .stored_response_api import PATH as STORED_RESPONSE_PATH
from .stored_response_api import StoredResponseLookup
from .tenant_metrics import TenantMetrics
from .tenants import Tenants, fairness_params
from .tokenizer_cache_metrics import TokenizerCacheMetrics
from .upstream_client import UpstreamClient
from .workers import MetricsExchange, WorkerContext, WorkerLoad

if TYPE_CHECKING:  # imported at run time only with tracing on (they need OpenTelemetry)
    from .traced import TracedPipeline
    from .tracing import Tracing

log = logging.getLogger(__name__)

# How often an open /status stream gets the next status.
STATUS_TICK_S = 1.0


class Router:
    def __init__(
        self,
        config: Config,
        worker: WorkerContext | None = None,
        launched: LaunchedFleet | None = None,
        pool_fleets: Sequence[LaunchedFleet] = (),
    ) -> None:
        """``launched``: the replicas of a config without pools that this process started;
        ``pool_fleets``: those of its model pools (removing one of them stops it)."""
        self.config = config
        # With several worker processes: shared load, and each other's counters in /metrics.
        self._shared = WorkerLoad(worker) if worker is not None else None
        self._exchange = MetricsExchange(worker) if worker is not None else None
        self.core = core = RoutingCore(config, _Hooks(self), self._shared)
        self.pools = core.pools
        self.registry = core.registry
        self.replicas: dict[str, ReplicaHandle] = core.registry.handles
        self.fleet: FleetView = core.fleet
        self.prober = core.prober
        self.scraper = core.scraper
        self.catalog = core.catalog
        self.metrics = RouterMetrics(
            lambda: self.fleet.replicas,
            self._exchange.peers if self._exchange else list,
            kv_sources=core.pools.kv_sources,
            index_entries=core.pools.index_entries,
            replica_reports=lambda: self.scraper.reports,
            breaker_states=lambda: {
                name: h.breaker.state.value for name, h in self.replicas.items()
            },
            admission=lambda: (self.admission.active, self.admission.queued),
        )
        self.metrics.parts["pools"] = PoolMetrics(core.pools)
        if core.canary is not None:
            core.canary.on_check = self.metrics.observe_canary
        self._loop_lag = LoopLagMonitor(self.metrics.loop_lag)
        self._started_at = int(time.time())
        limits = config.limits
        # Each worker process enforces its share of every tenant's budget, unless the budget
        # bus shares every process's charges: then each enforces the whole of it.
        shared_budgets = config.tenants.budget_bus is not None
        share = 1.0 if shared_budgets else 1 / max(1, config.listen.workers)
        self.tenants = Tenants(config, TenantMetrics(), share)
        self._budget_bus: BudgetBus | None = None
        if shared_budgets:
            bus = config.tenants
            assert bus.budget_bus is not None
            self._budget_bus = BudgetBus(
                bus.budget_bus, bus.budget_bus_subject, self.tenants, bus.budget_bus_interval_s
            )
        self.metrics.parts["tenants"] = self.tenants.metrics
        self.metrics.parts["buses"] = BusMetrics(self._buses)
        self.chat_parser = chat_parser_for(config.routing)
        self.metrics.parts["tokenizer_caches"] = TokenizerCacheMetrics(
            lambda: [self.chat_parser.counts(), *core.pools.tokenizer_cache_counts()]
        )
        slots = (
            limits.max_concurrent_requests,
            limits.max_queued_requests,
            limits.queue_timeout_s,
            fairness_params(config),
            self.tenants.limits,
            pools_locality(core.pools, time.monotonic),
            pools_cost(core.pools, time.monotonic),
        )
        # timeouts.total_s, checked on a tick of a tenth of it (at most 1 s): see deadlines.py.
        total_s = config.timeouts.total_s
        self._deadlines = Deadlines(min(1.0, total_s / 10)) if total_s else None
        t = config.timeouts
        forwarding = (
            core.pools,
            self.registry,
            self.metrics,
            Timeouts(t.first_byte_s, t.first_token_s, t.idle_s),
            config.decision_headers,
        )
        self.auth = Auth(config.auth)
        self.tracing: Tracing | None = None
        make_pipeline: type[RequestPipeline] | functools.partial[TracedPipeline] = RequestPipeline
        if config.tracing.otlp_endpoint is None:
            self.admission = Admission(*slots)
            self.forwarder = Forwarder(*forwarding)
        else:
            # Chosen once, here: only with tracing on is OpenTelemetry imported and the path's
            # parts the traced subclasses (traced.py); off, nothing on the path knows of it.
            from .traced import TracedAdmission, TracedForwarder, TracedPipeline
            from .tracing import Tracing

            tracing = self.tracing = Tracing(config.tracing)
            self.admission = TracedAdmission(tracing, *slots)
            self.forwarder = TracedForwarder(tracing, *forwarding)
            make_pipeline = functools.partial(TracedPipeline, tracing=tracing)
        if self._budget_bus is not None and config.fairness.share_bus:
            # The same bus carries what this fair queue served each tenant (router/budget_bus.py).
            self._budget_bus.fair = self.admission.fair
            if config.fairness.share_slots:
                # And its slots and tenants' demand: each tenant admitted up to its part of the
                # fleet's slots (kvcore/fleet_slots.py).
                self._budget_bus.share_slots(self.admission, config.fairness.share_slots_max_factor)
        # Off for a policy that reads no prefixes: nothing is keyed, nothing to compare.
        self.parity: ParityChecker | None = None
        if config.parity.enabled and any(p.keys.wanted for p in core.pools):
            self.parity = ParityChecker(
                config.parity,
                core.pools.of_replica,
                lambda: {name: h.base_url for name, h in self.replicas.items()},
                lambda: self.scraper.reports,
                core.follows_events,
                self.metrics.registry,
            )
        self.pipeline = make_pipeline(
            config,
            auth=self.auth,
            admission=self.admission,
            deadlines=self._deadlines,
            catalog=self.catalog,
            pools=core.pools,
            registry=self.registry,
            forwarder=self.forwarder,
            metrics=self.metrics,
            retry_after_s=max(1, math.ceil(config.health.interval_s)),
            parity=self.parity,
            tenants=self.tenants,
            token_paths=core.token_path,
        )
        # The batch lane (/v1/files, /v1/batches, /v1/messages/batches), when configured; its metrics always exist.
        # GET /v1/responses/{id}: from the replica that stores it.
        self.stored_response_lookup = StoredResponseLookup(
            self.pipeline.stored_responses, self.registry, self.auth, config.timeouts.first_byte_s
        )
        self.batch_metrics = BatchMetrics()
        self.metrics.parts["batch"] = self.batch_metrics
        self.batch: BatchLane | None = None
        if config.batch is not None:
            self.batch = BatchLane(
                config.batch,
                self.pipeline,
                self.admission,
                self.fleet,
                self.auth,
                self.tenants,
                self.batch_metrics,
            )
        # Set when SIGTERM starts the drain: /ready says 503 so load balancers stop sending.
        self.draining = False
        self.status = StatusFeed(
            lambda: self.replicas,
            lambda: self.scraper.reports,
            self.metrics.registry,
            self.forwarder.recent,
            self._status_header,
            self._status_checks,
            lambda: self.tenants.summary(self.admission.fair, time.monotonic()),
            agents=lambda: agents_summary(self.pipeline.session_metrics, self.admission.fair),
            fleet_fields=lambda name: self.fleet_control.row_fields(name),
            parity=lambda: self.parity.snapshot() if self.parity is not None else None,
            rollout=lambda: self.fleet_control.progress(),
            canary_enabled=config.canary.enabled,
            kv_tiers=core.pools.kv_tiers,
        )
        self._worker_index = worker.index if worker is not None else None
        # Fleet changes while serving: add/remove replicas, rollouts, the autoscaler.
        self.fleet_control = FleetControl(
            config, core, self.auth, lambda: self.forwarder.client, launched, pool_fleets
        )
        self.metrics.parts["fleet"] = self.fleet_control.metrics
        self._status_closing = asyncio.Event()  # set at shutdown: open /status streams end

    # The single pool's parts (``RoutingCore``'s; they raise with several model pools).

    @property
    def index(self) -> PrefixIndex:
        return self.core.index

    @property
    def keys(self) -> PromptKeys:
        return self.core.keys

    @property
    def kv_events(self) -> KVEventSubscribers:
        return self.core.kv_events

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @property
    def ledger(self) -> DispatchLedger:
        return self.core.ledger

    @property
    def tokenizer(self) -> PromptTokenizer | None:
        return self.keys.tokenizer

    def block_size(self) -> int:
        return self.keys.block_size()

    # -- lifecycle ---------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        handler = self.pipeline.handler
        routes = app.router
        expect = _expect_handler(self.config.limits.max_body_bytes)
        routes.add_post("/v1/completions", handler(parse_completion), expect_handler=expect)
        chat = handler(self.chat_parser)
        routes.add_post("/v1/chat/completions", chat, expect_handler=expect)
        # The agent APIs, as vLLM serves them (router/agent_request.py).
        messages = handler(parse_messages, errors.ANTHROPIC)
        routes.add_post("/v1/messages", messages, expect_handler=expect)
        count_tokens = handler(parse_count_tokens, errors.ANTHROPIC)
        routes.add_post("/v1/messages/count_tokens", count_tokens, expect_handler=expect)
        routes.add_post("/v1/responses", handler(parse_responses), expect_handler=expect)
        routes.add_get(
            STORED_RESPONSE_PATH, self.stored_response_lookup.handle_get, expect_handler=expect
        )
        routes.add_get("/v1/models", self.handle_models, expect_handler=expect)
        if self.batch is not None:
            self.batch.add_routes(routes)
        else:
            off_routes(routes)
            messages_off_routes(routes)
        routes.add_get("/health", self.handle_health, expect_handler=expect)
        routes.add_get("/ready", self.handle_ready, expect_handler=expect)
        if self.config.metrics.enabled:
            routes.add_get("/metrics", self.handle_metrics, expect_handler=expect)
        routes.add_get("/admin/replicas", self.handle_admin_replicas, expect_handler=expect)
        routes.add_get("/admin/tenants", self.handle_admin_tenants, expect_handler=expect)
        routes.add_get(warm_start.PATH, self.handle_index_snapshot, expect_handler=expect)
        routes.add_post(
            "/admin/replicas/{name}/unquarantine", self.handle_unquarantine, expect_handler=expect
        )
        self.fleet_control.add_routes(routes, expect)
        routes.add_get("/status", self.handle_status_page, expect_handler=expect)
        routes.add_get("/status/events", self.handle_status_events, expect_handler=expect)
        # Last: what no route above serves gets a JSON 404 or 405.
        routes.add_route("*", "/{unrouted:.*}", _unrouted, expect_handler=expect)
        app.on_startup.append(self._on_startup)
        # Before the server waits for handlers to finish: a status stream never would.
        app.on_shutdown.append(self._end_status_streams)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.forwarder.client = UpstreamClient(self.config.timeouts.connect_s)
        self._loop_lag.start()
        if self._deadlines is not None:
            self._deadlines.start()
        await self.core.start()
        if self.batch is not None:
            await self.batch.start()
        if self.parity is not None:
            self.parity.start()
        if self._exchange is not None:
            self._exchange.start(self.metrics)
        if self._budget_bus is not None:
            await self._budget_bus.start()
        await self._start_ledger_buses()
        self.fleet_control.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self.batch is not None:
            await self.batch.close()  # its lines go back to the queue while the client is open
        await self.fleet_control.close()
        await self.stored_response_lookup.close()
        self._loop_lag.close()
        if self._deadlines is not None:
            await self._deadlines.close()
        if self.parity is not None:
            await self.parity.close()
        for pool in self.core.pools:
            if pool.bus is not None:
                await pool.bus.close()
        await self.core.close()
        if self._budget_bus is not None:
            await self._budget_bus.close()
        if self._exchange is not None:
            await self._exchange.close(self.metrics)
        if self.forwarder.client is not None:
            self.forwarder.client.close()
        if self.tracing is not None:
            await self.tracing.close()  # the last spans are exported before the router exits

    async def _start_ledger_buses(self) -> None:
        """routing.ledger_bus: each pool's dispatches shared with the other routers (a subject
        per pool where there are several, so only the same model's ledgers meet)."""
        routing = self.config.routing
        if routing.ledger_bus is None:
            return
        pools = list(self.core.pools)
        for pool in pools:
            subject = routing.ledger_bus_subject
            if len(pools) > 1:
                subject = f"{subject}.{pool.name}"
            bus = LedgerBus(routing.ledger_bus, subject, pool.ledger)
            await bus.start()
            pool.bus = bus

    # -- router endpoints --------------------------------------------------------------

    async def handle_models(self, request: web.Request) -> web.Response:
        try:  # as vLLM's --api-key and OpenAI's API keep it: a /v1 route like the others
            self.auth.check_client(request)
        except errors.ApiError as exc:
            return exc.response()
        data = [
            {"id": model, "object": "model", "created": self._started_at, "owned_by": "kvroute"}
            for model in self.catalog.names
        ]
        return _json({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        healthy = self.registry.in_rotation()
        # Not before the tokenizer is loaded: the first long prompts would wait seconds for it.
        warming = any(pool.keys.warming for pool in self.pools)
        ready = healthy > 0 and not self.draining and not warming
        body = {
            "ready": ready,
            "healthy_replicas": healthy,
            "replicas": len(self.registry),
            "draining": self.draining,
            "tokenizer_loading": warming,
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
                    # A data-parallel replica's ranks, one row each (router/dp_ranks.py).
                    "replica": replica_of(name),
                    "data_parallel_rank": handle.data_parallel_rank,
                    "healthy": state.healthy,
                    "ejected": state.ejected or handle.panic,
                    # Ejected, yet taking traffic: nothing else serves its model (panic).
                    "panic": handle.panic,
                    # Out of new routing while it drains (or until a replacement is checked).
                    "draining": state.draining,
                    **self.fleet_control.row_fields(name),
                    "breaker": breaker.state.value,
                    "breaker_reason": breaker.last_reason or None,
                    # Why its last health probe failed (null while healthy).
                    "down_reason": None if state.healthy else handle.down_reason,
                    "ejected_for_s": round(max(0.0, breaker.open_until - now), 3)
                    if breaker.state is BreakerState.OPEN
                    else 0.0,
                    # Unix time it left rotation (null while in rotation).
                    "out_since": handle.out_since,
                    "in_flight": state.in_flight,
                    "models": sorted(state.models) if state.models is not None else None,
                    "kv_capacity_tokens": state.kv_capacity_tokens,
                    # Its speed against the others' as configured (replicas[].speed): where its
                    # latency lines started.
                    "speed": state.speed,
                    # Its learnt latency lines (kv_aware with cost_unit time or speed, or an
                    # slo:), else null.
                    "latency": state.latency.describe() if state.latency is not None else None,
                    **_drift_fields(handle),
                }
            )
        return _json(
            {"replicas": rows, "draining": self.draining, "rollout": self.fleet_control.progress()}
        )

    async def handle_admin_tenants(self, request: web.Request) -> web.Response:
        """Each tenant's settings, usage, queue and budget state (this worker's)."""
        try:
            self.auth.check_admin(request)
        except errors.ApiError as exc:
            return exc.response()
        return _json(self.tenants.snapshot(self.admission.fair, time.monotonic()))

    def _buses(self) -> list[tuple[str, Bus]]:
        """The NATS buses this router runs (bus_metrics.py)."""
        buses: list[tuple[str, Bus]] = [("dispatch", p.bus) for p in self.pools if p.bus]
        if self._budget_bus is not None:
            buses.append(("budget", self._budget_bus))
        return buses

    async def handle_index_snapshot(self, request: web.Request) -> web.Response:
        """A pool's prefix index for a starting router (router/warm_start.py)."""
        return warm_start.snapshot_response(request, self.auth, self.pools)

    async def handle_unquarantine(self, request: web.Request) -> web.Response:
        """Back into rotation now (after fixing it, say); the next canary round judges it anew."""
        try:
            self.auth.check_admin(request)
        except errors.ApiError as exc:
            return exc.response()
        name = request.match_info["name"]
        handle = self.replicas.get(name)
        if handle is None:
            message = f"no replica named {name!r}"
            return errors.ApiError(404, message, param="name", code="not_found").response()
        was = handle.drift.quarantined
        handle.drift.quarantined, handle.drift.quarantined_at = False, None
        handle.drift.quarantine = None
        handle.state.quarantined = False
        self.registry.probed()
        if was:
            log.info("replica %s taken out of quarantine by an admin", name)
        return _json({"name": name, "was_quarantined": was, **_drift_fields(handle)})

    # -- the status page (router/status.py) ------------------------------------------

    async def handle_status_page(self, request: web.Request) -> web.Response:
        """The page itself is open (it holds no data); its data needs the admin key."""
        headers = {"Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}
        return web.Response(body=page_html(), content_type="text/html", headers=headers)

    async def handle_status_events(self, request: web.Request) -> web.StreamResponse:
        """The status as one JSON document, or with ``Accept: text/event-stream`` as a stream
        of them, one a second: built only while someone is looking."""
        try:
            self.auth.check_admin(request)
        except errors.ApiError as exc:
            return exc.response()
        if "text/event-stream" not in request.headers.get("Accept", ""):
            response = web.Response(body=self._status_json(), content_type="application/json")
            response.headers["Cache-Control"] = "no-store"
            return response
        stream = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # proxies such as nginx would hold the events back
            }
        )
        await stream.prepare(request)
        closing = self._status_closing
        try:
            while not closing.is_set() and not self.draining:
                await stream.write(b"data: " + self._status_json() + b"\n\n")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STATUS_TICK_S):
                        await closing.wait()
            await stream.write_eof()
        except ConnectionResetError:
            pass  # the viewer went away
        return stream

    def _status_json(self) -> bytes:
        if self._shared is not None:
            self._shared.totals_into(self.fleet.replicas)  # every worker's in-flight, as /metrics
        return self.status.json()

    def _status_header(self) -> dict[str, object]:
        active, queued = self.admission.active, self.admission.queued
        return {
            "policy": self.pools.describe_policies(),
            # Model pools: name, model ("*": any) and policy each.
            "pools": [
                {"name": p.name, "model": p.model or "*", "policy": p.policy.name}
                for p in self.pools
            ],
            "draining": self.draining,
            "started_at": self._started_at,
            "worker": self._worker_index,
            "active_requests": active,
            "queued_requests": queued,
        }

    def _status_checks(self) -> dict[str, object]:
        parity = self.parity
        if parity is None:
            return {"parity": "off (no prefix keys to check)"}
        snapshot = parity.snapshot()
        if snapshot["alarm"]:
            return {"parity": "ALARM: " + snapshot["finding"]["detail"], "alarm": True}
        agreed = sum(c["count"] for c in snapshot["checks"] if c["result"] == "agree")
        return {"parity": f"ok ({agreed} checks agreed)"} if agreed else {}

    async def _end_status_streams(self, app: web.Application) -> None:
        self._status_closing.set()

    async def handle_metrics(self, request: web.Request) -> web.Response:
        try:
            self.auth.check_admin(request, open_without_key=True)
        except errors.ApiError as exc:
            return exc.response()
        if self._shared is not None:
            self._shared.totals_into(self.fleet.replicas)
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response


class _Hooks:
    """What the replica registry asks of the router's other parts."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def ejected(self, handle: ReplicaHandle, kind: str) -> None:
        self._router.metrics.observe_ejection(handle.name, kind)

    def abandon_waiting(self, handle: ReplicaHandle, why: str) -> int:
        client = self._router.forwarder.client
        return client.abandon_waiting(handle.base_url, why) if client is not None else 0

    async def responds(self, handle: ReplicaHandle) -> bool:
        return await self._router.core.prober.responds(handle.base_url)


def _expect_handler(max_body_bytes: int) -> Callable[[web.Request], Awaitable[web.Response | None]]:
    """Answer ``Expect: 100-continue``, unless the body announced is over the limit (a 413
    now, before the client sends it); refuse any other expectation with a 417. Errors in the
    shape of the route's API."""

    async def expect(request: web.Request) -> web.Response | None:
        shape = errors.shape_of_path(request.path)
        refused: web.Response | None = None
        if request.headers.get("Expect", "").lower() != "100-continue":
            message = "Only 'Expect: 100-continue' is supported."
            error = errors.ApiError(417, message, param="Expect", code="expectation_failed")
            refused = error.response(shape)
        elif request.content_length is not None and request.content_length > max_body_bytes:
            refused = errors.body_too_large(max_body_bytes).response(shape)
        if refused is not None:
            # The body may still come (or never): the connection ends with the answer, or its
            # next request would be read from the body's bytes.
            refused.force_close()
            return refused
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own: an error after it still answers
        return None

    return expect


async def _unrouted(request: web.Request) -> web.Response:
    """A path no route serves (404), or a method its route does not take (405), as a JSON
    error in the shape of the API the path belongs to (aiohttp's own are plain text)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is request.match_info.route.resource:
            continue  # this catch-all
        _, takes = await resource.resolve(request)
        allowed |= takes
    shape = errors.shape_of_path(request.path)
    path = request.path if len(request.path) <= 200 else request.path[:200] + "..."
    if allowed:
        methods = ", ".join(sorted(allowed))
        error = errors.ApiError(
            405,
            f"Method {request.method} is not allowed on {path}: use {methods}.",
            error_type="method_not_allowed",
            code="method_not_allowed",
            headers={"Allow": methods},
        )
    else:
        error = errors.ApiError(
            404, f"No route serves {path}.", error_type="NotFoundError", code="not_found"
        )
    return error.response(shape)


def _drift_fields(handle: ReplicaHandle) -> dict[str, object]:
    """What the output-drift canary says of a replica, for /admin/replicas."""
    drift = handle.drift
    return {
        "quarantined": drift.quarantined,
        "quarantine_reason": "drift" if drift.quarantined else None,
        # The first divergent position and both continuations (null unless quarantined).
        "drift": drift.quarantine.to_dict() if drift.quarantine is not None else None,
        "canary": drift.to_dict(),
    }


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )
