"""Turn a config's ``launch:`` section into running replicas the router routes to."""

from __future__ import annotations

import sys

import msgspec

from kvroute.backends.launcher import DEFAULT_TINY_MODEL_DIR, LaunchedFleet, LaunchSpec
from kvroute.kvcore.tokenizer import BUILTIN

from .config import Config, ReplicaConfig, RoutingConfig


def launch_spec(config: Config) -> LaunchSpec:
    assert config.launch is not None
    fields = msgspec.structs.asdict(config.launch)
    fields["extra_args"] = tuple(fields["extra_args"])
    return LaunchSpec(**fields)


def start_launched_replicas(config: Config) -> tuple[Config, LaunchedFleet | None]:
    """Start what ``launch`` declares; return the config with them as plain replicas."""
    if config.launch is None:
        return config, None
    spec = launch_spec(config)
    print(
        f"kvroute: starting {spec.count} {spec.engine} replicas (logs in {spec.log_dir}/)",
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
