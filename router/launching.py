"""Turn a config's ``launch:`` section into running replicas the router routes to, or into
the plan ``serve --dry-run`` prints."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping

import msgspec

from kvroute.backends.dry_run import describe_plan, plan_fleet
from kvroute.backends.gpus import Discovery, discover_gpus
from kvroute.backends.launcher import DEFAULT_TINY_MODEL_DIR, LaunchedFleet, LaunchSpec
from kvroute.backends.placement import GpuPlan, PlacementError, plan_gpus
from kvroute.kvcore.tokenizer import BUILTIN

from .config import (
    Config,
    ConfigError,
    LaunchConfig,
    ReplicaConfig,
    RoutingConfig,
    gpus_requested,
    launch_layout,
)

# The launch keys that placement resolves before they reach the launcher.
_GPU_KEYS = (
    "gpus",
    "gpus_per_replica",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
)


def gpu_plan(
    launch: LaunchConfig,
    *,
    dry_run: bool = False,
    discover: Callable[[], Discovery] = discover_gpus,
    environ: Mapping[str, str] = os.environ,
) -> GpuPlan | None:
    """Each replica's GPUs; None when the config asks for none. A placement that cannot be
    made (too few GPUs, a GPU that is not there) is a ``ConfigError`` naming the key.

    Real vLLM needs the GPUs it is given; a dry run and emulated replicas accept a listed
    ``gpus`` on a machine without any.
    """
    if not gpus_requested(launch):
        return None
    try:
        return plan_gpus(
            gpus=launch.gpus,
            count=launch.count,
            layout=launch_layout(launch),
            discovery=discover(),
            cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
            require_hardware=launch.engine == "vllm" and not dry_run,
        )
    except PlacementError as exc:
        raise ConfigError(*exc.problems) from None


def launch_spec(config: Config, gpus: GpuPlan | None = None) -> LaunchSpec:
    assert config.launch is not None
    fields = msgspec.structs.asdict(config.launch)
    for key in _GPU_KEYS:
        del fields[key]
    fields["extra_args"] = tuple(fields["extra_args"])
    if gpus is not None:
        fields.update(
            gpu_groups=gpus.groups,
            tensor_parallel_size=gpus.layout.tensor,
            pipeline_parallel_size=gpus.layout.pipeline,
            data_parallel_size=gpus.layout.data,
        )
    return LaunchSpec(**fields)


def start_launched_replicas(config: Config) -> tuple[Config, LaunchedFleet | None]:
    """Start what ``launch`` declares; return the config with them as plain replicas."""
    if config.launch is None:
        return config, None
    gpus = gpu_plan(config.launch)
    spec = launch_spec(config, gpus)
    on = ""
    if gpus is not None:
        on = " on GPUs " + " | ".join(",".join(map(str, group)) for group in gpus.groups)
    print(
        f"kvroute: starting {spec.count} {spec.engine} replicas{on} (logs in {spec.log_dir}/)",
        file=sys.stderr,
        flush=True,
    )
    fleet = LaunchedFleet(spec)
    fleet.start()
    launched = [
        ReplicaConfig(
            url=r.url,
            name=r.name,
            kv_events=r.kv_events,
            kv_replay=r.kv_replay,
        )
        for r in fleet.replicas
    ]
    routing = routing_for_launch(config.routing, spec)
    return msgspec.structs.replace(
        config, replicas=[*config.replicas, *launched], launch=None, routing=routing
    ), fleet


def dry_run(
    config: Config,
    *,
    discover: Callable[[], Discovery] = discover_gpus,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """What ``serve`` would start, and where, without starting anything."""
    listen = f"{config.listen.host}:{config.listen.port}"
    if config.launch is None:
        return (
            f"router on {listen} (policy {config.policy.name}) in front of "
            f"{len(config.replicas)} listed replicas; the config launches none"
        )
    gpus = gpu_plan(config.launch, dry_run=True, discover=discover, environ=environ)
    spec = launch_spec(config, gpus)
    routing = routing_for_launch(config.routing, spec)
    head = (
        f"router on {listen} (policy {config.policy.name}, tokenizer {routing.tokenizer}, "
        f"block size {routing.block_size})"
    )
    if config.replicas:
        head += f", also routing to {len(config.replicas)} listed replicas"
    return head + "\n" + describe_plan(spec, plan_fleet(spec), gpus)


def routing_for_launch(routing: RoutingConfig, spec: LaunchSpec) -> RoutingConfig:
    """The router tokenizes and cuts blocks like the replicas it launched, unless told otherwise."""
    tokenizer = routing.tokenizer
    if tokenizer is None:
        if spec.engine == "vllm":
            tokenizer = spec.tokenizer or spec.model_path or str(DEFAULT_TINY_MODEL_DIR)
        else:
            tokenizer = spec.tokenizer or BUILTIN
    return msgspec.structs.replace(
        routing, tokenizer=tokenizer, block_size=routing.block_size or spec.block_size
    )
