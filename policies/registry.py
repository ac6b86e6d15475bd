"""Build policies by name from config parameters."""

from __future__ import annotations

import inspect
from typing import Any

from .consistent_hash import ConsistentHash
from .kv_aware import KvAware
from .least_loaded import LeastLoaded
from .power_of_two import PowerOfTwo
from .random_choice import RandomChoice
from .round_robin import RoundRobin
from .types import Policy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        RandomChoice,
        LeastLoaded,
        PowerOfTwo,
        ConsistentHash,
        KvAware,
    )
}

DEFAULT_POLICY = "kv_aware"


class PolicyConfigError(ValueError):
    """A policy name or parameter that cannot be used; the message says which and why."""


def _optional_numbers(name: str) -> set[str]:
    """Parameters declared ``float | None``: a number, or null for none."""
    signature = inspect.signature(POLICIES[name].__init__)
    return {p.name for p in signature.parameters.values() if "float" in str(p.annotation)}


def policy_parameters(name: str) -> dict[str, Any]:
    """The parameters a policy accepts, with their defaults."""
    signature = inspect.signature(POLICIES[name].__init__)
    return {
        p.name: p.default
        for p in list(signature.parameters.values())[1:]
        if p.kind is p.POSITIONAL_OR_KEYWORD
    }


def build_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    if name not in POLICIES:
        raise PolicyConfigError(
            f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}"
        )
    params = dict(params or {})
    accepted = policy_parameters(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        allowed = ", ".join(sorted(accepted)) or "none"
        raise PolicyConfigError(
            f"policy {name!r} has no parameter {unknown[0]!r} (accepted: {allowed})"
        )
    floats = _optional_numbers(name)
    for key, value in params.items():
        default = accepted[key]
        if default is None and key in floats:
            if value is not None:
                _check_type(key, value, 0.0)
            continue
        _check_type(key, value, default)
    try:
        return POLICIES[name](**params)
    except ValueError as exc:
        raise PolicyConfigError(f"policy {name!r}: {exc}") from exc


def _check_type(key: str, value: Any, default: Any) -> None:
    """Parameters take the type of their default; a None default means an optional int (an
    optional number when declared ``float | None``, checked as a float default here)."""
    if isinstance(default, float):
        ok, wanted = isinstance(value, (int, float)), "a number"
    elif default is None:
        ok, wanted = value is None or isinstance(value, int), "an integer or null"
    else:
        ok, wanted = isinstance(value, type(default)), f"of type {type(default).__name__}"
    if not ok or (isinstance(value, bool) and not isinstance(default, bool)):
        raise PolicyConfigError(f"policy parameter {key!r} must be {wanted}, got {value!r}")
