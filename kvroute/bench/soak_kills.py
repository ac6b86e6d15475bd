"""Replica kills for the soak: SIGKILL a replica's process group, wait for it to come back.

``kvroute serve`` supervises the replicas it launched (``ManagedProcess.watch``): one that dies
is started again, on the same port and KV-event endpoints. A kill counts as recovered when a
new process runs on that port, answers its health check, and the router has it in rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvroute.bench.soak_procs import RouterTree

POLL_S = 0.1
# A restart takes the supervisor's backoff (1 s) plus the replica's start-up (1-3 s here).
RECOVER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Replica:
    name: str
    url: str

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        assert port is not None, self.url
        return port


@dataclass
class Kill:
    replica: str
    at_s: float  # seconds into the traffic
    pid: int | None  # the process group killed; None: nothing ran there (still restarting)
    back_after_s: float | None = None  # back in rotation this long after the kill


async def replicas(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """The router's /admin/replicas rows."""
    async with http.get(url + "/admin/replicas") as resp:
        resp.raise_for_status()
        rows: list[dict[str, Any]] = (await resp.json())["replicas"]
    return rows


async def _in_rotation(http: aiohttp.ClientSession, url: str, name: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        for row in await replicas(http, url):
            if row["name"] == name:
                return bool(row["healthy"] and not row["ejected"])
    return False


async def _healthy(http: aiohttp.ClientSession, replica_url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with http.get(replica_url + "/health") as resp:
            return resp.status == 200
    return False


async def kill(
    http: aiohttp.ClientSession,
    router_url: str,
    tree: RouterTree,
    replica: Replica,
    at_s: float,
) -> Kill:
    """Kill ``replica`` and wait (up to RECOVER_TIMEOUT_S) until it is back in rotation."""
    pid = tree.kill_replica(replica.port)
    record = Kill(replica.name, at_s, pid)
    if pid is None:
        return record
    killed = time.monotonic()
    deadline = killed + RECOVER_TIMEOUT_S
    while time.monotonic() < deadline:
        now_pid = tree.replica_group(replica.port)
        if (
            now_pid is not None
            and now_pid != pid
            and await _healthy(http, replica.url)
            and await _in_rotation(http, router_url, replica.name)
        ):
            record.back_after_s = time.monotonic() - killed
            return record
        await asyncio.sleep(POLL_S)
    return record
