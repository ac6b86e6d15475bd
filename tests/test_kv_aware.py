"""Properties of the kv_aware policy: affinity, load, spreading, second homes."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies import FleetView, ReplicaState, RouteRequest, build_policy
from kvroute.policies.hash_ring import load_bound
from kvroute.policies.kv_aware import (
    AFFINITY,
    HOME,
    LOAD_OVER_AFFINITY,
    SECOND_HOME,
    KvAware,
)

BLOCK = 16


def fleet(n: int, **load: int) -> FleetView:
    return FleetView([ReplicaState(f"r{i}", **load) for i in range(n)], membership_version=1)


def prompt(seed: int, blocks: int = 32) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.getrandbits(64) for _ in range(blocks))


def request(
    hashes: tuple[int, ...], prefix: dict[str, int] | None = None, max_tokens: int = 64
) -> RouteRequest:
    return RouteRequest(len(hashes) * BLOCK, max_tokens, "m", None, hashes, prefix)


def test_is_the_default_policy() -> None:
    from kvroute.policies import DEFAULT_POLICY

    assert DEFAULT_POLICY == "kv_aware"
    assert isinstance(build_policy(DEFAULT_POLICY), KvAware)


def test_affinity_wins_when_load_is_even() -> None:
    policy = KvAware(seed=1)
    view = fleet(4, in_flight=2, in_flight_tokens=2000)
    hashes = prompt(1)
    for holder in ("r0", "r1", "r2", "r3"):
        decision = policy.decide(request(hashes, {holder: 20 * BLOCK}), view)
        assert (decision.chosen, decision.reason) == (holder, AFFINITY)


def test_the_longest_prefix_wins_among_holders() -> None:
    decision = KvAware().decide(
        request(prompt(2), {"r0": 4 * BLOCK, "r1": 30 * BLOCK, "r2": 10 * BLOCK}), fleet(3)
    )
    assert decision.chosen == "r1"


def test_load_wins_when_the_affine_replica_is_saturated() -> None:
    view = fleet(3)
    busy = view.replicas[0]
    # r0 holds the prompt but has far more prefill queued than the prompt is long.
    busy.in_flight = busy.prefilling = 40
    busy.prefill_tokens = 40 * 2048
    decision = KvAware().decide(request(prompt(3), {"r0": 32 * BLOCK}), view)
    assert decision.chosen != "r0"
    assert decision.reason == LOAD_OVER_AFFINITY
    assert decision.ranked[-1] == "r0"


def test_a_nearly_full_kv_cache_counts_against_a_replica() -> None:
    view = fleet(2)
    view.replicas[0].reported_kv_usage = 0.99
    decision = KvAware().decide(request(prompt(4)), view)
    assert decision.chosen == "r1"


def test_requests_the_replica_reports_waiting_count_as_queued_work() -> None:
    view = fleet(2)
    view.replicas[1].reported_waiting = 20  # sent by another router
    for seed in range(20):
        assert KvAware().decide(request(prompt(seed)), view).chosen == "r0"


def test_cold_prefixes_spread_evenly_and_keep_their_home() -> None:
    policy = KvAware(seed=0)
    view = fleet(4)
    counts: Counter[str] = Counter()
    for seed in range(2000):
        hashes = prompt(seed, blocks=8)
        first = policy.decide(request(hashes), view)
        assert first.reason in (HOME, SECOND_HOME)
        again = policy.decide(request(hashes), view)
        assert again.chosen == first.chosen  # same cold prefix, same fleet: same home
        counts[first.chosen] += 1
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert max(counts.values()) / min(counts.values()) < 1.3, counts


def test_prompts_sharing_their_first_blocks_share_a_home() -> None:
    policy = KvAware(key_blocks=4)
    view = fleet(8)
    system = prompt(99, blocks=4)
    homes = {
        policy.decide(request(system + prompt(seed, blocks=6)), view).chosen for seed in range(50)
    }
    assert len(homes) == 1


def test_a_hot_prefix_grows_a_second_home_instead_of_piling_up() -> None:
    """Requests for one prefix arrive faster than they finish: the load must spread, but over
    as few replicas as the load needs (each new home costs a full prefill)."""
    policy = KvAware(seed=3)
    view = fleet(6)
    states = {r.replica_id: r for r in view.replicas}
    hashes = prompt(7, blocks=64)  # 1024 tokens
    holders: dict[str, int] = {}
    chosen: list[str] = []
    for _ in range(24):
        decision = policy.decide(request(hashes, dict(holders)), view)
        replica = states[decision.chosen]
        cached = holders.get(decision.chosen, 0)
        replica.in_flight += 1
        replica.prefilling += 1
        replica.prefill_tokens += max(1, 1024 - cached)
        replica.in_flight_tokens += 1024 + 64
        holders[decision.chosen] = 1024
        chosen.append(decision.chosen)
    counts = Counter(chosen)
    assert len(counts) >= 2, "one replica took every request of a hot prefix"
    assert len(counts) < 6, "a hot prefix was sprayed over the whole fleet"
    assert max(counts.values()) - min(counts.values()) <= 4, counts


def test_retries_are_ranked_by_cost() -> None:
    view = fleet(3)
    view.replicas[2].prefill_tokens = 10_000
    view.replicas[2].prefilling = 1
    view.replicas[2].in_flight = 1
    decision = KvAware().decide(request(prompt(5), {"r1": 32 * BLOCK}), view)
    assert decision.ranked == ("r1", "r0", "r2")


loads = st.fixed_dictionaries(
    {
        "in_flight": st.integers(0, 50),
        "prefill_tokens": st.integers(0, 100_000),
        "waiting": st.one_of(st.none(), st.integers(0, 50)),
        "kv": st.one_of(st.none(), st.floats(0, 1)),
        "healthy": st.booleans(),
        "prefix_blocks": st.integers(0, 40),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(loads, min_size=1, max_size=8), st.integers(1, 40), st.integers(0, 2**32))
def test_the_choice_is_within_the_margin_of_the_cheapest(
    replicas: list[dict[str, object]], blocks: int, seed: int
) -> None:
    states = []
    prefix = {}
    for i, spec in enumerate(replicas):
        in_flight = int(spec["in_flight"])  # type: ignore[call-overload]
        state = ReplicaState(
            f"r{i}",
            healthy=bool(spec["healthy"]),
            in_flight=in_flight,
            prefilling=in_flight // 2,
            prefill_tokens=int(spec["prefill_tokens"]) if in_flight else 0,  # type: ignore[call-overload]
            reported_waiting=spec["waiting"],  # type: ignore[arg-type]
            reported_kv_usage=spec["kv"],  # type: ignore[arg-type]
        )
        states.append(state)
        prefix[state.replica_id] = min(blocks, int(spec["prefix_blocks"])) * BLOCK  # type: ignore[call-overload]
    view = FleetView(states, membership_version=1)
    policy = KvAware(seed=seed)
    req = request(prompt(seed, blocks), prefix)
    decision = policy.decide(req, view)
    healthy = [s for s in states if s.healthy]
    if not healthy:
        assert decision.ranked == ()
        return
    assert sorted(decision.ranked) == sorted(s.replica_id for s in healthy)
    bound = load_bound(sum(s.in_flight for s in healthy), len(healthy), policy.eps)
    held = policy.held_with_room(req, healthy, bound)
    costs = {s.replica_id: policy.cost(s, req, held) for s in healthy}
    best = min(costs.values())
    margin = max(policy.margin_tokens, policy.margin_ratio * best)
    assert costs[decision.chosen] <= best + margin


def test_a_conversation_waits_for_its_cached_replica_rather_than_prefill_it_again() -> None:
    # r0 holds the whole prompt but has more prefill queued than the prompt is long: moving
    # would win this request a little time and cost the fleet a second copy of the prefix.
    view = fleet(3, in_flight=1, prefilling=1)
    view.replicas[0].prefill_tokens = 800
    decision = KvAware().decide(request(prompt(8), {"r0": 32 * BLOCK}), view)
    assert (decision.chosen, decision.reason) == ("r0", AFFINITY)
    # Without the fleet's cost of a copy, its own wait alone sends it elsewhere.
    alone = KvAware(refill_weight=0).decide(request(prompt(8), {"r0": 32 * BLOCK}), view)
    assert alone.reason == LOAD_OVER_AFFINITY


def test_a_holder_far_above_the_mean_load_loses_its_claim() -> None:
    view = fleet(3)
    busy = view.replicas[0]
    busy.in_flight = busy.prefilling = 6  # the others have nothing in flight
    busy.prefill_tokens = 800
    decision = KvAware().decide(request(prompt(9), {"r0": 32 * BLOCK}), view)
    assert decision.chosen != "r0"
    assert decision.reason == LOAD_OVER_AFFINITY


def test_a_near_tie_goes_to_the_replica_holding_part_of_the_prompt() -> None:
    hashes = prompt(10, blocks=100)
    view = fleet(4, in_flight=2, in_flight_tokens=2000)
    for holder in ("r0", "r1", "r2", "r3"):
        # Two cached blocks of a hundred: within the margin, so the ring would decide alone.
        decision = KvAware().decide(request(hashes, {holder: 2 * BLOCK}), view)
        assert decision.chosen == holder


def test_a_prefix_every_replica_holds_leaves_the_choice_to_the_ring() -> None:
    hashes = prompt(11, blocks=100)
    view = fleet(4)
    everyone = {f"r{i}": 2 * BLOCK for i in range(4)}
    shared = KvAware().decide(request(hashes, everyone), view)
    cold = KvAware().decide(request(hashes), view)
    assert shared.chosen == cold.chosen
    assert shared.reason in (HOME, SECOND_HOME)
