"""The vLLM server command line, on CPU (as before) and on GPUs (parallel sizes, memory share)."""

from __future__ import annotations

import json

import pytest

from kvroute.backends.vllm_args import owned_flags_in, vllm_server_command
from kvroute.router.config import LaunchConfig, launch_problems

BASE: dict[str, object] = {
    "model_dir": "/models/m",
    "port": 8001,
    "served_model_name": "m",
    "block_size": 32,
    "num_gpu_blocks": 160,
    "max_num_seqs": 8,
    "kv_events_endpoint": None,
    "kv_replay_endpoint": None,
    "python": "python",
}


def command(**changes: object) -> tuple[list[str], dict[str, str]]:
    return vllm_server_command(**{**BASE, **changes})  # type: ignore[arg-type]


def test_cpu_command_is_unchanged_by_the_gpu_parameters() -> None:
    argv, env = command()
    assert "--tensor-parallel-size" not in argv and "--gpu-memory-utilization" not in argv
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "160"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    with pytest.raises(ValueError, match="multiple of 32 on CPU"):
        command(block_size=16)


def test_gpu_command_passes_the_parallel_sizes_and_memory_share() -> None:
    argv, env = command(
        gpu=True,
        block_size=16,
        num_gpu_blocks=None,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        data_parallel_size=1,
        gpu_memory_utilization=0.85,
    )
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--tensor-parallel-size"] == "2"
    assert flags["--pipeline-parallel-size"] == "2"
    assert "--data-parallel-size" not in argv  # 1 is vLLM's default
    assert flags["--gpu-memory-utilization"] == "0.85"
    assert "--num-gpu-blocks-override" not in argv and "--max-model-len" not in argv
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_gpu_parameters_without_gpus_are_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs gpu=True"):
        command(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization needs gpu=True"):
        command(gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        command(gpu=True, gpu_memory_utilization=1.5)


def test_extra_args_may_not_set_what_the_parameters_set_in_any_spelling() -> None:
    assert owned_flags_in(["--tensor_parallel_size=4", "-tp", "4", "--enforce-eager"]) == [
        "--tensor-parallel-size",
        "-tp",
    ]
    with pytest.raises(ValueError, match="must not set --gpu-memory-utilization"):
        command(gpu=True, extra_args=["--gpu-memory-utilization", "0.5"])


EVENTS = {"kv_events_endpoint": "ipc:///tmp/e", "kv_replay_endpoint": "ipc:///tmp/r"}


def _kv_events_config(**changes: object) -> dict[str, object]:
    argv, _ = command(**EVENTS, **changes)
    config: dict[str, object] = json.loads(argv[argv.index("--kv-events-config") + 1])
    return config


def test_the_replay_buffer_goes_into_the_kv_events_config() -> None:
    """launch.kv_replay_buffer is vLLM's KVEventsConfig.buffer_steps; unset, vLLM's default."""
    assert _kv_events_config(kv_replay_buffer=500)["buffer_steps"] == 500
    assert "buffer_steps" not in _kv_events_config()


@pytest.mark.vllm
def test_vllm_takes_the_replay_buffer_as_configured() -> None:
    kv_events = pytest.importorskip("vllm.config.kv_events")
    assert kv_events.KVEventsConfig(**_kv_events_config(kv_replay_buffer=500)).buffer_steps == 500


def test_a_replay_buffer_below_one_is_a_config_error() -> None:
    problems = launch_problems(LaunchConfig(kv_replay_buffer=0))
    assert "launch.kv_replay_buffer: must be >= 1, got 0" in problems
