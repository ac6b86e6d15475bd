"""Prefill/decode disaggregation: when a request is worth splitting, and what moving its KV costs.

Pure rules shared by the live router (router/disaggregation.py), the emulated replica and the
simulator, so that ``kvroute plan``'s disaggregated fleets split requests exactly as the router
would. No I/O here.

The rule (``decide``) follows what the disaggregating routers converged on (vLLM Router's and
llm-d's "uncached tokens" bypass, Dynamo's conditional disaggregation): a request goes through a
prefill replica only when the prefill it would do on its decode replica is long enough to hurt
that replica's running decodes. Short prompts, and prompts the chosen decode replica mostly holds
already, are prefilled where they decode: a transfer would cost more than it saves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Mode = Literal["conditional", "always", "never"]
MODES: tuple[str, ...] = ("conditional", "always", "never")

# What ``decide`` answers: the request is split, or why it is not.
SPLIT = "split"
SHORT = "short"  # too few prompt tokens to be worth a transfer
CACHED = "cached"  # the decode replica holds most of it: little prefill left to move
NO_PREFILL = "no_prefill"  # no prefill replica can take it now (all down, draining or failed)
NEVER = "never"  # disaggregation is off for this pool
DECISIONS: tuple[str, ...] = (SPLIT, SHORT, CACHED, NO_PREFILL, NEVER)

# Link figures for the modelled KV transfer, bytes per second one way.
# NVLink (H100/H200): 900 GB/s bidirectional = 450 GB/s each way (roofline figures).
NVLINK_BYTES_PER_S = 450e9
# Between nodes: one 400 Gb/s RDMA NIC per GPU (ConnectX-7 / InfiniBand NDR, the usual 8-GPU
# node) = 50 GB/s per GPU; a tensor-parallel replica's ranks each send their own KV heads'
# shard over their own NIC, so a replica of G GPUs moves G x 50 GB/s.
RDMA_NIC_BYTES_PER_S = 50e9
LINKS: dict[str, float] = {"nvlink": NVLINK_BYTES_PER_S, "rdma": RDMA_NIC_BYTES_PER_S}
# A transfer's fixed cost: the decode side's request for the blocks and the completion notice
# (a few network round trips and a descriptor exchange).
TRANSFER_SETUP_S = 0.002


@dataclass(frozen=True, slots=True)
class DisaggregationRule:
    """``disaggregate:`` of a decode pool (or ``kvroute plan --pd``)."""

    mode: Mode = "conditional"
    # Split only when at least this many prompt tokens are not cached on the decode replica.
    # 512 is about where one 70B prefill chunk starts to stretch a running batch's decode step
    # (cf. vLLM Router's 256-token bypass and llm-d's nonCachedTokens).
    min_uncached_tokens: int = 512


def decide(
    rule: DisaggregationRule, prompt_tokens: int, cached_on_decode: int, prefill_ready: bool
) -> str:
    """Whether to split this request (``SPLIT``) or prefill it on its decode replica (why not).

    ``cached_on_decode``: prompt tokens the chosen decode replica holds (the prefix index's).
    ``prefill_ready``: some prefill replica may take traffic now.
    """
    if rule.mode == "never":
        return NEVER
    if not prefill_ready:
        return NO_PREFILL
    if rule.mode == "always":
        return SPLIT
    if prompt_tokens < rule.min_uncached_tokens:
        return SHORT
    if prompt_tokens - min(cached_on_decode, prompt_tokens) < rule.min_uncached_tokens:
        return CACHED
    return SPLIT


def transfer_s(tokens: int, kv_bytes_per_token: float, link_bytes_per_s: float) -> float:
    """Seconds to move ``tokens`` tokens' KV from a prefill replica to a decode replica."""
    if tokens <= 0:
        return 0.0
    return TRANSFER_SETUP_S + tokens * kv_bytes_per_token / link_bytes_per_s


def link_bytes_per_s(link: str, gpus: int = 1) -> float:
    """A named link's speed for a replica of ``gpus`` GPUs ('nvlink' within a node, 'rdma'
    between nodes: one NIC per GPU), or a number of GB/s given as text ('25')."""
    if link in LINKS:
        return LINKS[link] * max(1, gpus) if link == "rdma" else LINKS[link]
    try:
        gbps = float(link)
    except ValueError:
        known = ", ".join(sorted(LINKS))
        raise ValueError(f"unknown link {link!r}: one of {known}, or GB/s as a number") from None
    if gbps <= 0:
        raise ValueError(f"a link's speed must be above 0 GB/s, not {link!r}")
    return gbps * 1e9


# -- vLLM's wire: --kv-transfer-config and a request's kv_transfer_params ------------------------

# vLLM's KVTransferConfig.kv_role values. NixlConnector acts on both directions whatever the
# role (it reads only the request's kv_transfer_params); vLLM requires a known role all the same.
KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
# The connectors whose protocol kvroute's emulated replica speaks.
EMULATED_CONNECTORS: tuple[str, ...] = ("NixlConnector",)
# vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default: how long a prefill replica keeps a finished
# request's blocks for a decode replica that never reads them.
HOLD_TIMEOUT_S = 480.0


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config JSON``, checked: a ValueError that says what is wrong."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("must be a JSON object")
    check_kv_transfer_config(config)
    return config


def check_kv_transfer_config(config: dict[str, Any]) -> None:
    """A ValueError unless ``config`` names a connector the emulated replica speaks and a role."""
    connector = config.get("kv_connector")
    if connector not in EMULATED_CONNECTORS:
        known = ", ".join(EMULATED_CONNECTORS)
        raise ValueError(f"kv_connector {connector!r}: the emulated replica speaks only {known}")
    role = config.get("kv_role")
    if role not in KV_ROLES:
        raise ValueError(f"kv_role {role!r} is not one of: {', '.join(KV_ROLES)}")


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """A request's (or a prefill answer's) ``kv_transfer_params``, as NixlConnector reads them.

    The prefill leg asks ``do_remote_decode``: keep the prompt's blocks for a decode replica.
    Its answer, passed on to the decode leg, says ``do_remote_prefill`` and where the blocks
    are: ``remote_block_ids`` on engine ``remote_engine_id``, reached at remote_host:remote_port.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int | None = None

    @property
    def readable(self) -> bool:
        """Whether a decode replica can read the blocks: NixlConnector's own check (without it
        vLLM logs "Got invalid KVTransferParams" and computes the prompt itself)."""
        return bool(self.remote_block_ids) and None not in (
            self.remote_engine_id,
            self.remote_host,
            self.remote_port,
            self.remote_request_id,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": self.do_remote_prefill,
            "do_remote_decode": self.do_remote_decode,
            "remote_block_ids": self.remote_block_ids,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "tp_size": self.tp_size,
        }


# Each field's JSON type (every one may also be null), and its name in error messages.
_PARAM_TYPES: dict[str, tuple[type, str]] = {
    "do_remote_decode": (bool, "a boolean"),
    "do_remote_prefill": (bool, "a boolean"),
    "remote_engine_id": (str, "a string"),
    "remote_block_ids": (list, "a list of block ids"),
    "remote_host": (str, "a string"),
    "remote_port": (int, "an integer"),
    "remote_request_id": (str, "a string"),
    "tp_size": (int, "an integer"),
}


def parse_kv_transfer_params(value: object) -> KVTransferParams | None:
    """A request's ``kv_transfer_params`` (None when absent or null); a ValueError naming the
    field for a wrong type. Unknown keys are ignored, as NixlConnector ignores them."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_params must be an object or null")
    fields: dict[str, Any] = {}
    for name, (kind, spelled) in _PARAM_TYPES.items():
        field_value = value.get(name)
        if field_value is None:
            continue
        # JSON true is a Python int: never a port or a size.
        if not isinstance(field_value, kind) or (kind is int and isinstance(field_value, bool)):
            raise ValueError(f"kv_transfer_params.{name} must be {spelled} or null")
        fields[name] = field_value
    block_ids = fields.get("remote_block_ids")
    if block_ids is not None and not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids
    ):
        raise ValueError("kv_transfer_params.remote_block_ids must be non-negative integers")
    port = fields.get("remote_port")
    if port is not None and not 0 <= port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port {port} is not a TCP port")
    return KVTransferParams(**fields)
