"""KV tiers: events per medium into the index, the tier a prefix would load from, the capacity
learnt from events, kv_aware's cost modes, and the fast engine's offload tiers."""

from __future__ import annotations

from importlib.util import find_spec

import msgspec
import pytest

from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.kv_events import BlockRemoved, BlockStored, decode_event_batch, tier_of
from kvroute.kvcore.prefix_index import PrefixIndex, PrefixMatch
from kvroute.policies import FleetView, ReplicaState, RouteRequest
from kvroute.policies.kv_aware import KvAware
from kvroute.simulator.engine.config import EngineConfig, OffloadTier
from kvroute.simulator.engine.latency import PRESETS
from kvroute.simulator.engine.offload import offload_tiers
from kvroute.simulator.fleet.fast_engine import FastEngine
from kvroute.simulator.fleet.units import SimRequest

from .conftest import StartEmulated, StartRouter

BS = 4
TOKENS = list(range(100, 100 + 8 * BS))  # 8 blocks
ENGINE = [1000 + i for i in range(8)]


def stored(index: PrefixIndex, medium: str, first: int, last: int, replica: str = "r") -> None:
    parent = ENGINE[first - 1] if first else None
    index.apply_stored(
        replica, ENGINE[first:last], parent, TOKENS[first * BS : last * BS], BS, medium
    )


def run_of(index: PrefixIndex, replica: str = "r") -> tuple[int, tuple[tuple[str, int], ...]]:
    hashes = block_hashes(TOKENS, BS)
    match = index.match(hashes, 0.0)[replica]
    tier_run = index.tier_run(replica, hashes, match)
    assert tier_run is not None
    return tier_run.gpu, tier_run.lower


def test_a_gpu_eviction_leaves_the_cpu_copy_and_the_prefix_loads_from_there() -> None:
    index = PrefixIndex()
    stored(index, "GPU", 0, 8)
    assert index.tier_run("r", block_hashes(TOKENS, BS), PrefixMatch(8, 8)) is None  # GPU only
    assert not index.tiered
    stored(index, "CPU", 0, 8)  # write-through: every computed block offloaded
    assert run_of(index) == (8, ())
    # The GPU evicts the tail (vLLM frees a request's blocks tail first): 5..7 load from CPU.
    index.apply_removed("r", ENGINE[5:], "GPU")
    assert run_of(index) == (5, (("CPU", 3),))
    # The CPU evicting a block the GPU still holds changes nothing for the GPU run.
    index.apply_removed("r", ENGINE[:2], "CPU")
    assert run_of(index) == (5, (("CPU", 3),))
    # A block on no tier ends the connector's lookup there.
    index.apply_removed("r", ENGINE[6:7], "CPU")
    assert run_of(index) == (5, (("CPU", 1),))


def test_the_fastest_lower_tier_serves_each_block() -> None:
    index = PrefixIndex()
    stored(index, "GPU", 0, 2)
    stored(index, "STORAGE", 0, 8)
    stored(index, "CPU", 0, 5)
    assert run_of(index) == (2, (("CPU", 3), ("STORAGE", 3)))


def test_capacity_is_learnt_from_events_and_known_once_the_tier_evicts() -> None:
    index = PrefixIndex()
    stored(index, "GPU", 0, 8)
    stored(index, "CPU", 0, 6)
    seen = index.tier_capacity()["r"]
    assert seen["GPU"] == {"held_blocks": 8, "capacity_blocks": 8, "capacity_known": False}
    index.apply_removed("r", ENGINE[4:], "GPU")
    seen = index.tier_capacity()["r"]
    assert seen["GPU"] == {"held_blocks": 4, "capacity_blocks": 8, "capacity_known": True}
    assert seen["CPU"]["capacity_blocks"] == 6 and not seen["CPU"]["capacity_known"]
    index.clear_replica("r")
    assert index.tier_capacity()["r"]["GPU"]["held_blocks"] == 0
    assert index.tier_capacity()["r"]["GPU"]["capacity_blocks"] == 8


def test_tier_names_keep_remote_copies_apart() -> None:
    assert tier_of(None) == "GPU"
    assert tier_of("CPU", "LOCAL") == "CPU"
    assert tier_of("STORAGE", "REMOTE") == "STORAGE:REMOTE"


@pytest.mark.skipif(find_spec("vllm") is None, reason="vllm is not installed")
def test_offload_events_as_vllm_encodes_them_decode_with_their_medium() -> None:
    from vllm.distributed import kv_events as v

    batch = v.KVEventBatch(
        ts=1.0,
        events=[
            v.BlockStored(
                block_hashes=[7, 8],
                parent_block_hash=None,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium=v.MEDIUM_CPU,
                lora_name=None,
                group_idx=0,
                locality="REMOTE",
            ),
            # vLLM's offloading connector without self-describing events: a placeholder.
            v.BlockStored(
                block_hashes=[9],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=v.MEDIUM_CPU,
                lora_name=None,
            ),
            v.BlockRemoved(block_hashes=[7], medium=v.MEDIUM_STORAGE, group_idx=0),
        ],
    )
    _, events, _ = decode_event_batch(msgspec.msgpack.Encoder().encode(batch))
    assert len(events) == 2  # the placeholder is skipped, not the batch
    first, removed = events
    assert tier_of(first.medium, first.locality) == "CPU:REMOTE"  # type: ignore[union-attr]
    assert tier_of(removed.medium, removed.locality) == "STORAGE"  # type: ignore[union-attr]


def _decide(policy: KvAware, held: dict[str, tuple[tuple[str, int], ...]]) -> str:
    fleet = FleetView([ReplicaState("gpu"), ReplicaState("cpu")])
    # "gpu" holds 8k on its GPU but has 1k queued; "cpu" holds the same 8k on CPU, idle.
    fleet.replicas[0].prefill_tokens = 1000
    fleet.replicas[0].prefilling = 1
    fleet.replicas[0].in_flight = 1
    request = RouteRequest(
        prompt_tokens=8192 + 256,
        max_tokens=16,
        block_hashes=(1, 2, 3),
        prefix_tokens={"gpu": 8192, "cpu": 8192},
        block_tokens=16,
        prefix_tiers=held,
    )
    return policy.decide(request, fleet).chosen


def test_fixed_weights_and_the_time_cost_differ_where_loading_is_cheap() -> None:
    held = {"cpu": (("CPU", 8192),)}
    # llm-d's weights: CPU tokens cost 0.2 of a computed one, 1.6k > the 1k queue.
    assert _decide(KvAware(tier_mode="weights", session_ttl_s=0), held) == "gpu"
    # In time: 8k tokens x 128 KiB over 51 GB/s = 21 ms, ~640 prefill tokens at 32 us.
    assert _decide(KvAware(tier_mode="time", session_ttl_s=0), held) == "cpu"
    # A slow tier in time costs more than the weights say.
    slow = KvAware(tier_mode="time", storage_load_gbps=0.5, session_ttl_s=0)
    assert _decide(slow, {"cpu": (("STORAGE", 8192),)}) == "gpu"


def test_a_load_from_a_lower_tier_queues_on_its_replica_in_time_only() -> None:
    """The time cost's load is work on the replica until its first token (its steps wait for
    it): the next request sees it queued there. Fixed weights (llm-d's) and flat count none."""
    from kvroute.kvcore.ledger import DispatchLedger, Route

    request = RouteRequest(
        prompt_tokens=8192 + 256,
        max_tokens=16,
        block_hashes=(1, 2, 3),
        prefix_tokens={"cpu": 8192},
        block_tokens=16,
        prefix_tiers={"cpu": (("CPU", 8192),)},
    )
    queued = {}
    for mode in ("time", "weights", "flat"):
        policy = KvAware(tier_mode=mode, session_ttl_s=0)
        fleet = FleetView([ReplicaState("gpu"), ReplicaState("cpu")])
        ledger = DispatchLedger(policy, fleet, PrefixIndex(), prediction_ttl_s=1.0)
        d = ledger.dispatch(Route(request, ("cpu", "gpu"), "test"), "cpu", 0.0, predict=False)
        queued[mode] = fleet.replicas[1].prefill_tokens
        ledger.first_token(d, 0.1)
        assert fleet.replicas[1].prefill_tokens == 0  # gone with its first token
    # 8k tokens x 128 KiB over 51 GB/s = 21 ms, ~640 prefill tokens at 32 us, on the 256 computed.
    assert 256 + 600 < queued["time"] < 256 + 700
    assert queued["weights"] == queued["flat"] == 256


def test_bad_tier_parameters_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="tier_mode must be one of time, weights, flat"):
        KvAware(tier_mode="fast")
    with pytest.raises(ValueError, match="cpu_weight"):
        KvAware(cpu_weight=1.5)
    with pytest.raises(ValueError, match="storage_load_gbps"):
        KvAware(storage_load_gbps=0)


def _request(index: int, keys: tuple[int, ...], arrival: float = 0.0) -> SimRequest:
    return SimRequest(
        index=index,
        arrival_s=arrival,
        input_tokens=len(keys) * 64,
        output_tokens=2,
        unit_keys=keys,
        full_units=len(keys),
        route_hashes=keys,
    )


def _drain(engine: FastEngine, now: float) -> tuple[float, list[tuple[object, ...]]]:
    """Run the engine until idle; the time it ends and the index operations it sent."""
    ops: list[tuple[object, ...]] = []
    end = engine.start(now)
    while end is not None:
        now = end
        report = engine.complete()
        ops += report.index_ops
        end = engine.start(now)
    return now, ops


def test_the_fast_engine_offloads_on_store_and_loads_a_gpu_miss_back_at_the_tier_speed() -> None:
    latency = PRESETS["llama-3.1-8b-h100"]
    cpu = OffloadTier("CPU", 1000, 1e9)  # 1 GB/s: 2 units (128 tokens) load in 16.8 ms
    config = EngineConfig(block_size=16, num_blocks=16, latency=latency, offload=(cpu,))
    engine = FastEngine(config, block_tokens=64)
    engine.add(_request(0, (11, 12, 13)), 0, 2)
    now, ops = _drain(engine, 0.0)
    assert ops == [
        ("stored", [11, 12, 13], None, [11, 12, 13], 1),  # GPU
        ("stored", [11, 12, 13], None, [11, 12, 13], 1, "CPU"),  # offloaded on store
    ]
    # Another prompt needs the room: the GPU evicts all three (a request's tail first); the
    # CPU keeps them.
    engine.add(_request(1, (21, 22, 23)), 0, 2)
    now, ops = _drain(engine, now)
    assert [op for op in ops if op[0] == "removed"] == [("removed", [13, 12]), ("removed", [11])]
    # 11 and 12 load from CPU at 1 GB/s before the request runs (13 holds the prompt's last
    # token, which is always computed).
    assert engine.cached_prompt_tokens(_request(2, (11, 12, 13))) == 0
    engine.add(_request(2, (11, 12, 13)), 0, 2)
    end = engine.start(now)
    assert end == pytest.approx(now + 2 * 64 * latency.kv_bytes_per_token / 1e9)
    assert engine.loaded_tokens == {"CPU": 2 * 64}
    report = engine.complete()
    assert report.lookups == [(2, 3 * 64, 2 * 64)]  # loaded tokens count as hits
    assert ("stored", [11, 12], None, [11, 12], 1) in report.index_ops  # in the GPU cache again
    now, _ = _drain(engine, end)
    assert now > end


def test_node_presets_give_a_replica_its_share_and_bad_names_are_refused() -> None:
    qwen = PRESETS["qwen3-32b-2xh100"]
    cpu, disk = offload_tiers("cpu+disk", qwen, 16)
    assert cpu.medium == "CPU" and disk.medium == "STORAGE"
    assert cpu.num_blocks * 16 * qwen.kv_bytes_per_token == pytest.approx(2e12 * 0.8 / 4, rel=1e-3)
    assert disk.load_bytes_per_s < cpu.load_bytes_per_s
    assert offload_tiers("cpu", qwen, 16, cpu_tokens=1600)[0].num_blocks == 100
    with pytest.raises(ValueError, match="KV tiers must be one of none, cpu, cpu\\+disk"):
        offload_tiers("ram", qwen, 16)


def test_the_router_exports_each_replica_tier_and_its_learnt_capacity() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector

    from kvroute.router.pools import _tier_families

    index = PrefixIndex()
    stored(index, "GPU", 0, 8)
    stored(index, "CPU", 0, 8)
    index.apply_removed("r", ENGINE[6:], "GPU")

    class Tiers(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            return _tier_families(index.tier_capacity())

    registry = CollectorRegistry()
    registry.register(Tiers())
    text = generate_latest(registry).decode()
    seen = {
        (f.name, s.labels["tier"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert seen[("kvroute_kv_tier_blocks", "GPU")] == 6
    assert seen[("kvroute_kv_tier_capacity_blocks", "GPU")] == 8
    assert seen[("kvroute_kv_tier_capacity_known", "GPU")] == 1
    assert seen[("kvroute_kv_tier_blocks", "CPU")] == 8
    assert seen[("kvroute_kv_tier_capacity_known", "CPU")] == 0


def _run_engine(engine: object, t: float = 0.0) -> tuple[float, list[object]]:
    from kvroute.simulator.engine import Engine

    assert isinstance(engine, Engine)
    events: list[object] = []
    while engine.has_unfinished_requests():
        out = engine.step(t)
        t += out.duration_s
        events += out.events
    return t, events


@pytest.mark.skipif(find_spec("vllm") is None, reason="vllm is not installed")
def test_the_emulated_engine_offloads_to_cpu_with_vllms_events_and_loads_back() -> None:
    from vllm.distributed import kv_events as v

    from kvroute.kvcore.kv_events import encode_event_batch
    from kvroute.simulator.engine import Engine, EngineRequest

    latency = PRESETS["llama-3.1-8b-h100"]
    cpu = OffloadTier("CPU", 64, 1e9)
    engine = Engine(EngineConfig(block_size=16, num_blocks=8, latency=latency, offload=(cpu,)))
    a = list(range(1, 81))  # 5 blocks
    engine.add_request(EngineRequest("a", a, 1, 0.0))
    t, first = _run_engine(engine)
    engine.add_request(EngineRequest("b", list(range(500, 580)), 1, t))  # evicts a on GPU
    t, second = _run_engine(engine, t)
    engine.add_request(EngineRequest("a2", [*a, 7, 7], 1, t))  # a's 5 blocks: loaded from CPU
    before = engine.stats
    t2, third = _run_engine(engine, t)
    after = engine.stats

    # vLLM's own decoder reads the events: stores on CPU carry the GPU's hashes and tokens.
    wire = encode_event_batch(1.0, [*first, *second, *third], 0, "map")
    batch = msgspec.msgpack.Decoder(v.KVEventBatch).decode(wire)
    cpu_stored = [e for e in batch.events if isinstance(e, v.BlockStored) and e.medium == "CPU"]
    gpu_stored = [e for e in batch.events if isinstance(e, v.BlockStored) and e.medium == "GPU"]
    assert cpu_stored[0].block_hashes == gpu_stored[0].block_hashes
    assert cpu_stored[0].token_ids == a[:80]
    gpu_removed = [e for e in batch.events if isinstance(e, v.BlockRemoved) and e.medium == "GPU"]
    assert gpu_removed and not any(
        isinstance(e, v.BlockRemoved) and e.medium == "CPU" for e in batch.events
    )
    # The third request hit what the GPU kept of a and loaded the rest from CPU instead of
    # computing it, which took the time of those tokens' KV at 1 GB/s on top of its step.
    evicted = {h for e in gpu_removed for h in e.block_hashes}
    loaded = 16 * sum(1 for h in gpu_stored[0].block_hashes if h in evicted)
    assert loaded > 0
    by_source = [
        x - y
        for x, y in zip(after.prompt_tokens_by_source, before.prompt_tokens_by_source, strict=True)
    ]
    assert by_source == [2, 80 - loaded, loaded]  # computed, local hit, loaded ("external")
    load_bytes = loaded * latency.kv_bytes_per_token
    assert after.offload_load_bytes - before.offload_load_bytes == load_bytes
    assert t2 - t > load_bytes / 1e9

    # The router's index, fed the same events, says where a2's prefix would come from.
    index = PrefixIndex()
    for e in [*first, *second]:
        if isinstance(e, BlockStored):
            index.apply_stored("r", e.block_hashes, e.parent_block_hash, e.token_ids, 16, e.medium)
        elif isinstance(e, BlockRemoved):
            index.apply_removed("r", e.block_hashes, e.medium)
    hashes = block_hashes(a, 16)
    run = index.tier_run("r", hashes, index.match(hashes, 0.0)["r"])
    assert run == (5 - loaded // 16, (("CPU", loaded // 16),))


async def test_a_live_router_follows_an_emulated_replicas_cpu_tier(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    import aiohttp
    import openai

    from kvroute.kvcore.stats import parse_metrics
    from kvroute.kvcore.tokenizer import SimpleTokenizer

    from .helpers import wait_until

    replica = await start_emulated(num_blocks=16, offload=(OffloadTier("CPU", 256, 1e9),))
    source = {
        "url": replica.url,
        "name": "emu",
        "kv_events": replica.events,
        "kv_replay": replica.replay,
    }
    r = await start_router([source])
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    first = "The first tenant's long system prompt, cached and then pushed out. " * 4
    other = "Another tenant's prompt takes the whole GPU cache of this small replica. " * 8
    await client.completions.create(model="tiny", prompt=first, max_tokens=2)
    await client.completions.create(model="tiny", prompt=other, max_tokens=2)
    hashes = block_hashes(SimpleTokenizer().encode(first), 16)

    def lower() -> int:
        match = r.router.index.match(hashes, now=0.0).get("emu")
        run = r.router.index.tier_run("emu", hashes, match) if match else None
        return sum(n for _, n in run.lower) if run else 0

    # The GPU evicted the first prompt; the router sees its copy on the replica's CPU tier.
    await wait_until(lambda: lower() > 0, what="the index to place the first prompt on CPU")
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/metrics") as resp:
            samples = {
                (s.name, s.labels.get("tier")): s.value
                for s in parse_metrics(await resp.text()).samples
                if s.labels.get("replica") == "emu"
            }
        assert samples[("kvroute_kv_tier_blocks", "CPU")] >= len(hashes)
        assert samples[("kvroute_kv_tier_capacity_known", "GPU")] == 1  # the GPU has evicted
        async with http.get(r.url + "/status/events") as resp:
            status = await resp.json()
        [row] = [row for row in status["replicas"] if row["name"] == "emu"]
        assert row["kv_tiers"]["CPU"]["held_blocks"] >= len(hashes)
        # The prompt again: the replica loads it from CPU instead of computing it.
        await client.completions.create(model="tiny", prompt=first, max_tokens=2)
        async with http.get(replica.url + "/metrics") as resp:
            loaded = {s.name: s.value for s in parse_metrics(await resp.text()).samples}
        assert loaded["vllm:kv_offload_load_bytes_total"] > 0


def test_the_exact_fleet_engine_passes_each_events_tier_to_the_index() -> None:
    from kvroute.simulator.fleet.exact_engine import _op

    stored_op = _op(BlockStored([1], None, [0] * 16, 16, medium="CPU"))
    assert stored_op == ("stored", [1], None, [0] * 16, 16, "CPU")
    assert _op(BlockRemoved([1], "STORAGE", 0, "REMOTE")) == ("removed", [1], "STORAGE:REMOTE")
    assert _op(BlockRemoved([1], None)) == ("removed", [1], "GPU")


def test_an_engine_hash_reused_for_other_content_leaves_its_tier_too() -> None:
    index = PrefixIndex()
    stored(index, "GPU", 0, 2)
    stored(index, "CPU", 0, 2)
    # The CPU tier's engine hash of block 1 now names other content (a broken publisher).
    other = [7] * BS
    index.apply_stored("r", [ENGINE[1]], ENGINE[0], other, BS, "CPU")
    index.apply_removed("r", ENGINE[:1], "GPU")
    # Block 0 loads from CPU; block 1 is only on the GPU now, after a miss there: the
    # connector's lookup ends at it (its old CPU copy is gone).
    hashes = block_hashes(TOKENS, BS)
    match = index.match(hashes, 0.0)["r"]
    assert index.tier_run("r", hashes, match) == (0, (("CPU", 1),))
