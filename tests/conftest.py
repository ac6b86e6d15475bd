"""Shared fixtures: fake replicas and in-process routers on free ports."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from router.config import config_from_dict
from router.server import Router

from .fake_replica import FakeReplica


def pytest_sessionstart(session: pytest.Session) -> None:
    """With KVROUTE_REQUIRE_VLLM=1 (the README's test command, so CI), tests that need real
    vLLM must run: fail at once instead of letting them skip."""
    if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        pytest.exit(
            "KVROUTE_REQUIRE_VLLM=1 but vLLM is not installed: pip install -e '.[vllm]'",
            returncode=3,
        )


@dataclass
class RunningRouter:
    router: Router
    url: str


StartReplica = Callable[..., Awaitable[FakeReplica]]
StartRouter = Callable[..., Awaitable[RunningRouter]]


@pytest.fixture
async def start_replica() -> AsyncIterator[StartReplica]:
    started: list[FakeReplica] = []

    async def start(name: str = "r", models: tuple[str, ...] = ("tiny",)) -> FakeReplica:
        replica = await FakeReplica(name=name, models=models).start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.gate.set()
        await replica.stop()


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    runners: list[web.AppRunner] = []

    async def start(replicas: list[FakeReplica] | list[str], **overrides: Any) -> RunningRouter:
        urls = [r if isinstance(r, str) else r.url for r in replicas]
        names = [None if isinstance(r, str) else r.name for r in replicas]
        raw: dict[str, Any] = {
            "replicas": [
                {"url": url, **({"name": name} if name else {})}
                for url, name in zip(urls, names, strict=True)
            ],
            "health": {"interval_s": 0.2, "timeout_s": 0.5},
            "timeouts": {"connect_s": 1.0},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        router = Router(config_from_dict(raw))
        runner = web.AppRunner(router.build_app(), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return RunningRouter(router, f"http://127.0.0.1:{port}")

    yield start
    for runner in runners:
        await runner.cleanup()
