"""Several pickers, one view of the load: every dispatch shared over NATS (optional).

The gateway spreads requests over several endpoint pickers. Each follows every pod's KV
events, so their prefix indexes agree; what each lacks is the others' in-flight requests and
their predictions (a prompt just sent to a pod, not yet confirmed by its events). With a bus,
each picker publishes its dispatches, first tokens and finishes, and replays the others' on
its own dispatch ledger (``remote`` dispatches: the same load counted, the same prediction
made), so every picker decides as one router would. Simulated first (``kvroute replay
--routers N --share bus``, BENCHMARKS.md), where a 1 ms bus matched one router.

A picker that stops publishing (crashed, partitioned) has its dispatches closed on the others
after ``silence_s``: its requests no longer count, instead of counting forever. NATS core
pub/sub, at most once: a lost message costs a little accuracy, never correctness.

What it costs a receiving picker (measured, BENCHMARKS.md "Several routers ... bus cost"): replaying
a dispatch's prediction was most of it (a Python pass over every block of the prompt), the NATS
message a few microseconds. So a dispatch carries only the blocks past those the replica held by
KV events when it was routed (``skipped``): every picker follows the same events, so the receiver
holds those already and would have skipped them in its prediction anyway. (A receiver whose
events lag the sender's lacks those blocks until its own events bring them: the sender had them,
so they are on their way.) And each send cycle's events go in one message (a ``LedgerBatch``),
the wire format versioned (``WIRE_VERSION``).

A dispatch also carries its session key and cache hint, so the receiver's policy records the
session's claim as if it had routed that turn itself (``Policy.observe_remote``), and its LoRA
adapter, so the receiver counts the adapter's slot there as in use (kv_aware's residency, the
LoRA planner's ``lora_in_flight``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import TYPE_CHECKING

import msgspec

from kvroute.kvcore.ledger import REMOTE, Dispatch, DispatchLedger, Route
from kvroute.policies import RouteRequest

from .nats_link import NatsLink

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

log = logging.getLogger(__name__)

DISPATCH, FIRST_TOKEN, REFUSED, FINISH, HEARTBEAT = range(5)
# The wire format: a LedgerBatch (version 2). Version 1 (before 2026-12-07) sent one bare
# LedgerEvent per message, with the origin and every block hash in it; it is refused (logged once
# per sender), not replayed: mixed versions on one subject share nothing until all are upgraded.
WIRE_MAGIC = "kvroute-ledger"
WIRE_VERSION = 2


class LedgerEvent(msgspec.Struct, array_like=True):
    kind: int
    id: int = 0
    replica: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    cached: int = 0
    # The prompt's block hashes past its first ``skipped``, which the replica held by KV events
    # when the sender routed it (so the receiver, following the same events, holds them too).
    hashes: list[int] = msgspec.field(default_factory=list)
    skipped: int = 0
    session: str | None = None  # RouteRequest.routing_key: the turn's session, for its claim
    cache_ttl_s: float | None = None  # RouteRequest.cache_ttl_s: the client's cache hint
    adapter: str | None = None  # the LoRA adapter it runs with there: its slot is in use


class LedgerBatch(msgspec.Struct, array_like=True):
    """One message: the events of one send cycle, in order, from one picker."""

    magic: str
    version: int
    origin: str
    events: list[LedgerEvent]


class _V1Event(msgspec.Struct, array_like=True):
    """Version 1's message, recognised only to say so (see WIRE_VERSION)."""

    kind: int
    origin: str


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LedgerBatch)
_v1_decoder = msgspec.msgpack.Decoder(_V1Event)


def encode_batch(origin: str, events: list[LedgerEvent]) -> bytes:
    return _encoder.encode(LedgerBatch(WIRE_MAGIC, WIRE_VERSION, origin, events))


def decode_batch(data: bytes) -> LedgerBatch | str:
    """The batch in ``data``, or why it is refused (a line for the log)."""
    try:
        batch = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        try:
            old = _v1_decoder.decode(data)
        except msgspec.DecodeError:
            return f"undecodable message ({exc})"
        return (
            f"a version 1 message from {old.origin} (a router of an earlier kvroute): ignored; "
            f"run the same version everywhere on this subject"
        )
    if batch.magic != WIRE_MAGIC or batch.version != WIRE_VERSION:
        return (
            f"a message of wire format {batch.magic!r} version {batch.version} from "
            f"{batch.origin} (this router speaks {WIRE_VERSION}): ignored"
        )
    return batch


class LedgerBus:
    def __init__(
        self,
        url: str,
        subject: str,
        ledger: DispatchLedger,
        *,
        heartbeat_s: float = 1.0,
        silence_s: float = 5.0,
    ) -> None:
        self.url = url
        self.subject = subject
        self.ledger = ledger
        self.origin = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
        self.heartbeat_s = heartbeat_s
        self.silence_s = silence_s
        self._link: NatsLink | None = None
        self._client: Client | None = None
        self._ids: dict[int, int] = {}  # id(local Dispatch) -> its bus id
        self._next_id = 0
        self._remote: dict[tuple[str, int], Dispatch] = {}
        self._heard: dict[str, float] = {}  # origin -> monotonic time last heard
        self._tasks: list[asyncio.Task[None]] = []
        # Events waiting for the one sender task, which sends each cycle's in one message.
        self._outbox: list[LedgerEvent] = []
        self._wake = asyncio.Event()
        self._refused: set[str] = set()  # log lines said once (a sender of another version)
        self._sent_at = -math.inf  # monotonic time of the last message sent
        self.published = 0  # events
        self.messages = 0  # NATS messages they went in
        self.applied = 0

    async def start(self) -> None:
        self._link = NatsLink(
            self.url, f"kvroute-ledger {self.origin}", "dispatch bus", self._connected
        )
        await self._link.start()

    @property
    def connected(self) -> bool:
        """Whether NATS has answered (the bus starts alone when it does not, and joins later)."""
        return self._client is not None

    async def _connected(self, client: Client) -> None:
        self._client = client
        await client.subscribe(self.subject, cb=self._on_message)
        self._tasks = [
            asyncio.create_task(self._send(client), name="kvroute-ledger-bus-send"),
            asyncio.create_task(self._beat(), name="kvroute-ledger-bus-beat"),
        ]
        log.info("sharing dispatches on %s %s as %s", self.url, self.subject, self.origin)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._link is not None:
            await self._link.close()

    # -- what this picker did -----------------------------------------------------------

    def dispatched(self, d: Dispatch) -> None:
        self._next_id += 1
        self._ids[id(d)] = self._next_id
        r = d.request
        hashes = r.block_hashes
        # The leading blocks the replica held by events at routing time: the others follow the
        # same events, so they hold them too (and their prediction would skip them).
        skipped = min(d.held, len(hashes))
        self._publish(
            LedgerEvent(
                DISPATCH,
                self._next_id,
                d.replica,
                r.prompt_tokens,
                r.max_tokens,
                d.cached_tokens,
                list(hashes[skipped:]) if skipped else list(hashes),
                skipped,
                r.routing_key,
                r.cache_ttl_s,
                d.adapter,
            )
        )

    def first_token(self, d: Dispatch, ok: bool) -> None:
        bus_id = self._ids.get(id(d))
        if bus_id is not None:
            self._publish(LedgerEvent(FIRST_TOKEN if ok else REFUSED, bus_id))

    def finished(self, d: Dispatch) -> None:
        bus_id = self._ids.pop(id(d), None)
        if bus_id is not None:
            self._publish(LedgerEvent(FINISH, bus_id))

    def _publish(self, event: LedgerEvent) -> None:
        if self._client is None:
            return
        self.published += 1
        self._outbox.append(event)
        self._wake.set()

    async def _send(self, client: Client) -> None:
        """One message per cycle: what the loop queued since the last (nats-py's publish only
        buffers it; its own task flushes)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            outbox, self._outbox = self._outbox, []
            if not outbox:
                continue
            try:
                await client.publish(self.subject, encode_batch(self.origin, outbox))
                self.messages += 1
                self._sent_at = time.monotonic()
            except Exception as exc:  # at most once: a lost event costs accuracy only
                log.debug("ledger bus publish failed: %s", exc)

    # -- what the others did ------------------------------------------------------------

    async def _on_message(self, message: Msg) -> None:
        self.receive(message.data, time.monotonic())

    def receive(self, data: bytes, now: float) -> int:
        """Replay one message's events (none of this picker's own); returns how many."""
        batch = decode_batch(data)
        if isinstance(batch, str):
            # Once per kind of refusal and sender (the reason before its parenthesis), so a
            # sender of another version or of garbage costs a line, not a line a message.
            key = batch.partition(" (")[0]
            if key not in self._refused and len(self._refused) < 64:
                self._refused.add(key)
                log.warning("ledger bus on %s: %s", self.subject, batch)
            else:
                log.debug("ledger bus on %s: %s", self.subject, batch)
            return 0
        origin = batch.origin
        if origin == self.origin:
            return 0
        self._heard[origin] = now
        for event in batch.events:
            self.apply(origin, event, now)
        return len(batch.events)

    def apply(self, origin: str, event: LedgerEvent, now: float) -> None:
        """Replay another picker's step on this picker's ledger."""
        key = (origin, event.id)
        if event.kind == DISPATCH:
            if event.replica not in self.ledger.members:
                return  # a pod this picker has not discovered (yet)
            request = RouteRequest(
                event.prompt_tokens,
                event.max_tokens,
                routing_key=event.session,
                block_hashes=event.hashes,
                prefix_tokens={event.replica: event.cached},
                model=event.adapter,
                cache_ttl_s=event.cache_ttl_s,
            )
            route = Route(request, (event.replica,), REMOTE)
            self._remote[key] = self.ledger.dispatch(route, event.replica, now, REMOTE)
            self.applied += 1
        elif event.kind in (FIRST_TOKEN, REFUSED):
            d = self._remote.get(key)
            if d is not None:
                self.ledger.first_token(d, now, ok=event.kind == FIRST_TOKEN)
        elif event.kind == FINISH:
            d = self._remote.pop(key, None)
            if d is not None:
                self.ledger.finish(d, now)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            if self.beat_due(now):
                self._publish(LedgerEvent(HEARTBEAT))
            self.forget_silent(now)

    def beat_due(self, now: float) -> bool:
        """Whether to send a heartbeat: only after a quiet ``heartbeat_s`` (any message tells
        the others this picker is alive, so a busy one sends none: a message fewer a second
        for each, received by every other)."""
        return now - self._sent_at >= self.heartbeat_s

    def forget_silent(self, now: float) -> int:
        """Close the dispatches of pickers not heard from for ``silence_s``."""
        closed = 0
        for origin in [o for o, at in self._heard.items() if now - at > self.silence_s]:
            del self._heard[origin]
            keys = [k for k in self._remote if k[0] == origin]
            for key in keys:
                self.ledger.finish(self._remote.pop(key), now)
            closed += len(keys)
            log.warning("ledger bus: %s fell silent; closed its %d dispatches", origin, len(keys))
        return closed

    @property
    def remote_open(self) -> int:
        return len(self._remote)
