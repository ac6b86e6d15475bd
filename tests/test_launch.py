"""Launched emulated replicas: started, routed to, restarted, and stopped, as a user runs them."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from kvroute.backends.launcher import LaunchedFleet, LaunchSpec
from kvroute.backends.process import ProcessState, free_ports

from .helpers import alive, children_of, wait_until_sync


def _spec(tmp_path: Path, count: int = 2) -> LaunchSpec:
    return LaunchSpec(
        engine="emulated", count=count, model="tiny", model_path=None, tokenizer=None, block_size=16,
        num_gpu_blocks=128, max_num_seqs=8, preset="tiny-cpu", time_scale=1.0, kv_events=True,
        host="127.0.0.1", log_dir=str(tmp_path / "logs"), startup_timeout_s=60, max_restarts=3,
    )  # fmt: skip


def _private_socket_dir(endpoints: list[str]) -> Path:
    """The one directory holding these ipc:// sockets, checked to be this user's alone."""
    paths = [Path(e.removeprefix("ipc://")) for e in endpoints]
    assert all(e.startswith("ipc://") for e in endpoints), endpoints
    assert all(stat.S_ISSOCK(p.stat().st_mode) for p in paths), endpoints
    (directory,) = {p.parent for p in paths}
    info = directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    return directory


def test_fleet_starts_restarts_a_killed_replica_and_stops(tmp_path: Path) -> None:
    fleet = LaunchedFleet(_spec(tmp_path))
    fleet.start()
    try:
        for replica in fleet.replicas:
            models = httpx.get(replica.url + "/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            assert replica.kv_events and replica.kv_replay
            assert (tmp_path / "logs" / f"{replica.name}.log").exists()
        # KV events stay on this host and user: Unix sockets in a 0700 directory.
        kv_dir = _private_socket_dir(
            [e for r in fleet.replicas for e in (r.kv_events or "", r.kv_replay or "")]
        )
        victim = fleet.replicas[0].process
        old_pid = victim.pid
        victim.kill()
        wait_until_sync(
            lambda: victim.pid != old_pid and victim.state is ProcessState.READY, 30, "the restart"
        )
        assert httpx.get(fleet.replicas[0].url + "/health").status_code == 200
    finally:
        pids = [r.process.pid for r in fleet.replicas]
        fleet.stop(grace_s=5)
    for pid in pids:
        assert not alive(pid), f"replica process {pid} outlived stop()"
    assert not kv_dir.exists(), "the KV-event sockets outlived stop()"


def test_a_replica_that_keeps_dying_is_given_up_after_max_restarts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """launch.max_restarts: a replica killed once more than it may be restarted stays down
    (FAILED), instead of a crash loop."""
    caplog.set_level(logging.ERROR, logger="kvroute.backends.process")
    fleet = LaunchedFleet(replace(_spec(tmp_path, count=1), max_restarts=1))
    fleet.start()
    try:
        victim = fleet.replicas[0].process
        first = victim.pid
        victim.kill()
        wait_until_sync(
            lambda: victim.pid != first and victim.state is ProcessState.READY, 30, "the restart"
        )
        second = victim.pid
        victim.kill()
        gave_up = "exited (-9) and has used its 1 restarts"
        wait_until_sync(lambda: gave_up in caplog.text, 30, "giving up")
        assert victim.state is ProcessState.FAILED and not alive(second)
        assert victim.restarts == 1 and victim.pid == second  # not started a third time
    finally:
        fleet.stop(grace_s=5)


def test_kv_events_bind_tcp_exposes_them_on_the_launch_host_only(tmp_path: Path) -> None:
    fleet = LaunchedFleet(replace(_spec(tmp_path, count=1), kv_events_bind="tcp"))
    fleet.start()
    try:
        replica = fleet.replicas[0]
        assert fleet.kv_dir is None
        for endpoint in (replica.kv_events, replica.kv_replay):
            assert endpoint and endpoint.startswith("tcp://127.0.0.1:"), endpoint
            port = int(endpoint.rsplit(":", 1)[1])
            with socket.socket() as other:  # another loopback address: free unless bound on *
                other.bind(("127.0.0.2", port))
            with socket.socket() as subscriber:
                subscriber.connect(("127.0.0.1", port))
    finally:
        fleet.stop(grace_s=5)


def test_a_replica_whose_port_was_taken_meanwhile_starts_on_another(tmp_path: Path) -> None:
    fleet = LaunchedFleet(_spec(tmp_path, count=1))
    taken = int(fleet.replicas[0].url.rsplit(":", 1)[1])
    squatter = socket.socket()  # takes the port between the pick and the replica's bind
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    try:
        fleet.start()
        try:
            url = fleet.replicas[0].url
            assert not url.endswith(f":{taken}")
            assert httpx.get(url + "/health").status_code == 200
            # The first try said why it stopped, in one line (the log is appended to).
            log = (tmp_path / "logs" / "emulated-0.log").read_text()
            assert f"kvroute replica: cannot listen on 127.0.0.1:{taken}" in log
            assert "Traceback" not in log
        finally:
            fleet.stop(grace_s=5)
    finally:
        squatter.close()


def test_serve_launches_its_replicas_routes_and_cleans_up(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    config = tmp_path / "kvroute.yaml"
    config.write_text(
        f"listen: {{port: {port}}}\n"
        "launch:\n  engine: emulated\n  count: 2\n  block_size: 16\n  num_gpu_blocks: 128\n"
        f"  preset: tiny-cpu\n  log_dir: {tmp_path / 'logs'}\n"
    )
    router = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until_sync(lambda: _ready(port) or router.poll() is not None, 60, "the router")
        assert router.poll() is None, router.stderr.read() if router.stderr else ""
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        seen = set()
        for _ in range(4):
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt="Hello", max_tokens=3
            )
            assert raw.parse().usage.completion_tokens == 3  # type: ignore[union-attr]
            seen.add(raw.headers["x-kvroute-replica"])
        assert seen <= {"emulated-0", "emulated-1"} and seen
        # The router hears the replicas' KV events over their private Unix sockets: a prompt
        # of several 16-token blocks is stored, and the batch reaches the router.
        client.completions.create(model="tiny", prompt="Hello there " * 40, max_tokens=1)
        wait_until_sync(lambda: _kv_batches(port) > 0, 10, "a KV event batch at the router")
        kv_dir = _private_socket_dir(_kv_endpoints(port))
        children = children_of(router.pid)  # the replicas' reapers, the tokenizer's pool
        reapers = [p for p in children if b"kvroute.backends.reaper" in _cmdline(p)]
        assert len(reapers) == 2
    finally:
        router.send_signal(signal.SIGTERM)
        _, stderr = router.communicate(timeout=30)
    assert router.returncode == 0, stderr
    assert "Traceback" not in stderr
    wait_until_sync(
        lambda: not any(os.path.exists(f"/proc/{p}") for p in children), 10, "children to stop"
    )
    assert not kv_dir.exists(), "the KV-event sockets outlived the router"


def _metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


def _kv_batches(port: int) -> float:
    lines = re.findall(r"^kvroute_kv_event_batches_total\{.*\} (\S+)$", _metrics(port), re.M)
    return sum(float(v) for v in lines)


def _kv_endpoints(port: int) -> list[str]:
    return re.findall(r'^kvroute_kv_event_connected\{endpoint="([^"]+)"', _metrics(port), re.M)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_demo_compares_policies_side_by_side(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "kvroute.cli", "demo", "--replicas", "2", "--tenants", "2",
            "--conversations", "2", "--turns", "2", "--max-tokens", "4", "--log-dir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = {
        line.split()[0]: line.split()
        for line in lines
        if line.startswith(("round_robin", "kv_aware"))
    }
    assert set(rows) == {"round_robin", "kv_aware"}
    for row in rows.values():
        requests, errors, hit_rate = int(row[1]), int(row[2]), row[3]
        assert requests == 8 and errors == 0
        assert hit_rate.endswith("%") and float(hit_rate[:-1]) > 0  # turns reuse their history


@pytest.mark.slow
def test_demo_through_a_real_envoy_and_two_pickers(tmp_path: Path) -> None:
    """`kvroute demo --gateway`: Envoy alone, then Envoy asking two `kvroute epp` pickers."""
    result = subprocess.run(
        [
            sys.executable, "-m", "kvroute.cli", "demo", "--gateway", "--pickers", "2",
            "--policies", "kv_aware", "--replicas", "2", "--tenants", "2", "--conversations", "2",
            "--turns", "2", "--max-tokens", "4", "--log-dir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Columns are padded with two or more spaces; labels hold single ones.
    rows = {
        cells[0]: cells[1:]
        for line in result.stdout.splitlines()
        if line.startswith("envoy") and (cells := re.split(r"\s{2,}", line.strip()))
    }
    assert set(rows) == {"envoy round robin", "envoy + 2 epp kv_aware"}
    for row in rows.values():
        requests, errors, hit_rate = int(row[0]), int(row[1]), row[2]
        assert requests == 8 and errors == 0
        assert hit_rate.endswith("%") and float(hit_rate[:-1]) > 0
