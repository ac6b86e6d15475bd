"""``kvroute epp``: the picker's three ports and its endpoint set.

* ``grpc_port``: Envoy's ``ExternalProcessor`` (plaintext, or TLS), and gRPC health for the
  gateway's own health check of the picker cluster.
* ``health_port``: ``grpc.health.v1`` for kubelet probes: ``liveness`` is SERVING while the
  process runs; ``readiness``, ``""``, ``inference-extension`` and the ext_proc service name
  only once the endpoint set has synced (static endpoints probed once, or the InferencePool
  and its pods listed).
* ``metrics_port``: Prometheus ``/metrics``, and ``GET /admin/index-snapshot`` (the admin key)
  for a picker or router that warm-starts from this one (router/warm_start.py).

Endpoints are the static ``replicas`` (``--endpoint``), or an ``InferencePool`` watched in
Kubernetes (``epp.pool_name``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import warm_start
from ..auth import Auth
from ..bus_metrics import Bus, BusMetrics
from ..config import Config, ReplicaConfig
from ..runner import settle_heap
from . import service
from .endpoints import url_of_address
from .h2_grpc import GrpcServer
from .health_service import HealthBoard
from .picker import EndpointPicker
from .tls import server_context

if TYPE_CHECKING:
    from kvroute.backends.kubernetes import InferencePoolWatcher, PoolEndpoint

    from ..budget_bus import BudgetBus

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Served once synced: the protocol's names, the empty name, and the reference chart's.
READINESS_SERVICES = ("readiness", "", EXT_PROC_SERVICE, "inference-extension")


@dataclass(slots=True)
class Ports:
    grpc: int
    health: int
    metrics: int


class PickerServer:
    """The picker with its gRPC, health and metrics servers; ``start`` then ``stop``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.picker = EndpointPicker(config, destinations=config.epp.destinations)
        self.health = HealthBoard()
        self._grpc: GrpcServer | None = None
        self._health_server: GrpcServer | None = None
        self._metrics: web.AppRunner | None = None
        self._watcher: InferencePoolWatcher | None = None
        self._apply_task: asyncio.Task[None] | None = None
        self.ports = Ports(0, 0, 0)
        self.synced = asyncio.Event()
        self._budget_bus: BudgetBus | None = None  # tenants.budget_bus: budgets shared
        self.picker.metrics.parts["buses"] = BusMetrics(self._buses)

    def _buses(self) -> list[tuple[str, Bus]]:
        """The NATS buses this picker runs (router/bus_metrics.py)."""
        buses: list[tuple[str, Bus]] = []
        if self.picker.bus is not None:
            buses.append(("dispatch", self.picker.bus))
        if self._budget_bus is not None:
            buses.append(("budget", self._budget_bus))
        return buses

    async def start(self) -> Ports:
        epp = self.config.epp
        self._set_health(("liveness",), serving=True)
        self._set_health(READINESS_SERVICES, serving=False)
        # A body of up to max_body_bytes comes in one message in BUFFERED mode.
        max_message = max(4 << 20, self.config.limits.max_body_bytes + (64 << 10))
        limits = epp.h2.limits()
        self._grpc = GrpcServer(
            {**service.handlers(self.picker), **self.health.handlers()},
            max_message_bytes=max_message,
            limits=limits,
        )
        self._health_server = GrpcServer(self.health.handlers(), limits=limits)
        metrics_port = await self._start_metrics(epp.host, epp.metrics_port)
        await self.picker.start()
        if epp.ledger_bus:
            from ..ledger_bus import LedgerBus

            bus = LedgerBus(epp.ledger_bus, epp.ledger_bus_subject, self.picker.ledger)
            await bus.start()
            self.picker.bus = bus
        tenants = self.config.tenants
        if tenants.budget_bus:
            from ..budget_bus import BudgetBus

            self._budget_bus = BudgetBus(
                tenants.budget_bus,
                tenants.budget_bus_subject,
                self.picker.tenants,
                tenants.budget_bus_interval_s,
                self.picker.admission.fair if self.config.fairness.share_bus else None,
            )
            await self._budget_bus.start()
            if self.config.fairness.share_slots:
                # The picker's admission is not wired to the fleet's slots (kvroute serve's is).
                log.warning(
                    "fairness.share_slots: kvroute serve only; the endpoint picker shares "
                    "tenants' service (share_bus) and admits by its own limit"
                )
        tls = server_context(epp.cert, epp.key) if epp.tls else None
        grpc_port = await self._grpc.start(epp.host, epp.grpc_port, ssl=tls)
        health_port = await self._health_server.start(epp.host, epp.health_port)
        self.ports = Ports(grpc_port, health_port, metrics_port)
        if epp.pool_name:
            await self._watch_pool()
        else:
            await self._now_synced()
        return self.ports

    async def _now_synced(self) -> None:
        self._set_health(READINESS_SERVICES, serving=True)
        self.synced.set()

    def _set_health(self, services: tuple[str, ...], *, serving: bool) -> None:
        for name in services:
            self.health.set(name, serving)

    async def _start_metrics(self, host: str, port: int) -> int:
        async def metrics(request: web.Request) -> web.Response:
            body = generate_latest(self.picker.metrics.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        auth = Auth(self.config.auth)
        pools = self.picker.core.pools

        async def index_snapshot(request: web.Request) -> web.Response:
            return warm_start.snapshot_response(request, auth, pools)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        # A starting picker (or router) warms from this one: warm_start.peers names this port.
        app.router.add_get(warm_start.PATH, index_snapshot)
        self._metrics = web.AppRunner(app, access_log=None)
        await self._metrics.setup()
        await web.TCPSite(self._metrics, host, port).start()
        return int(self._metrics.addresses[0][1])

    async def _watch_pool(self) -> None:
        from kvroute.backends.kubernetes import InferencePoolWatcher

        epp = self.config.epp
        assert epp.pool_name is not None
        updates: asyncio.Queue[dict[str, PoolEndpoint] | None] = asyncio.Queue()
        watcher = InferencePoolWatcher(
            epp.pool_name, epp.pool_namespace, updates.put_nowait, kubeconfig=epp.kubeconfig
        )
        self._watcher = watcher
        await watcher.start()
        self._apply_task = asyncio.create_task(self._apply_endpoints(updates, watcher))

    async def _apply_endpoints(
        self,
        updates: asyncio.Queue[dict[str, PoolEndpoint] | None],
        watcher: InferencePoolWatcher,
    ) -> None:
        """Discovery's endpoint sets, in order; ready once the first full list is applied."""
        synced = asyncio.create_task(watcher.synced.wait())
        synced.add_done_callback(lambda _: updates.put_nowait(None))
        while True:
            endpoints = await updates.get()
            if endpoints is not None:
                replicas = [
                    ReplicaConfig(
                        url=url_of_address(e.address),
                        name=e.name,
                        kv_events=e.kv_events[0] if e.kv_events else None,
                        data_parallel_size=e.data_parallel_size,
                        speed=e.speed,
                    )
                    for e in endpoints.values()
                ]
                await self.picker.set_endpoints(replicas, ready=True)
            if watcher.synced.is_set() and not self.synced.is_set():
                await self._now_synced()

    async def stop(self, grace_s: float = 5.0, unready_s: float = 0.0) -> None:
        """Stop: NOT_SERVING first; ``unready_s`` more of taking streams while the gateway's
        health check notices (a delay for another process to act on, not a wait for this
        one), then no new streams and ``grace_s`` for the open ones."""
        self._set_health(READINESS_SERVICES, serving=False)
        if unready_s > 0:
            await asyncio.sleep(unready_s)
        self.health.close_watches()
        task = self._apply_task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._watcher is not None:
            await self._watcher.close()
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._metrics is not None:
            await self._metrics.cleanup()
        if self.picker.bus is not None:
            await self.picker.bus.close()
        if self._budget_bus is not None:
            await self._budget_bus.close()
        await self.picker.close()


async def serve(config: Config) -> None:
    """Run until SIGTERM or SIGINT, then stop taking streams and finish the open ones."""
    server = PickerServer(config)
    ports = await server.start()
    # As the router does: its startup objects frozen out of every collection and rarer young
    # collections (each stream allocates dozens of protobuf and gRPC objects); bodies of
    # 220 KB stay on the heap.
    settle_heap()
    epp = config.epp
    mode = "TLS" if epp.tls else "plaintext"
    source = (
        f"InferencePool {epp.pool_namespace}/{epp.pool_name}"
        if epp.pool_name
        else f"{len(config.replicas)} endpoints"
    )
    print(
        f"kvroute epp: ext_proc on {epp.host}:{ports.grpc} ({mode}), gRPC health on "
        f":{ports.health}, metrics on :{ports.metrics}/metrics; {source}, policy "
        f"{config.policy.name}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(config.shutdown.drain_timeout_s, config.epp.unready_delay_s)
