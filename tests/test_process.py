"""Replica processes: ready with a deadline, restarted with backoff, stopped with their group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.backends.process import (
    LaunchError,
    ManagedProcess,
    ProcessState,
    free_ports,
    signal_group,
    spawn_group,
    stop_group,
)

from .helpers import group_members, wait_until_sync

# A stand-in replica: answers /health with 200 and starts a grandchild (sleep) in its group.
SERVER = r"""
import http.server, subprocess, sys
subprocess.Popen(["sleep", "300"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _process(tmp_path: Path, argv: list[str], port: int, **kwargs: object) -> ManagedProcess:
    return ManagedProcess(
        "stand-in", argv, log_path=tmp_path / "stand-in.log", health_url=f"http://127.0.0.1:{port}/health",
        backoff_s=0.1, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_ready_then_restarted_after_a_crash_then_stopped_with_its_group(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    process = _process(tmp_path, [sys.executable, "-c", SERVER, str(port)], port)
    process.start()
    process.wait_ready(20)
    assert process.state is ProcessState.READY
    first_pid = process.pid
    assert first_pid is not None
    process.watch(ready_timeout_s=20)
    process.kill()  # the replica dies abruptly
    wait_until_sync(
        lambda: process.pid != first_pid and process.state is ProcessState.READY, 20, "a restart"
    )
    assert process.restarts == 1
    assert not group_members(first_pid), "the dead replica's children were left behind"
    pgid = process.pid
    assert pgid is not None and len(group_members(pgid)) >= 2  # the server and its sleep
    process.stop(grace_s=5)
    assert process.state is ProcessState.STOPPED
    assert not group_members(pgid), "stop() left processes of the group running"


def test_exit_before_ready_is_a_launch_error_with_the_log(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    process = _process(
        tmp_path, [sys.executable, "-c", "import sys; print('boom: bad flag'); sys.exit(3)"], port
    )
    process.start()
    with pytest.raises(LaunchError, match="exited with code 3") as info:
        process.wait_ready(20)
    assert "boom: bad flag" in str(info.value)


def test_not_ready_in_time_is_a_launch_error(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    process = _process(tmp_path, [sys.executable, "-c", "import time; time.sleep(60)"], port)
    process.start()
    with pytest.raises(LaunchError, match="not ready after"):
        process.wait_ready(0.5)
    process.stop(grace_s=2)


def test_replica_dies_with_the_launcher_even_on_sigkill(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    launcher = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from backends.process import ManagedProcess\n"
        f"p = ManagedProcess('x', [sys.executable, '-c', {SERVER!r}, '{port}'], log_path=Path({str(tmp_path / 'x.log')!r}),"
        f" health_url='http://127.0.0.1:{port}/health')\n"
        "p.start(); p.wait_ready(20); print(p.pid, flush=True); time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{child}")
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_until_sync(
        lambda: not group_members(child), 10, "the replica to exit after its launcher was killed"
    )


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(20)
    assert len(set(ports)) == 20
    for host in ("", "127.0.0.1"):
        (port,) = free_ports(1, host)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_spawned_group_is_stopped_whole_even_when_it_ignores_sigterm(tmp_path: Path) -> None:
    # A leader that ignores SIGTERM, with a grandchild in its group.
    script = (
        "import signal, subprocess, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen(['sleep', '300'])\n"
        "time.sleep(300)\n"
    )
    with (tmp_path / "leader.log").open("wb") as log:
        popen = spawn_group([sys.executable, "-c", script], stdout=log)
    assert os.getpgid(popen.pid) == popen.pid != os.getpgrp()
    wait_until_sync(lambda: len(group_members(popen.pid)) == 2, 10, "the leader and its sleep")
    assert not stop_group(popen, grace_s=0.5)  # it did not exit within the grace: killed
    assert popen.returncode == -signal.SIGKILL
    wait_until_sync(lambda: not group_members(popen.pid), 10, "the whole group to be gone")


def test_stop_group_on_a_leader_that_exits_on_sigterm(tmp_path: Path) -> None:
    popen = spawn_group(["sleep", "300"], stdout=subprocess.DEVNULL)
    assert signal_group(popen.pid, signal.SIGSTOP) and signal_group(popen.pid, signal.SIGCONT)
    assert stop_group(popen, grace_s=5)
    assert popen.returncode == -signal.SIGTERM
