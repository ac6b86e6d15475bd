"""``kvroute bench bus-cost``: what replaying another router's dispatches costs a router.

In one process, no NATS: a sender's ledger routes conversations whose earlier turns the replicas
hold by KV events (both routers follow the same events), and a receiver decodes and replays each
request's dispatch, first token and finish (router/ledger_bus.py). Timed on the receiver:
decode plus replay (``LedgerBus.receive``), per request, for the dispatch sent with every block
hash (as the wire format before version 2 sent it) and with only the blocks past those the
replica held (version 2's). NATS's own cost per message (a few microseconds in a tight loop, more
with an idle event loop woken for each) comes on top, the same for both.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

import msgspec

from kvroute.kvcore.block_hashing import chain_hashes, root_seed
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import FleetView, ReplicaState, RouteRequest, build_policy
from kvroute.router.ledger_bus import LedgerBatch, LedgerBus, encode_batch

BLOCK = 16
NAMES = ("r0", "r1", "r2", "r3")


class _Router:
    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.fleet = FleetView([ReplicaState(n) for n in NAMES])
        policy = build_policy("kv_aware")
        self.ledger = DispatchLedger(policy, self.fleet, self.index, prediction_ttl_s=5.0)
        self.bus = LedgerBus("nats://unused:4222", "kvroute.bench", self.ledger)
        self.bus._client = object()  # type: ignore[assignment]  # queue events; send none

    def stored(self, replica: str, tokens: list[int], blocks: int) -> None:
        engine = [hash((replica, b)) & 0xFFFFFFFF for b in range(blocks)]
        self.index.apply_stored(replica, engine, None, tokens[: blocks * BLOCK], BLOCK)

    def sent(self) -> bytes:
        events, self.bus._outbox = self.bus._outbox, []
        return encode_batch(self.bus.origin, events)


@dataclass
class Cost:
    wire: str
    requests: int
    us_per_request: float
    bytes_per_request: float


def _every_hash(data: bytes, hashes: list[int]) -> bytes:
    """The same message with the dispatch's every block hash (the wire before version 2)."""
    batch = msgspec.msgpack.decode(data, type=LedgerBatch)
    for event in batch.events:
        event.hashes, event.skipped = hashes, 0
    return encode_batch(batch.origin, batch.events)


def measure(
    wire: str, sessions: int = 16, turns: int = 16, blocks_per_turn: int = 16, seed: int = 0
) -> Cost:
    """``wire``: "tail" (version 2's) or "every" (every hash)."""
    rng = random.Random(seed)
    contexts = [
        [rng.randrange(1 << 31) for _ in range(turns * blocks_per_turn * BLOCK)]
        for _ in range(sessions)
    ]
    sender, receiver = _Router(), _Router()
    now = cpu = 0.0
    sent_bytes = requests = 0
    for turn in range(1, turns + 1):
        for s, tokens in enumerate(contexts):
            blocks = turn * blocks_per_turn
            prompt = tokens[: blocks * BLOCK]
            hashes = chain_hashes(prompt, BLOCK, root_seed(None))
            replica = NAMES[s % len(NAMES)]
            for router in (sender, receiver):  # the earlier turns, held by events
                router.stored(replica, prompt, blocks - blocks_per_turn)
            now += 0.002
            request = RouteRequest(len(prompt), 16, routing_key=f"s{s}", block_hashes=hashes)
            d = sender.ledger.dispatch(sender.ledger.route(request, now, BLOCK), replica, now)
            sender.bus.dispatched(d)
            messages = [sender.sent()]
            if wire == "every":
                messages[0] = _every_hash(messages[0], hashes)
            sender.ledger.first_token(d, now, True)
            sender.bus.first_token(d, True)
            messages.append(sender.sent())
            sender.ledger.finish(d, now)
            sender.bus.finished(d)
            messages.append(sender.sent())
            for data in messages:
                sent_bytes += len(data)
                started = time.process_time()
                receiver.bus.receive(data, now)
                cpu += time.process_time() - started
            requests += 1
    return Cost(wire, requests, cpu / requests * 1e6, sent_bytes / requests)


def add_bus_cost_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bus-cost",
        help="A router's CPU to decode and replay another's dispatches (the dispatch bus), "
        "with every block hash sent and with only those past the replica's held blocks.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sessions", type=int, default=16, help="Conversations, routed in turn (default 16)."
    )
    p.add_argument(
        "--turns",
        type=int,
        default=16,
        help="Turns per conversation, each 16 blocks (256 tokens) longer (default 16).",
    )
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if args.sessions < 1 or args.turns < 1:
        print("kvroute bench bus-cost: --sessions and --turns must be at least 1", file=sys.stderr)
        return 2
    costs = [measure(w, args.sessions, args.turns) for w in ("every", "tail")]
    print("| dispatch carries | requests | receiver decode + replay us/request | bytes/request |")
    print("|---|--:|--:|--:|")
    for c in costs:
        what = "every block hash" if c.wire == "every" else "the hashes past the held blocks"
        print(f"| {what} | {c.requests} | {c.us_per_request:.0f} | {c.bytes_per_request:.0f} |")
    return 0
