"""Start the replicas a config declares under ``launch:``, and stop them again.

Launching happens before the router serves (and, with several workers, in the supervisor
before it forks), so the router itself only ever sees a list of replica URLs with their
KV-event endpoints: launched replicas become static ones once they run.

KV events say which prompts' blocks a replica holds, so by default (``kv_events_bind: ipc``)
they stay on this host and this user: each replica binds Unix sockets (``ipc://``) in a
directory of mode 0700 that the fleet creates and removes on stop, and the router connects to
them. ``tcp`` binds TCP ports instead, for subscribers on other hosts (vLLM binds a TCP
endpoint only as ``tcp://*:P``, every interface; the emulated replica binds it on its --host).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .process import LaunchError, ManagedProcess, free_ports

DEFAULT_TINY_MODEL_DIR = Path.home() / ".cache" / "kvroute" / "tiny-model"
KV_TOPIC = "kv-events"


@dataclass(frozen=True)
class LaunchSpec:
    """What a launcher needs to know; mirrors the config's ``launch`` section."""

    engine: str
    count: int
    model: str
    model_path: str | None
    tokenizer: str | None
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    preset: str
    time_scale: float
    kv_events: bool
    host: str
    log_dir: str
    startup_timeout_s: float
    max_restarts: int
    extra_args: tuple[str, ...] = ()
    # The ZMQ topic KV events are published under. kvroute subscribes to every topic; some
    # peers (vllm-router 0.1.17's kv_aware) only take events published under "".
    kv_topic: str = KV_TOPIC
    # "ipc": KV events on Unix sockets in a private directory (this host, this user only);
    # "tcp": on TCP ports, for subscribers elsewhere.
    kv_events_bind: str = "ipc"


@dataclass
class LaunchedReplica:
    name: str
    url: str
    kv_events: str | None
    kv_replay: str | None
    process: ManagedProcess


@dataclass(frozen=True)
class KVEndpoints:
    """One replica's KV-event endpoints: as it binds them, and as the router connects."""

    bind_events: str
    bind_replay: str
    events: str
    replay: str


# Unix socket paths longer than this do not fit sockaddr_un (108 bytes with the NUL).
_MAX_IPC_PATH = 107


def emulated_command(spec: LaunchSpec, port: int, kv: KVEndpoints | None) -> list[str]:
    argv = [
        sys.executable, "-m", "kvroute.cli", "replica",
        "--host", spec.host,
        "--port", str(port),
        "--served-model-name", spec.model,
        "--block-size", str(spec.block_size),
        "--num-gpu-blocks-override", str(spec.num_gpu_blocks),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--preset", spec.preset,
        "--time-scale", str(spec.time_scale),
    ]  # fmt: skip
    if spec.tokenizer:
        argv += ["--tokenizer", spec.tokenizer]
    if kv is not None:
        argv += [
            "--kv-events-config",
            kv_events_config_json(kv.bind_events, kv.bind_replay, spec.kv_topic),
        ]
    return argv + list(spec.extra_args)


def kv_events_config_json(events: str, replay: str, topic: str = KV_TOPIC) -> str:
    # vLLM binds an endpoint only when it is ipc:// or has a wildcard host ("tcp://*:P"); with
    # a concrete host it connects out instead. The replica binds; the router connects.
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,
            "replay_endpoint": replay,
            "topic": topic,
        }
    )


def vllm_command(
    spec: LaunchSpec, port: int, kv: KVEndpoints | None
) -> tuple[list[str], dict[str, str]]:
    from .vllm_args import vllm_server_command

    model_dir = Path(spec.model_path) if spec.model_path else ensure_tiny_model()
    return vllm_server_command(
        model_dir=model_dir,
        port=port,
        served_model_name=spec.model,
        block_size=spec.block_size,
        num_gpu_blocks=spec.num_gpu_blocks,
        max_num_seqs=spec.max_num_seqs,
        kv_events_endpoint=kv.bind_events if kv is not None else None,
        kv_replay_endpoint=kv.bind_replay if kv is not None else None,
        topic=spec.kv_topic,
        host=spec.host,
        extra_args=spec.extra_args,
    )


def ensure_tiny_model() -> Path:
    from .tiny_model import make_tiny_model

    return make_tiny_model(DEFAULT_TINY_MODEL_DIR)


class LaunchedFleet:
    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        # The replicas' KV-event sockets: mkdtemp makes it mode 0700, owned by this user.
        self.kv_dir: Path | None = None
        if spec.kv_events and spec.kv_events_bind == "ipc":
            self.kv_dir = Path(tempfile.mkdtemp(prefix="kvroute-kv-"))
        ports = free_ports(3 * spec.count)
        try:
            self.replicas: list[LaunchedReplica] = [
                self._replica(i, ports[3 * i : 3 * i + 3]) for i in range(spec.count)
            ]
        except LaunchError:
            if self.kv_dir is not None:
                shutil.rmtree(self.kv_dir, ignore_errors=True)
            raise

    def _replica(self, i: int, ports: list[int]) -> LaunchedReplica:
        spec = self.spec
        port, events_port, replay_port = ports
        name = f"{spec.engine}-{i}"
        env: dict[str, str] = {}
        kv = self._kv_endpoints(name, events_port, replay_port)
        if spec.engine == "vllm":
            argv, env = vllm_command(spec, port, kv)
        else:
            argv = emulated_command(spec, port, kv)
        url = f"http://{spec.host}:{port}"
        process = ManagedProcess(
            name,
            argv,
            env=env,
            log_path=Path(spec.log_dir) / f"{name}.log",
            health_url=url + "/health",
            max_restarts=spec.max_restarts,
        )
        return LaunchedReplica(
            name,
            url,
            kv.events if kv is not None else None,
            kv.replay if kv is not None else None,
            process,
        )

    def _kv_endpoints(self, name: str, events_port: int, replay_port: int) -> KVEndpoints | None:
        if not self.spec.kv_events:
            return None
        if self.kv_dir is None:  # tcp: the replica binds the port, the router connects to host:P
            host = self.spec.host
            return KVEndpoints(
                f"tcp://*:{events_port}",
                f"tcp://*:{replay_port}",
                f"tcp://{host}:{events_port}",
                f"tcp://{host}:{replay_port}",
            )
        events, replay = self.kv_dir / f"{name}.events", self.kv_dir / f"{name}.replay"
        if len(str(replay).encode()) > _MAX_IPC_PATH:
            raise LaunchError(
                f"{name}: the KV-event socket path {replay} is too long for a Unix socket: set "
                "TMPDIR to a shorter directory, or launch.kv_events_bind: tcp"
            )
        return KVEndpoints(
            f"ipc://{events}", f"ipc://{replay}", f"ipc://{events}", f"ipc://{replay}"
        )

    def start(self) -> None:
        """Start every replica, wait until all are ready (in parallel), then watch them.

        A port the OS called free can be taken before the replica binds it (by any process's
        outgoing connection): a replica that exits saying its address is in use is started
        again once on fresh ports.
        """
        for replica in self.replicas:
            replica.process.start()
        failed = self._wait_ready(range(len(self.replicas)))
        retry = [i for i, exc in failed.items() if "address already in use" in str(exc).lower()]
        for i in retry:
            self.replicas[i] = self._replica(i, free_ports(3))
            self.replicas[i].process.start()
        failed = {i: e for i, e in failed.items() if i not in retry} | self._wait_ready(retry)
        if failed:
            self.stop()
            raise failed[min(failed)]
        for replica in self.replicas:
            replica.process.watch(self.spec.startup_timeout_s)

    def _wait_ready(self, indices: Iterable[int]) -> dict[int, LaunchError]:
        errors: dict[int, LaunchError] = {}

        def wait(i: int) -> None:
            try:
                self.replicas[i].process.wait_ready(self.spec.startup_timeout_s)
            except LaunchError as exc:
                errors[i] = exc

        threads = [threading.Thread(target=wait, args=(i,)) for i in indices]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return errors

    def stop(self, grace_s: float = 10.0) -> None:
        threads = [threading.Thread(target=r.process.stop, args=(grace_s,)) for r in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.kv_dir is not None:  # the sockets outlive a killed replica: remove them too
            shutil.rmtree(self.kv_dir, ignore_errors=True)
