"""Let NIXL's UCX progress thread sleep when idle, for real-vLLM P/D tests on a small CPU box.

Put this directory on the replicas' PYTHONPATH. nixl 1.5.1's Python API creates every agent with
``pthrDelay = 0``: its progress thread polls with a zero timeout and keeps a whole core busy
per replica, idle or not. That is NIXL's choice for GPU hosts (lowest transfer latency), but two
such replicas take both cores of a 2-core CI machine and everything else crawls. This hook sets
``pthrDelay`` (the poll timeout, microseconds) to $NIXL_PTHR_DELAY_US (1000 by default) on
every agent created in the process. Test support only: kvroute never installs it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_BINDINGS_USERS = {"nixl_cu12._api", "nixl_cu13._api"}
_DELAY_US = int(os.environ.get("NIXL_PTHR_DELAY_US", "1000"))


def _patch(api: ModuleType) -> None:
    bindings = getattr(api, "nixlBind", None)
    make_agent: Callable[..., Any] | None = getattr(bindings, "nixlAgent", None)
    if bindings is None or make_agent is None or getattr(make_agent, "kvroute_patched", False):
        return
    original = make_agent

    def agent_that_sleeps(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        config.pthrDelay = _DELAY_US
        return original(name, config, *args, **kwargs)

    agent_that_sleeps.kvroute_patched = True  # type: ignore[attr-defined]
    bindings.nixlAgent = agent_that_sleeps


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _BINDINGS_USERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
