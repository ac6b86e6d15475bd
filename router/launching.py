"""Turn a config's ``launch:`` sections (its own, or each model pool's) into running replicas
the router routes to, or into the plan ``serve --dry-run`` prints."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

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
from .pool_config import PoolSpec, default_kv_transfer_config, in_key, pool_specs

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
    taken: Mapping[int, str] | None = None,
    key: str = "launch",
) -> GpuPlan | None:
    """Each replica's GPUs; None when the config asks for none. A placement that cannot be
    made (too few GPUs, a GPU that is not there) is a ``ConfigError`` naming the key (``key``:
    the section's, 'pools[1].launch' in a pool). ``taken``: GPUs other pools hold already.

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
            taken=taken,
        )
    except PlacementError as exc:
        raise ConfigError(*in_key(exc.problems, key)) from None


# vLLM serves its token-in /inference/v1/generate (and the render endpoints) only with it.
SCALE_OUT_FLAG = "--enable-scale-out"


def launch_spec(
    launch: LaunchConfig,
    gpus: GpuPlan | None = None,
    *,
    model: str | None = None,
    name_prefix: str = "",
    send_tokens: bool = False,
) -> LaunchSpec:
    """``model``: the served name when it is not ``launch.model`` (a pool's model).
    ``send_tokens`` (routing.send_tokens): vLLM replicas serve /inference/v1/generate."""
    fields = msgspec.structs.asdict(launch)
    for key in _GPU_KEYS:
        del fields[key]
    extra = list(fields["extra_args"])
    if send_tokens and launch.engine == "vllm" and SCALE_OUT_FLAG not in extra:
        extra.append(SCALE_OUT_FLAG)
    fields["extra_args"] = tuple(extra)
    fields["presets"] = tuple(fields["presets"])
    fields["name_prefix"] = name_prefix
    if model is not None:
        fields["model"] = model
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
    spec = launch_spec(config.launch, gpus, send_tokens=config.routing.send_tokens)
    fleet = _start(spec, gpus, "")
    launched = _as_listed(fleet)
    routing = routing_for_launch(config.routing, spec)
    return msgspec.structs.replace(
        config, replicas=[*config.replicas, *launched], launch=None, routing=routing
    ), fleet


def _start(spec: LaunchSpec, gpus: GpuPlan | None, pool: str) -> LaunchedFleet:
    on = ""
    if gpus is not None:
        on = " on GPUs " + " | ".join(",".join(map(str, group)) for group in gpus.groups)
    print(
        f"kvroute: {pool}starting {spec.count} {spec.engine} replicas{on} "
        f"(logs in {spec.log_dir}/)",
        file=sys.stderr,
        flush=True,
    )
    fleet = LaunchedFleet(spec)
    fleet.start()
    return fleet


def _as_listed(fleet: LaunchedFleet) -> list[ReplicaConfig]:
    """Launched replicas as the router sees them: listed ones, with their KV-event endpoints."""
    return [
        ReplicaConfig(
            url=r.url,
            name=r.name,
            kv_events=r.kv_events,
            kv_replay=r.kv_replay,
            data_parallel_size=r.data_parallel_size,
            speed=r.speed,
        )
        for r in fleet.replicas
    ]


# -- model pools ------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolLaunch:
    """What one pool's ``launch:`` starts, and on which GPUs."""

    pool: PoolSpec
    spec: LaunchSpec
    gpus: GpuPlan | None


def plan_pools(
    config: Config,
    *,
    dry_run: bool = False,
    discover: Callable[[], Discovery] = discover_gpus,
    environ: Mapping[str, str] = os.environ,
) -> list[PoolLaunch]:
    """Each launching pool's replicas and GPUs, drawn in pool order from one inventory of the
    host's GPUs: no GPU goes to two pools, and a pool that finds too few left is a
    ``ConfigError`` naming its key. Every pool is planned before any replica starts."""
    found: list[Discovery] = []

    def discover_once() -> Discovery:
        if not found:
            found.append(discover())
        return found[0]

    taken: dict[int, str] = {}
    plans = []
    for pool in pool_specs(config):
        if pool.launch is None:
            continue
        key = pool.key("launch")
        gpus = gpu_plan(
            pool.launch,
            dry_run=dry_run,
            discover=discover_once,
            environ=environ,
            taken=taken,
            key=key,
        )
        spec = launch_spec(
            pool.launch,
            gpus,
            model=pool.model,
            name_prefix=pool.replica_prefix,
            send_tokens=config.routing.send_tokens,
        )
        if pool.role is not None:
            transfer = pool.kv_transfer_config or default_kv_transfer_config(pool.role)
            spec = replace(spec, kv_transfer_config=json.dumps(transfer))
        for slot, group in enumerate(gpus.groups if gpus is not None else ()):
            for local, gpu in enumerate(group):
                taken[gpu] = f"{spec.replica_name(slot)} as cuda:{local}"
        plans.append(PoolLaunch(pool, spec, gpus))
    return plans


def start_pools(config: Config) -> tuple[Config, list[LaunchedFleet]]:
    """Start what each pool's ``launch`` declares; return the config with them as listed
    replicas of their pools (and each pool's tokenizer and block size its replicas'), and the
    fleets to stop on exit. A pool that fails to start stops the ones started before it."""
    plans = plan_pools(config)
    pools = list(config.pools)
    fleets: list[LaunchedFleet] = []
    try:
        for plan in plans:
            fleet = _start(plan.spec, plan.gpus, f"pool {plan.pool.name}: ")
            fleets.append(fleet)
            routing = routing_for_launch(plan.pool.routing, plan.spec)
            written = pools[plan.pool.position]
            pools[plan.pool.position] = msgspec.structs.replace(
                written,
                replicas=[*written.replicas, *_as_listed(fleet)],
                launch=None,
                tokenizer=routing.tokenizer,
                block_size=routing.block_size,
            )
    except BaseException:
        for fleet in fleets:
            fleet.stop()
        raise
    return msgspec.structs.replace(config, pools=pools), fleets


def _dry_run_pools(
    config: Config, discover: Callable[[], Discovery], environ: Mapping[str, str]
) -> str:
    plans = {
        p.pool.name: p for p in plan_pools(config, dry_run=True, discover=discover, environ=environ)
    }
    specs = pool_specs(config)
    listen = f"{config.listen.host}:{config.listen.port}"
    served = ", ".join(f"{s.name} ({s.model!r})" for s in specs)
    lines = [f"router on {listen} in front of {len(specs)} model pools: {served}"]
    for pool in specs:
        plan = plans.get(pool.name)
        routing = routing_for_launch(pool.routing, plan.spec) if plan else pool.routing
        head = (
            f"pool {pool.name} serving {pool.model!r} (policy {pool.policy.name}, "
            f"tokenizer {routing.tokenizer or 'from its replicas'}, "
            f"block size {routing.block_size or 'from its replicas'})"
        )
        lines += ["", f"== {head}"]
        listed = len(pool.replicas)
        if plan is None:
            lines.append(f"{listed} listed replicas; the pool launches none")
            continue
        if listed:
            lines.append(f"also routing to {listed} listed replicas")
        lines.append(
            describe_plan(plan.spec, plan_fleet(plan.spec), plan.gpus, key=pool.key("launch"))
        )
    return "\n".join(lines)


def dry_run(
    config: Config,
    *,
    discover: Callable[[], Discovery] = discover_gpus,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """What ``serve`` would start, and where, without starting anything."""
    if config.pools:
        return _dry_run_pools(config, discover, environ)
    listen = f"{config.listen.host}:{config.listen.port}"
    if config.launch is None:
        return (
            f"router on {listen} (policy {config.policy.name}) in front of "
            f"{len(config.replicas)} listed replicas; the config launches none"
        )
    gpus = gpu_plan(config.launch, dry_run=True, discover=discover, environ=environ)
    spec = launch_spec(config.launch, gpus, send_tokens=config.routing.send_tokens)
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
