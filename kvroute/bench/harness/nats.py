"""A NATS server (Debian's ``nats-server``) for what routers share: started, waited for until it
accepts connections, and stopped (its process group) on exit. Benches and tests use it alike."""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from kvroute.backends.process import free_ports
from kvroute.bench.harness import processes

HOST = "127.0.0.1"


@contextlib.contextmanager
def nats_server(
    log_dir: Path,
    *,
    port: int | None = None,
    jetstream_dir: Path | None = None,
    timeout_s: float = 10.0,
) -> Iterator[str]:
    """Its ``nats://`` URL once it listens; on ``port`` (default: a free one), with JetStream
    storing in ``jetstream_dir`` when given."""
    binary = shutil.which("nats-server")
    if binary is None:
        raise processes.StartError("nats-server is not on PATH (apt-get install nats-server)")
    if port is None:
        (port,) = free_ports(1)
    argv = [binary, "-a", HOST, "-p", str(port)]
    if jetstream_dir is not None:
        argv += ["-js", "-sd", str(jetstream_dir)]
    with processes.managed(f"nats-{port}", argv, log_dir):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((HOST, port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise processes.StartError(f"nats-server did not listen on {port}") from None
                time.sleep(0.05)
        yield f"nats://{HOST}:{port}"
