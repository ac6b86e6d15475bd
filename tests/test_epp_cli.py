"""``kvroute epp`` as an operator runs it, and the configs that go with it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.backends.process import free_ports
from kvroute.gateway import GatewaySpec, envoy_binary, envoy_config
from kvroute.router.config import load_config

from .conftest import StartEmulated

ROOT = Path(__file__).resolve().parents[1]
KVROUTE = [sys.executable, "-m", "kvroute.cli"]


def run_epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVROUTE, "epp", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_envoy_config_in_configs_is_the_generated_one_and_envoy_accepts_it() -> None:
    path = ROOT / "configs" / "envoy" / "epp.yaml"
    generated = envoy_config(GatewaySpec(pods=[("127.0.0.1", 8001), ("127.0.0.1", 8002)]))
    assert yaml.safe_load(path.read_text()) == generated
    checked = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_epp_config_file_loads() -> None:
    config = load_config(ROOT / "configs" / "epp.yaml")
    assert (config.epp.grpc_port, config.epp.health_port, config.epp.metrics_port) == (
        9002,
        9003,
        9090,
    )
    assert [r.kv_events for r in config.replicas] == [
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no endpoints: give --endpoint HOST:PORT"),
        (("--endpoint", "nonsense"), "expected HOST:PORT"),
        (("--endpoint", "::1:8000"), "bracket an IPv6 address: [::1]:8000"),
        (
            ("--endpoint", "127.0.0.1:8001", "--kv-events", "127.0.0.1:9=tcp://x:1"),
            "127.0.0.1:9 is not one of the endpoints",
        ),
        (("--endpoint", "127.0.0.1:8001", "--destinations", "0"), "epp.destinations: must be >= 1"),
        (
            ("--endpoint", "127.0.0.1:8001", "--cert", "c.pem"),
            "epp.cert, epp.key: give both",
        ),
        (
            ("--endpoint", "127.0.0.1:8001", "--grpc-port", "9100", "--health-port", "9100"),
            "must differ",
        ),
    ],
)
def test_bad_flags_get_one_clear_line(args: tuple[str, ...], message: str) -> None:
    result = run_epp(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_epp_key_in_a_config_file_is_named(tmp_path: Path) -> None:
    config = tmp_path / "epp.yaml"
    config.write_text("epp:\n  grpc_prot: 9002\nreplicas:\n  - url: http://127.0.0.1:8001\n")
    result = run_epp("--config", str(config))
    assert result.returncode == 2
    assert "epp.grpc_prot" in result.stderr and "did you mean 'grpc_port'" in result.stderr


async def test_epp_serves_health_and_stops_cleanly_on_sigterm(
    start_emulated: StartEmulated,
) -> None:
    replica = await start_emulated()
    grpc_port, health_port, metrics_port = free_ports(3)
    endpoint = replica.url.removeprefix("http://")
    process = await asyncio.create_subprocess_exec(
        *KVROUTE,
        "epp",
        "--endpoint",
        endpoint,
        "--kv-events",
        f"{endpoint}={replica.events}",
        "--tokenizer",
        "builtin",
        "--grpc-port",
        str(grpc_port),
        "--health-port",
        str(health_port),
        "--metrics-port",
        str(metrics_port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        assert f"ext_proc on 127.0.0.1:{grpc_port} (plaintext)" in line
        assert f"metrics on :{metrics_port}/metrics" in line and "1 endpoints" in line
        async with aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stderr is not None
    assert "Traceback" not in (await process.stderr.read()).decode()


def test_a_taken_port_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_epp(
            "--endpoint", "127.0.0.1:8001", "--metrics-port", str(port), "--grpc-port", "0",
            "--health-port", "0",
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert str(port) in result.stderr
