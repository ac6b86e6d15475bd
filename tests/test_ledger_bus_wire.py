"""The dispatch bus's wire and replay (router/ledger_bus.py), without NATS.

A sender's events are encoded as it sends them and handed to a receiver's ``receive``: what the
receiver's ledger, index and policy end up with is what they would with every block hash sent,
and what they would had the receiver routed the turn itself.
"""

from __future__ import annotations

import logging
import random

import msgspec
import pytest

from kvroute.kvcore.block_hashing import chain_hashes, root_seed
from kvroute.kvcore.ledger import REMOTE, Dispatch, DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import FleetView, ReplicaState, RouteRequest, build_policy
from kvroute.policies.kv_aware import KvAware
from kvroute.router.ledger_bus import (
    DISPATCH,
    FINISH,
    FIRST_TOKEN,
    WIRE_VERSION,
    LedgerBatch,
    LedgerBus,
    LedgerEvent,
    decode_batch,
    encode_batch,
)

BS = 16
NAMES = ("r0", "r1", "r2", "r3")


class Router:
    """One router's ledger, index and bus (its sends kept, not published)."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.fleet = FleetView([ReplicaState(n) for n in NAMES])
        self.policy = build_policy("kv_aware")
        self.ledger = DispatchLedger(self.policy, self.fleet, self.index, prediction_ttl_s=5.0)
        self.bus = LedgerBus("nats://unused:4222", "kvroute.test", self.ledger)
        self.bus._client = object()  # type: ignore[assignment]  # _publish queues; nothing sends

    def sent(self) -> bytes:
        """This cycle's events, as the sender task would send them: one message."""
        events, self.bus._outbox = self.bus._outbox, []
        return encode_batch(self.bus.origin, events)

    def stored(self, replica: str, tokens: list[int], blocks: int) -> None:
        """The replica's KV events: it holds the prompt's first ``blocks`` blocks."""
        engine = [hash((replica, b)) & 0xFFFFFFFF for b in range(blocks)]
        self.index.apply_stored(replica, engine, None, tokens[: blocks * BS], BS)


def hashes_of(tokens: list[int]) -> list[int]:
    return chain_hashes(tokens, BS, root_seed(None))


def matches(router: Router, queries: list[list[int]], now: float) -> list[dict[str, tuple]]:
    return [
        {r: (m.blocks, m.confirmed) for r, m in router.index.match(q, now).items()} for q in queries
    ]


@pytest.mark.parametrize("outcome", ["answered", "refused"])
def test_a_dispatch_sent_without_the_held_blocks_leaves_the_same_index(outcome: str) -> None:
    """Conversations whose earlier turns the replicas hold by events: a receiver sent only the
    blocks past those (the default) ends up with the index, load and predictions of a receiver
    sent every hash, after the dispatch, its first token (or refusal) and its finish."""
    rng = random.Random(3)
    sender, tail, full = Router(), Router(), Router()
    sessions = [[rng.randrange(1 << 20) for _ in range(40 * BS)] for _ in range(6)]
    queries: list[list[int]] = []
    now = 0.0
    skipped_total = 0
    for turn in range(1, 5):
        for s, tokens in enumerate(sessions):
            blocks = 10 * turn
            prompt = tokens[: blocks * BS]
            hashes = hashes_of(prompt)
            queries += [hashes[:k] for k in (1, blocks // 2, blocks - 1, blocks)]
            replica = NAMES[s % len(NAMES)]
            for router in (sender, tail, full):  # every router follows the same events
                router.stored(replica, prompt, blocks - 10)
            now += 0.01
            route = sender.ledger.route(RouteRequest(len(prompt), 16, block_hashes=hashes), now, BS)
            d = sender.ledger.dispatch(route, replica, now)
            sender.bus.dispatched(d)
            data = sender.sent()
            (event,) = msgspec.msgpack.decode(data, type=LedgerBatch).events
            assert event.skipped == blocks - 10 and len(event.hashes) == 10
            skipped_total += event.skipped
            # The same message with every hash: what the receiver got before.
            every = LedgerEvent(**{**msgspec.structs.asdict(event), "hashes": hashes, "skipped": 0})
            tail.bus.receive(data, now)
            full.bus.receive(encode_batch(sender.bus.origin, [every]), now)
            assert matches(tail, queries, now) == matches(full, queries, now)
            now += 0.01
            ok = outcome == "answered"
            sender.ledger.first_token(d, now, ok)
            sender.bus.first_token(d, ok)
            sender.ledger.finish(d, now)
            sender.bus.finished(d)
            data = sender.sent()
            assert len(msgspec.msgpack.decode(data, type=LedgerBatch).events) == 2  # one message
            for router in (tail, full):
                assert router.bus.receive(data, now) == 2
            assert matches(tail, queries, now) == matches(full, queries, now)
            assert tail.index.predicted_entries == full.index.predicted_entries
    assert skipped_total > 0
    for router in (tail, full):
        assert router.bus.remote_open == 0
        assert [s.in_flight for s in router.fleet.replicas] == [0] * len(NAMES)
    # Later, as the predictions expire: still the same.
    for later in (now + 2.6, now + 5.1):
        assert matches(tail, queries, later) == matches(full, queries, later)


def test_a_session_routed_by_another_router_is_claimed_as_if_routed_here() -> None:
    """kv_aware's live sessions: the receiver's policy records the other router's turn (its
    home, its tokens) exactly as the sender's did, so its next turn goes home from either."""
    sender, receiver = Router(), Router()
    request = RouteRequest(4000, 16, routing_key="agent-7", cache_ttl_s=None)
    route = sender.ledger.route(request, 1.0, BS)
    d = sender.ledger.dispatch(route, route.ranked[0], 1.0)
    sender.bus.dispatched(d)
    receiver.bus.receive(sender.sent(), 1.0)
    assert isinstance(sender.policy, KvAware) and isinstance(receiver.policy, KvAware)
    home = sender.policy._sessions.home("agent-7", 1.5)  # type: ignore[union-attr]
    assert home == (d.replica, 4000.0)
    assert receiver.policy._sessions.home("agent-7", 1.5) == home  # type: ignore[union-attr]
    # The next turn, sent to the receiver, goes back to that replica for the session.
    receiver.fleet.replicas[NAMES.index(d.replica)].in_flight = 1  # busier than the others
    again = receiver.ledger.route(RouteRequest(4100, 16, routing_key="agent-7"), 2.0, BS)
    assert again.ranked[0] == d.replica and again.reason == "kv_session"


def test_a_lora_request_routed_elsewhere_holds_its_adapter_slot_here() -> None:
    """The dispatch names its adapter: the receiver counts it in flight there (the LoRA
    planner's ``lora_in_flight``) and kv_aware takes the adapter as resident there."""
    sender, receiver = Router(), Router()
    for router in (sender, receiver):
        for state in router.fleet.replicas:
            state.lora_adapters, state.max_loras = frozenset({"sql", "chat"}), 1
    route = sender.ledger.route(RouteRequest(100, 10, model="sql"), 1.0, BS)
    d = sender.ledger.dispatch(route, "r2", 1.0)
    sender.bus.dispatched(d)
    receiver.bus.receive(sender.sent(), 1.0)
    r2 = receiver.fleet.replicas[NAMES.index("r2")]
    assert r2.lora_in_flight == {"sql": 1}
    policy = receiver.policy
    assert isinstance(policy, KvAware)
    assert policy.adapter_cost(r2, "sql", 1.5) == 0  # resident: no load to pay
    assert policy.adapter_cost(r2, "chat", 1.5) > 0  # the one slot is sql's
    sender.ledger.finish(d, 2.0)
    sender.bus.finished(d)
    receiver.bus.receive(sender.sent(), 2.0)
    assert r2.lora_in_flight == {}
    # A base-model request names no adapter: nothing is marked.
    plain = sender.ledger.dispatch(sender.ledger.route(RouteRequest(100, 10), 3.0, BS), "r1", 3.0)
    sender.bus.dispatched(plain)
    receiver.bus.receive(sender.sent(), 3.0)
    assert receiver.fleet.replicas[NAMES.index("r1")].lora_in_flight == {}


def test_the_ledger_tells_the_policy_of_remote_dispatches_only() -> None:
    seen: list[tuple[str, float]] = []
    router = Router()

    def observe(request: RouteRequest, replica: ReplicaState, now: float) -> None:
        seen.append((replica.replica_id, now))

    router.policy.observe_remote = observe  # type: ignore[method-assign]
    route = router.ledger.route(RouteRequest(100, 10, routing_key="s"), 1.0, BS)
    router.ledger.dispatch(route, "r1", 1.0)
    assert seen == []
    router.ledger.dispatch(route, "r2", 2.0, REMOTE)
    assert seen == [("r2", 2.0)]


def test_old_and_malformed_messages_are_refused_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = Router()
    v1 = msgspec.msgpack.encode([DISPATCH, "old-router-1", 1, "r0", 100, 10, 0, [1, 2, 3]])
    other = msgspec.msgpack.encode(["kvroute-ledger", WIRE_VERSION + 1, "new-router", []])
    reason = decode_batch(v1)
    assert isinstance(reason, str) and "version 1" in reason and "old-router-1" in reason
    assert "version 3" in str(decode_batch(other))
    assert str(decode_batch(b"\xc1garbage")).startswith("undecodable message")
    with caplog.at_level(logging.WARNING, logger="kvroute.router.ledger_bus"):
        for k in range(3):
            for data in (v1, other, b"\xc1garbage", b"\x93\x01" + bytes([k])):
                assert router.bus.receive(data, 1.0) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # each reason once (garbage of any shape one), no traceback
    assert all(r.exc_info is None for r in caplog.records)
    assert all(s.in_flight == 0 for s in router.fleet.replicas)


def test_a_router_ignores_its_own_messages_and_events_of_unknown_dispatches() -> None:
    router = Router()
    own = encode_batch(router.bus.origin, [LedgerEvent(DISPATCH, 1, "r0", 100, 10)])
    assert router.bus.receive(own, 1.0) == 0
    stray = encode_batch("other", [LedgerEvent(FIRST_TOKEN, 9), LedgerEvent(FINISH, 9)])
    assert router.bus.receive(stray, 1.0) == 2
    assert all(s.in_flight == 0 for s in router.fleet.replicas)
    assert router.bus.remote_open == 0


def test_dispatch_events_keep_the_sender_s_prompt_and_cached_tokens() -> None:
    sender, receiver = Router(), Router()
    tokens = list(range(20 * BS))
    for router in (sender, receiver):
        router.stored("r3", tokens, 12)
    hashes = hashes_of(tokens)
    route = sender.ledger.route(RouteRequest(len(tokens), 16, block_hashes=hashes), 1.0, BS)
    d: Dispatch = sender.ledger.dispatch(route, "r3", 1.0)
    sender.bus.dispatched(d)
    receiver.bus.receive(sender.sent(), 1.0)
    (remote,) = receiver.bus._remote.values()
    assert (remote.cached_tokens, remote.prefill, remote.reason) == (
        d.cached_tokens,
        d.prefill,
        REMOTE,
    )
    state = receiver.fleet.replicas[3]
    assert (state.in_flight, state.prefill_tokens) == (1, d.prefill)


def test_bench_bus_cost_measures_both_wires(capsys: pytest.CaptureFixture[str]) -> None:
    from kvroute.bench.bus_cost import measure
    from kvroute.cli import main

    every, tail = measure("every", 4, 3), measure("tail", 4, 3)
    assert every.requests == tail.requests == 12
    assert tail.bytes_per_request < every.bytes_per_request
    assert main(["bench", "bus-cost", "--sessions", "2", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert "| every block hash | 4 |" in out and "| the hashes past the held blocks | 4 |" in out
    assert main(["bench", "bus-cost", "--turns", "0"]) == 2
