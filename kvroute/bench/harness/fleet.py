"""Command lines for a bench's processes, and starting them on free ports.

Every process is a ``processes.managed`` child entered on the caller's ``ExitStack``: started,
waited for until its ready URL answers 200, and stopped (its whole process group) when the stack
closes, whatever happens in between.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.backends.process import free_ports
from kvroute.bench.harness import processes

HOST = "127.0.0.1"


def base_url(port: int) -> str:
    return f"http://{HOST}:{port}"


# ---------------------------------------------------------------- executables


def kvroute_cli() -> list[str]:
    """This interpreter, so the children run the code under test whatever PATH holds."""
    return [sys.executable, "-m", "kvroute.cli"]


def find_executable(name: str, peer_bin_dir: str | None) -> str | None:
    """``name`` in --peer-bin-dir, else next to this Python (same venv), else on PATH."""
    dirs = [Path(peer_bin_dir)] if peer_bin_dir else []
    dirs.append(Path(sys.executable).parent)
    for d in dirs:
        candidate = d / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def kvroute_argv() -> list[str]:
    """The installed ``kvroute`` script next to this Python or on PATH, else ``kvroute_cli``."""
    exe = find_executable("kvroute", None)
    return [exe] if exe else kvroute_cli()


# ---------------------------------------------------------------- command lines


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    ready_path: str


def stub_argv(port: int, model: str) -> list[str]:
    """An instant-answer stub upstream (``kvroute.bench.stub_upstream``)."""
    return [
        sys.executable, "-m", "kvroute.bench.stub_upstream",
        "--host", HOST, "--port", str(port), "--model", model,
    ]  # fmt: skip


def replica_argv(port: int, model: str, *flags: str, cli: Sequence[str] = ()) -> list[str]:
    """An emulated replica (``kvroute replica``) serving ``model``, with ``flags``."""
    argv = [*(cli or kvroute_cli()), "replica", "--host", HOST, "--port", str(port)]
    return [*argv, "--served-model-name", model, *flags]


def serve_argv(
    port: int, replicas: Sequence[str] = (), *flags: str, cli: Sequence[str] = ()
) -> list[str]:
    """``kvroute serve`` in front of ``replicas`` (URLs), with ``flags``, on ``port``."""
    argv = [*(cli or kvroute_argv()), "serve"]
    for url in replicas:
        argv += ["--replica", url]
    return [*argv, *flags, "--host", HOST, "--port", str(port)]


def peer_launch(
    router: str,
    exe: str,
    workers: Sequence[str],
    port: int,
    metrics_port: int,
    policy: str | None,
    vllm_router_flags: Sequence[str] = (),
) -> Launch:
    """vllm-router or smg (``router``, installed at ``exe``) in front of the ``workers``."""
    common = [
        "--host", HOST, "--port", str(port), "--worker-urls", *workers,
        "--policy", policy or "cache_aware",
        "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    if router == "vllm-router":
        return Launch([exe, *common, "--log-level", "error", *vllm_router_flags], "/health")
    if router == "smg":
        argv = [
            exe, "launch", *common, "--log-level", "warn", "--disable-tokenizer-autoload",
            "--shutdown-grace-period-secs", "0", "--prometheus-host", HOST,
        ]  # fmt: skip
        return Launch(argv, "/readiness")
    raise ValueError(f"no launch command for {router}")


# ---------------------------------------------------------------- starting


def start_all(
    stack: contextlib.ExitStack[bool | None],
    name: str,
    argv_for: Callable[[int], list[str]],
    ports: Sequence[int],
    log_dir: Path,
    timeout_s: float = 60.0,
) -> list[str]:
    """A process per port (``argv_for(port)``, named ``name-0``, ``name-1``...), each ready
    when its /health answers; their URLs."""
    urls = []
    for i, port in enumerate(ports):
        url = base_url(port)
        stack.enter_context(
            processes.managed(f"{name}-{i}", argv_for(port), log_dir, url + "/health", timeout_s)
        )
        urls.append(url)
    return urls


def start_router(
    stack: contextlib.ExitStack[bool | None],
    name: str,
    launch: Launch,
    port: int,
    log_dir: Path,
    timeout_s: float = 60.0,
) -> tuple[str, processes.Child]:
    """A router on ``port``, ready when its ready path answers; its URL and process."""
    url = base_url(port)
    child = stack.enter_context(
        processes.managed(name, launch.argv, log_dir, url + launch.ready_path, timeout_s)
    )
    return url, child


@contextlib.contextmanager
def running_stubs(count: int, model: str, log_dir: Path, timeout_s: float) -> Iterator[list[str]]:
    """``count`` stub upstreams, each answering /health; their URLs."""
    with contextlib.ExitStack() as stack:
        ports = free_ports(count)
        yield start_all(
            stack, "stub", lambda port: stub_argv(port, model), ports, log_dir, timeout_s
        )


def start_emulated_with_events(
    stack: contextlib.ExitStack[bool | None],
    names: Sequence[str],
    flags_for: Callable[[int], Sequence[str]],
    model: str,
    log_dir: Path,
    timeout_s: float = 60.0,
) -> list[dict[str, str]]:
    """Emulated replicas (``kvroute replica``), one per name, each publishing KV events and
    serving their replay on ports of its own, with ``flags_for(i)`` for the i-th; their
    config entries for a router (url, name, kv_events, kv_replay)."""
    cli = kvroute_cli()
    ports = free_ports(3 * len(names))
    kv = {ports[k]: (ports[k + 1], ports[k + 2]) for k in range(0, len(ports), 3)}
    order = {port: i for i, port in enumerate(kv)}

    def replica(port: int) -> list[str]:
        events, replay = kv[port]
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "kv-events",
        }
        flags = [*flags_for(order[port]), "--kv-events-config", json.dumps(config)]
        return replica_argv(port, model, *flags, cli=cli)

    urls = start_all(stack, "replica", replica, list(kv), log_dir, timeout_s)
    return [
        {
            "url": url,
            "name": name,
            "kv_events": f"tcp://{HOST}:{events}",
            "kv_replay": f"tcp://{HOST}:{replay}",
        }
        for name, url, (events, replay) in zip(names, urls, kv.values(), strict=True)
    ]
