"""Child processes in their own process group, and one replica process built on them.

The one home of the process-group helpers: ``free_ports`` for a child to listen on,
``spawn_group`` (start a command as the leader of a new session, so of its own process group),
``signal_group`` and ``stop_group`` (SIGTERM the whole group, a grace period, then SIGKILL what is
left), used by the launcher, the benches' routers and stubs, the drill's faults and the tests.

``ManagedProcess`` is one replica: started in its own process group, logged to a file,
watched, restarted with backoff when it dies, and stopped with its whole group. Synchronous (a
watcher thread per process) so the same code serves a single router process and the
multi-worker supervisor, which has no event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import httpx

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class ProcessState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


class LaunchError(RuntimeError):
    """A replica did not become ready; the message includes the end of its log."""


def free_ports(count: int, host: str = "") -> list[int]:
    """``count`` distinct ports the OS says are free now, bound all at once so they differ.

    ``host`` "" (the default) binds every interface, so a port is free whichever address the
    child listens on. A small race remains: another process may take one before the child does.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


def free_port_run(length: int, host: str = "", tries: int = 200) -> int:
    """The first of ``length`` consecutive ports the OS says are free now (a data-parallel
    replica's KV-event publishers bind the configured port plus each rank). Raises OSError
    when no run is found in ``tries`` draws."""
    for _ in range(tries):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind((host, 0))
            base = int(first.getsockname()[1])
            if base + length - 1 > 65535:
                continue
            try:
                for port in range(base + 1, base + length):
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    raise OSError(f"no {length} consecutive free ports found")


def spawn_group(
    argv: Sequence[str],
    *,
    stdout: IO[bytes] | int | None = None,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session, so of its own process group (its group id
    is its pid): ``signal_group`` and ``stop_group`` then reach it and everything it starts.
    stdin is /dev/null; stderr goes where stdout goes."""
    return subprocess.Popen(
        list(argv),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is gone (or not ours)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(popen: subprocess.Popen[bytes], grace_s: float, reap_s: float = 5.0) -> bool:
    """Stop the group ``popen`` leads (see ``spawn_group``): SIGTERM, up to ``grace_s`` for the
    leader to exit, then SIGKILL to the group, which also reaches helpers the leader left behind,
    and up to ``reap_s`` to reap the leader. True when the leader exited within the grace."""
    exited = True
    if popen.poll() is None:
        signal_group(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            exited = False
    signal_group(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=reap_s)
    return exited


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launching process dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ManagedProcess:
    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path,
        health_url: str,
        max_restarts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        on_state: Callable[[str, ProcessState], None] = lambda name, state: None,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.health_url = health_url
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_state = on_state
        self.stop_grace_s = stop_grace_s
        self.state = ProcessState.STOPPED
        self.restarts = 0
        self.popen: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def _set_state(self, state: ProcessState) -> None:
        self.state = state
        self.on_state(self.name, state)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        log_file.write(
            f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n".encode()
        )
        log_file.flush()
        self._set_state(ProcessState.STARTING)
        reaper = [sys.executable, "-m", "kvroute.backends.reaper", str(self.stop_grace_s), "--"]
        self.popen = spawn_group(  # its own process group: we stop it and all its children
            [*reaper, *self.argv],
            stdout=log_file,
            env=self.env,
            preexec_fn=_die_with_parent,
        )
        log_file.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Poll the health URL until it answers 200; raise LaunchError on exit or deadline."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                assert self.popen is not None
                code = self.popen.poll()
                if code is not None:
                    self._set_state(ProcessState.FAILED)
                    raise LaunchError(
                        f"replica {self.name} exited with code {code} before it was ready; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.health_url).status_code == 200:
                        self._set_state(ProcessState.READY)
                        return
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"replica {self.name} not ready after {timeout_s:g}s; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.1)

    def watch(self, ready_timeout_s: float) -> None:
        """Restart the process with backoff whenever it dies, until stop()."""
        self._watcher = threading.Thread(
            target=self._watch, args=(ready_timeout_s,), name=f"watch-{self.name}", daemon=True
        )
        self._watcher.start()

    def _watch(self, ready_timeout_s: float) -> None:
        backoff = self.backoff_s
        while not self._stopping.is_set():
            assert self.popen is not None
            code = self.popen.wait()
            if self._stopping.is_set():
                return
            self._kill_group(signal.SIGKILL)  # children it may have left behind
            if self.restarts >= self.max_restarts:
                log.error(
                    "replica %s exited (%s) and has used its %d restarts",
                    self.name,
                    code,
                    self.max_restarts,
                )
                self._set_state(ProcessState.FAILED)
                return
            log.warning("replica %s exited with %s; restarting in %.1fs", self.name, code, backoff)
            self._set_state(ProcessState.FAILED)
            if self._stopping.wait(backoff):
                return
            self.restarts += 1
            backoff = min(backoff * 2, self.max_backoff_s)
            self.start()
            try:
                self.wait_ready(ready_timeout_s)
                backoff = self.backoff_s
            except LaunchError as exc:
                log.error("%s", exc)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole group, wait up to ``grace_s``, then SIGKILL what is left."""
        self._stopping.set()
        if self.popen is None:
            return
        self._set_state(ProcessState.DRAINING)
        if not stop_group(self.popen, grace_s):
            log.warning("replica %s did not exit within %gs; killed it", self.name, grace_s)
        self._set_state(ProcessState.STOPPED)

    def kill(self) -> None:
        """Kill the replica abruptly (drills and tests); the watcher restarts it."""
        if self.popen is not None:
            self._kill_group(signal.SIGKILL)

    def _kill_group(self, sig: int) -> None:
        if self.popen is not None:
            signal_group(self.popen.pid, sig)
