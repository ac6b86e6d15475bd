"""Run the router until SIGINT/SIGTERM, on uvloop."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from collections.abc import Sequence

import uvloop
from aiohttp import web

from kvroute.backends.launcher import LaunchedFleet

from .client_faults import quiet_client_faults
from .config import Config
from .fd_limit import needed_fds, raise_fd_limit
from .malloc_tuning import tune_malloc
from .server import Router
from .workers import WorkerContext

log = logging.getLogger(__name__)


def app_runner(router: Router) -> web.AppRunner:
    """The aiohttp runner for a router, with the connection-level settings of its config."""
    config = router.config
    quiet_client_faults()
    return web.AppRunner(
        router.build_app(),
        handler_cancellation=True,  # a client that disconnects cancels its handler at once
        access_log=None,  # no logging on the hot path
        # In-flight requests get this long to finish once SIGTERM starts the drain.
        shutdown_timeout=config.shutdown.drain_timeout_s,
        # A connection that completes no request in this long is closed: idle keep-alive, and
        # clients that send their headers too slowly (aiohttp starts this timer on connect).
        keepalive_timeout=config.timeouts.client_idle_s,
    )


def bound_port(runner: web.AppRunner, asked: int) -> int:
    """The TCP port the runner's site listens on (``asked`` where it cannot tell)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return asked


async def serve_forever(
    config: Config,
    context: WorkerContext | None = None,
    launched: LaunchedFleet | None = None,
    pool_fleets: Sequence[LaunchedFleet] = (),
) -> None:
    router = Router(config, context, launched, pool_fleets)
    runner = app_runner(router)
    await runner.setup()
    site = web.TCPSite(
        runner,
        config.listen.host,
        config.listen.port,
        backlog=2048,
        reuse_port=context is not None,  # workers share the port
    )
    await site.start()
    settle_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    healthy = sum(1 for r in router.fleet.replicas if r.healthy)
    worker = f" worker {context.index}" if context is not None else ""
    # The port bound, not the one asked for: listen.port 0 takes any free one, and this line is
    # how a script that started the router learns which.
    port = bound_port(runner, config.listen.port)
    print(
        f"kvroute{worker} listening on http://{config.listen.host}:{port} "
        f"(policy {router.pools.describe_policies()}, {healthy}/{len(router.replicas)} "
        "replicas healthy)",
        file=sys.stderr,
        flush=True,
    )
    for handle in router.replicas.values():  # say which replica is out and why, not just a count
        if not handle.state.healthy:
            print(
                f"kvroute{worker}: replica {handle.name} is down: "
                f"{handle.down_reason or 'no health probe yet'}",
                file=sys.stderr,
                flush=True,
            )
    try:
        await stop.wait()
    finally:
        router.draining = True
        in_flight = router.admission.active
        print(
            f"kvroute{worker} draining: no new connections, {in_flight} requests in flight "
            f"get up to {config.shutdown.drain_timeout_s:g}s to finish",
            file=sys.stderr,
            flush=True,
        )
        await runner.cleanup()
        print(f"kvroute{worker} stopped", file=sys.stderr, flush=True)


# Young-generation collections every this many tracked allocations (CPython's default is 700).
GC_GEN0_THRESHOLD = 20_000


def settle_heap() -> None:
    """Keep the garbage collector off the latency tail.

    Measured with the overhead bench (round_robin, 2 stub replicas, wrk c=32): a full collection
    of the router's ~70k startup objects (modules, functions, types) took 45-97 ms on the 2-core
    dev box, so every one of them stalled every request in flight (p99 57-71 ms instead of
    17-21 ms). Freezing what exists after startup takes it out of every later collection, and a
    larger young generation makes collections rarer (each still only visits young objects).
    Large request buffers stay on the heap (``malloc_tuning``).
    """
    tune_malloc()
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def check_can_listen(host: str, port: int) -> str | None:
    """Why the router could not listen on host:port, or None. Checked before any worker starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def run(
    config: Config,
    context: WorkerContext | None = None,
    launched: LaunchedFleet | None = None,
    pool_fleets: Sequence[LaunchedFleet] = (),
) -> None:
    """``launched``: the replicas this process started (launch:), which the router may then
    replace, add and stop (rollouts, the admin API, the autoscaler); one worker only.
    ``pool_fleets``: the model pools' launched replicas (the admin API may remove them)."""
    limits = config.limits
    raise_fd_limit(needed_fds(limits.max_concurrent_requests, limits.max_queued_requests))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve_forever(config, context, launched, pool_fleets))
