"""The routing flags ``kvroute serve`` and ``kvroute epp`` share, and how they override a config."""

from __future__ import annotations

import argparse
from typing import Any

from kvroute.policies import DEFAULT_POLICY, POLICIES
from kvroute.router.config import Config


def add_routing_args(p: argparse.ArgumentParser, tokenizer_help: str, servers: str) -> None:
    """``--policy``, ``--tokenizer``, ``--block-size``, ``--model``; ``servers`` names what
    the command routes to (replicas, pods)."""
    p.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        help=f"Routing policy (default: the config's, else {DEFAULT_POLICY}).",
    )
    p.add_argument("--tokenizer", metavar="PATH", help=tokenizer_help)
    p.add_argument(
        "--block-size",
        type=int,
        metavar="TOKENS",
        help=f"The {servers}' KV block size (default: from their KV events or "
        "vllm:cache_config_info).",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help=f"A model name clients may request (repeat for more). Default: the models the "
        f"{servers} report on /v1/models.",
    )


def apply_routing_args(raw: dict[str, Any], config: Config, args: argparse.Namespace) -> None:
    """Write the routing flags given into ``raw`` (``config`` as plain data)."""
    if args.policy:
        params = config.policy.params if config.policy.name == args.policy else {}
        raw["policy"] = {"name": args.policy, "params": params}
    if args.tokenizer:
        raw["routing"]["tokenizer"] = args.tokenizer
    if args.block_size is not None:
        raw["routing"]["block_size"] = args.block_size
    if args.model:
        raw["models"] = args.model
