"""`kvroute serve` as a user runs it: starts, serves, stops cleanly, and fails clearly."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import aiohttp

from kvroute.backends.process import free_ports

from .conftest import StartReplica


def test_serve_on_a_busy_port_says_so_without_a_traceback() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvroute.cli",
                "serve",
                "--replica",
                "http://127.0.0.1:9",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


async def test_serve_names_each_replica_that_is_down_and_why() -> None:
    gone, port = free_ports(2)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "serve", "--replica", f"http://127.0.0.1:{gone}",
        "--port", str(port), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        async with asyncio.timeout(20):  # both lines come once it listens
            listening = (await process.stderr.readline()).decode()
            down = (await process.stderr.readline()).decode()
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            await process.wait()
    assert "0/1 replicas healthy" in listening, listening
    assert down == (
        f"kvroute: replica 127.0.0.1:{gone} is down: connection refused to 127.0.0.1:{gone}\n"
    )


async def wait_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            async with http.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        assert loop.time() < deadline, "router did not become ready"
        await asyncio.sleep(0.05)


async def listening_line(process: asyncio.subprocess.Process) -> str:
    """`kvroute serve`'s 'listening on' line, read from its stderr."""
    assert process.stderr is not None
    async with asyncio.timeout(30):
        while line := (await process.stderr.readline()).decode():
            if " listening on " in line:
                return line
    raise AssertionError("kvroute serve exited without listening")


async def test_serve_answers_then_stops_on_sigterm(start_replica: StartReplica) -> None:
    """On port 0 (any free one): the 'listening on' line names the port it took."""
    a = await start_replica("a")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "serve", "--replica", a.url, "--port", "0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    listening = await listening_line(process)
    url = listening.split(" listening on ", 1)[1].split()[0]
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0"), listening
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url)
            async with http.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
            ) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["text"] == "hello from a"
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            await process.wait()
    stderr = (await process.stderr.read()).decode()  # type: ignore[union-attr]
    assert process.returncode == 0, stderr
    assert "draining" in stderr and "stopped" in stderr
    assert "Traceback" not in stderr


async def test_sigterm_drains_in_flight_streams_and_refuses_new_connections(
    start_replica: StartReplica,
) -> None:
    a = await start_replica("a")
    port = free_ports(1)[0]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "serve", "--replica", a.url, "--port", str(port),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    signalled = False
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url)
            body = {"model": "tiny", "prompt": "gate", "stream": True}
            async with http.post(url + "/v1/completions", json=body) as stream:
                first = await stream.content.readuntil(b"\n\n")
                assert b"hello" in first
                process.send_signal(signal.SIGTERM)
                signalled = True

                async def refuses() -> bool:
                    try:
                        _, writer = await asyncio.open_connection("127.0.0.1", port)
                    except OSError:
                        return True
                    writer.close()
                    return False

                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while not await refuses():
                    assert loop.time() < deadline, "still accepting connections after SIGTERM"
                    await asyncio.sleep(0.05)
                assert process.returncode is None  # still finishing the stream
                a.gate.set()
                rest = await stream.read()
            assert rest.endswith(b"data: [DONE]\n\n") and b" a" in rest
    finally:
        # Once signalled it is shutting down: a second SIGTERM in its last moments, after its
        # handler is gone, would kill it (-15) instead of letting it exit 0.
        if process.returncode is None and not signalled:
            process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            await process.wait()
    stderr = (await process.stderr.read()).decode()  # type: ignore[union-attr]
    assert process.returncode == 0, stderr
    assert "1 requests in flight" in stderr
