"""Several router processes on one port: shared load, whole-router metrics, clean shutdown."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys

import aiohttp

from kvroute.backends.process import free_ports
from kvroute.kvcore.stats import parse_metrics
from kvroute.policies import ReplicaState
from kvroute.router.loadboard import LoadBoard

from .conftest import StartReplica
from .helpers import children_of, wait_until


def _add_load(board: LoadBoard) -> None:
    board.add(worker=1, replica=0, requests=3, tokens=300)
    board.add(worker=1, replica=1, requests=1, tokens=10)


def test_load_board_sums_every_workers_row_across_processes() -> None:
    board = LoadBoard(workers=2, replicas=2)
    board.add(worker=0, replica=0, requests=2, tokens=50)
    child = multiprocessing.get_context("fork").Process(target=_add_load, args=(board,))
    child.start()
    child.join()
    states = [ReplicaState("a"), ReplicaState("b")]
    board.totals_into(states)
    assert (states[0].in_flight, states[0].in_flight_tokens) == (5, 350)
    assert (states[1].in_flight, states[1].in_flight_tokens) == (1, 10)
    board.clear_row(1)
    board.totals_into(states)
    assert (states[0].in_flight, states[1].in_flight) == (2, 0)


async def test_two_workers_serve_one_port_and_report_all_requests(
    start_replica: StartReplica,
) -> None:
    a = await start_replica("a")
    b = await start_replica("b")
    port = free_ports(1)[0]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "serve", "--workers", "2", "--port", str(port),
        "--replica", a.url, "--replica", b.url, "--policy", "round_robin",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                try:
                    async with http.get(url + "/ready") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    return False

            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while not await ready():
                assert loop.time() < deadline, "router did not become ready"
                await asyncio.sleep(0.05)

            async def one() -> int:
                # A new connection each time, so the kernel spreads them over both workers.
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.post(
                        url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
                    ) as resp:
                        await resp.read()
                        return resp.status

            statuses = await asyncio.gather(*(one() for _ in range(40)))
            assert statuses == [200] * 40

            async def total_reported() -> float:
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                return parse_metrics(text).sum("kvroute_requests_total")

            # Each worker publishes its counters about once a second; any scrape must add up.
            deadline = loop.time() + 10
            while (reported := await total_reported()) != 40:
                assert loop.time() < deadline, f"/metrics reports {reported} requests, not 40"
                await asyncio.sleep(0.1)
        assert len(a.seen) + len(b.seen) == 40 and a.seen and b.seen
        workers = children_of(process.pid)
        assert len(workers) == 2
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            await process.wait()
    stderr = (await process.stderr.read()).decode()  # type: ignore[union-attr]
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert stderr.count("listening on") == 2
    await wait_until(
        lambda: not any(os.path.exists(f"/proc/{w}") for w in workers), what="workers to exit"
    )
