"""The ``kvroute`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

from kvroute.router.config import (
    Config,
    ConfigError,
    LaunchConfig,
    ReplicaConfig,
    config_from_dict,
    gpus_requested,
    launch_layout,
    load_config,
)
from kvroute.routing_args import add_routing_args, apply_routing_args

EXIT_CONFIG_ERROR = 2
T = TypeVar("T")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        result: int = args.func(args)
    except ConfigError as exc:
        print(f"kvroute: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return 130
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="Cache-aware router and load balancer for fleets of vLLM replicas.",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="Log verbosity (default: warning; the request path never logs per request).",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_serve(sub)
    _add_check_config(sub)
    from kvroute.backends.tiny_model import add_make_tiny_model_command
    from kvroute.bench.cli import add_bench
    from kvroute.demo import add_demo_command
    from kvroute.drill.run import add_drill_command
    from kvroute.epp_cli import add_epp_command
    from kvroute.rollout_cli import add_rollout_command
    from kvroute.simulator.cli_replay import add_replay_parsers
    from kvroute.simulator.replica.cli import add_replica_command
    from kvroute.sweep import add_sweep_command

    add_epp_command(sub)
    add_demo_command(sub)
    add_replica_command(sub)
    add_replay_parsers(sub)
    add_sweep_command(sub)
    add_make_tiny_model_command(sub)
    add_drill_command(sub)
    add_rollout_command(sub)
    add_bench(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="Run the router (OpenAI-compatible API) in front of vLLM replicas.",
        description=(
            "Run the router. Give a YAML config with --config, or replicas with --replica; "
            "flags override the config file. Replicas under the config's launch: are started "
            "first, each on its own GPUs when launch: places GPUs. A config with pools: serves "
            "several models, each its own pool of replicas (listed and/or launched, GPUs drawn "
            "from one inventory), tokenizer and policy; requests go to their model's pool."
        ),
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (see configs/).")
    p.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        help="Base URL of a replica, e.g. http://127.0.0.1:8001 (repeat for more). "
        "Replaces the config's replicas.",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        metavar="URL=EVENTS[,REPLAY]",
        help="A replica's ZMQ KV-event endpoint and optional replay endpoint, e.g. "
        "http://127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 (repeat per replica).",
    )
    add_routing_args(
        p,
        "The served model's HuggingFace tokenizer (a directory with tokenizer.json, or "
        "the file), or 'builtin' for kvroute's emulated replicas. The router tokenizes "
        "prompts exactly as vLLM does to find cached prefixes. Default: the config's "
        "routing.tokenizer, else the launched replicas', else the model directory a local "
        "replica reports in /v1/models.",
        "replicas",
    )
    p.add_argument("--host", help="Listen address (default 127.0.0.1).")
    p.add_argument(
        "--port",
        type=int,
        help="Listen port (default 8000; 0: any free port, named in the 'listening on' line).",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="Router processes sharing the port, for more than one core's worth of traffic "
        "(default 1). Workers share in-flight load and metrics.",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Print what would be launched and exit without starting anything: the GPU map "
        "(GPU -> replica) and each replica's command line and the environment variables "
        "kvroute sets for it, for every model pool of a config with pools:. Works without "
        "GPUs or model files when launch.gpus lists the GPUs (a plan made on a laptop); "
        "config errors exit 2.",
    )
    p.set_defaults(func=_cmd_serve)


def _add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check-config",
        help="Validate a config file and exit (0 valid, 2 invalid).",
        description="Validate a YAML config file: unknown keys, wrong types, bad URLs and "
        "policy parameters are reported with the key path and the reason.",
    )
    p.add_argument("file", metavar="FILE", help="The YAML config file to check.")
    p.set_defaults(func=_cmd_check_config)


def config_from_args(args: argparse.Namespace) -> Config:
    config = load_config(args.config) if args.config else Config()
    overrides = msgspec.to_builtins(config)
    if args.replica:
        overrides["replicas"] = [msgspec.to_builtins(ReplicaConfig(url=u)) for u in args.replica]
    if args.kv_events:
        by_url = {r["url"].rstrip("/"): r for r in overrides["replicas"]}
        for spec in args.kv_events:
            url, events, replay = _parse_kv_events(spec)
            if url not in by_url:
                raise ConfigError(f"--kv-events {spec}: {url} is not one of the replicas")
            by_url[url]["kv_events"] = events
            by_url[url]["kv_replay"] = replay
    apply_routing_args(overrides, config, args)
    if args.host:
        overrides["listen"]["host"] = args.host
    if args.port is not None:
        overrides["listen"]["port"] = args.port
    if args.workers is not None:
        overrides["listen"]["workers"] = args.workers
    config = config_from_dict(overrides)
    if not config.replicas and config.launch is None and not config.pools:
        raise ConfigError(
            "no replicas: give --replica URL, or 'replicas', 'launch' or 'pools' in the config"
        )
    return config


def _parse_kv_events(spec: str) -> tuple[str, str, str | None]:
    url, sep, endpoints = spec.partition("=")
    events, _, replay = endpoints.partition(",")
    if not sep or not url or not events:
        raise ConfigError(f"--kv-events {spec!r}: expected URL=EVENTS_ENDPOINT[,REPLAY_ENDPOINT]")
    return url.rstrip("/"), events, replay or None


def _cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from kvroute.backends.process import LaunchError

    if args.dry_run:
        from kvroute.router.launching import dry_run

        try:
            print(_in_file(dry_run, config, args.config))
        except LaunchError as exc:  # e.g. a socket directory path too long for ipc://
            print(f"kvroute: {exc}", file=sys.stderr)
            return 1
        return 0
    from kvroute.router.runner import check_can_listen

    problem = check_can_listen(config.listen.host, config.listen.port)
    if problem:
        print(f"kvroute: {problem}", file=sys.stderr)
        return 1
    from kvroute.backends.launcher import LaunchedFleet
    from kvroute.router.launching import start_launched_replicas, start_pools

    fleet: LaunchedFleet | None = None
    pool_fleets: list[LaunchedFleet] = []
    try:
        if config.pools:
            config, pool_fleets = _in_file(start_pools, config, args.config)
        else:
            config, fleet = _in_file(start_launched_replicas, config, args.config)
    except LaunchError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        return 1
    try:
        if config.listen.workers > 1:
            from kvroute.router.supervisor import run_workers

            run_workers(config)
        else:
            from kvroute.router.runner import run

            run(config, launched=fleet, pool_fleets=pool_fleets)
    finally:
        # After the router has drained its in-flight requests.
        for launched in [fleet] if fleet is not None else pool_fleets:
            launched.stop()
    return 0


def _in_file(fn: Callable[[Config], T], config: Config, path: str | None) -> T:
    """``fn(config)``, its config errors (GPUs counted at launch) said of the file, as on load."""
    try:
        return fn(config)
    except ConfigError as exc:
        raise ConfigError(*exc.problems, source=path) from None


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    listen = f"listen {config.listen.host}:{config.listen.port}"
    if not config.pools:
        fleet = _fleet_summary(config.replicas, config.launch)
        print(f"{args.file}: OK ({fleet}, policy {config.policy.name}, {listen})")
        return 0
    pools = "; ".join(
        f"{p.name} serving {p.model!r}: {_fleet_summary(p.replicas, p.launch)}, "
        f"policy {(p.policy or config.policy).name}"
        for p in config.pools
    )
    print(f"{args.file}: OK ({len(config.pools)} model pools: {pools}; {listen})")
    return 0


def _fleet_summary(replicas: list[ReplicaConfig], launch: LaunchConfig | None) -> str:
    fleet = [f"{len(replicas)} replicas"] if replicas or not launch else []
    if launch is not None:  # started by serve: they count as much as the listed ones
        fleet.append(f"{launch.count} launched replicas, engine {launch.engine}")
        if gpus_requested(launch):  # counted against the machine's GPUs by serve, not here
            fleet[-1] += f", {launch_layout(launch).describe()}"
    return " + ".join(fleet)


if __name__ == "__main__":
    sys.exit(main())
