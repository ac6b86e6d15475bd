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
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec

from kvroute.kvcore.ledger import Dispatch, DispatchLedger, Route
from kvroute.policies import RouteRequest

from .nats_link import NatsLink

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

log = logging.getLogger(__name__)

DISPATCH, FIRST_TOKEN, REFUSED, FINISH, HEARTBEAT = range(5)


class LedgerEvent(msgspec.Struct, array_like=True):
    kind: int
    origin: str
    id: int = 0
    replica: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    cached: int = 0
    hashes: list[int] = msgspec.field(default_factory=list)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LedgerEvent)


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
        # Encoded events waiting for the one sender task (not a task per event).
        self._outbox: list[bytes] = []
        self._wake = asyncio.Event()
        self.published = 0
        self.applied = 0

    async def start(self) -> None:
        self._link = NatsLink(
            self.url, f"kvroute-ledger {self.origin}", "dispatch bus", self._connected
        )
        await self._link.start()

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
        self._publish(
            LedgerEvent(
                DISPATCH,
                self.origin,
                self._next_id,
                d.replica,
                r.prompt_tokens,
                r.max_tokens,
                d.cached_tokens,
                list(r.block_hashes),
            )
        )

    def first_token(self, d: Dispatch, ok: bool) -> None:
        bus_id = self._ids.get(id(d))
        if bus_id is not None:
            self._publish(LedgerEvent(FIRST_TOKEN if ok else REFUSED, self.origin, bus_id))

    def finished(self, d: Dispatch) -> None:
        bus_id = self._ids.pop(id(d), None)
        if bus_id is not None:
            self._publish(LedgerEvent(FINISH, self.origin, bus_id))

    def _publish(self, event: LedgerEvent) -> None:
        if self._client is None:
            return
        self.published += 1
        self._outbox.append(_encoder.encode(event))
        self._wake.set()

    async def _send(self, client: Client) -> None:
        """nats-py's publish only buffers the message (its own task flushes): one await each."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            outbox, self._outbox = self._outbox, []
            for payload in outbox:
                try:
                    await client.publish(self.subject, payload)
                except Exception as exc:  # at most once: a lost event costs accuracy only
                    log.debug("ledger bus publish failed: %s", exc)

    # -- what the others did ------------------------------------------------------------

    async def _on_message(self, message: Msg) -> None:
        try:
            event = _decoder.decode(message.data)
        except msgspec.DecodeError:
            log.warning("ledger bus: undecodable message on %s", self.subject)
            return
        if event.origin == self.origin:
            return
        now = time.monotonic()
        self._heard[event.origin] = now
        self.apply(event, now)

    def apply(self, event: LedgerEvent, now: float) -> None:
        """Replay another picker's step on this picker's ledger."""
        key = (event.origin, event.id)
        if event.kind == DISPATCH:
            if event.replica not in self.ledger.members:
                return  # a pod this picker has not discovered (yet)
            request = RouteRequest(
                event.prompt_tokens,
                event.max_tokens,
                block_hashes=event.hashes,
                prefix_tokens={event.replica: event.cached},
            )
            route = Route(request, (event.replica,), "remote")
            self._remote[key] = self.ledger.dispatch(route, event.replica, now, "remote")
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
            self._publish(LedgerEvent(HEARTBEAT, self.origin))
            self.forget_silent(time.monotonic())

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
