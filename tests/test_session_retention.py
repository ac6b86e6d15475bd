"""Sessions' caches kept warm across tool calls: the gap learner (policies/gaps.py), staged
claims (policies/sessions.py), and kv_aware's learnt horizons and client hints."""

from __future__ import annotations

import math
import random

import pytest

from kvroute.policies import FleetView, ReplicaState, RouteRequest
from kvroute.policies.gaps import BUCKETS, GapLearner, bucket_of, quantile
from kvroute.policies.kv_aware import KvAware
from kvroute.policies.sessions import LiveSessions

BLOCK = 16


# -- the gap learner -----------------------------------------------------------------------


def test_buckets_double() -> None:
    assert [bucket_of(g) for g in (0.0, 0.9, 1.0, 1.9, 2.0, 10.0, 1e9)] == [0, 0, 1, 1, 2, 4, 17]
    counts = [0.0] * BUCKETS
    counts[bucket_of(10.0)] = 4.0  # all in [8, 16)
    assert 8.0 <= quantile(counts, 0.1) < quantile(counts, 0.9) <= 16.0
    assert math.isnan(quantile([0.0] * BUCKETS, 0.5))


def _feed(learner: GapLearner, key: str, gaps: list[float], start: float = 0.0) -> float:
    now = start
    learner.observe(key, now)
    for gap in gaps:
        now += gap
        assert learner.observe(key, now) == pytest.approx(gap)
    return now


def test_a_session_learns_its_own_rhythm_from_the_fleets_prior() -> None:
    learner = GapLearner()
    assert learner.quantiles("new", (0.5,)) is None  # nothing seen anywhere
    rng = random.Random(1)
    for k in range(20):  # the fleet: agents back in 5-20 s
        _feed(learner, f"agent{k}", [rng.uniform(5, 20) for _ in range(10)])
    prior = learner.quantiles("new", (0.5, 0.9))
    assert prior is not None and 4 <= prior[0] <= prior[1] <= 32
    # A user who reads and types for minutes becomes itself as its gaps come in.
    _feed(learner, "human", [rng.uniform(200, 400) for _ in range(12)], start=1000.0)
    human = learner.quantiles("human", (0.5, 0.9))
    assert human is not None and human[0] > 100 and human[1] <= 512
    assert learner.quantiles("agent0", (0.5,))[0] < 32  # type: ignore[index]


def test_memory_is_bounded_and_continuation_is_counted() -> None:
    learner = GapLearner(max_sessions=3)
    assert learner.continues() == 1.0
    for k in range(10):
        learner.observe(f"s{k}", float(k))  # ten sessions of one turn each
    assert len(learner) == 3
    assert learner.continues() < 0.1  # none came back
    learner.observe("s0", 100.0)  # forgotten: a first turn again, no gap
    assert learner.quantiles("s0", (0.5,)) is None


# -- staged claims ---------------------------------------------------------------------------


def test_a_claim_weakens_stage_by_stage_and_then_releases() -> None:
    sessions = LiveSessions(ttl_s=60.0)
    sessions.touch("a", "r0", 100, 0.0, ((10.0, 1.0), (20.0, 0.5), (40.0, 0.25)))
    sessions.touch("b", "r0", 50, 0.0)  # the default: ttl_s at full weight
    seen = []
    for now in (5.0, 15.0, 30.0, 45.0, 61.0):
        sessions.expire(now)
        seen.append(sessions.tokens_on("r0"))
    assert seen == [150, 100, 75, 50, 0]
    assert len(sessions) == 0 and sessions.home("a", 61.0) is None


def test_a_returning_turn_renews_its_claim() -> None:
    sessions = LiveSessions(ttl_s=60.0)
    sessions.touch("a", "r0", 100, 0.0, ((10.0, 1.0), (20.0, 0.5)))
    sessions.expire(15.0)
    assert sessions.home("a", 15.0) == ("r0", 50.0)
    sessions.touch("a", "r1", 120, 15.0, ((10.0, 1.0), (20.0, 0.5)))
    sessions.expire(24.0)  # its first claim's stage change is stale now
    assert (sessions.tokens_on("r0"), sessions.tokens_on("r1")) == (0, 120)
    for k in range(200):  # stale heap entries stay bounded
        sessions.touch("a", "r1", 120, 24.0 + k, ((10.0, 1.0),))
    assert len(sessions._due) <= 4 * len(sessions) + 64


# -- kv_aware --------------------------------------------------------------------------------


def _request(
    seed: int, key: str | None, tokens: int = 60, ttl: float | None = None
) -> RouteRequest:
    rng = random.Random(seed)
    hashes = tuple(rng.getrandbits(64) for _ in range(tokens // BLOCK))
    return RouteRequest(len(hashes) * BLOCK, 8, "m", key, hashes, None, BLOCK, ttl)


def _fleet(capacity: int, n: int = 2) -> FleetView:
    replicas = [ReplicaState(f"r{i}", kv_capacity_tokens=capacity) for i in range(n)]
    return FleetView(replicas, membership_version=1)


def _claimed(policy: KvAware, replica: str) -> float:
    assert policy._sessions is not None
    return policy._sessions.tokens_on(replica)


def test_a_slow_session_keeps_its_claim_past_the_fixed_ttl_when_learnt() -> None:
    """A session back every 5 minutes: the fixed 60 s ttl forgets it between turns, the learnt
    horizon (its 90th percentile gap) keeps its tokens claimed until it is back."""
    claimed = []
    for policy in (KvAware(), KvAware(session_horizon_quantile=0.9)):
        view = _fleet(10_000)
        for turn in range(8):
            view.now = turn * 300.0
            home = policy.decide(_request(turn, "human", 1600), view).chosen
        view.now += 200.0
        policy._sessions.expire(view.now)  # type: ignore[union-attr]
        claimed.append(_claimed(policy, home))
    assert claimed == [0, 1600]


def test_a_session_that_ended_releases_its_claim() -> None:
    policy = KvAware(session_horizon_quantile=0.9, session_horizon_max_s=600.0)
    view = _fleet(10_000)
    for turn in range(10):  # an agent back every 10 s, then gone
        view.now = turn * 10.0
        home = policy.decide(_request(turn, "agent", 1600), view).chosen
    view.now = 90.0 + 5.0
    policy._sessions.expire(view.now)  # type: ignore[union-attr]
    assert _claimed(policy, home) == 1600  # expected back: full weight
    view.now = 90.0 + 600.0
    policy._sessions.expire(view.now)  # type: ignore[union-attr]
    assert _claimed(policy, home) == 0 and len(policy._sessions) == 0  # type: ignore[arg-type]


def test_a_new_prompt_evicts_the_overdue_session_not_the_one_expected_back() -> None:
    """Two replicas, each nearly full with one session back every 20 s. One comes back; the
    other stays away well past its usual gap. A cold prompt goes where it evicts the overdue
    one; with today's fixed ttl both still weigh alike."""
    policy = KvAware(session_horizon_quantile=0.95)
    view = _fleet(2000)
    for turn in range(6):
        for k, key in enumerate(("back", "away")):
            view.now = turn * 20.0 + k
            policy.decide(_request(10 * turn + k, key, 1600), view)
    homes = {key: policy._sessions.home(key, view.now) for key in ("back", "away")}  # type: ignore[union-attr]
    assert homes["back"] is not None and homes["away"] is not None
    assert homes["back"][0] != homes["away"][0]
    view.now = 150.0  # "away" last came at 101 s
    policy.decide(_request(99, "back", 1600), view)
    view.now = 151.0
    assert policy.decide(_request(1234, None, 1600), view).chosen == homes["away"][0]
    assert _claimed(policy, homes["back"][0]) == 1600
    assert _claimed(policy, homes["away"][0]) < 1600 * 0.5


def test_the_clients_ttl_sets_the_horizon_at_least() -> None:
    policy = KvAware()  # fixed ttl 60 s; the hint outlasts it
    view = _fleet(10_000)
    home = policy.decide(_request(1, "messages", 1600, ttl=3600.0), view).chosen
    view.now = 1800.0
    policy._sessions.expire(view.now)  # type: ignore[union-attr]
    assert _claimed(policy, home) == 1600
    view.now = 3601.0
    policy._sessions.expire(view.now)  # type: ignore[union-attr]
    assert _claimed(policy, home) == 0
    capped = KvAware(session_horizon_max_s=600.0)  # a hint is capped like a learnt horizon
    home = capped.decide(_request(1, "messages", 1600, ttl=3600.0), view).chosen
    view.now += 601.0
    capped._sessions.expire(view.now)  # type: ignore[union-attr]
    assert _claimed(capped, home) == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="session_horizon_quantile"):
        KvAware(session_horizon_quantile=1.0)
    with pytest.raises(ValueError, match="session_horizon_min_s"):
        KvAware(session_horizon_min_s=100.0, session_horizon_max_s=10.0)
    described = KvAware(session_horizon_quantile=0.9).describe()
    assert described["session_horizon_quantile"] == 0.9
    assert described["session_horizon_max_s"] == 3600.0


# -- simulated: the committed Claude Code excerpt ---------------------------------------------


def test_learnt_retention_on_the_claude_code_excerpt() -> None:
    """10 Claude Code sessions on 4 replicas of 150,000 KV tokens (cache-bound: the pooled LRU
    of the fleet keeps 92.6% of the returning turns' tokens), replayed open loop (requests at
    their recorded times) and closed loop (each session's next turn its recorded gap after its
    previous answer). Both policies keep the returning turns above 0.95 of that bound either way.
    Learnt horizons are not better than the fixed ttl: within 0.1 point open loop, and 0.6 point
    below it closed loop (92.3% vs 91.7%). On the whole trace at 16 replicas, closed loop, the
    gap widens as the cache fills (BENCHMARKS.md, "Closed loop at 16 replicas"), which is why
    learnt retention stays off by default; this test pins that finding on the excerpt."""
    from kvroute.policies import build_policy
    from kvroute.simulator.engine.latency import latency_preset
    from kvroute.simulator.fleet import FleetConfig, engine_config, prepare, simulate
    from kvroute.simulator.fleet.returning import (
        pooled_bound_hits,
        returning_indices,
        returning_summary,
    )
    from kvroute.simulator.traces import load_trace

    from .helpers import CLAUDE_CODE

    units = prepare(load_trace(str(CLAUDE_CODE), None, seed=0))
    engine = engine_config(latency_preset("llama-3.1-8b-h100"), 150_000)
    returning = returning_indices(units)
    bound = pooled_bound_hits(units, engine.num_blocks * 4, engine.block_size)
    for closed in (False, True):
        config = FleetConfig(replicas=4, engine=engine, closed_loop=closed)
        rates = {}
        for name, params in (("fixed", {}), ("learnt", {"session_horizon_quantile": 0.9})):
            result = simulate(units, build_policy("kv_aware", {"seed": 0, **params}), config)
            summary = returning_summary(units, result, returning, bound)
            assert summary is not None and summary["requests"] > 1000  # some too large for one
            rates[name] = summary["hit_rate"]
            assert summary["vs_pooled_lru"] >= 0.95, (closed, name, summary)
        if closed:
            # Not better closed loop: if learnt ever beats the fixed ttl here, revisit the
            # default (session_horizon_quantile) with the 16-replica closed-loop runs.
            assert rates["fixed"] - 0.01 <= rates["learnt"] <= rates["fixed"], rates
        else:
            assert rates["learnt"] >= rates["fixed"] - 0.002, rates
