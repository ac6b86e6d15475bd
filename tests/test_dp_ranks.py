"""Data-parallel replicas: one routing endpoint per rank, the rank sent as vLLM's
X-data-parallel-rank header, each rank's KV events and metrics read on their own, and the
emulated replica serving ranks as vLLM does (header honoured, else vLLM's own balancing)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import zmq
import zmq.asyncio

from kvroute.backends.dry_run import describe_plan, plan_fleet
from kvroute.backends.launcher import LaunchSpec, emulated_command
from kvroute.health.scrape import parse_vllm_metrics
from kvroute.kvcore.kv_events import rank_endpoint
from kvroute.kvcore.stats import parse_metrics
from kvroute.router.config import ReplicaConfig, config_from_dict
from kvroute.router.dp_ranks import expand_ranks, replica_of
from kvroute.simulator.engine.dp_balance import DPBalancer, RankLoad

from .conftest import Running, StartEmulated, StartRouter
from .helpers import replica_source, wait_until

# -- pure: endpoints, names, metrics, balancing --------------------------------------------


def test_rank_endpoints_follow_vllms_offsets() -> None:
    # vLLM's ZmqEventPublisher.offset_endpoint_port (checked against vLLM itself in
    # tests/test_real_vllm_dp.py): rank 0 unchanged, tcp port + rank, port 0 left to the OS.
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert rank_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert rank_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert rank_endpoint("ipc:///run/kv.events", 2) == "ipc:///run/kv.events_dp2"


def test_a_data_parallel_replica_is_one_endpoint_per_rank() -> None:
    replica = ReplicaConfig(
        url="http://h:8000",
        name="moe",
        kv_events="tcp://h:5557",
        kv_replay="tcp://h:5657",
        data_parallel_size=3,
    )
    plain = ReplicaConfig(url="http://h:9000")
    ranks = expand_ranks([replica, plain])
    assert [(r.name, r.data_parallel_rank, r.kv_events, r.kv_replay) for r in ranks] == [
        ("moe@dp0", 0, "tcp://h:5557", "tcp://h:5657"),
        ("moe@dp1", 1, "tcp://h:5558", "tcp://h:5658"),
        ("moe@dp2", 2, "tcp://h:5559", "tcp://h:5659"),
        (None, None, None, None),
    ]
    assert {r.url for r in ranks[:3]} == {"http://h:8000"}
    assert [replica_of(r.name or "") for r in ranks[:3]] == ["moe"] * 3
    assert replica_of("a@dpx") == "a@dpx"  # not a rank suffix
    # Expanding again changes nothing (discovery hands back what it was given).
    assert expand_ranks(ranks) == ranks


def test_config_routes_to_each_rank() -> None:
    config = config_from_dict(
        {"replicas": [{"url": "http://h:8000", "data_parallel_size": 2, "kv_events": "tcp://h:7"}]}
    )
    from kvroute.router.pool_config import pool_specs

    (spec,) = pool_specs(config)
    assert [(r.name, r.kv_events) for r in spec.replicas] == [
        ("h:8000@dp0", "tcp://h:7"),
        ("h:8000@dp1", "tcp://h:8"),
    ]


VLLM_PAGE = b"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100"} 1.0
"""


def test_each_rank_reads_its_own_engines_metrics() -> None:
    whole = parse_vllm_metrics(VLLM_PAGE)
    assert (whole.waiting, whole.running, whole.kv_usage) == (8, 8, 0.5)
    rank1 = parse_vllm_metrics(VLLM_PAGE, engine=1)
    assert (rank1.waiting, rank1.running, rank1.kv_usage) == (7, 5, 0.75)
    assert rank1.kv_capacity_tokens == 3200
    rank0 = parse_vllm_metrics(VLLM_PAGE, engine=0)
    assert (rank0.waiting, rank0.running, rank0.kv_usage) == (1, 3, 0.25)


def test_vllms_balancing_takes_the_least_loaded_rank_and_rotates_ties() -> None:
    balancer = DPBalancer()
    idle = [RankLoad(0, 0)] * 3
    assert [balancer.pick(idle) for _ in range(4)] == [0, 1, 2, 0]
    assert balancer.pick([RankLoad(0, 4), RankLoad(0, 1), RankLoad(0, 3)]) == 1
    # Waiting on a nearly full KV cache weighs more than running requests.
    assert balancer.pick([RankLoad(2, 0, 0.95), RankLoad(0, 4, 0.95)]) == 1


# -- launching --------------------------------------------------------------------------


def dp_spec(engine: str, bind: str) -> LaunchSpec:
    return LaunchSpec(
        engine=engine, count=2, model="m", model_path="/models/m", tokenizer=None, block_size=32,
        num_gpu_blocks=64, max_num_seqs=8, preset="tiny-cpu", time_scale=1.0, kv_events=True,
        kv_events_bind=bind, host="127.0.0.1", log_dir="logs", startup_timeout_s=60,
        max_restarts=0, data_parallel_size=4,
    )  # fmt: skip


@pytest.mark.parametrize("engine", ["emulated", "vllm"])
def test_dry_run_shows_each_ranks_header_and_event_ports(engine: str) -> None:
    spec = dp_spec(engine, "tcp")
    plans = plan_fleet(spec)
    text = describe_plan(spec, plans, None)
    for plan in plans:
        assert plan.kv is not None
        base = int(plan.kv.events.rsplit(":", 1)[1])
        replay = int(plan.kv.replay.rsplit(":", 1)[1])
        assert f"{plan.name}: {plan.url}" in text
        for rank in range(4):
            line = (
                f"rank {rank}: header X-data-parallel-rank: {rank}, KV events "
                f"tcp://127.0.0.1:{base + rank} (replay tcp://127.0.0.1:{replay + rank})"
            )
            assert line in text
        flag = plan.argv.index("--data-parallel-size")
        assert plan.argv[flag + 1] == "4"


def test_emulated_ranks_publish_on_ipc_paths_with_the_rank_suffix() -> None:
    spec = dp_spec("emulated", "ipc")
    (plan, _) = plan_fleet(spec)
    assert plan.kv is not None
    text = describe_plan(spec, [plan], None)
    assert f"KV events {plan.kv.events}_dp3" in text
    argv = emulated_command(spec, 1, plan.kv)
    assert argv[argv.index("--data-parallel-size") + 1] == "4"


# -- the emulated replica's ranks --------------------------------------------------------


async def engine_samples(url: str, name: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        page = parse_metrics(await resp.text())
    return {labels["engine"]: value for labels, value in page.series(name)}


async def complete(url: str, prompt: str, headers: dict[str, str] | None = None) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body, headers=headers or {}) as resp,
    ):
        await resp.read()
        return resp.status


async def test_emulated_replica_serves_the_rank_in_the_header(
    start_emulated: StartEmulated,
) -> None:
    replica = await start_emulated(num_blocks=128, data_parallel_size=3)
    assert len(replica.replica.ranks) == 3
    async with aiohttp.ClientSession() as http, http.get(replica.url + "/kv_event_sources") as r:
        sources = await r.json()
    port = int(replica.events.rsplit(":", 1)[1])
    assert [sources[str(k)]["endpoint"].rsplit(":", 1)[1] for k in range(3)] == [
        str(port + k) for k in range(3)
    ]
    for _ in range(2):
        assert (
            await complete(replica.url, "rank two only " * 8, {"X-data-parallel-rank": "2"}) == 200
        )
    queries = await engine_samples(replica.url, "vllm:prefix_cache_queries_total")
    assert queries["0"] == queries["1"] == 0 and queries["2"] > 0
    hits = await engine_samples(replica.url, "vllm:prefix_cache_hits_total")
    assert hits["2"] > 0  # the second request found the first's blocks on rank 2
    assert await complete(replica.url, "x", {"X-data-parallel-rank": "3"}) == 400


async def test_emulated_replica_without_the_header_balances_like_vllm(
    start_emulated: StartEmulated,
) -> None:
    replica = await start_emulated(num_blocks=128, data_parallel_size=2, time_scale=5.0)
    # Concurrent requests: each goes to the rank with fewer waiting + running.
    await asyncio.gather(*(complete(replica.url, f"prompt {i} " * 6) for i in range(6)))
    queries = await engine_samples(replica.url, "vllm:prefix_cache_queries_total")
    assert queries["0"] > 0 and queries["1"] > 0
    finished = await engine_samples(replica.url, "vllm:e2e_request_latency_seconds_count")
    assert finished == {"0": 3.0, "1": 3.0}


async def test_emulated_ranks_publish_their_own_events(start_emulated: StartEmulated) -> None:
    replica = await start_emulated(num_blocks=128, data_parallel_size=2)
    context = zmq.asyncio.Context()
    subs = []
    try:
        for rank in range(2):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(rank_endpoint(replica.events, rank))
            subs.append(sub)
        seen: dict[int, list[int]] = {0: [], 1: []}
        for attempt in range(50):  # a SUB socket drops what came before it connected
            await complete(replica.url, f"rank one {attempt} " * 8, {"X-data-parallel-rank": "1"})
            if await subs[1].poll(100):
                break
        frames = await subs[1].recv_multipart()
        seen[1].append(msgspec.msgpack.decode(frames[2])[2])
        assert await subs[0].poll(200) == 0  # rank 0 ran nothing, so published nothing
        assert seen[1] == [1]  # the batch carries its data_parallel_rank
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()


# -- the router over a data-parallel replica ---------------------------------------------


def dp_source(replica: Running, name: str, size: int) -> dict[str, Any]:
    return replica_source(replica, name) | {"data_parallel_size": size}


async def test_router_picks_ranks_by_their_cache_and_sends_the_header(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replica = await start_emulated(num_blocks=256, data_parallel_size=4)
    r = await start_router([dp_source(replica, "moe", 4)], routing={"tokenizer": "builtin"})
    async with aiohttp.ClientSession() as http, http.get(r.url + "/admin/replicas") as resp:
        rows = (await resp.json())["replicas"]
    assert [(x["name"], x["replica"], x["data_parallel_rank"]) for x in rows] == [
        (f"moe@dp{k}", "moe", k) for k in range(4)
    ]
    await wait_until(
        lambda: all(s.reported_waiting is not None for s in r.router.core.fleet.replicas),
        what="every rank's metrics scraped",
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    homes: dict[int, str] = {}
    for tenant in range(4):
        system = f"Tenant {tenant} rules. " + " ".join(f"rule {tenant}.{i}" for i in range(30))
        first = await client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            max_tokens=1,
        )
        homes[tenant] = first.headers["x-kvroute-replica"]
        again = await client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "more"}],
            max_tokens=1,
        )
        # Its prefix is on the rank it went to first: the router sends it back there.
        assert again.headers["x-kvroute-replica"] == homes[tenant]
        assert int(again.headers["x-kvroute-prefix-hit-tokens"]) > 0
    # The ranks the router named are the engines that served: per-engine metrics agree.
    finished = await engine_samples(replica.url, "vllm:e2e_request_latency_seconds_count")
    expected: dict[str, float] = {}
    for home in homes.values():
        rank = home.removeprefix("moe@dp")
        expected[rank] = expected.get(rank, 0) + 2
    assert {k: v for k, v in finished.items() if v} == expected
    # The router's own metrics name each rank.
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        samples = parse_metrics(await resp.text())
    replicas = {s.labels.get("replica") for s in samples.samples if "replica" in s.labels}
    assert {f"moe@dp{k}" for k in range(4)} <= replicas
    # A client's own rank header is not passed on: the router's pick is.
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt="client header", max_tokens=1,
        extra_headers={"X-data-parallel-rank": "99"},
    )  # fmt: skip
    assert raw.http_response.status_code == 200


async def test_removing_a_data_parallel_replica_drains_all_its_ranks(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    moe = await start_emulated(num_blocks=64, data_parallel_size=2)
    other = await start_emulated(num_blocks=64)
    r = await start_router([dp_source(moe, "moe", 2), replica_source(other, "solo")])
    async with (
        aiohttp.ClientSession() as http,
        http.delete(r.url + "/admin/replicas/moe") as resp,
    ):
        assert resp.status == 200, await resp.text()
    assert list(r.router.core.registry.handles) == ["solo"]
    async with aiohttp.ClientSession() as http:
        body = {"url": moe.url, "name": "moe", "data_parallel_size": 2}
        async with http.post(r.url + "/admin/replicas", json=body) as resp:
            assert resp.status in (200, 201), await resp.text()
        async with http.post(r.url + "/admin/replicas", json=body | {"name": "x"}) as resp:
            assert resp.status == 201 or resp.status == 200
        bad = {"url": moe.url, "name": "y", "data_parallel_size": 0}
        async with http.post(r.url + "/admin/replicas", json=bad) as resp:
            assert resp.status == 400
            assert "data_parallel_size: must be 1-1024" in await resp.text()
    assert {"moe@dp0", "moe@dp1", "x@dp0", "x@dp1"} <= set(r.router.core.registry.handles)


# -- kvroute bench dp's arithmetic --------------------------------------------------------


def test_bench_dp_pools_rounds_and_judges_the_targets() -> None:
    from kvroute.bench.chat_load import RunResult
    from kvroute.bench.dp import Options, Outcome, Row, pooled, report

    def run(hit: float, ttfts: list[float]) -> RunResult:
        r = RunResult("x", requests=len(ttfts), hit_rate=hit, wall_s=1.0)
        r.ttfts, r.latencies = list(ttfts), list(ttfts)
        return r

    single = pooled(pooled(None, run(0.8, [0.1] * 10)), run(0.6, [0.2] * 10))
    assert single.requests == 20 and abs(single.hit_rate - 0.7) < 1e-9
    ranks = run(0.7, [0.1] * 19 + [0.21])
    vllm = run(0.4, [0.3] * 20)
    outcome = Outcome([Row("single", single), Row("dp-ranks", ranks), Row("dp-vllm", vllm)])
    text = report(outcome, Options())
    assert "hit rate 1.000x (target >= 0.95: met)" in text
    assert "TTFT p99 1.050x (target <= 1.1: met)" in text
    assert "hit rate 0.700 vs 0.400 (+0.300)" in text
    worse = Outcome([Row("single", single), Row("dp-ranks", run(0.6, [0.5] * 20))])
    assert "MISSED" in report(worse, Options())


# -- the simulator's ranks -----------------------------------------------------------------


def test_simulated_ranks_picked_by_the_router_are_single_rank_replicas_and_vllm_loses_hits() -> (
    None
):
    from kvroute.policies import build_policy
    from kvroute.simulator.engine import latency_preset
    from kvroute.simulator.fleet import FleetConfig, engine_config, prepare, simulate
    from kvroute.simulator.traces.synthetic import generate

    spec = (
        "multi-tenant:tenants=12,rate=10,system_tokens=4096,prompt_tokens=256,"
        "output_tokens=64,duration=60"
    )
    trace = prepare(generate(spec, seed=1))
    engine = engine_config(latency_preset("llama-3.1-70b-4xh100"), 30_000)

    def run(**dp: Any) -> Any:
        return simulate(
            trace, build_policy("kv_aware"), FleetConfig(replicas=8, engine=engine, **dp)
        )

    single = run()
    ranks = run(data_parallel_size=4, rank_routing="router")
    vllm = run(data_parallel_size=4, rank_routing="vllm")
    hits = [sum(r.hit_tokens) / sum(r.queried_tokens) for r in (single, ranks, vllm)]
    assert hits[0] == hits[1] and single.first_token_s == ranks.first_token_s
    assert hits[2] < 0.95 * hits[0]  # vLLM's balancer spreads a tenant over ranks
    # Each replica's ranks are engines of their own: both replicas' ranks served requests.
    served = {r // 4 for r in vllm.replica if r >= 0}
    assert served == {0, 1} and len(set(vllm.replica)) > 2
    with pytest.raises(ValueError, match="multiple of data_parallel_size 3"):
        FleetConfig(replicas=8, data_parallel_size=3)
    with pytest.raises(ValueError, match="not modelled with failures"):
        FleetConfig(replicas=8, data_parallel_size=4, rank_routing="vllm", failures=((0, 1.0),))
    with pytest.raises(ValueError, match="rank_routing must be one of router, vllm"):
        FleetConfig(replicas=8, rank_routing="engine")


# -- launched data-parallel replicas, added and removed while serving ----------------------


async def test_a_launched_data_parallel_replica_joins_and_leaves_with_all_its_ranks(
    tmp_path: Any,
) -> None:
    import dataclasses

    from kvroute.backends.launcher import LaunchedFleet
    from kvroute.router.server import Router

    from .helpers import serve_router

    spec = dataclasses.replace(dp_spec("emulated", "tcp"), count=1, data_parallel_size=2)
    spec = dataclasses.replace(spec, log_dir=str(tmp_path), model="tiny", tokenizer=None)
    launched = LaunchedFleet(spec)
    await asyncio.to_thread(launched.start)
    (first,) = launched.replicas
    assert first.data_parallel_size == 2
    raw = {
        "replicas": [
            {"url": r.url, "name": r.name, "kv_events": r.kv_events, "data_parallel_size": 2}
            for r in launched.replicas
        ],
        "routing": {"tokenizer": "builtin", "block_size": 32},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "rollout": {"drain_timeout_s": 2.0, "readiness_timeout_s": 60.0},
    }
    router = Router(config_from_dict(raw), launched=launched)
    runner, url = await serve_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/admin/replicas", json={"launch": True}) as resp:
                body = await resp.json()
                assert resp.status == 201, body
            added = body["replica"]
            assert body["data_parallel_rank"] == 0 and body["healthy"]
            ranks = {n for n in router.core.registry.handles if replica_of(n) == added}
            assert ranks == {f"{added}@dp0", f"{added}@dp1"}
            assert all(router.core.registry.handles[n].state.healthy for n in ranks)
            assert all(router.core.follows_events(n) for n in ranks)
            async with http.delete(f"{url}/admin/replicas/{added}") as resp:
                assert resp.status == 200, await resp.text()
        assert not any(replica_of(n) == added for n in router.core.registry.handles)
        assert [r.name for r in launched.replicas] == [first.name]
    finally:
        await runner.cleanup()
        await asyncio.to_thread(launched.stop, 5.0)
