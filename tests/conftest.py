"""Shared fixtures: fake replicas and in-process routers on free ports."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from kvroute.backends.process import free_port_run, free_ports
from kvroute.kvcore.tokenizer import SimpleTokenizer
from kvroute.router.config import config_from_dict
from kvroute.router.runner import app_runner
from kvroute.router.server import Router
from kvroute.simulator.engine import EngineConfig, latency_preset
from kvroute.simulator.engine.config import OffloadTier
from kvroute.simulator.replica.faults import Faults
from kvroute.simulator.replica.server import EmulatedReplica, ReplicaOptions

from .fake_replica import FakeReplica


def pytest_sessionstart(session: pytest.Session) -> None:
    """With KVROUTE_REQUIRE_VLLM=1 (the README's test command, so CI), tests that need real
    vLLM must run: fail at once instead of letting them skip."""
    if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        pytest.exit(
            "KVROUTE_REQUIRE_VLLM=1 but vLLM is not installed: pip install -e '.[vllm]'",
            returncode=3,
        )


# The openai and anthropic SDKs' async HTTP clients (``AsyncHttpxClientWrapper``) close
# themselves from ``__del__`` by scheduling ``aclose()`` on the running loop. A client that a
# test leaves open is garbage in a reference cycle (the client and its resources refer to each
# other), so it goes whenever the collector next runs: in a later test, on this session's one
# event loop. In that collection asyncio's transport finalizer (``_SelectorTransport.__del__``)
# closes the client's pooled connection's socket without marking the transport closed, and the
# client's ``__del__`` brings it all back with the ``aclose()`` task. When that task runs, the
# socket's fd number may already be a new socket's, and the task's ``transport.abort()`` calls
# ``loop.remove_reader()`` on the number: the new socket is never read again. It was a router's
# listening socket (test_status_truth after test_status_page: the status request waited in
# the accept queue until it timed out). So each SDK client a test creates on the loop is held
# until the test ends, and one left open is closed then, while its sockets are still its own.
SDK_CLIENT_MODULES = ("openai._base_client", "anthropic._base_client")
_sdk_clients: list[tuple[Any, asyncio.AbstractEventLoop]] = []


def _track_sdk_clients() -> None:
    """Record every SDK async client created from now on (once the SDK is imported)."""
    for name in SDK_CLIENT_MODULES:
        cls = getattr(sys.modules.get(name), "AsyncHttpxClientWrapper", None)
        if cls is None or "_kvroute_tracked" in cls.__dict__:
            continue
        init = cls.__init__

        def tracked_init(self: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            # One made outside a loop has no sockets on this session's loop to harm.
            with contextlib.suppress(RuntimeError):
                _sdk_clients.append((self, asyncio.get_running_loop()))

        cls.__init__ = tracked_init
        cls._kvroute_tracked = True


def pytest_collection_finish(session: pytest.Session) -> None:
    _track_sdk_clients()  # the test modules that use an SDK have imported it by now


async def close_sdk_clients_left_open() -> list[Any]:
    """Close the SDK clients made on this loop that are still open, and hold none any more
    (a client made on another loop, one a test ran itself, has no sockets on this one)."""
    loop = asyncio.get_running_loop()
    held = [client for client, on in _sdk_clients if on is loop]
    _sdk_clients.clear()
    left_open = [client for client in held if not client.is_closed]
    for client in left_open:
        async with asyncio.timeout(10):
            await client.aclose()
    return left_open


@pytest.fixture(autouse=True)
async def _sdk_clients_closed_at_the_end() -> AsyncIterator[None]:
    """Hold the SDK clients a test makes and close those it leaves open (see above)."""
    _track_sdk_clients()
    yield
    await close_sdk_clients_left_open()


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

    async def start(
        replicas: list[FakeReplica] | list[str] | list[dict[str, Any]], **overrides: Any
    ) -> RunningRouter:
        entries = [
            r
            if isinstance(r, dict)
            else {"url": r}
            if isinstance(r, str)
            else {"url": r.url, "name": r.name}
            for r in replicas
        ]
        raw: dict[str, Any] = {
            "replicas": entries,
            # A replica joins rotation on its first passing probe, and the router probes once
            # before it serves: a start-up probe that times out on a loaded box would leave it
            # out. Tests of a probe timing out set their own timeout_s.
            "health": {"interval_s": 0.2, "timeout_s": 5.0},
            "timeouts": {"connect_s": 1.0},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        router = Router(config_from_dict(raw))
        runner = app_runner(router)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return RunningRouter(router, f"http://127.0.0.1:{port}")

    yield start
    for runner in runners:
        await runner.cleanup()


@dataclass
class Running:
    replica: EmulatedReplica
    url: str
    events: str
    replay: str


StartEmulated = Callable[..., Awaitable[Running]]


async def launch_emulated(
    num_blocks: int = 64,
    block_size: int = 16,
    kv_events: bool = True,
    lora_modules: dict[str, str] | None = None,
    model: str = "tiny",
    max_loras: int = 0,
    runtime_lora: bool = False,
    time_scale: float = 1.0,
    kv_transfer: dict[str, Any] | None = None,
    preset: str = "tiny-cpu",
    enable_scale_out: bool = False,
    buffer_steps: int = 10_000,
    data_parallel_size: int = 1,
    offload: tuple[OffloadTier, ...] = (),
) -> tuple[web.AppRunner, Running]:
    """An in-process emulated vLLM replica (built-in tokenizer) publishing KV events over ZMQ;
    the caller cleans its runner up. With ``data_parallel_size`` N, rank k publishes on the
    event and replay ports + k (``events``/``replay`` are rank 0's)."""
    port, events_port, replay_port = free_ports(3)
    if data_parallel_size > 1:
        events_port, replay_port = (
            free_port_run(data_parallel_size),
            free_port_run(data_parallel_size),
        )
    options = ReplicaOptions(
        served_model_name=model,
        engine=EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=8,
            latency=latency_preset(preset),
            max_loras=max_loras,
            offload=offload,
        ),
        time_scale=time_scale,
        kv_events={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "kv-events",
            "buffer_steps": buffer_steps,  # the replay buffer (vLLM's default: 10,000)
        }
        if kv_events
        else None,
        lora_modules=lora_modules or {},
        enable_lora=bool(max_loras),
        allow_runtime_lora_updating=runtime_lora,
        kv_transfer=kv_transfer,
        enable_scale_out=enable_scale_out,
        data_parallel_size=data_parallel_size,
    )
    emulated = EmulatedReplica(options, SimpleTokenizer(), Faults())
    runner = web.AppRunner(emulated.build_app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    running = Running(
        emulated,
        f"http://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{events_port}",
        f"tcp://127.0.0.1:{replay_port}",
    )
    return runner, running


@pytest.fixture
async def start_emulated() -> AsyncIterator[StartEmulated]:
    """In-process emulated vLLM replicas (built-in tokenizer) publishing KV events over ZMQ."""
    runners: list[web.AppRunner] = []

    async def start(**options: Any) -> Running:
        runner, running = await launch_emulated(**options)
        runners.append(runner)
        return running

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def replica(start_emulated: StartEmulated) -> Running:
    return await start_emulated()


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS server (Debian's nats-server) for the tests of what routers share over it."""
    from kvroute.bench.harness.nats import nats_server

    with nats_server(tmp_path_factory.mktemp("nats")) as url:
        yield url
