"""kv_aware against an SLO: latency lines learnt per replica, the choice among replicas that
meet the targets, and the ``slo:`` config that turns it on."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import openai
import pytest

from kvroute.health.scrape import ReplicaReport, observe_decode, parse_vllm_metrics
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import (
    FleetView,
    LatencyPrior,
    PolicyConfigError,
    ReplicaLatency,
    ReplicaState,
    RouteRequest,
    build_policy,
)
from kvroute.policies.kv_aware import SLO_MISS, KvAware
from kvroute.router.config import ConfigError, load_config, policy_params

from .conftest import StartEmulated, StartRouter
from .helpers import wait_until

BLOCK = 16


# -- the latency lines ---------------------------------------------------------------------


def test_the_prefill_line_moves_from_its_prior_to_what_the_replica_does() -> None:
    # The prior says an H100; this replica is ten times slower, with a 50 ms floor.
    latency = ReplicaLatency(LatencyPrior(ttft_base_s=0.009, prefill_s_per_token=3.2e-5))
    rng = random.Random(0)
    for _ in range(300):
        work = rng.randint(100, 8000)
        latency.observe_prefill(work, (0.05 + 3.2e-4 * work) * rng.uniform(0.95, 1.05))
    assert latency.ttft(4000) == pytest.approx(0.05 + 3.2e-4 * 4000, rel=0.05)
    assert latency.describe()["prefill_samples"] == 300


def test_requests_of_one_size_move_the_level_but_keep_the_priors_slope() -> None:
    prior = LatencyPrior(ttft_base_s=0.01, prefill_s_per_token=1e-4)
    latency = ReplicaLatency(prior)
    for _ in range(200):
        latency.observe_prefill(1000, 0.5)  # no spread in x: the slope is not identifiable
    assert latency.ttft(1000) == pytest.approx(0.5, rel=0.05)
    # Through the origin it would be 5e-4 s per token; the prior keeps it near 1e-4.
    assert 1e-4 <= latency.describe()["prefill_s_per_token"] < 2e-4


def test_the_decode_line_follows_the_batch() -> None:
    latency = ReplicaLatency(LatencyPrior(tpot_base_s=0.007, tpot_per_seq_s=1e-4))
    for batch in [1, 4, 8, 16, 32] * 40:
        latency.observe_decode(batch, 0.02 + 0.001 * batch)
    assert latency.tpot(24) == pytest.approx(0.044, rel=0.05)
    latency.observe_decode(4, float("nan"))  # ignored, not a poisoned fit
    assert latency.tpot(24) == pytest.approx(0.044, rel=0.05)


def test_a_prior_with_a_negative_figure_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        LatencyPrior(prefill_s_per_token=-1.0)


# -- the ledger feeds the lines ------------------------------------------------------------


def _request(
    tokens: int, prefix: dict[str, int] | None = None, key: str | None = None, seed: int = 0
) -> RouteRequest:
    rng = random.Random(seed)
    hashes = tuple(rng.getrandbits(64) for _ in range(tokens // BLOCK))
    return RouteRequest(tokens, 64, "m", key, hashes, prefix)


def test_the_ledger_learns_each_replicas_time_to_first_token_when_the_policy_has_an_slo() -> None:
    policy = KvAware(slo_ttft_s=1.0)
    view = FleetView([ReplicaState("a"), ReplicaState("b")], membership_version=1)
    ledger = DispatchLedger(policy, view, PrefixIndex(), prediction_ttl_s=30.0)
    a = view.replicas[0]
    assert a.latency is not None and view.replicas[1].latency is not None
    before = a.latency.ttft(2048)
    for k in range(50):
        now = 10.0 * k
        route = ledger.route(_request(2048, seed=k), now, BLOCK)
        d = ledger.dispatch(route, "a", now)
        ledger.first_token(d, now + 0.8)  # far slower than the prior's 75 ms
        ledger.finish(d, now + 2.0)
    assert before < 0.1
    assert a.latency.ttft(2048) == pytest.approx(0.8, rel=0.1)
    assert view.replicas[1].latency.describe()["prefill_samples"] == 0


def test_without_an_slo_no_replica_gets_latency_lines() -> None:
    view = FleetView([ReplicaState("a")], membership_version=1)
    DispatchLedger(KvAware(), view, PrefixIndex(), prediction_ttl_s=30.0)
    assert view.replicas[0].latency is None


def test_the_scraper_feeds_the_decode_line_from_the_replicas_inter_token_histogram() -> None:
    state = ReplicaState("a", latency=ReplicaLatency(LatencyPrior(tpot_base_s=0.007)))
    page = (
        "# TYPE vllm:inter_token_latency_seconds histogram\n"
        'vllm:inter_token_latency_seconds_bucket{{le="+Inf",model_name="m"}} {n}\n'
        'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {s}\n'
        'vllm:inter_token_latency_seconds_count{{model_name="m"}} {n}\n'
        'vllm:num_requests_running{{model_name="m"}} 8\n'
        'vllm:cache_config_info{{block_size="16",num_gpu_blocks="1000"}} 1\n'
    )
    before = parse_vllm_metrics(page.format(n=100, s=2.0).encode())
    after = parse_vllm_metrics(page.format(n=1100, s=52.0).encode())  # 50 ms per token since
    assert after.kv_capacity_tokens == 16_000
    for _ in range(100):
        observe_decode(state, before, after)
    assert state.latency is not None
    assert state.latency.tpot(8) == pytest.approx(0.05, rel=0.05)
    # A restarted replica's counters go back: nothing to learn from that interval.
    samples = state.latency.describe()["decode_samples"]
    observe_decode(state, after, before)
    observe_decode(state, None, after)
    assert state.latency.describe()["decode_samples"] == samples


# -- the choice against an SLO -------------------------------------------------------------


def _holder_and_idle() -> tuple[FleetView, RouteRequest]:
    """a holds 3,000 of a 4,000-token prompt behind 10,000 queued tokens; b is idle, cold."""
    a = ReplicaState("a", in_flight=3, prefilling=3, prefill_tokens=10_000)
    b = ReplicaState("b")
    return FleetView([a, b], membership_version=1), _request(4000, {"a": 3000})


def test_without_an_slo_the_queue_sends_the_prompt_away_from_its_cache() -> None:
    view, request = _holder_and_idle()
    assert KvAware().decide(request, view).chosen == "b"


def test_with_room_under_the_slo_the_replica_holding_the_prefix_keeps_it() -> None:
    # a: 9 ms + 11,000 tokens x 32 us = 0.36 s, within 2 s: the cache wins.
    view, request = _holder_and_idle()
    decision = KvAware(slo_ttft_s=2.0, slo_headroom=1.0).decide(request, view)
    assert decision.chosen == "a"
    assert decision.ranked == ("a", "b")


def test_a_replica_predicted_to_miss_the_slo_is_passed_over() -> None:
    view, request = _holder_and_idle()
    decision = KvAware(slo_ttft_s=0.2, slo_headroom=1.0).decide(
        request, view
    )  # a: 0.36 s, b: 0.14 s
    assert decision.chosen == "b"


def test_the_headroom_asks_for_a_margin_under_the_targets() -> None:
    # a: 0.36 s predicted. Within 0.5 s as given, but not within half of it (the default):
    # predictions are means, and a replica at its limit misses as often as not.
    view, request = _holder_and_idle()
    assert KvAware(slo_ttft_s=0.5, slo_headroom=1.0).decide(request, view).chosen == "a"
    assert KvAware(slo_ttft_s=0.5).decide(request, view).chosen == "b"
    with pytest.raises(ValueError, match="slo_headroom"):
        KvAware(slo_headroom=0)


def test_when_no_replica_can_meet_the_slo_the_plain_cost_decides_and_says_so() -> None:
    view, request = _holder_and_idle()
    decision = KvAware(slo_ttft_s=0.05).decide(request, view)
    assert (decision.chosen, decision.reason) == ("b", SLO_MISS)
    assert decision.ranked == KvAware().decide(request, view).ranked
    # Late everywhere with the holder the cheaper: the holder keeps it.
    view.replicas[0].prefill_tokens = 1000
    decision = KvAware(slo_ttft_s=0.01).decide(request, view)
    assert (decision.chosen, decision.reason) == ("a", SLO_MISS)


def test_the_tpot_target_counts_the_batch_a_replica_decodes() -> None:
    busy = ReplicaState("busy", in_flight=200)  # 7 ms + 201 x 0.1 ms = 27 ms per token
    idle = ReplicaState("idle")
    view = FleetView([busy, idle], membership_version=1)
    request = _request(1024, {"busy": 1024})
    assert KvAware(slo_tpot_s=0.05, slo_headroom=1.0).decide(request, view).chosen == "busy"
    assert KvAware(slo_tpot_s=0.02, slo_headroom=1.0).decide(request, view).chosen == "idle"


# -- configuration -------------------------------------------------------------------------


def test_slo_parameters_take_a_number_or_null_and_nothing_else() -> None:
    assert (
        build_policy("kv_aware", {"slo_ttft_s": 1.5, "slo_tpot_s": None}).describe()["slo_ttft_s"]
        == 1.5
    )
    with pytest.raises(PolicyConfigError, match=r"slo_ttft_s.*must be a number"):
        build_policy("kv_aware", {"slo_ttft_s": "fast"})
    with pytest.raises(PolicyConfigError, match="slo_tpot_s must be a number > 0"):
        build_policy("kv_aware", {"slo_tpot_s": 0})


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvroute.yaml"
    path.write_text('replicas: [{url: "http://127.0.0.1:9"}]\n' + text)
    return path


def test_the_slo_section_becomes_the_policys_targets(tmp_path: Path) -> None:
    config = load_config(_config(tmp_path, "slo: {ttft_s: 1.5, tpot_s: 0.05}\n"))
    assert policy_params(config) == {"slo_ttft_s": 1.5, "slo_tpot_s": 0.05}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("slo: {ttft_s: -1}\n", r"slo\.ttft_s: must be a number of seconds > 0"),
        ("slo: {ttft_s: 1}\npolicy: {name: round_robin}\n", "only kv_aware routes against"),
        ("slo: {ttft: 1}\n", "ttft"),
    ],
)
def test_a_bad_slo_section_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_config(tmp_path, text))


def test_an_empty_report_leaves_nothing_to_learn() -> None:
    state = ReplicaState("a", latency=ReplicaLatency(LatencyPrior()))
    observe_decode(state, ReplicaReport(), ReplicaReport())
    assert state.latency is not None and state.latency.describe()["decode_samples"] == 0


# -- live: the router learns its replicas' lines -------------------------------------------


async def test_a_router_with_an_slo_learns_each_replicas_latency_and_shows_it(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    running = await start_emulated(num_blocks=512)
    r = await start_router(
        [{"url": running.url, "name": "emu"}],
        routing={"tokenizer": "builtin", "scrape_interval_s": 0.1},
        slo={"ttft_s": 5.0, "tpot_s": 1.0},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    for k in range(6):
        stream = await client.completions.create(
            model="tiny", prompt=f"question {k} " * 50, max_tokens=16, stream=True
        )
        async for _ in stream:
            pass

    state = r.router.replicas["emu"].state

    def learnt() -> bool:
        lines = state.latency.describe() if state.latency is not None else {}
        return lines.get("prefill_samples", 0) >= 6 and lines.get("decode_samples", 0) > 0

    await wait_until(learnt, what="latency lines from first tokens and the ITL histogram")
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/admin/replicas") as resp:
            (row,) = (await resp.json())["replicas"]
    assert row["kv_capacity_tokens"] == 512 * 16
    lines = row["latency"]
    assert lines["prefill_samples"] >= 6 and lines["decode_samples"] > 0
    # (How far the lines moved depends on how fast this box answers; the fit itself is
    # checked above with known slopes.)
    assert all(isinstance(lines[k], float) for k in ("ttft_base_s", "tpot_base_s"))
