"""``kvroute epp``: run the endpoint picker behind an Envoy-based gateway."""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec
import uvloop

from kvroute.router.config import Config, ConfigError, ReplicaConfig, config_from_dict, load_config
from kvroute.routing_args import add_routing_args, apply_routing_args


def add_epp_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "epp",
        help="Run the Kubernetes endpoint picker (Envoy ext_proc) over the same routing core.",
        description=(
            "Run kvroute as the Gateway API Inference Extension endpoint picker: an Envoy "
            "ext_proc gRPC server that picks the pod for each request with the same tokenizer, "
            "KV-event prefix index and policy as 'kvroute serve', and answers with an ordered "
            "fallback list in x-gateway-destination-endpoint. Endpoints come from --endpoint, "
            "the config's 'replicas', or an InferencePool (--pool-name). Flags override the "
            "config file's 'epp:' section."
        ),
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (see configs/epp.yaml).")
    p.add_argument(
        "--endpoint",
        action="append",
        metavar="HOST:PORT",
        help="A model server's address, e.g. 10.0.0.5:8000 or [fd00::5]:8000 (repeat for "
        "more). Replaces the config's replicas.",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        metavar="HOST:PORT=EVENTS[,REPLAY]",
        help="An endpoint's ZMQ KV-event endpoint and optional replay endpoint, e.g. "
        "10.0.0.5:8000=tcp://10.0.0.5:5557 (repeat per endpoint).",
    )
    p.add_argument("--pool-name", help="Watch this InferencePool's Ready pods (Kubernetes).")
    p.add_argument("--pool-namespace", help="The InferencePool's namespace (default: default).")
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="Kubeconfig for --pool-name (default: in-cluster config, else ~/.kube/config).",
    )
    p.add_argument("--host", help="Listen address of all three ports (default 127.0.0.1).")
    p.add_argument("--grpc-port", type=int, help="ext_proc gRPC port (default 9002).")
    p.add_argument("--health-port", type=int, help="grpc.health.v1 port (default 9003).")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 9090).")
    p.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="Serve ext_proc over TLS (gateways expect it by default): --cert/--key, else a "
        "self-signed certificate made at start.",
    )
    p.add_argument("--cert", metavar="FILE", help="TLS certificate (PEM), with --key.")
    p.add_argument("--key", metavar="FILE", help="TLS private key (PEM), with --cert.")
    p.add_argument(
        "--destinations",
        type=int,
        metavar="N",
        help="Endpoints listed in each pick, best first; the gateway retries down the list "
        "(default 4).",
    )
    p.add_argument(
        "--ledger-bus",
        metavar="NATS_URL",
        help="Several pickers behind one gateway: share every dispatch (in-flight load and "
        "predictions) over this NATS server, e.g. nats://nats:4222 (default: off).",
    )
    add_routing_args(
        p,
        "The served model's HuggingFace tokenizer (directory or tokenizer.json), or "
        "'builtin' for kvroute's emulated replicas.",
        "pods",
    )
    p.set_defaults(func=_cmd_epp)


def epp_config_from_args(args: argparse.Namespace) -> Config:
    config = load_config(args.config) if args.config else Config()
    raw = msgspec.to_builtins(config)
    if args.endpoint:
        raw["replicas"] = [
            msgspec.to_builtins(ReplicaConfig(url=_endpoint_url(e), name=e.strip()))
            for e in args.endpoint
        ]
    if args.kv_events:
        by_name = {r.get("name") or _address(r["url"]): r for r in raw["replicas"]}
        for spec in args.kv_events:
            name, sep, endpoints = spec.partition("=")
            events, _, replay = endpoints.partition(",")
            if not sep or not events:
                raise ConfigError(
                    f"--kv-events {spec!r}: expected HOST:PORT=EVENTS_ENDPOINT[,REPLAY_ENDPOINT]"
                )
            if name not in by_name:
                raise ConfigError(f"--kv-events {spec}: {name} is not one of the endpoints")
            by_name[name]["kv_events"] = events
            by_name[name]["kv_replay"] = replay or None
    epp = raw["epp"]
    for flag, key in (
        ("host", "host"),
        ("grpc_port", "grpc_port"),
        ("health_port", "health_port"),
        ("metrics_port", "metrics_port"),
        ("tls", "tls"),
        ("cert", "cert"),
        ("key", "key"),
        ("destinations", "destinations"),
        ("pool_name", "pool_name"),
        ("pool_namespace", "pool_namespace"),
        ("kubeconfig", "kubeconfig"),
        ("ledger_bus", "ledger_bus"),
    ):
        value = getattr(args, flag)
        if value is not None:
            epp[key] = value
    apply_routing_args(raw, config, args)
    config = config_from_dict(raw)
    if config.launch is not None:
        raise ConfigError("launch: the endpoint picker routes to pods it does not start")
    if config.pools:
        raise ConfigError(
            "pools: the endpoint picker routes one pool of pods (one InferencePool); run one "
            "picker per model, each with its replicas at the top level"
        )
    if not config.replicas and not config.epp.pool_name:
        raise ConfigError(
            "no endpoints: give --endpoint HOST:PORT, 'replicas' in the config, or --pool-name"
        )
    return config


def _endpoint_url(endpoint: str) -> str:
    endpoint = endpoint.strip()
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.5:8000")
    if ":" in host and not host.startswith("["):
        raise ConfigError(f"--endpoint {endpoint!r}: bracket an IPv6 address: [{host}]:{port}")
    return f"http://{endpoint}"


def _address(url: str) -> str:
    from kvroute.router.epp.endpoints import address_of_url

    return address_of_url(url)


def _cmd_epp(args: argparse.Namespace) -> int:
    config = epp_config_from_args(args)
    from kvroute.router.epp.server import serve

    try:
        # uvloop, as 'kvroute serve': the picker's gRPC server parses frames in the loop's
        # read callbacks, which cost less on it.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(config))
    except OSError as exc:  # a port taken, a certificate file missing
        print(f"kvroute epp: {exc}", file=sys.stderr)
        return 1
    return 0
