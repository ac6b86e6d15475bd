"""kv_aware's live sessions: an agent's next turn goes back to the replica that served its last
one, and a cold prompt does not evict live sessions' blocks when another replica has room."""

from __future__ import annotations

import random

from kvroute.policies import FleetView, ReplicaState, RouteRequest
from kvroute.policies.kv_aware import SESSION, KvAware
from kvroute.policies.sessions import LiveSessions

BLOCK = 16


def _request(seed: int, key: str | None, prefix: dict[str, int] | None = None) -> RouteRequest:
    rng = random.Random(seed)
    hashes = tuple(rng.getrandbits(64) for _ in range(64))
    return RouteRequest(len(hashes) * BLOCK, 64, "m", key, hashes, prefix)


def _fleet(n: int, now: float = 0.0) -> FleetView:
    return FleetView([ReplicaState(f"r{i}") for i in range(n)], membership_version=1, now=now)


def _other_than(view: FleetView, replica: str) -> str:
    return next(r.replica_id for r in view.replicas if r.replica_id != replica)


def test_a_live_sessions_next_turn_goes_back_to_its_replica_over_a_lighter_one() -> None:
    policy = KvAware()
    view = _fleet(4)
    home = policy.decide(_request(1, "agent-1"), view).chosen
    # The next turn is a new prompt as far as the index knows (its events have not arrived),
    # and the ring would put it elsewhere; its home is busier, within the session's bound.
    seed = next(
        s
        for s in range(2, 200)
        if KvAware(session_ttl_s=0).decide(_request(s, None), view).chosen != home
    )
    view.now = 5.0
    for r in view.replicas:
        r.in_flight = 2 if r.replica_id == home else 1
    decision = policy.decide(_request(seed, "agent-1"), view)
    assert (decision.chosen, decision.reason) == (home, SESSION)
    # Without a session key, the same prompt goes where the ring says.
    assert policy.decide(_request(seed, None), view).chosen != home


def test_a_session_past_its_ttl_is_routed_like_any_prompt() -> None:
    policy = KvAware(session_ttl_s=30.0)
    view = _fleet(4)
    home = policy.decide(_request(1, "agent-1"), view).chosen
    seed = next(
        s
        for s in range(2, 200)
        if KvAware(session_ttl_s=0).decide(_request(s, None), view).chosen != home
    )
    view.now = 31.0
    decision = policy.decide(_request(seed, "agent-1"), view)
    assert decision.chosen != home and decision.reason != SESSION


def test_a_session_home_far_above_the_fleets_load_is_left() -> None:
    policy = KvAware(session_eps=1.0)
    view = _fleet(4)
    home = policy.decide(_request(1, "agent-1"), view).chosen
    for r in view.replicas:
        r.in_flight = 8 if r.replica_id == home else 0  # bound: 2 x (8 + 1) / 4 = 5
    decision = policy.decide(_request(1, "agent-1"), view)
    assert decision.chosen != home


def test_the_index_knowing_another_replica_holds_more_beats_the_session() -> None:
    policy = KvAware()
    view = _fleet(4)
    home = policy.decide(_request(1, "agent-1"), view).chosen
    other = _other_than(view, home)
    decision = policy.decide(_request(1, "agent-1", {other: 40 * BLOCK}), view)
    assert decision.chosen == other


def test_a_cold_prompt_avoids_the_replica_whose_room_live_sessions_fill() -> None:
    policy = KvAware()
    view = _fleet(2)
    for r in view.replicas:
        r.kv_capacity_tokens = 2000
    full = view.replicas[0].replica_id
    # Ten live sessions, 180 tokens each, on r0: its 2,000 tokens are nearly all taken.
    for k in range(10):
        policy._sessions.touch(f"s{k}", full, 180, 0.0)  # type: ignore[union-attr]
    cold = _request(7, None)  # 1,024 tokens would evict them
    assert policy.cost(view.replicas[0], cold) > policy.cost(view.replicas[1], cold)
    assert policy.decide(cold, view).chosen == view.replicas[1].replica_id
    # With the term off, the two cost the same.
    plain = KvAware(session_evict_weight=0.0)
    assert plain.cost(view.replicas[0], cold) == plain.cost(view.replicas[1], cold)


def test_live_sessions_expire_in_order_and_count_their_tokens_per_replica() -> None:
    sessions = LiveSessions(ttl_s=10.0)
    sessions.touch("a", "r0", 100, 0.0)
    sessions.touch("b", "r0", 50, 4.0)
    sessions.touch("a", "r1", 120, 6.0)  # a moved: its tokens move with it
    assert (sessions.tokens_on("r0"), sessions.tokens_on("r1")) == (50, 120)
    assert sessions.home("a", 15.0) == ("r1", 120)
    assert sessions.home("b", 15.0) is None  # last seen at 4 s
    assert sessions.tokens_on("r0") == 0 and len(sessions) == 1
