"""What several router processes on one port share, for more than one core's worth of traffic.

Python runs one event loop per core, so ``--workers N`` forks N processes that each run
the whole router and accept on the same port (SO_REUSEPORT: the kernel spreads
connections). They share in-flight load through a ``LoadBoard`` and publish their
counters to each other through small files, so every worker routes by the fleet's whole
load and every /metrics scrape reports the whole router. Each worker probes health on its
own. The supervisor (``supervisor.py``) starts, restarts and stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvroute.policies import ReplicaState

from .loadboard import LoadBoard
from .metrics import RouterMetrics, Snapshot

log = logging.getLogger(__name__)

# How often each worker publishes its counters for the others' /metrics.
PUBLISH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class WorkerContext:
    index: int
    count: int
    board: LoadBoard
    metrics_dir: Path


class WorkerLoad:
    """This worker's row of the load board, as the dispatch ledger's shared load."""

    def __init__(self, context: WorkerContext) -> None:
        self._board = context.board
        self._worker = context.index

    def add(
        self, replica: int, requests: int, tokens: int, prefilling: int, prefill_tokens: int
    ) -> None:
        self._board.add(self._worker, replica, requests, tokens, prefilling, prefill_tokens)

    def totals_into(self, states: Sequence[ReplicaState], first: int = 0) -> None:
        self._board.totals_into(states, first)


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
