"""GPU placement end to end, without GPUs: the environments launched replicas really receive.

A fake ``nvidia-smi`` lists the GPUs; emulated replicas stand in for vLLM (they take their
share of GPUs as vLLM would, and ignore it). Each replica's environment is read from
/proc/PID/environ of the replica process itself, below its reaper.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvroute.backends.launcher import LaunchedFleet, LaunchSpec
from kvroute.backends.process import free_ports

from .gpu_fakes import fake_nvidia_smi, no_driver_pynvml
from .helpers import children_of, wait_until_sync

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def cmdline_of(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:  # exited since it was listed
        return []


def replica_processes(parent: int) -> dict[int, int]:
    """{HTTP port: pid} of the emulated replicas below ``parent`` (each under its reaper)."""
    found = {}
    for reaper in children_of(parent):
        if "kvroute.backends.reaper" not in cmdline_of(reaper):
            continue
        for pid in children_of(reaper):
            argv = cmdline_of(pid)
            if argv[1:4] == ["-m", "kvroute.cli", "replica"]:
                found[int(argv[argv.index("--port") + 1])] = pid
    return found


def logged_port(log: Path) -> int:
    """The port a replica was last started on, from the command lines its log holds (a
    replica whose port was taken meanwhile is started again on another)."""
    ports = re.findall(r"starting: .* --port (\d+) ", log.read_text())
    assert ports, log.read_text()
    return int(ports[-1])


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_gives_each_replica_its_own_visible_gpus(tmp_path: Path) -> None:
    # Eight GPUs on the machine, four of them kvroute's to hand out (as a scheduler would set
    # CUDA_VISIBLE_DEVICES): two replicas of two GPUs each get 4,5 and 6,7.
    fake_nvidia_smi(tmp_path / "bin")
    (port,) = free_ports(1)
    config = tmp_path / "kvroute.yaml"
    config.write_text(
        f"listen: {{port: {port}}}\n"
        "launch:\n  engine: emulated\n  count: 2\n  gpus: auto\n  gpus_per_replica: 2\n"
        f"  block_size: 16\n  num_gpu_blocks: 64\n  preset: tiny-cpu\n  log_dir: {tmp_path / 'logs'}\n"
    )
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        # NVML that cannot start, whatever this machine has installed: nvidia-smi answers.
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(no_driver_pynvml(tmp_path / "py")), os.environ.get("PYTHONPATH")])
        ),
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
    }
    env.pop("CUDA_DEVICE_ORDER", None)
    router = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config)],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        wait_until_sync(lambda: ready(port) or router.poll() is not None, 60, "the router")
        assert router.poll() is None, router.stderr.read() if router.stderr else ""
        replicas = replica_processes(router.pid)
        assert len(replicas) == 2, replicas
        for name, gpus in (("emulated-0", "4,5"), ("emulated-1", "6,7")):
            received = environ_of(replicas[logged_port(tmp_path / "logs" / f"{name}.log")])
            assert received["CUDA_VISIBLE_DEVICES"] == gpus, name
            assert received["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", name
    finally:
        router.send_signal(signal.SIGTERM)
        _, stderr = router.communicate(timeout=30)
    assert router.returncode == 0, stderr
    assert "starting 2 emulated replicas on GPUs 4,5 | 6,7" in stderr
    assert "Traceback" not in stderr


def test_replicas_without_gpu_keys_get_no_gpu_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    spec = LaunchSpec(
        engine="emulated", count=1, model="tiny", model_path=None, tokenizer=None, block_size=16,
        num_gpu_blocks=64, max_num_seqs=4, preset="tiny-cpu", time_scale=1.0, kv_events=False,
        host="127.0.0.1", log_dir=str(tmp_path / "logs"), startup_timeout_s=60, max_restarts=0,
    )  # fmt: skip
    fleet = LaunchedFleet(spec)
    fleet.start()
    try:
        reaper = fleet.replicas[0].process.pid
        assert reaper is not None
        (pid,) = [p for p in children_of(reaper) if "replica" in cmdline_of(p)]
        received = environ_of(pid)
        assert "CUDA_VISIBLE_DEVICES" not in received
        assert "CUDA_DEVICE_ORDER" not in received
    finally:
        fleet.stop(grace_s=5)
