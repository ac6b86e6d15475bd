"""`kvroute serve --dry-run`: the GPU map and each replica's command and environment, nothing
started; and the placement errors, each one line naming its key (exit 2)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.cli import main

from .gpu_fakes import DRIVER_MISSING, fake_nvidia_smi, no_driver_pynvml

ROOT = Path(__file__).parent.parent


@pytest.fixture
def no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without GPUs: NVML not importable, nvidia-smi not found."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def four_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    table = "".join(f"{i}, GPU-{i}f00, NVIDIA L4, 23034\n" for i in range(4))
    fake_nvidia_smi(tmp_path / "bin", table)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def write_config(tmp_path: Path, launch: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(f"launch:\n  log_dir: {tmp_path / 'logs'}\n" + launch)
    return path


def replica_blocks(out: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """{name: (environment, argv)} from the dry run's per-replica blocks."""
    blocks: dict[str, tuple[dict[str, str], list[str]]] = {}
    name = None
    lines = iter(out.splitlines())
    for line in lines:
        if line and not line.startswith(" ") and ": http://" in line:
            name = line.split(":", 1)[0]
            blocks[name] = ({}, [])
        elif name and line.startswith("    ") and "=" in line and not blocks[name][1]:
            key, value = line.strip().split("=", 1)
            blocks[name][0][key] = shlex.split(value)[0]
        elif name and line == "  command:":
            blocks[name][1].extend(shlex.split(next(lines)))
    return blocks


def test_the_shipped_8_gpu_example_plans_on_a_machine_without_gpus(tmp_path: Path) -> None:
    """As a user runs it on a laptop: a subprocess, no GPU, no model files."""
    fake_nvidia_smi(tmp_path / "bin", DRIVER_MISSING, code=9)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(no_driver_pynvml(tmp_path / "py")),
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    config = ROOT / "configs" / "gpu-fleet-8x.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config), "--dry-run"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "GPU map (launch.gpus 0-7):" in out
    for gpu in range(8):
        assert f"  GPU {gpu}  -> vllm-{gpu // 2} as cuda:{gpu % 2}\n" in out
    assert "GPUs: not checked against this machine, which has none" in out
    assert "nvidia-smi: exited with 9: NVIDIA-SMI has failed" in out
    blocks = replica_blocks(out)
    assert list(blocks) == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
    ports = set()
    for i, (name, (environment, argv)) in enumerate(blocks.items()):
        assert environment["CUDA_VISIBLE_DEVICES"] == f"{2 * i},{2 * i + 1}", name
        assert environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert "VLLM_CPU_KVCACHE_SPACE" not in environment  # a CPU-only setting
        assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        flags = dict(zip(argv[3::2], argv[4::2], strict=False))
        assert flags["--model"] == "/models/Llama-3.1-8B-Instruct"
        assert flags["--tensor-parallel-size"] == "2"
        assert flags["--gpu-memory-utilization"] == "0.9"
        assert flags["--block-size"] == "16"
        assert "--num-gpu-blocks-override" not in argv  # vLLM sizes its KV cache on GPUs
        assert json.loads(flags["--kv-events-config"])["endpoint"].endswith(f"/{name}.events")
        ports.add(flags["--port"])
    assert len(ports) == 4
    assert "launch.model_path /models/Llama-3.1-8B-Instruct: not on this machine" in out
    assert not (tmp_path / "kvroute-logs").exists(), "a dry run made the log directory"


def test_dry_run_against_the_gpus_found_shows_them_and_the_unused(
    tmp_path: Path, four_gpus: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "  engine: vllm\n  count: 3\n  gpus: auto\n")
    assert main(["serve", "--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "GPU map (4 GPUs found by nvidia-smi):\n" in out
    assert "  GPU 0  NVIDIA L4, 23034 MiB  -> vllm-0 as cuda:0\n" in out
    assert "  GPU 2  NVIDIA L4, 23034 MiB  -> vllm-2 as cuda:0\n" in out
    assert "  GPU 3  NVIDIA L4, 23034 MiB  unused\n" in out
    blocks = replica_blocks(out)
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in blocks.values()] == ["0", "1", "2"]
    assert "--tensor-parallel-size" not in blocks["vllm-0"][1]  # 1 GPU each: TP 1
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("launch", "visible", "left_out"),
    [
        ("  gpus: [2, 1]\n", None, "not in launch.gpus"),
        ("  gpus: auto\n", "2,1", "hidden by CUDA_VISIBLE_DEVICES"),
    ],
    ids=["listed", "visible"],
)
def test_dry_run_map_says_why_a_gpu_is_left_out(
    tmp_path: Path,
    four_gpus: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    launch: str,
    visible: str | None,
    left_out: str,
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = write_config(tmp_path, "  engine: emulated\n  count: 2\n" + launch)
    assert main(["serve", "--config", str(config), "--dry-run"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  GPU ")]
    assert rows == [
        "  GPU 2  NVIDIA L4, 23034 MiB  -> emulated-0 as cuda:0",
        "  GPU 1  NVIDIA L4, 23034 MiB  -> emulated-1 as cuda:0",
        f"  GPU 0  NVIDIA L4, 23034 MiB  {left_out}",
        f"  GPU 3  NVIDIA L4, 23034 MiB  {left_out}",
    ]


def test_dry_run_without_gpu_keys_shows_the_cpu_fleet_as_before(
    tmp_path: Path, no_gpus: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "  engine: emulated\n  count: 2\n  preset: tiny-cpu\n")
    assert main(["serve", "--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: none (no GPU keys set)" in out
    blocks = replica_blocks(out)
    assert list(blocks) == ["emulated-0", "emulated-1"]
    for environment, argv in blocks.values():
        assert environment == {}
        assert argv[argv.index("--num-gpu-blocks-override") + 1] == "1024"  # today's default


def test_auto_without_gpus_is_a_config_error(
    tmp_path: Path, no_gpus: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "  engine: vllm\n  gpus: auto\n  tensor_parallel_size: 2\n")
    assert main(["serve", "--config", str(config), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"kvroute: config error: {config}: launch.gpus: auto, but no GPUs were found (NVML: "
        "pynvml is not installed (pip install nvidia-ml-py, or kvroute[gpu]); nvidia-smi: not "
        "found on PATH); to plan a fleet on a machine without them, list them: gpus: [0, 1, ...]\n"
    )


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "serve"])
def test_asking_for_more_gpus_than_exist_names_the_key_and_starts_nothing(
    tmp_path: Path, four_gpus: None, capsys: pytest.CaptureFixture[str], dry_run: bool
) -> None:
    config = write_config(tmp_path, "  engine: emulated\n  count: 3\n  gpus_per_replica: 2\n")
    argv = ["serve", "--config", str(config), "--port", "0"] + (["--dry-run"] if dry_run else [])
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"kvroute: config error: {config}: launch.gpus: auto found 4 GPUs (0-3, by "
        "nvidia-smi), but launch.count 3 x 2 GPUs per replica (tensor_parallel_size 2) needs 6\n"
    )
    assert not (tmp_path / "logs").exists()


def test_real_vllm_needs_the_gpus_it_lists(
    tmp_path: Path, no_gpus: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "  engine: vllm\n  count: 1\n  gpus: [0]\n")
    assert main(["serve", "--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute: config error: {config}: launch.gpus: lists GPU 0, but no")
    assert "`kvroute serve --dry-run` plans without them" in err


def test_every_placement_problem_gets_its_own_line(
    tmp_path: Path, no_gpus: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(
        tmp_path,
        "  engine: vllm\n  count: 2\n  gpus: [0, 1, 2]\n  gpus_per_replica: 4\n"
        "  tensor_parallel_size: 2\n  gpu_memory_utilization: 0\n",
    )
    assert main(["serve", "--config", str(config), "--dry-run"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"kvroute: config error: {config}: 2 problems:"
    assert lines[1].startswith("  launch.gpu_memory_utilization: must be a share")
    assert lines[2].startswith("  launch.gpus_per_replica: 4 disagrees with")
