"""Warm start, live: a router that starts after the fleet's caches are warm (and after the
replicas' replay buffers have moved on) loads a running router's index and routes the next
request to the replica holding its prefix, from a peer or from NATS JetStream; a snapshot of
another block size is refused."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.tokenizer import SimpleTokenizer
from kvroute.router.config import ConfigError, config_from_dict
from kvroute.router.epp.server import PickerServer
from kvroute.router.runner import app_runner
from kvroute.router.server import Router

from .conftest import Running, launch_emulated
from .helpers import wait_until

BLOCK = 16
# Distinct long prompts, one conversation each.
PROMPTS = [f"Conversation {i} about topic {i * 7}: " + f"detail {i} " * 60 for i in range(6)]
ADMIN_KEY = "warm-start-admin-key"
HEALTH_TIMEOUT_S = 5.0


class Fleet:
    def __init__(self, replicas: list[Running]) -> None:
        self.replicas = replicas
        self.runners: list[web.AppRunner] = []

    def sources(self) -> list[dict[str, Any]]:
        return [
            {"url": r.url, "name": f"emu{i}", "kv_events": r.events, "kv_replay": r.replay}
            for i, r in enumerate(self.replicas)
        ]

    async def router(self, **overrides: Any) -> tuple[Router, str]:
        raw: dict[str, Any] = {
            "replicas": self.sources(),
            # A start-up probe that times out leaves a replica out of rotation (it has never
            # been seen healthy): 0.5 s ran out on the loaded CI box once (2026-12-07).
            "health": {"interval_s": 0.2, "timeout_s": HEALTH_TIMEOUT_S},
            "timeouts": {"connect_s": 1.0},
            "routing": {"tokenizer": "builtin", "block_size": BLOCK},
            "auth": {"admin_api_key": ADMIN_KEY},
            **overrides,
        }
        router = Router(config_from_dict(raw))
        runner = app_runner(router)
        await runner.setup()  # the warm start runs here, before the port opens
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return router, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
async def fleet() -> AsyncIterator[Fleet]:
    """Three replicas with a replay buffer of 2 batches (vLLM's holds 10,000: a busy fleet
    turns it over in minutes), warmed by one router: a router starting now cannot learn the
    prompts' blocks from the replicas."""
    runners, replicas = [], []
    for _ in range(3):
        runner, running = await launch_emulated(num_blocks=256, buffer_steps=2)
        runners.append(runner)
        replicas.append(running)
    fleet = Fleet(replicas)
    first, url = await fleet.router()
    fleet.homes = {}  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as http:
        for prompt in PROMPTS:
            fleet.homes[prompt] = (await _complete(http, url, prompt))[0]  # type: ignore[attr-defined]
    hashes = [_hashes(p) for p in PROMPTS]
    await wait_until(
        lambda: all(
            (m := first.index.match(h, 0.0).get(fleet.homes[p])) is not None  # type: ignore[attr-defined]
            and m.confirmed == len(h)
            for p, h in zip(PROMPTS, hashes, strict=True)
        ),
        30,
        what="the first router's index to hold every prompt",
    )
    fleet.first_url = url  # type: ignore[attr-defined]
    yield fleet
    for runner in [*fleet.runners, *runners]:
        await runner.cleanup()


def _hashes(prompt: str) -> list[int]:
    return block_hashes(SimpleTokenizer().encode(prompt), BLOCK)


async def _complete(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, int]:
    """The replica the router chose and the tokens that replica found cached."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
        return resp.headers["X-Kvroute-Replica"], data["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]


async def test_a_warm_started_router_sends_each_prompt_to_its_holder(fleet: Any) -> None:
    router, url = await fleet.router(warm_start={"peers": [fleet.first_url]})
    for prompt in PROMPTS:  # before any event: the snapshot alone
        match = router.index.match(_hashes(prompt), 0.0)
        assert match[fleet.homes[prompt]].confirmed == len(_hashes(prompt))
    async with aiohttp.ClientSession() as http:
        for prompt in PROMPTS:
            replica, cached = await _complete(http, url, prompt + " and a follow-up question")
            assert replica == fleet.homes[prompt]
            assert cached >= BLOCK * (len(_hashes(prompt)) - 1)  # the replica's own count
    # Live events follow on from the snapshot's sequence numbers: no resync was needed.
    totals = router.kv_events.totals()
    assert totals.resyncs == 0 and totals.batches >= 1


async def test_a_cold_router_knows_none_of_it(fleet: Any) -> None:
    """What the warm start is for: the replay buffers have moved on."""
    router, _ = await fleet.router()
    await wait_until(
        lambda: router.kv_events.totals().connected, 30, what="the subscribers to connect"
    )
    for prompt in PROMPTS:
        assert router.index.match(_hashes(prompt), 0.0) == {}


async def test_a_snapshot_of_another_block_size_is_refused_and_the_router_starts_cold(
    fleet: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvroute.router.warm_start")
    router, _ = await fleet.router(
        warm_start={"peers": [fleet.first_url]},
        routing={"tokenizer": "builtin", "block_size": 2 * BLOCK},
    )
    assert "refused: block size 16, this router's is 32" in caplog.text
    assert "starting cold" in caplog.text
    assert router.index.entries == 0 or all(
        router.index.match(_hashes(p), 0.0) == {} for p in PROMPTS
    )


async def test_a_warm_started_router_prices_each_replica_as_its_peer_learnt_to(
    fleet: Any,
) -> None:
    """Mixed pools: the learnt latency lines come with the index, so a restarted router does
    not price every replica at the prior until each has answered it."""
    timed = {"name": "kv_aware", "params": {"cost_unit": "time"}}
    first, url = await fleet.router(policy=timed)
    async with aiohttp.ClientSession() as http:
        for k in range(9):
            await _complete(http, url, f"{PROMPTS[k % len(PROMPTS)]} question {k}")

    def prefill_lines(router: Router) -> dict[str, tuple[object, ...]]:
        """Each replica's TTFT line and its samples (what only dispatches teach: it holds
        still between requests, where the decode line may still take a scrape)."""
        lines = {}
        for name, handle in router.replicas.items():
            latency = handle.state.latency
            assert latency is not None
            d = latency.describe()
            lines[name] = (d["prefill_samples"], d["ttft_base_s"], d["prefill_s_per_token"])
        return lines

    await wait_until(
        lambda: sum(1 for n, *_ in prefill_lines(first).values() if n) >= 2,
        30,
        what="the first router's lines",
    )
    second, _ = await fleet.router(policy=timed, warm_start={"peers": [url]})
    assert prefill_lines(second) == prefill_lines(first)
    cold, _ = await fleet.router(policy=timed)
    assert all(n == 0 for n, *_ in prefill_lines(cold).values())


async def test_the_snapshot_needs_the_admin_key(fleet: Any) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(fleet.first_url + "/admin/index-snapshot") as resp:
            assert resp.status == 401
        async with http.get(
            fleet.first_url + "/admin/index-snapshot",
            params={"pool": "nope"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ) as resp:
            assert resp.status == 400
            assert "pool" in (await resp.json())["error"]["message"]


async def test_a_picker_warms_from_a_router_and_serves_its_snapshot_to_the_next(
    fleet: Any,
) -> None:
    """serve -> picker -> serve: a picker warm-starts like a router, and its metrics port
    answers the snapshot path, so pickers scaled out behind the gateway warm from each other."""
    config = config_from_dict(
        {
            "replicas": fleet.sources(),
            "health": {"interval_s": 0.2, "timeout_s": HEALTH_TIMEOUT_S},
            "routing": {"tokenizer": "builtin", "block_size": BLOCK},
            "auth": {"admin_api_key": ADMIN_KEY},
            "warm_start": {"peers": [fleet.first_url]},
            "epp": {"grpc_port": 0, "health_port": 0, "metrics_port": 0},
        }
    )
    picker = PickerServer(config)
    ports = await picker.start()
    try:
        picker_url = f"http://127.0.0.1:{ports.metrics}"
        async with aiohttp.ClientSession() as http:
            async with http.get(picker_url + "/admin/index-snapshot") as resp:
                assert resp.status == 401  # the admin key, as on the router
        router, _ = await fleet.router(warm_start={"peers": [picker_url]})
        for prompt in PROMPTS:
            match = router.index.match(_hashes(prompt), 0.0)
            assert match[fleet.homes[prompt]].confirmed == len(_hashes(prompt))
    finally:
        await picker.stop(0)


@pytest.fixture(scope="module")
def jetstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's nats-server with JetStream on (-js), its store in a temporary directory."""
    from kvroute.bench.harness.nats import nats_server

    store = tmp_path_factory.mktemp("jetstream")
    with nats_server(store, jetstream_dir=store) as url:
        yield url


async def _publishing(fleet: Any, jetstream: str, snapshots: int) -> dict[str, Any]:
    """A router (warmed from the first) that has put ``snapshots`` of its index in NATS; the
    warm_start settings to read them with."""
    # The default 10 s to read the bucket ran out once on the loaded CI box (2026-12-07).
    nats = {"nats_url": jetstream, "publish_interval_s": 0.2, "timeout_s": 30.0}
    publisher, _ = await fleet.router(warm_start={"peers": [fleet.first_url], **nats})
    assert publisher.core.snapshot_publisher is not None
    await wait_until(
        lambda: publisher.core.snapshot_publisher.published >= snapshots,
        30,
        what="the router to put its snapshot in NATS",
    )
    return nats


async def test_a_router_with_no_peer_up_loads_the_snapshot_others_put_in_nats(
    fleet: Any, jetstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Routers put their index in a JetStream object store; one that starts when no peer
    answers (here: none configured) loads it from there."""
    nats = await _publishing(fleet, jetstream, snapshots=2)
    caplog.set_level(logging.INFO, logger="kvroute.router.warm_start")
    router, url = await fleet.router(warm_start=nats)
    assert f"from {jetstream} kvroute-index/pool-default" in caplog.text
    for prompt in PROMPTS:
        match = router.index.match(_hashes(prompt), 0.0)
        assert match[fleet.homes[prompt]].confirmed == len(_hashes(prompt))
    async with aiohttp.ClientSession() as http:
        replica, cached = await _complete(http, url, PROMPTS[0] + " once more")
    assert replica == fleet.homes[PROMPTS[0]] and cached > 0


async def test_a_snapshot_older_than_max_age_s_is_refused_and_the_router_starts_cold(
    fleet: Any, jetstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    """warm_start.max_age_s: a snapshot taken longer ago than this is not loaded (its blocks may
    have left the replicas since); the router says so and learns from the events instead."""
    nats = await _publishing(fleet, jetstream, snapshots=1)
    caplog.set_level(logging.INFO, logger="kvroute.router.warm_start")
    # A millisecond: less than any snapshot's trip through NATS.
    router, _ = await fleet.router(warm_start={**nats, "max_age_s": 0.001})
    assert "more than warm_start.max_age_s 0.001" in caplog.text
    assert "loaded" not in caplog.text
    for prompt in PROMPTS:
        assert router.index.match(_hashes(prompt), 0.0) == {}


@pytest.mark.parametrize(
    ("warm_start", "why"),
    [
        (
            {"peers": ["router-a:8000"]},
            "warm_start.peers[0]: 'router-a:8000' is not an http(s) URL",
        ),
        ({"nats_url": "http://nats:4222"}, "warm_start.nats_url: expected a nats:// URL"),
        ({"nats_bucket": "a.b"}, "warm_start.nats_bucket: letters, digits"),
        ({"publish_interval_s": 0}, "warm_start.publish_interval_s: must be a finite number > 0"),
        ({"api_key": "env:KVROUTE_NO_SUCH_VARIABLE"}, "warm_start.api_key: environment variable"),
    ],
)
def test_bad_warm_start_settings_name_the_key(warm_start: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError) as raised:
        config_from_dict({"replicas": [{"url": "http://a:8000"}], "warm_start": warm_start})
    assert why in str(raised.value)
