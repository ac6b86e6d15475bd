"""Mixed pools: replicas of different speeds in one fleet, and kv_aware's cost in time.

Presets per replica (NAME@SPEED, A100s beside H100s) in the simulator, the replica emulator and
the launch config; kv_aware's per-replica latency lines learnt and priced (``cost_unit: time``)
so that a fast replica takes more."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.backends.launcher import emulated_command
from kvroute.bench.mixed import Measured, verdicts
from kvroute.bench.mixed import Options as MixedOptions
from kvroute.bench.mixed import Run as MixedRun
from kvroute.bench.mixed import presets as mixed_presets
from kvroute.cli import main
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import (
    Decision,
    FleetView,
    ReplicaLatency,
    ReplicaState,
    RouteRequest,
    build_policy,
)
from kvroute.policies.kv_aware import KvAware
from kvroute.policies.latency import LatencyPrior
from kvroute.policies.registry import PolicyConfigError
from kvroute.router.config import ConfigError, load_config
from kvroute.router.launching import launch_spec
from kvroute.simulator.engine.latency import latency_preset
from kvroute.simulator.fleet import FleetConfig, SimResult, engine_config, prepare, simulate
from kvroute.simulator.fleet.mix import apportion, describe_counts, parse_mix
from kvroute.simulator.replica.cli import add_replica_command
from kvroute.simulator.traces.model import Trace, TraceRequest

from .conftest import StartEmulated, StartRouter
from .helpers import MOONCAKE, replica_source

H100 = latency_preset("llama-3.1-8b-h100")
HALF = latency_preset("llama-3.1-8b-h100@0.5")

# -- presets ---------------------------------------------------------------------------------


def test_a_preset_at_half_speed_takes_twice_as_long_for_every_step() -> None:
    for tokens, context, kv in ((1, 2048, 2048), (2048, 2048 * 2049 // 2, 2048), (64, 9000, 9000)):
        assert HALF.step_time(tokens, context, kv) == pytest.approx(
            2 * H100.step_time(tokens, context, kv)
        )
    assert HALF.name == "llama-3.1-8b-h100@0.5"
    assert latency_preset("llama-3.1-8b-h100@1") is H100


def test_an_a100_prefills_slower_than_an_h100_by_the_ratio_of_their_flops() -> None:
    a100 = latency_preset("llama-3.1-8b-a100")
    chunk = (8192, 8192 * 8193 // 2, 8192)
    overhead = H100.step_overhead_s
    ratio = (a100.step_time(*chunk) - overhead) / (H100.step_time(*chunk) - overhead)
    assert ratio == pytest.approx(989 / 312, rel=0.01)
    assert latency_preset("llama-3.1-70b-4xa100").num_gpus == 4


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("llama-3.1-8b-h100@fast", "the speed after @ must be a number > 0"),
        ("llama-3.1-8b-h100@0", "the speed after @ must be a number > 0"),
        ("llama-3.1-8b-h100@-1", "the speed after @ must be a number > 0"),
        ("b200@2", "unknown latency preset 'b200'"),
    ],
)
def test_a_bad_preset_name_says_why(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        latency_preset(name)


def test_the_replica_command_takes_a_preset_at_a_speed_and_refuses_a_bad_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_replica_command(parser.add_subparsers())
    args = parser.parse_args(["replica", "--preset", "llama-3.1-8b-a100@0.5"])
    assert args.preset == "llama-3.1-8b-a100@0.5"
    with pytest.raises(SystemExit):
        parser.parse_args(["replica", "--preset", "llama-3.1-8b-h100@x"])
    assert "the speed after @ must be a number > 0" in capsys.readouterr().err


# -- the mix ---------------------------------------------------------------------------------


def test_a_mix_deals_out_its_kinds_in_proportion_at_any_size() -> None:
    mix = parse_mix("llama-3.1-8b-h100*3,llama-3.1-8b-a100")
    assert mix == (("llama-3.1-8b-h100", 3), ("llama-3.1-8b-a100", 1))
    names = apportion(mix, 8)
    assert names.count("llama-3.1-8b-h100") == 6 and names.count("llama-3.1-8b-a100") == 2
    assert describe_counts(apportion(mix, 4)) == "3 x llama-3.1-8b-h100 + 1 x llama-3.1-8b-a100"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("llama-3.1-8b-h100*0", "expected PRESET\\*COUNT with COUNT >= 1"),
        ("llama-3.1-8b-h100*two", "expected PRESET\\*COUNT"),
        ("llama-3.1-8b-h100*2,llama-3.1-8b-h100*2", "a preset appears twice"),
        ("h100*2", "unknown latency preset 'h100'"),
    ],
)
def test_a_bad_mix_says_which_part_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mix(text)


def test_a_fleet_config_needs_one_latency_per_replica() -> None:
    with pytest.raises(ValueError, match="one latency model per replica"):
        FleetConfig(replicas=3, replica_latency=(H100, HALF))


# -- kv_aware's cost in time -----------------------------------------------------------------


def test_the_time_cost_of_replicas_at_the_prior_is_the_token_cost() -> None:
    tokens, timed = KvAware(), KvAware(cost_unit="time")
    state = ReplicaState("a", in_flight=3, prefilling=1, prefill_tokens=900, reported_waiting=2)
    state.latency = ReplicaLatency(timed.prior)
    request = RouteRequest(2000, 64, prefix_tokens={"a": 512})
    assert timed.cost(state, request) == pytest.approx(tokens.cost(state, request))


def test_a_replica_twice_as_slow_per_token_costs_twice_as_much_in_time() -> None:
    policy = KvAware(cost_unit="time")
    fast = ReplicaState("fast", in_flight=2, prefilling=1, prefill_tokens=1000)
    slow = ReplicaState("slow", in_flight=2, prefilling=1, prefill_tokens=1000)
    base = policy.prior
    fast.latency = ReplicaLatency(base)
    slow.latency = ReplicaLatency(
        LatencyPrior(base.ttft_base_s, 2 * base.prefill_s_per_token, base.tpot_base_s)
    )
    request = RouteRequest(3000, 64)
    assert policy.cost(slow, request) == pytest.approx(2 * policy.cost(fast, request))
    # In tokens both cost the same, and the tie goes by the ring; in time the fast one wins.
    decision = policy.decide(request, FleetView([slow, fast], membership_version=1))
    assert decision.chosen == "fast"


def _learnt(level_s: float, noise_s: float, seed: int, n: int = 30) -> ReplicaLatency:
    """A latency line fitted to ``n`` TTFTs around ``level_s`` (plus 0.1 ms a token)."""
    rng = random.Random(seed)
    line = ReplicaLatency(KvAware().prior)
    for _ in range(n):
        work = rng.randint(200, 2000)
        line.observe_prefill(work, level_s + 1e-4 * work + rng.gauss(0.0, noise_s))
    return line


def test_a_ttft_level_within_its_noise_does_not_steer_the_time_cost() -> None:
    """Alike replicas on a busy host (levels scattered by 0.3 s): the prompt goes where its
    prefix is cached, as the token cost sends it, not to whichever level came out lowest."""
    policy = KvAware(cost_unit="time")
    holder = ReplicaState("holder", latency=_learnt(0.5, 0.3, seed=5))
    other = ReplicaState("other", latency=_learnt(0.5, 0.3, seed=8))
    assert holder.latency is not None and other.latency is not None
    # The noise made the holder's level 0.16 s higher: 5,000 tokens at the prior's price.
    assert holder.latency.prefill_base_s > other.latency.prefill_base_s + 0.15
    request = RouteRequest(1200, 16, prefix_tokens={"holder": 1024})
    decision = policy.decide(request, FleetView([holder, other], membership_version=1))
    assert decision.chosen == "holder"


def test_a_level_every_replica_shares_leaves_the_choice_to_the_cost() -> None:
    """A CPU host's TTFTs sit half a second above an H100 prior's. Counted in, that common
    level made every replica a near tie (``margin_ratio`` of a huge cost) and the warm one won
    whatever its queue. Alike replicas at a common level decide as the token cost does."""
    line = _learnt(0.5, 0.001, seed=1)
    line_tokens = line.prefill_s_per_token / KvAware().prior.prefill_s_per_token
    timed, tokens = (
        KvAware(cost_unit="time", prefill_s_per_token=line.prefill_s_per_token),
        KvAware(),
    )
    assert line_tokens > 3  # the line is steeper than the prior: priced at its own slope here
    rng = random.Random(3)
    for _ in range(200):
        replicas = []
        for name in "abc":
            queued = rng.choice([0, 0, 200, 500, 900, 2000])
            state = ReplicaState(name, latency=line, prefill_tokens=queued)
            state.in_flight = state.prefilling = 1 if queued else 0
            replicas.append(state)
        holder = rng.choice("abc")
        request = RouteRequest(600, 16, prefix_tokens={holder: rng.choice([64, 256, 512])})
        fleet = FleetView(replicas, membership_version=1)
        assert timed.decide(request, fleet).chosen == tokens.decide(request, fleet).chosen


def test_a_ttft_level_clearly_apart_from_the_fleets_still_counts_in_time() -> None:
    """The same gap between levels, measured without scatter, is the replicas' own: the cost
    of the slower level is higher by it."""
    policy = KvAware(cost_unit="time")
    slow = ReplicaState("slow", latency=_learnt(0.6, 0.001, seed=1))
    fast = ReplicaState("fast", latency=_learnt(0.4, 0.001, seed=2))
    assert slow.latency is not None and fast.latency is not None
    apart = slow.latency.prefill_base_s - fast.latency.prefill_base_s
    assert apart > 0.15
    request = RouteRequest(1200, 16)
    policy.decide(request, FleetView([slow, fast], membership_version=1))  # the fleet's level
    gap = policy.cost(slow, request) - policy.cost(fast, request)
    assert gap * policy.prior.prefill_s_per_token > 0.6 * apart  # most of it counts


def test_the_time_cost_keeps_latency_lines_without_an_slo_and_says_its_unit() -> None:
    assert KvAware().latency_prior is None
    policy = build_policy("kv_aware", {"cost_unit": "time"})
    assert policy.latency_prior is not None
    assert policy.describe()["cost_unit"] == "time"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"cost_unit": "seconds"}, "cost_unit must be one of tokens, time"),
        ({"cost_unit": "time", "prefill_s_per_token": 0.0}, "needs prefill_s_per_token > 0"),
    ],
)
def test_a_bad_cost_unit_is_refused_with_why(params: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        build_policy("kv_aware", params)


# -- a simulated mixed pool ------------------------------------------------------------------


def _trace(n: int = 400, rate: float = 8.0, seed: int = 5) -> Trace:
    """Conversations of a few turns with long prompts: enough prefill to queue."""
    rng = random.Random(seed)
    requests = []
    t = 0.0
    for i in range(n):
        blocks = rng.randint(4, 24)
        ids = tuple(range(i * 100, i * 100 + blocks))
        requests.append(TraceRequest(t, blocks * 512, rng.randint(20, 200), ids, f"c{i}"))
        t += rng.expovariate(rate)
    return Trace("mixed", 512, tuple(requests))


@pytest.fixture(scope="module")
def mixed_runs() -> dict[str, SimResult]:
    trace = prepare(_trace())
    mix = (H100, HALF) * 2
    config = FleetConfig(replicas=4, engine=engine_config(H100, 200_000), replica_latency=mix)
    prior = H100.latency_prior()
    runs = {}
    for unit in ("tokens", "time"):
        policy = build_policy("kv_aware", {"seed": 1, "cost_unit": unit, **prior})
        runs[unit] = simulate(trace, policy, config)
    runs["least_loaded"] = simulate(trace, build_policy("least_loaded"), config)
    return runs


def test_in_time_the_fast_replicas_take_more_of_the_prompts(
    mixed_runs: dict[str, SimResult],
) -> None:
    def fast_share(result: SimResult) -> float:
        tokens = result.routed_tokens
        return (tokens[0] + tokens[2]) / sum(tokens)

    assert fast_share(mixed_runs["time"]) > 0.6
    assert fast_share(mixed_runs["time"]) > fast_share(mixed_runs["tokens"]) + 0.05


def test_in_time_the_mixed_pool_answers_sooner_than_counting_tokens_or_load(
    mixed_runs: dict[str, SimResult],
) -> None:
    def p99(result: SimResult) -> float:
        ttfts = sorted(result.ttfts())
        return ttfts[int(0.99 * (len(ttfts) - 1))]

    assert mixed_runs["time"].completed == mixed_runs["time"].requests
    assert p99(mixed_runs["time"]) < p99(mixed_runs["tokens"])
    assert p99(mixed_runs["time"]) < p99(mixed_runs["least_loaded"])


def test_the_ledger_learns_each_replicas_own_prefill_line() -> None:
    trace = prepare(_trace(n=200, rate=6.0))
    config = FleetConfig(
        replicas=2, engine=engine_config(H100, 200_000), replica_latency=(H100, HALF)
    )
    states: list[ReplicaState] = []

    class Spy(KvAware):
        def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
            states[:] = list(fleet.replicas)
            return super().decide(request, fleet)

    spy = Spy(cost_unit="time", **H100.latency_prior())
    simulate(trace, spy, config)
    fast, slow = (s.latency for s in states)
    assert fast is not None and slow is not None
    assert fast.prefill_samples > 20 and slow.prefill_samples > 20
    assert slow.prefill_s_per_token > 1.5 * fast.prefill_s_per_token


# -- speeds told ------------------------------------------------------------------------------


def _opening_burst(speeds: tuple[float, float], n: int = 60) -> dict[str, int]:
    """``n`` distinct 2,048-token prompts at once (no first token back yet) to a fast and a
    slow replica through the ledger, kv_aware in time: where each went."""
    policy = KvAware(cost_unit="time", **H100.latency_prior())
    states = [ReplicaState("fast", speed=speeds[0]), ReplicaState("slow", speed=speeds[1])]
    view = FleetView(states, membership_version=1)
    ledger = DispatchLedger(policy, view, PrefixIndex(), prediction_ttl_s=30.0)
    served = {"fast": 0, "slow": 0}
    rng = random.Random(7)
    for _ in range(n):
        hashes = tuple(rng.getrandbits(64) for _ in range(2048 // 16))
        route = ledger.route(RouteRequest(2048, 32, "m", None, hashes), 0.0, 16)
        chosen = route.ranked[0]
        ledger.dispatch(route, chosen, 0.0)
        served[chosen] += 1
    return served


def test_a_replica_told_half_speed_starts_its_lines_at_twice_the_prior() -> None:
    view = FleetView([ReplicaState("a"), ReplicaState("b", speed=0.5)], membership_version=1)
    policy = KvAware(cost_unit="time", **H100.latency_prior())
    DispatchLedger(policy, view, PrefixIndex(), prediction_ttl_s=30.0)
    a, b = (r.latency for r in view.replicas)
    assert a is not None and b is not None
    assert b.prefill_s_per_token == pytest.approx(2 * a.prefill_s_per_token)
    assert b.ttft(2048) == pytest.approx(2 * a.ttft(2048))
    assert b.tpot(8) == pytest.approx(2 * a.tpot(8))


def test_told_speeds_split_an_opening_burst_by_speed_before_any_answer() -> None:
    untold = _opening_burst((1.0, 1.0))
    told = _opening_burst((1.0, 0.5))
    assert abs(untold["fast"] - untold["slow"]) <= 2  # alike until their answers say otherwise
    # Twice the speed, about twice the work (the margin that keeps near ties put shaves a little).
    assert told["fast"] > 1.7 * told["slow"]


@pytest.mark.parametrize("speed", ["0", "-1", ".nan", "5000"])
def test_a_bad_replica_speed_names_the_key(tmp_path: Path, speed: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f"replicas:\n  - url: http://a:8000\n  - url: http://b:8000\n    speed: {speed}\n"
    )
    with pytest.raises(ConfigError, match=r"replicas\[1\]\.speed: must be a number above 0"):
        load_config(path)


def test_launched_emulated_replicas_are_told_their_presets_speed(tmp_path: Path) -> None:
    presets = "[llama-3.1-8b-h100, llama-3.1-8b-h100@0.5, llama-3.1-8b-a100]"
    config = load_config(_config(tmp_path, f"  count: 3\n  presets: {presets}\n"))
    assert config.launch is not None
    spec = launch_spec(config.launch)
    assert [spec.speed_for(i) for i in range(3)] == [1.0, 0.5, 1.0]


async def test_a_router_shows_each_replicas_told_speed_and_where_its_lines_start(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    fast, slow = await start_emulated(num_blocks=64), await start_emulated(num_blocks=64)
    r = await start_router(
        [replica_source(fast, "fast"), replica_source(slow, "slow") | {"speed": 0.5}],
        routing={"tokenizer": "builtin"},
        policy={"name": "kv_aware", "params": {"cost_unit": "time"}},
    )

    async def rows(http: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        async with http.get(r.url + "/admin/replicas") as resp:
            assert resp.status == 200, await resp.text()
            return {row["name"]: row for row in (await resp.json())["replicas"]}

    async with aiohttp.ClientSession() as http:
        shown = await rows(http)
        assert (shown["fast"]["speed"], shown["slow"]["speed"]) == (1.0, 0.5)
        lines = {name: row["latency"] for name, row in shown.items()}
        assert lines["slow"]["prefill_s_per_token"] == pytest.approx(
            2 * lines["fast"]["prefill_s_per_token"]
        )
        # One more, registered at run time with its speed; a bad speed says which key.
        body = {"url": fast.url, "name": "quick", "speed": 2.0}
        async with http.post(r.url + "/admin/replicas", json=body) as resp:
            assert resp.status == 201, await resp.text()
        assert (await rows(http))["quick"]["speed"] == 2.0
        async with http.post(
            r.url + "/admin/replicas", json=body | {"name": "z", "speed": 0}
        ) as resp:
            assert resp.status == 400
            assert "speed: must be a number above 0" in await resp.text()


def test_the_simulator_tells_each_replica_its_speed_against_the_preset() -> None:
    trace = prepare(_trace(n=20, rate=2.0))
    engine = engine_config(H100, 200_000)
    first: list[tuple[float, float]] = []

    class Spy(KvAware):
        def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
            if not first:  # before any answer: where the lines start
                first.extend(
                    (r.speed, r.latency.prefill_s_per_token if r.latency else 0.0)
                    for r in fleet.replicas
                )
            return super().decide(request, fleet)

    told = FleetConfig(replicas=2, engine=engine, replica_latency=(H100, HALF), tell_speeds=True)
    assert told.speeds() == pytest.approx([1.0, 0.5])
    simulate(trace, Spy(cost_unit="time", **H100.latency_prior()), told)
    (fast_speed, fast_slope), (slow_speed, slow_slope) = first
    assert (fast_speed, slow_speed) == pytest.approx((1.0, 0.5))
    assert slow_slope == pytest.approx(2 * fast_slope)
    untold = FleetConfig(replicas=2, engine=engine, replica_latency=(H100, HALF))
    assert untold.speeds() is None


# -- launched emulated replicas --------------------------------------------------------------


def _config(tmp_path: Path, launch: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(f"launch:\n  engine: emulated\n{launch}")
    return path


def test_each_launched_emulated_replica_runs_its_own_preset(tmp_path: Path) -> None:
    presets = "[llama-3.1-8b-h100, llama-3.1-8b-h100@0.5, llama-3.1-8b-a100]"
    config = load_config(_config(tmp_path, f"  count: 3\n  presets: {presets}\n"))
    assert config.launch is not None
    spec = launch_spec(config.launch)
    argvs = [emulated_command(spec, 8000 + i, None, i) for i in range(3)]
    chosen = [argv[argv.index("--preset") + 1] for argv in argvs]
    assert chosen == ["llama-3.1-8b-h100", "llama-3.1-8b-h100@0.5", "llama-3.1-8b-a100"]


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        ("  count: 3\n  presets: [llama-3.1-8b-h100]\n", "one preset per replica, 3"),
        (
            "  engine: vllm\n  count: 1\n  presets: [llama-3.1-8b-h100]\n",
            "only emulated replicas have a latency preset",
        ),
    ],
)
def test_a_bad_presets_list_names_the_key(tmp_path: Path, launch: str, message: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("launch:\n" + launch)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert "launch.presets" in str(caught.value)


# -- kvroute bench mixed ---------------------------------------------------------------------


def test_the_live_bench_pits_fast_and_slow_against_the_average_speed() -> None:
    options = MixedOptions(replicas=2, preset="llama-3.1-8b-h100", slow_speed=0.5)
    assert mixed_presets(options, "mixed") == [
        "llama-3.1-8b-h100",
        "llama-3.1-8b-h100@0.5",
        "llama-3.1-8b-h100",
        "llama-3.1-8b-h100@0.5",
    ]
    assert mixed_presets(options, "average") == ["llama-3.1-8b-h100@0.75"] * 4
    for name in mixed_presets(options, "mixed") + mixed_presets(options, "average"):
        latency_preset(name)  # every one a preset the replicas accept


def test_the_live_bench_judges_the_time_cost_against_both_baselines() -> None:
    def m(pool: str, policy: str, unit: str | None, p99: float) -> Measured:
        return Measured(MixedRun(pool, policy, unit), frozenset(), {"ttft_p99_s": p99})

    runs = [
        m("mixed", "kv_aware", "time", 1.0),
        m("mixed", "least_loaded", None, 1.5),
        m("mixed", "power_of_two", None, 1.2),
        m("average", "kv_aware", "tokens", 0.9),
    ]
    lines = verdicts(runs)
    assert lines[0].endswith("1.11 (target <= 1): NOT met")
    assert lines[1].endswith("0.83 (target < 1): met")


def test_with_rounds_the_live_bench_judges_by_the_median_of_each_rounds_ratios() -> None:
    def m(k: int, pool: str, policy: str, unit: str | None, p99: float) -> Measured:
        run = MixedRun(pool, policy, unit)
        return Measured(run, frozenset(), {"ttft_p99_s": p99}, round=k)

    runs = [
        # Round 2 on a box twice as busy: every p99 doubles, its ratios do not.
        *(m(0, "mixed", "kv_aware", "time", 1.0), m(0, "average", "kv_aware", "tokens", 1.25)),
        *(m(1, "mixed", "kv_aware", "time", 2.4), m(1, "average", "kv_aware", "tokens", 2.0)),
        *(m(2, "mixed", "kv_aware", "time", 0.9), m(2, "average", "kv_aware", "tokens", 1.0)),
    ]
    assert verdicts(runs) == [
        "- mixed pool, kv_aware (time), TTFT p99 / average pool's: 0.90 (median of 3 rounds: "
        "0.80, 1.20, 0.90) (target <= 1): met"
    ]


def test_in_speed_alike_replicas_cost_tokens_whatever_their_lines_say() -> None:
    policy = KvAware(cost_unit="speed")
    slow = LatencyPrior(prefill_s_per_token=1e-3, ttft_base_s=0.5)  # 30x the prior, a big base
    a = ReplicaState("a", in_flight=2, prefilling=1, prefill_tokens=700)
    b = ReplicaState("b", in_flight=1, prefilling=1, prefill_tokens=100)
    a.latency, b.latency = ReplicaLatency(slow), ReplicaLatency(slow)
    request = RouteRequest(1500, 64)
    decision = policy.decide(request, FleetView([a, b], membership_version=1))
    assert decision.chosen == "b"
    assert policy.cost(a, request) == pytest.approx(KvAware().cost(a, request))


def test_in_speed_a_replica_twice_as_slow_per_token_costs_twice_the_fast_ones() -> None:
    policy = KvAware(cost_unit="speed")
    fast = ReplicaState("fast", prefill_tokens=1000, prefilling=1, in_flight=1)
    slow = ReplicaState("slow", prefill_tokens=1000, prefilling=1, in_flight=1)
    fast.latency = ReplicaLatency(LatencyPrior(prefill_s_per_token=1e-4))
    slow.latency = ReplicaLatency(LatencyPrior(prefill_s_per_token=2e-4))
    request = RouteRequest(3000, 64)
    assert policy.decide(request, FleetView([slow, fast], membership_version=1)).chosen == "fast"
    assert policy.cost(slow, request) == pytest.approx(2 * policy.cost(fast, request))


# -- the commands ----------------------------------------------------------------------------


def test_plan_sizes_a_mixed_fleet_and_says_how_many_of_each_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mix = "llama-3.1-8b-h100*1,llama-3.1-8b-a100*1"
    argv = ["plan", "--trace", str(MOONCAKE), "--max-requests", "100", "--mix", mix, "--quiet"]
    code = main([*argv, "--slo", "ttft=30", "--rate-multipliers", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert f"plan for kv_aware on a mix of {mix}" in out
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    for row in rows:
        n = row["replicas"]
        assert row["kinds"] == describe_counts(apportion(parse_mix(mix), n))
        assert f"of which {row['kinds']}" in " ".join(out.split())
        assert row["gpus"] == n


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "--mix", "llama-3.1-8b-h100*x"], "expected PRESET*COUNT"),
        (["plan", "--mix", "llama-3.1-8b-h100*2", "--explain", "--slo", "ttft=1"], "--explain"),
        (["replay", "--mix", "llama-3.1-8b-h100*2", "--live", "http://127.0.0.1:9"], "--live"),
        (["replay", "--tell-speeds"], "--tell-speeds needs --mix"),
    ],
)
def test_a_bad_mix_on_the_command_line_is_one_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with contextlib.suppress(SystemExit):
        code = main([*argv, "--trace", str(MOONCAKE), "--out", "unused"])
        assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "time,fastest"], "--policies takes time, time-told, speed, tokens"),
        (["--slow-speed", "1.5"], "--slow-speed must be below 1"),
    ],
)
def test_bench_mixed_refuses_bad_arguments_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "mixed", "--no-record", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
