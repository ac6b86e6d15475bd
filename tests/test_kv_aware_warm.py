"""kv_aware's ``warm_holders``: a prefix that many replicas hold (a shared system prompt) does
not pull new prompts onto those replicas; what one replica holds beyond it still does."""

from __future__ import annotations

import random

import pytest

from kvroute.policies import FleetView, ReplicaState, RouteRequest, build_policy
from kvroute.policies.kv_aware import KvAware

BLOCK = 16


def fleet(n: int) -> FleetView:
    return FleetView([ReplicaState(f"r{i}") for i in range(n)], membership_version=1)


def request(seed: int, prefix: dict[str, int] | None = None) -> RouteRequest:
    rng = random.Random(seed)
    hashes = tuple(rng.getrandbits(64) for _ in range(40))
    return RouteRequest(len(hashes) * BLOCK, 64, "m", None, hashes, prefix)


def _shared_by_three_others(seed: int, view: FleetView) -> tuple[str, dict[str, int]]:
    """The ring's choice for a cold prompt, and one block of it held by three other replicas."""
    home = KvAware().decide(request(seed), view).chosen
    others = [r.replica_id for r in view.replicas if r.replica_id != home][:3]
    return home, {rid: BLOCK for rid in others}


@pytest.mark.parametrize("seed", range(5))
def test_a_prefix_held_by_more_than_warm_holders_replicas_leaves_the_choice_to_the_ring(
    seed: int,
) -> None:
    view = fleet(8)
    home, shared = _shared_by_three_others(seed, view)
    decision = KvAware().decide(request(seed, shared), view)
    assert decision.chosen == home  # the prompt's own home gets a copy of the shared block
    # Off (0), as before: every holder counts, so the prompt goes to one of the three.
    old = KvAware(warm_holders=0).decide(request(seed, shared), view)
    assert old.chosen in shared


@pytest.mark.parametrize("seed", range(5))
def test_what_one_replica_holds_beyond_a_shared_prefix_still_makes_it_the_home(
    seed: int,
) -> None:
    view = fleet(8)
    home, shared = _shared_by_three_others(seed, view)
    holder = next(r.replica_id for r in view.replicas if r.replica_id not in {home, *shared})
    prefix = {**shared, holder: 3 * BLOCK}  # within the margin of the others: a near tie
    assert KvAware().decide(request(seed, prefix), view).chosen == holder


def test_a_prefix_held_by_two_replicas_is_still_warm() -> None:
    view = fleet(8)
    home, shared = _shared_by_three_others(0, view)
    two = dict(list(shared.items())[:2])
    assert KvAware().decide(request(0, two), view).chosen in two
    assert KvAware(warm_holders=1).decide(request(0, two), view).chosen == home


def test_warm_holders_is_a_declared_parameter_checked_when_built() -> None:
    assert build_policy("kv_aware", {"warm_holders": 3}).describe()["warm_holders"] == 3
    with pytest.raises(ValueError, match="warm_holders"):
        build_policy("kv_aware", {"warm_holders": -1})


def test_a_holder_that_is_down_does_not_make_a_prefix_shared() -> None:
    """Three replicas hold the block but one of them is down: two eligible holders, so the
    prefix is still a warm home (as with two holders), not a shared one."""
    view = fleet(8)
    _, shared = _shared_by_three_others(0, view)
    down = next(iter(shared))
    next(r for r in view.replicas if r.replica_id == down).healthy = False
    decision = KvAware().decide(request(0, shared), view)
    assert decision.chosen in shared and decision.chosen != down


def test_a_prompt_every_replica_holds_goes_by_load_not_to_one_ring_home() -> None:
    """A working set that fits in every cache: no replica holds more, so load decides. Keyed by
    its first blocks, every such prompt would go to the same two homes (bench prefix's "fits"
    control lost to round robin that way)."""
    view = fleet(3)
    whole = request(0)
    everywhere = {r.replica_id: whole.prompt_tokens for r in view.replicas}
    policy = KvAware(seed=1)
    chosen = []
    for _ in range(30):
        r = request(0, everywhere)
        r = RouteRequest(r.prompt_tokens, 64, "m", None, r.block_hashes, everywhere, BLOCK)
        decision = policy.decide(r, view)
        assert decision.reason == "kv_no_prefix"
        replica = next(x for x in view.replicas if x.replica_id == decision.chosen)
        replica.in_flight += 1  # the load a real dispatch adds
        chosen.append(decision.chosen)
    counts = [chosen.count(r.replica_id) for r in view.replicas]
    assert max(counts) - min(counts) <= 2  # power of two choices on load: even, not exact


def test_conversations_behind_one_shared_system_prompt_get_homes_of_their_own() -> None:
    """The first 8 blocks (a system prompt) are held by four replicas: they are cheaper (they
    hold half the prompt), and among them each conversation's ring key starts past the shared
    blocks, so new conversations spread over all four instead of that prefix's two homes."""
    view = fleet(8)
    system = tuple(random.Random(99).getrandbits(64) for _ in range(8))
    holders = {r.replica_id: 8 * BLOCK for r in view.replicas[:4]}
    homes = set()
    for seed in range(40):
        own = tuple(random.Random(seed).getrandbits(64) for _ in range(8))
        hashes = system + own
        r = RouteRequest(len(hashes) * BLOCK, 64, "m", None, hashes, holders, BLOCK)
        homes.add(KvAware().decide(r, view).chosen)
    assert homes == set(holders)
