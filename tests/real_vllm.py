"""Start and stop one real vLLM server for tests (no tests in here).

A stand-in until the launcher in ``backends/`` is used by the real-vLLM tests: the server
runs in its own process group (API server, engine core, worker and a resource tracker),
logs to a file, is ready when ``/health`` answers 200, and is stopped with SIGTERM to the
whole group, then SIGKILL after a grace period. Needs the ``vllm`` extra.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backends.vllm_args import vllm_server_command

# A stable path lets vLLM's compile cache (~/.cache/vllm) be reused between runs; the model
# itself is rebuilt only if missing or built by another version of backends/tiny_model.py.
TINY_MODEL_DIR = Path(
    os.environ.get("KVROUTE_TINY_MODEL_DIR", Path.home() / ".cache" / "kvroute" / "tiny-model")
)
# Seen on 2-core CI machines: 35-85 s for one replica, up to ~170 s for three started together.
DEFAULT_STARTUP_TIMEOUT_S = 300.0


class VllmStartError(RuntimeError):
    """The server died or missed its deadline; the message ends with its log's tail."""


@dataclass
class RealVllm:
    url: str
    model: str
    block_size: int
    num_gpu_blocks: int
    log_path: Path
    process: subprocess.Popen[bytes]
    # Where to connect a SUB / DEALER socket (the server binds tcp://*:PORT); None if off.
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    startup_s: float = 0.0
    stopped: bool = field(default=False, init=False)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        stop_group(self.process, grace_s)


def free_ports(count: int) -> list[int]:
    """Distinct ports free now on 127.0.0.1 (held open together while choosing)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def start_vllm(
    model_dir: Path,
    log_path: Path,
    *,
    model: str = "tiny",
    block_size: int = 32,
    num_gpu_blocks: int = 160,
    max_num_seqs: int = 16,
    kv_events: bool = True,
    topic: str = "kv-events",
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> RealVllm:
    """Start one server and wait until ``/health`` answers 200 (or raise VllmStartError)."""
    port, events_port, replay_port = free_ports(3)
    argv, env = vllm_server_command(
        model_dir=model_dir,
        port=port,
        served_model_name=model,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        kv_events_endpoint=f"tcp://*:{events_port}" if kv_events else None,
        kv_replay_endpoint=f"tcp://*:{replay_port}" if kv_events else None,
        topic=topic,
        extra_args=extra_args,
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )
    server = RealVllm(
        url=f"http://127.0.0.1:{port}",
        model=model,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        log_path=log_path,
        process=process,
        events_endpoint=f"tcp://127.0.0.1:{events_port}" if kv_events else None,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}" if kv_events else None,
        topic=topic,
    )
    try:
        wait_healthy(server, deadline=started + startup_timeout_s)
    except BaseException:
        server.stop(grace_s=5.0)
        raise
    server.startup_s = time.monotonic() - started
    return server


def wait_healthy(server: RealVllm, *, deadline: float) -> None:
    while True:
        code = server.process.poll()
        if code is not None:
            raise VllmStartError(
                f"vLLM exited with {code} before becoming healthy; log {server.log_path}:\n"
                + server.log_tail()
            )
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise VllmStartError(
                f"vLLM not healthy at {server.url} before the deadline; log {server.log_path}:\n"
                + server.log_tail()
            )
        time.sleep(0.5)


def stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process's group; SIGKILL the group if anything is left after grace_s."""
    pgid = process.pid  # start_new_session made it the group leader
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        process.poll()
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
