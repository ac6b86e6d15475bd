"""Model pools in the config (``pools:``): what each pool is, and what is wrong with them.

A pool is the replicas serving one model name (listed under ``replicas``, started from its
``launch:``, or both) with its own tokenizer, block size and policy. A config without ``pools:``
is one implicit pool made of the top-level ``replicas``, ``launch``, ``routing`` and ``policy``,
serving whatever ``models:`` (or the replicas) name, exactly as before pools existed:
``pool_specs`` turns either form into the same list, which is all the router, the launcher and
the dry run read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvroute.kvcore.pd import EMULATED_CONNECTORS, MODES, DisaggregationRule
from kvroute.policies import PolicyConfigError, build_policy

from .config import (
    Config,
    ConfigError,
    DisaggregateConfig,
    LaunchConfig,
    PolicyConfig,
    PoolConfig,
    ReplicaConfig,
    RoutingConfig,
    check_replica_url,
    launch_problems,
    passed_items,
    policy_params,
    replica_name_from_url,
    replica_problems,
    tokenizer_problems,
)
from .dp_ranks import expand_ranks

# The implicit pool of a config without ``pools:``.
IMPLICIT_POOL = "default"
# A pool's name prefixes its launched replicas' names and labels its metrics.
_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_DEFAULT_LAUNCH_MODEL = LaunchConfig().model


@dataclass(frozen=True)
class PoolSpec:
    """One pool as the router runs it, whichever way the config wrote it."""

    name: str
    model: str | None  # None: the implicit pool, which takes any model the catalog admits
    position: int  # its place in ``pools:`` (0 for the implicit pool)
    replicas: tuple[ReplicaConfig, ...]
    launch: LaunchConfig | None
    routing: RoutingConfig  # the top-level routing: with this pool's tokenizer and block size
    policy: PolicyConfig
    policy_params: dict[str, Any]
    # Prefill/decode disaggregation (kvcore/pd.py): "prefill", "decode" or None (both).
    role: str | None = None
    disaggregate: DisaggregationRule = field(default_factory=DisaggregationRule)  # decode's
    kv_transfer_config: dict[str, Any] | None = None  # a role pool's; None: NIXL

    @property
    def implicit(self) -> bool:
        return self.model is None

    def key(self, key: str) -> str:
        """``key`` as the config names it for this pool: 'pools[1].launch' or 'launch'."""
        return key if self.implicit else f"pools[{self.position}].{key}"

    @property
    def replica_prefix(self) -> str:
        """What its launched replicas' names start with: the pool's name, so that names stay
        unique across pools ('' in the implicit pool: emulated-0, vllm-1 as always)."""
        return "" if self.implicit else f"{self.name}-"


def pool_specs(config: Config) -> list[PoolSpec]:
    if not config.pools:
        return [
            PoolSpec(
                IMPLICIT_POOL,
                None,
                0,
                tuple(expand_ranks(config.replicas)),
                config.launch,
                config.routing,
                config.policy,
                policy_params(config),
            )
        ]
    specs = []
    for i, pool in enumerate(config.pools):
        policy = pool.policy or config.policy
        routing = msgspec.structs.replace(
            config.routing, tokenizer=pool.tokenizer, block_size=pool.block_size
        )
        specs.append(
            PoolSpec(
                pool.name,
                pool.model,
                i,
                tuple(expand_ranks(pool.replicas)),
                pool.launch,
                routing,
                policy,
                policy_params(config, policy),
                pool.role,
                _rule(pool.disaggregate),
                pool.kv_transfer_config,
            )
        )
    return specs


def _rule(written: DisaggregateConfig | None) -> DisaggregationRule:
    if written is None:
        return DisaggregationRule()
    return DisaggregationRule(written.mode, written.min_uncached_tokens)  # type: ignore[arg-type]


def default_kv_transfer_config(role: str) -> dict[str, Any]:
    """What a role pool's launched replicas get as --kv-transfer-config unless the pool says:
    NIXL, producing on prefill replicas and consuming on decode ones (vLLM deprecates
    kv_both for P/D pairs)."""
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return {"kv_connector": "NixlConnector", "kv_role": kv_role}


def all_replicas(config: Config) -> list[ReplicaConfig]:
    """Every listed replica of every pool, pool by pool (the registry's order)."""
    return [r for spec in pool_specs(config) for r in spec.replicas]


def in_key(problems: list[str], key: str) -> list[str]:
    """Problems said of a ``launch:`` section ('launch.gpus: ...') said of ``key`` instead."""
    if key == "launch":
        return problems
    return [p.replace("launch.", f"{key}.") for p in problems]


# -- checks -------------------------------------------------------------------------------


def pool_problems(config: Config, passed: list[tuple[int, Any]]) -> list[str]:
    """What types alone cannot rule out in ``pools:``; ``passed`` are the (position, raw entry)
    of the pools that became structs, in the order of ``config.pools``."""
    if not config.pools:
        return []
    problems = _top_level_problems(config)
    names: dict[str, str] = {}  # pool name -> its key
    models: dict[tuple[str, str | None], str] = {}  # (model, role) -> the key of its pool
    replica_names: dict[str, str] = {}  # replica name -> where it comes from
    gpus: dict[int, str] = {}  # a GPU listed by a pool's launch.gpus -> that key
    for (position, raw), pool in zip(passed, config.pools, strict=True):
        where = f"pools[{position}]"
        if not _POOL_NAME.fullmatch(pool.name):
            problems.append(
                f"{where}.name: {pool.name!r} must be 1-63 letters, digits, '-', '_' or '.', "
                "starting with a letter or digit (it names the pool's replicas and metrics)"
            )
        elif pool.name in names:
            problems.append(
                f"{where}.name: duplicate pool name {pool.name!r} (also {names[pool.name]})"
            )
        names.setdefault(pool.name, where)
        if not pool.model.strip():
            problems.append(f"{where}.model: must not be empty (the model name clients ask for)")
        else:
            problems += _model_problems(pool, where, models)
        models.setdefault((pool.model, pool.role), where)
        if not pool.replicas and pool.launch is None:
            problems.append(
                f"{where}: no replicas: give replicas: (running replicas' URLs) or launch: "
                "(replicas kvroute starts), or both"
            )
        launched = _launched_names(pool)
        for name in launched:
            replica_names.setdefault(name, f"a replica {where}.launch starts")
        problems += _replica_problems(pool, where, raw, replica_names)
        if pool.launch is not None:
            problems += _pool_launch_problems(pool, where, gpus)
        problems += tokenizer_problems(f"{where}.tokenizer", pool.tokenizer)
        if pool.block_size is not None and pool.block_size < 1:
            problems.append(f"{where}.block_size: must be >= 1, got {pool.block_size}")
        problems += _policy_problems(config, pool, where)
        problems += _role_problems(pool, where)
    return problems + _pair_problems(config, passed)


def _model_problems(
    pool: PoolConfig, where: str, models: dict[tuple[str, str | None], str]
) -> list[str]:
    """One pool per model, except a prefill pool and a decode pool that make a P/D pair."""
    same = [key for (model, role), key in models.items() if model == pool.model]
    if not same:
        return []
    if (pool.model, pool.role) in models or pool.role is None or (pool.model, None) in models:
        return [
            f"{where}.model: {pool.model!r} is already served by {same[0]}; each model name is "
            "served by one pool, or by one role: prefill and one role: decode pool"
        ]
    return []


def _role_problems(pool: PoolConfig, where: str) -> list[str]:
    problems = []
    if pool.role is not None and pool.role not in ("prefill", "decode"):
        problems.append(
            f"{where}.role: {pool.role!r} is not a role: prefill or decode (leave it out for a "
            "pool whose replicas do both)"
        )
    if pool.disaggregate is not None:
        rule = pool.disaggregate
        if pool.role != "decode":
            problems.append(
                f"{where}.disaggregate: only a role: decode pool has one (it decides which of "
                "its requests go through the prefill pool first)"
            )
        if rule.mode not in MODES:
            problems.append(
                f"{where}.disaggregate.mode: {rule.mode!r} is not one of {', '.join(MODES)}"
            )
        if rule.min_uncached_tokens < 0:
            problems.append(
                f"{where}.disaggregate.min_uncached_tokens: must be >= 0, got "
                f"{rule.min_uncached_tokens}"
            )
    if pool.kv_transfer_config is not None:
        if pool.role is None:
            problems.append(
                f"{where}.kv_transfer_config: only a role: prefill or decode pool moves KV "
                "between replicas"
            )
        elif not isinstance(connector := pool.kv_transfer_config.get("kv_connector"), str):
            problems.append(
                f"{where}.kv_transfer_config.kv_connector: must name vLLM's KV connector "
                "(e.g. NixlConnector)"
            )
        elif (
            pool.launch is not None
            and pool.launch.engine == "emulated"
            and connector not in EMULATED_CONNECTORS
        ):
            problems.append(
                f"{where}.kv_transfer_config.kv_connector: emulated replicas speak "
                f"{', '.join(EMULATED_CONNECTORS)}'s protocol only, not {connector!r}"
            )
    return problems


def _pair_problems(config: Config, passed: list[tuple[int, Any]]) -> list[str]:
    """Every role pool has its partner: a prefill pool alone would never be used, and a
    decode pool alone is an ordinary pool by another name."""
    problems = []
    roles = {(p.model, p.role) for p in config.pools}
    for (position, _), pool in zip(passed, config.pools, strict=True):
        other = {"prefill": "decode", "decode": "prefill"}.get(pool.role or "")
        if other and (pool.model, other) not in roles:
            problems.append(
                f"pools[{position}].role: a role: {pool.role} pool needs a role: {other} pool "
                f"serving the same model ({pool.model!r})"
            )
    return problems


def _top_level_problems(config: Config) -> list[str]:
    """Keys that say, for the whole router, what each pool says for itself."""
    problems = []
    for key, given, instead in (
        ("replicas", bool(config.replicas), "list each replica under its pool (pools[N].replicas)"),
        ("launch", config.launch is not None, "each pool has its own (pools[N].launch)"),
        ("models", bool(config.models), "clients ask for the pools' models (pools[N].model)"),
        (
            "routing.tokenizer",
            config.routing.tokenizer is not None,
            "each pool has its own (pools[N].tokenizer)",
        ),
        (
            "routing.block_size",
            config.routing.block_size is not None,
            "each pool has its own (pools[N].block_size)",
        ),
    ):
        if given:
            problems.append(f"{key}: not with pools: {instead}")
    return problems


def _launched_names(pool: PoolConfig) -> list[str]:
    launch = pool.launch
    if launch is None or launch.count < 1:
        return []
    return [f"{pool.name}-{launch.engine}-{i}" for i in range(launch.count)]


def _replica_problems(pool: PoolConfig, where: str, raw: Any, seen: dict[str, str]) -> list[str]:
    """The pool's listed replicas: usable URLs, names unique across every pool."""
    problems = []
    keys = [f"{where}.replicas[{i}]" for i, _ in passed_items(raw.get("replicas"), ReplicaConfig)]
    for key, replica in zip(keys, pool.replicas, strict=True):
        try:
            check_replica_url(replica.url, f"{key}.url")
        except ConfigError as exc:
            problems += exc.problems
            continue
        if replica.name is not None and not replica.name.strip():
            problems.append(
                f"{key}.name: must not be empty (leave it out to name the replica by its URL)"
            )
            continue
        name = replica.name or replica_name_from_url(replica.url)
        if name in seen:
            problems.append(f"{key}.name: duplicate replica name {name!r} ({seen[name]} too)")
        seen.setdefault(name, key)
        problems += replica_problems(replica, key)
    return problems


def _pool_launch_problems(pool: PoolConfig, where: str, gpus: dict[int, str]) -> list[str]:
    launch = pool.launch
    assert launch is not None
    key = f"{where}.launch"
    problems = in_key(launch_problems(launch), key)
    # Left at its default, launch.model is the pool's model (a config read back from plain
    # data, as the CLI's overrides do, has the default written out).
    if launch.model not in (_DEFAULT_LAUNCH_MODEL, pool.model):
        problems.append(
            f"{key}.model: {launch.model!r} differs from {where}.model {pool.model!r}; leave "
            "it out (the pool's model is the name its replicas serve)"
        )
    block_size = pool.block_size
    if block_size is not None and block_size != launch.block_size:
        problems.append(
            f"{where}.block_size: {block_size} differs from {key}.block_size "
            f"{launch.block_size}; the router must cut prompts into the replicas' blocks"
        )
    if isinstance(launch.gpus, list):
        for gpu in dict.fromkeys(launch.gpus):
            if gpu in gpus:
                problems.append(
                    f"{key}.gpus: GPU {gpu} is listed by {gpus[gpu]} too; each GPU goes to one pool"
                )
            gpus.setdefault(gpu, f"{key}.gpus")
    return problems


def _policy_problems(config: Config, pool: PoolConfig, where: str) -> list[str]:
    if pool.policy is None:
        return []  # the top-level policy:, checked as such
    try:
        build_policy(pool.policy.name, policy_params(config, pool.policy))
    except PolicyConfigError as exc:
        key = "policy.name" if "unknown policy" in str(exc) else "policy.params"
        return [f"{where}.{key}: {exc}"]
    return []
