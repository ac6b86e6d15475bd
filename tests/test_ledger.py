"""The dispatch ledger (kvcore/ledger.py): the routing step every front end calls.

Decisions through the ledger are the policy's own on the index's matches (the code it
replaced in the router and the simulator computed the same request by hand); load and
predictions go up at dispatch and come back exactly at first token and finish.
"""

from __future__ import annotations

import random

import pytest

from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import POLICIES, FleetView, ReplicaState, RouteRequest, build_policy
from kvroute.policies.registry import policy_parameters

BS = 4
TTL = 5.0


def random_fleet(rng: random.Random, docs: list[list[int]]) -> tuple[FleetView, PrefixIndex]:
    n = rng.randint(1, 12)
    states = []
    for i in range(n):
        state = ReplicaState(f"r{i}", healthy=rng.random() > 0.1, ejected=rng.random() < 0.05)
        state.in_flight = rng.randint(0, 20)
        state.in_flight_tokens = state.in_flight * rng.randint(10, 400)
        state.prefilling = rng.randint(0, state.in_flight)
        state.prefill_tokens = state.prefilling * rng.randint(1, 300)
        state.reported_waiting = rng.choice([None, rng.randint(0, 10)])
        state.reported_kv_usage = rng.choice([None, rng.random()])
        states.append(state)
    index = PrefixIndex()
    for _ in range(rng.randint(0, 3 * n)):
        doc = rng.choice(docs)
        replica = rng.randrange(n)
        depth = rng.randint(1, len(doc) // BS)
        ehs = [hash((replica, tuple(doc[:BS]), b)) & 0xFFFFFFF for b in range(depth)]
        index.apply_stored(f"r{replica}", ehs, None, doc[: depth * BS], BS)
    return FleetView(states, membership_version=1), index


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_decisions_are_the_policys_on_the_index_matches(name: str) -> None:
    """3,000 random fleets: the ledger's ranking and reason equal the policy called directly
    with ``prefix_tokens`` computed by hand, as the router and the simulator used to."""
    rng = random.Random(7)
    docs = [[d * 100 + i for i in range(8 * BS)] for d in range(6)]
    for trial in range(3000 // len(POLICIES) + 1):
        fleet, index = random_fleet(rng, docs)
        doc = rng.choice(docs)
        prompt = doc[: rng.randint(1, len(doc))]
        hashes = block_hashes(prompt, BS)
        request = RouteRequest(
            len(prompt), rng.randint(1, 64), None, rng.choice([None, "s1", "s2"]), hashes
        )
        seed = rng.randrange(1 << 30)
        params = {"seed": seed} if "seed" in policy_parameters(name) else {}
        ledger = DispatchLedger(build_policy(name, params), fleet, index, prediction_ttl_s=TTL)
        route = ledger.route(request, 1.0, BS)

        by_hand = {r: m.blocks * BS for r, m in index.match(hashes, 1.0).items()}
        direct = RouteRequest(
            request.prompt_tokens,
            request.max_tokens,
            None,
            request.routing_key,
            hashes,
            by_hand if hashes else None,
            BS,
        )
        decision = build_policy(name, params).decide(direct, fleet)
        assert (route.ranked, route.reason) == (decision.ranked, decision.reason), trial
        assert route.request.prefix_tokens == direct.prefix_tokens


def two_replicas() -> tuple[DispatchLedger, PrefixIndex, list[ReplicaState]]:
    states = [ReplicaState("a"), ReplicaState("b")]
    index = PrefixIndex()
    ledger = DispatchLedger(
        build_policy("kv_aware"), FleetView(states, 1), index, prediction_ttl_s=TTL
    )
    return ledger, index, states


def load(state: ReplicaState) -> tuple[int, int, int, int]:
    return (state.in_flight, state.in_flight_tokens, state.prefilling, state.prefill_tokens)


def test_dispatch_counts_load_and_predicts_until_first_token_and_finish() -> None:
    ledger, index, states = two_replicas()
    prompt = list(range(10 * BS))
    hashes = block_hashes(prompt, BS)
    index.apply_stored("a", [1, 2, 3, 4], None, prompt[: 4 * BS], BS)  # 16 tokens cached on a
    route = ledger.route(RouteRequest(len(prompt), 8, None, None, hashes), 0.0, BS)
    d = ledger.dispatch(route, "b", 0.0)  # sent elsewhere than the cache (e.g. a retry)
    assert (d.replica, d.cached_tokens, d.cost, d.prefill) == ("b", 0, 48, 40)
    assert load(states[1]) == (1, 48, 1, 40)
    assert index.match(hashes, 0.1)["b"].blocks == 10  # predicted there
    # The first token came after more than half the TTL: the prediction is renewed from it.
    assert ledger.first_token(d, 3.0) is True
    assert ledger.first_token(d, 3.0) is False  # counted once
    assert load(states[1]) == (1, 48, 0, 0)
    assert index.match(hashes, 7.9)["b"].blocks == 10  # renewed at the first token
    ledger.finish(d, 4.0)
    ledger.finish(d, 4.0)  # idempotent
    assert load(states[1]) == (0, 0, 0, 0)
    assert load(states[0]) == (0, 0, 0, 0)

    d = ledger.dispatch(route, "a", 4.0)
    assert (d.cached_tokens, d.prefill) == (16, 24)


def test_a_quick_first_token_leaves_the_fresh_prediction_as_it_is() -> None:
    """Renewing a long prompt's prediction costs a pass over its blocks: within half the TTL
    of the dispatch that predicted it, the first token does not renew it again."""
    ledger, index, _ = two_replicas()
    hashes = block_hashes(list(range(6 * BS)), BS)
    route = ledger.route(RouteRequest(6 * BS, 8, None, None, hashes), 0.0, BS)
    d = ledger.dispatch(route, "b", 0.0)
    ledger.first_token(d, 1.0)
    ledger.finish(d, 1.5)
    assert index.match(hashes, TTL - 0.01)["b"].blocks == 6  # from the dispatch at 0
    assert "b" not in index.match(hashes, TTL + 0.01)


@pytest.mark.parametrize("how", ["refused", "failed before answering"])
def test_a_replica_that_did_not_take_the_prompt_loses_its_prediction(how: str) -> None:
    ledger, index, states = two_replicas()
    hashes = block_hashes(list(range(4 * BS)), BS)
    route = ledger.route(RouteRequest(4 * BS, 8, None, None, hashes), 0.0, BS)
    d = ledger.dispatch(route, route.ranked[0], 0.0)
    assert d.replica in index.match(hashes, 0.0)
    if how == "refused":
        ledger.first_token(d, 0.5, ok=False)  # e.g. a 400 from the replica
    ledger.finish(d, 1.0)
    assert index.match(hashes, 1.0) == {}
    assert all(load(s) == (0, 0, 0, 0) for s in states)


def test_shared_load_sees_every_change_and_is_read_before_each_decision() -> None:
    calls: list[tuple[int, int, int, int, int]] = []
    reads: list[int] = []

    class Board:
        def add(self, replica: int, r: int, t: int, p: int, pt: int) -> None:
            calls.append((replica, r, t, p, pt))

        def totals_into(self, states: object) -> None:
            reads.append(1)

    states = [ReplicaState("a"), ReplicaState("b")]
    ledger = DispatchLedger(
        build_policy("round_robin"),
        FleetView(states, 1),
        PrefixIndex(),
        prediction_ttl_s=TTL,
        shared=Board(),
    )
    route = ledger.route(RouteRequest(10, 5), 0.0, BS)
    d = ledger.dispatch(route, "b", 0.0)
    ledger.finish(d, 1.0)
    assert reads == [1]
    assert calls == [(1, 1, 15, 1, 10), (1, 0, 0, -1, -10), (1, -1, -15, 0, 0)]


def test_requests_for_an_adapter_are_counted_in_flight_per_adapter_until_they_finish() -> None:
    """The LoRA planner reads ``lora_in_flight``: the router's own requests per adapter."""
    state = ReplicaState("a", lora_adapters=frozenset({"sql"}))
    ledger = DispatchLedger(
        build_policy("round_robin"), FleetView([state], 1), PrefixIndex(), prediction_ttl_s=TTL
    )
    first = ledger.dispatch(ledger.route(RouteRequest(10, 5, model="sql"), 0.0, BS), "a", 0.0)
    second = ledger.dispatch(ledger.route(RouteRequest(10, 5, model="sql"), 0.0, BS), "a", 0.0)
    base = ledger.dispatch(ledger.route(RouteRequest(10, 5, model="base"), 0.0, BS), "a", 0.0)
    assert state.lora_in_flight == {"sql": 2}
    ledger.finish(first, 1.0)
    ledger.finish(first, 1.0)  # idempotent
    assert state.lora_in_flight == {"sql": 1}
    ledger.finish(second, 2.0)
    ledger.finish(base, 2.0)
    assert state.lora_in_flight == {}
