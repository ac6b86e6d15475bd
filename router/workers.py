"""Several router processes on one port, for more than one core's worth of traffic.

Python runs one event loop per core, so ``--workers N`` forks N processes that each run
the whole router and accept on the same port (SO_REUSEPORT: the kernel spreads
connections). They share in-flight load through a ``LoadBoard`` and publish their
counters to each other through small files, so every worker routes by the fleet's whole
load and every /metrics scrape reports the whole router. Each worker probes health on its
own. The supervisor restarts a worker that dies and stops them all on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import msgspec

from .config import Config
from .loadboard import LoadBoard
from .metrics import RouterMetrics, Snapshot

log = logging.getLogger(__name__)

# How often each worker publishes its counters for the others' /metrics.
PUBLISH_INTERVAL_S = 1.0
RESTART_BACKOFF_S = 1.0


@dataclass(frozen=True)
class WorkerContext:
    index: int
    count: int
    board: LoadBoard
    metrics_dir: Path


class MetricsExchange:
    """Each worker writes its snapshot to ``worker-<i>.msgpack``; readers merge the others'."""

    def __init__(self, context: WorkerContext) -> None:
        self._context = context
        self._path = context.metrics_dir / f"worker-{context.index}.msgpack"
        self._task: asyncio.Task[None] | None = None

    def peers(self) -> list[Snapshot]:
        snapshots = []
        for i in range(self._context.count):
            if i == self._context.index:
                continue
            path = self._context.metrics_dir / f"worker-{i}.msgpack"
            with contextlib.suppress(OSError, msgspec.DecodeError):
                snapshots.append(msgspec.msgpack.decode(path.read_bytes()))
        return snapshots

    def publish(self, metrics: RouterMetrics) -> None:
        tmp = self._path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode(metrics.snapshot()))
        os.replace(tmp, self._path)  # readers never see a half-written file

    def start(self, metrics: RouterMetrics) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(PUBLISH_INTERVAL_S)
                try:
                    self.publish(metrics)
                except OSError:
                    log.exception("cannot publish metrics for the other workers")

        self._task = asyncio.create_task(loop(), name="kvroute-metrics-exchange")

    async def close(self, metrics: RouterMetrics) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(OSError):
            self.publish(metrics)  # the last counts survive the worker


def _worker_main(config: Config, context: WorkerContext) -> None:
    from .runner import run  # imported here: the supervisor needs no event loop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when to stop
    run(config, context)


def run_workers(config: Config) -> None:
    """Start ``config.listen.workers`` workers and supervise them until SIGINT/SIGTERM."""
    count = config.listen.workers
    ctx = multiprocessing.get_context("fork")  # the board's shared memory is inherited
    board = LoadBoard(count, len(config.replicas))
    metrics_dir = Path(tempfile.mkdtemp(prefix="kvroute-metrics-"))
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def spawn(index: int) -> BaseProcess:
        context = WorkerContext(index, count, board, metrics_dir)
        process = ctx.Process(
            target=_worker_main, args=(config, context), name=f"kvroute-worker-{index}"
        )
        process.start()
        return process

    processes = [spawn(i) for i in range(count)]
    print(f"kvroute supervisor: {count} workers", file=sys.stderr, flush=True)
    try:
        while not stopping:
            time.sleep(0.2)
            for i, process in enumerate(processes):
                if not process.is_alive() and not stopping:
                    print(
                        f"kvroute worker {i} exited with {process.exitcode}; restarting",
                        file=sys.stderr,
                        flush=True,
                    )
                    board.clear_row(i)
                    time.sleep(RESTART_BACKOFF_S)
                    processes[i] = spawn(i)
    finally:
        for process in processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        for process in processes:
            process.join()
        shutil.rmtree(metrics_dir, ignore_errors=True)
