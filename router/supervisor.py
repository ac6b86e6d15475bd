"""The ``--workers N`` supervisor: fork N router workers, restart one that dies, stop them all.

Each worker runs the whole router (``runner.run``); what they share is in ``workers``.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

from .config import Config
from .loadboard import LoadBoard
from .pool_config import all_replicas
from .runner import run
from .workers import WorkerContext

RESTART_BACKOFF_S = 1.0


def _worker_main(config: Config, context: WorkerContext) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when to stop
    run(config, context)


def run_workers(config: Config) -> None:
    """Start ``config.listen.workers`` workers and supervise them until SIGINT/SIGTERM."""
    count = config.listen.workers
    ctx = multiprocessing.get_context("fork")  # the board's shared memory is inherited
    board = LoadBoard(count, len(all_replicas(config)))  # every model pool's, pool by pool
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
