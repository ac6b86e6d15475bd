"""Durability: ``kill -9`` of the router in the middle of a batch, then a restart on the same
store. Every line ends with exactly one result, and no line whose result was stored before the
kill runs again (counted on the replicas, which record each answer they finished)."""

from __future__ import annotations

import asyncio
import io
import signal
import sqlite3
import sys
from pathlib import Path

import openai
import pytest
import yaml

from kvroute.backends.process import free_ports

from .conftest import StartReplica
from .helpers import wait_until
from .test_batch import chat_line, jsonl, lines_of, wait_status

LINES = 200


def stored_results(db: Path) -> set[int]:
    with sqlite3.connect(db) as conn:
        return {row[0] for row in conn.execute("SELECT line_no FROM kvr_results")}


async def start_router(config: Path, port: int) -> asyncio.subprocess.Process:
    with open(config.parent / "router.log", "ab") as log:  # read it when this test fails
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config), stderr=log
        )
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    async def up() -> bool:
        try:
            await client.models.list()
            return True
        except openai.APIConnectionError:
            return False

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not await up():
        assert process.returncode is None, "the router exited"
        assert loop.time() < deadline, "the router did not start"
        await asyncio.sleep(0.1)
    return process


@pytest.mark.slow
async def test_kill_9_mid_batch_then_restart_loses_and_repeats_nothing(
    start_replica: StartReplica, tmp_path: Path
) -> None:
    replicas = [await start_replica(name) for name in ("a", "b")]
    for replica in replicas:
        replica.delay_s = 0.1  # a batch of 200 takes a few seconds: time to kill it mid-way
    (port,) = free_ports(1, "127.0.0.1")
    db = tmp_path / "batches.db"
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "replicas": [{"url": r.url, "name": r.name} for r in replicas],
                "health": {"interval_s": 0.2},
                "batch": {
                    "store": f"sqlite:///{db}",
                    "poll_s": 0.05,
                    "lease_s": 2.0,
                    "max_in_flight_per_replica": 4,
                },
            }
        )
    )
    router = await start_router(config, port)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    lines = [chat_line(f"line-{i}", f"line {i}") for i in range(LINES)]
    uploaded = await client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    try:
        await wait_until(lambda: len(stored_results(db)) >= LINES // 4, 30, "a quarter stored")
        router.send_signal(signal.SIGKILL)
        await router.wait()
        before = stored_results(db)  # what the store held when the router died
        assert LINES // 4 <= len(before) < LINES
        router = await start_router(config, port)
        # A new client: the old one's pooled connections died with the router.
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        done = await wait_status(client, batch.id, {"completed"}, timeout_s=60)
        output = await lines_of(client, done.output_file_id)
    finally:
        if router.returncode is None:
            router.send_signal(signal.SIGKILL)
            await router.wait()
    assert done.request_counts is not None and done.request_counts.completed == LINES
    assert sorted(o["custom_id"] for o in output) == sorted(f"line-{i}" for i in range(LINES))
    assert done.error_file_id is None
    finished: dict[str, int] = {}
    for replica in replicas:
        for prompt in replica.completed:
            finished[prompt] = finished.get(prompt, 0) + 1
    # Every line was answered; a line stored before the kill was never run again. (A line in
    # flight at the kill may have run twice: its first answer was never stored.)
    assert set(finished) == {f"line {i}" for i in range(LINES)}
    repeated = {p for p, n in finished.items() if n > 1}
    assert {f"line {no - 1}" for no in before} & repeated == set()
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"].startswith("hello")
