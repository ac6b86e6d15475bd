"""LoRA residency: adapter requests go where the adapter is in a slot, hot adapters spread.

Pure parts first (the cost, the scrape of ``vllm:lora_requests_info``, the spread planner, the
config), then emulated vLLM replicas behind the router through the real ``openai`` client.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from kvroute.health.scrape import parse_vllm_metrics
from kvroute.kvcore.lora_spread import LoraSpreadPlanner, SpreadSettings
from kvroute.policies import FleetView, ReplicaState, RouteRequest, build_policy
from kvroute.policies.kv_aware import KvAware
from kvroute.router.config import ConfigError, config_from_dict
from kvroute.simulator.engine import Engine, EngineConfig, EngineRequest, latency_preset

from .conftest import Running, RunningRouter, StartEmulated, StartRouter
from .helpers import replica_source, wait_until

ADAPTERS = frozenset({"sql", "chat"})


def _replica(name: str, **fields: object) -> ReplicaState:
    state = ReplicaState(name, models=frozenset({"base", *ADAPTERS}), lora_adapters=ADAPTERS)
    for key, value in fields.items():
        setattr(state, key, value)
    return state


def _request(model: str, tokens: int = 200, key: str | None = None) -> RouteRequest:
    return RouteRequest(tokens, 16, model, key)


# -- the cost ----------------------------------------------------------------------------


def test_a_replica_with_the_adapter_running_is_cheaper() -> None:
    policy = KvAware()
    resident = _replica("a", lora_running=frozenset({"sql"}), max_loras=2)
    cold = _replica("b", max_loras=2)
    assert policy.cost(resident, _request("sql")) + 256 == policy.cost(cold, _request("sql"))
    # The base model (or a replica serving no adapters) pays nothing for adapters.
    assert policy.cost(cold, _request("base")) == policy.cost(resident, _request("base"))
    decision = policy.decide(_request("sql"), FleetView([cold, resident]))
    assert decision.chosen == "a"


def test_every_slot_busy_with_other_adapters_costs_a_swap() -> None:
    policy = KvAware()
    full = _replica("full", lora_running=frozenset({"chat"}), max_loras=1)
    free = _replica("free", max_loras=1)
    assert policy.adapter_cost(full, "sql", 0.0) == 4096
    assert policy.adapter_cost(free, "sql", 0.0) == 256
    assert policy.adapter_cost(full, "chat", 0.0) == 0
    assert policy.adapter_cost(free, "base", 0.0) == 0  # not an adapter
    # A long prompt's margin would hide a load, not a swap.
    assert policy.decide(_request("sql", 8000), FleetView([full, free])).chosen == "free"


def test_residency_outweighs_a_little_load_and_wins_near_ties() -> None:
    policy = KvAware()
    resident = _replica("a", lora_running=frozenset({"sql"}), max_loras=2, in_flight=2)
    cold = _replica("b", max_loras=2)
    assert policy.decide(_request("sql"), FleetView([cold, resident])).chosen == "a"
    # A prompt so long that the load penalty is within the near-tie margin: still resident
    # (while below the load bound, like a warm prefix).
    resident.in_flight = cold.in_flight = 1
    for i in range(8):
        request = RouteRequest(20_000, 16, "sql", None, [i, i + 1], None, 16)
        assert policy.decide(request, FleetView([cold, resident])).chosen == "a"


def test_the_policys_own_dispatches_keep_adapters_apart_without_thrash() -> None:
    # Two replicas with one adapter slot each, two adapters taking turns, distinct prompts,
    # nothing reported yet: each adapter keeps to the replica it went to first.
    policy = build_policy("kv_aware")
    fleet = FleetView([_replica("a", max_loras=1), _replica("b", max_loras=1)])
    homes: dict[str, set[str]] = {"sql": set(), "chat": set()}
    for i in range(20):
        adapter = "sql" if i % 2 == 0 else "chat"
        fleet.now = i * 0.5
        homes[adapter].add(policy.decide(_request(adapter, 100 + i), fleet).chosen)
    assert len(homes["sql"]) == 1 and len(homes["chat"]) == 1
    assert homes["sql"] != homes["chat"]


def test_adapter_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="lora_swap_tokens"):
        KvAware(lora_load_tokens=500, lora_swap_tokens=100)
    described = KvAware().describe()
    assert described["lora_load_tokens"] == 256 and described["lora_swap_tokens"] == 4096


# -- the scrape --------------------------------------------------------------------------


def test_the_newest_lora_requests_info_sample_is_now() -> None:
    page = b"""# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat",waiting_lora_adapters="sql"} 1.7000001e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9
vllm:num_requests_waiting{engine="0",model_name="base"} 1.0
"""
    report = parse_vllm_metrics(page)
    assert report.max_loras == 2
    assert report.lora_running == {"chat"}
    assert report.lora_waiting == {"sql"}
    assert parse_vllm_metrics(b"vllm:num_requests_waiting 0\n").max_loras is None


# -- the emulated engine's adapter slots -------------------------------------------------


def test_the_engine_runs_at_most_max_loras_adapters_at_once() -> None:
    engine = Engine(
        EngineConfig(block_size=16, num_blocks=64, latency=latency_preset("tiny-cpu"), max_loras=1)
    )
    for i, adapter in enumerate(["sql", "chat", "sql", None]):
        engine.add_request(EngineRequest(f"r{i}", [i + 1] * 20, 8, 0.0, lora_name=adapter))
    engine.step(0.0)
    stats = engine.stats
    assert stats.running_loras == ("sql",)  # chat waits for the slot
    assert stats.waiting_loras == ("chat",)
    assert stats.num_running == 3  # both sql requests and the base one: chat kept its place


# -- the spread planner ------------------------------------------------------------------


def _spread(**settings: object) -> LoraSpreadPlanner:
    defaults: dict[str, object] = {
        "adapters": {"sql": "/adapters/sql"},
        "hot_in_flight": 2,
        "cooldown_s": 10.0,
        "min_residency_s": 60.0,
        "idle_unload_s": 30.0,
    }
    return LoraSpreadPlanner(SpreadSettings(**{**defaults, **settings}))  # type: ignore[arg-type]


def _pool() -> list[ReplicaState]:
    home = ReplicaState("home", lora_adapters=frozenset({"sql"}), max_loras=2)
    home.lora_running, home.in_flight = frozenset({"sql"}), 3
    busy = ReplicaState("busy", max_loras=1, in_flight=0, lora_running=frozenset({"chat"}))
    off = ReplicaState("off", in_flight=0)  # no lora_requests_info: LoRA off
    free = ReplicaState("free", max_loras=2, in_flight=1)
    return [home, busy, off, free]


def test_a_hot_adapter_is_loaded_on_the_least_loaded_replica_with_a_free_slot() -> None:
    planner = _spread()
    pool = _pool()
    (action,) = planner.plan(pool, now=0.0)
    assert (action.kind, action.replica, action.adapter, action.path) == (
        "load",
        "free",
        "sql",
        "/adapters/sql",
    )
    assert planner.plan(pool, now=5.0) == []  # cooldown: the new home has not shown up yet
    pool[0].in_flight = 1
    assert planner.plan(pool, now=20.0) == []  # not hot any more


def test_the_routers_own_requests_make_an_adapter_hot_before_any_scrape_sees_it() -> None:
    planner = _spread()
    pool = _pool()
    home = pool[0]
    home.lora_running = frozenset()  # the replica's metrics are late (or a scrape failed)
    assert planner.plan(pool, now=0.0) == []  # nothing says sql is in use
    home.lora_in_flight = {"sql": 3}  # the ledger counted the router's own three
    (action,) = planner.plan(pool, now=1.0)
    assert (action.kind, action.replica, action.adapter) == ("load", "free", "sql")


def test_a_refused_load_is_not_asked_again_soon_and_another_replica_takes_it() -> None:
    planner = _spread()
    pool = _pool()
    (action,) = planner.plan(pool, now=0.0)
    planner.load_failed(action.replica, action.adapter, now=0.0)
    (again,) = planner.plan(pool, now=1.0)
    assert again.replica == "off"  # not reporting lora_requests_info yet: worth a try
    planner.load_failed(again.replica, again.adapter, now=1.0)
    assert planner.plan(pool, now=2.0) == []  # "busy" has no free slot
    (later,) = planner.plan(pool, now=400.0)
    assert later.replica == "free"


def test_only_an_adapter_the_router_loaded_leaves_once_idle_and_resident_long_enough() -> None:
    planner = _spread()
    pool = _pool()
    planner.plan(pool, now=0.0)  # loads sql on "free"
    pool[3].lora_adapters = frozenset({"sql"})
    pool[0].in_flight = 0  # cold now
    pool[0].lora_running = frozenset()
    pool[3].lora_running = frozenset({"sql"})
    assert planner.plan(pool, now=40.0) == []  # in use on "free"
    pool[3].lora_running = frozenset()
    assert planner.plan(pool, now=59.0) == []  # below min_residency_s
    assert planner.plan(pool, now=69.0) == []  # idle 29 s since its last use
    (action,) = planner.plan(pool, now=70.0)
    assert (action.kind, action.replica) == ("unload", "free")  # never "home": not ours


def test_spread_settings_are_checked() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {"replicas": [{"url": "http://x:1"}], "lora": {"spread": True, "hot_in_flight": 0}}
        )
    text = str(info.value)
    assert "lora.adapters: lora.spread needs the adapters" in text
    assert "lora.hot_in_flight: must be >= 1" in text
    config = config_from_dict({"replicas": [{"url": "http://x:1"}]})
    assert config.lora.spread is False


# -- emulated replicas behind the router -------------------------------------------------


async def test_adapter_requests_keep_to_the_replica_that_has_the_adapter(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replicas = [
        await start_emulated(lora_modules={"sql": "/a/sql", "chat": "/a/chat"}, max_loras=1)
        for _ in range(2)
    ]
    r = await start_router(
        [replica_source(rep, f"emu-{i}") for i, rep in enumerate(replicas)],
        routing={"tokenizer": "builtin", "scrape_interval_s": 0.1},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    served: dict[str, list[str]] = {"sql": [], "chat": []}
    for i in range(12):  # alternating adapters, distinct prompts: no prefix to follow
        adapter = "sql" if i % 2 == 0 else "chat"
        raw = await client.completions.with_raw_response.create(
            model=adapter, prompt=f"question number {i} about {adapter} " * 4, max_tokens=2
        )
        served[adapter].append(raw.headers["x-kvroute-replica"])
    assert len(set(served["sql"])) == 1 and len(set(served["chat"])) == 1
    assert served["sql"][0] != served["chat"][0]  # one slot each: no thrash
    # The scrape reports the adapters' slots: max_lora from vllm:lora_requests_info.
    await wait_until(lambda: all(s.max_loras == 1 for s in r.router.core.fleet.replicas))


async def _home_and_spare(
    start_emulated: StartEmulated,
    start_router: StartRouter,
    *,
    runtime_lora: bool,
    **spread: float,
) -> tuple[Running, RunningRouter]:
    """ "home" serves the sql adapter, "spare" none (it takes runtime loads with
    ``runtime_lora``), behind a router spreading sql once two requests run on every home: the
    spare and the router."""
    home = await start_emulated(lora_modules={"sql": "/a/sql"}, max_loras=2, time_scale=10.0)
    spare = await start_emulated(max_loras=2, runtime_lora=runtime_lora, time_scale=10.0)
    r = await start_router(
        [replica_source(home, "home"), replica_source(spare, "spare")],
        routing={"tokenizer": "builtin", "scrape_interval_s": 0.1},
        lora={
            "spread": True,
            "adapters": {"sql": "/a/sql"},
            "hot_in_flight": 2,
            "interval_s": 0.1,
            **spread,
        },
    )
    return spare, r


async def test_a_hot_adapter_is_loaded_on_a_second_replica(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    spare, r = await _home_and_spare(
        start_emulated, start_router, runtime_lora=True, cooldown_s=60.0
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)

    async def ask(i: int, words: int = 3, max_tokens: int = 60) -> str:
        raw = await client.completions.with_raw_response.create(
            model="sql", prompt=f"select number {i} from the orders " * words, max_tokens=max_tokens
        )
        return raw.headers["x-kvroute-replica"]

    first = [asyncio.create_task(ask(i)) for i in range(4)]  # only "home" serves sql yet
    await wait_until(lambda: "sql" in spare.replica.lora_modules, timeout_s=10.0)
    assert set(await asyncio.gather(*first)) == {"home"}
    spreader = r.router.core.lora_spreader
    assert spreader is not None
    assert [(a.kind, a.replica, ok) for a, ok in spreader.history] == [("load", "spare", True)]
    await wait_until(lambda: "sql" in (r.router.core.fleet.replicas[1].models or ()))
    # Activating it on the spare costs a little (lora_load_tokens): a burst spills over there.
    later = await asyncio.gather(*(ask(i, 12, 8) for i in range(10, 18)))
    assert "spare" in later and "home" in later
    async with aiohttp.ClientSession() as http:  # the spare now lists it, as vLLM would
        async with http.get(spare.url + "/v1/models") as response:
            cards = (await response.json())["data"]
    assert {c["id"]: c["parent"] for c in cards} == {"tiny": None, "sql": "tiny"}


async def test_a_replica_that_refuses_a_load_is_asked_again_after_retry_after_s(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """lora.retry_after_s: the spare refuses (runtime loading is off there, as in a vLLM
    without VLLM_ALLOW_RUNTIME_LORA_UPDATING), and while the adapter stays hot it is asked
    again once that much time has passed, not sooner."""
    retry_after_s = 1.0
    spare, r = await _home_and_spare(
        start_emulated, start_router, runtime_lora=False, cooldown_s=0.0,
        retry_after_s=retry_after_s,
    )  # fmt: skip
    spreader = r.router.core.lora_spreader
    assert spreader is not None
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    started = time.monotonic()  # before the adapter is hot: before the first ask
    hot = [
        asyncio.create_task(
            client.completions.create(model="sql", prompt=f"select {i} from orders", max_tokens=200)
        )
        for i in range(4)
    ]
    try:
        await wait_until(lambda: len(spreader.history) >= 3, what="three loads asked of the spare")
        third_seen = time.monotonic()
    finally:
        for task in hot:
            task.cancel()
        await asyncio.gather(*hot, return_exceptions=True)
    asked = spreader.history[:3]
    assert [(a.kind, a.replica, ok) for a, ok in asked] == [("load", "spare", False)] * 3
    assert "sql" not in spare.replica.lora_modules
    # Two waits of retry_after_s lie between the first ask and the third (each round, 0.1 s,
    # would ask again if the setting were not kept).
    assert third_seen - started >= 2 * retry_after_s


async def test_runtime_loading_needs_the_env_flag_as_in_vllm(
    start_emulated: StartEmulated,
) -> None:
    locked = await start_emulated(max_loras=1)
    open_ = await start_emulated(max_loras=1, runtime_lora=True)
    body = {"lora_name": "sql", "lora_path": "/a/sql"}
    async with aiohttp.ClientSession() as http:
        async with http.post(locked.url + "/v1/load_lora_adapter", json=body) as response:
            assert response.status == 404
        async with http.post(open_.url + "/v1/load_lora_adapter", json=body) as response:
            assert response.status == 200
        async with http.post(open_.url + "/v1/load_lora_adapter", json=body) as response:
            assert response.status == 400  # already loaded
        unload = {"lora_name": "sql"}
        async with http.post(open_.url + "/v1/unload_lora_adapter", json=unload) as response:
            assert response.status == 200
        async with http.post(open_.url + "/v1/unload_lora_adapter", json=unload) as response:
            assert response.status == 404
        async with http.get(open_.url + "/metrics") as response:
            text = await response.text()
    assert 'vllm:lora_requests_info{max_lora="1"' in text
