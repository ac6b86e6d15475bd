"""Several routers, one token budget per tenant: charges shared over NATS (optional).

Behind a load balancer, each ``kvroute serve`` (and each of its workers) would otherwise
enforce the whole budget on its own, and a tenant spreading requests over N routers would get
N times it. With ``tenants.budget_bus``, each process publishes its net charges per tenant
(reservations, corrections to the replica's count, output, refunds) every ``interval_s`` with
its buckets' levels, and applies the others' to its own buckets (router/tenants.py), so every
bucket drains at the fleet's rate. What can overshoot is what the routers admit in one interval
before hearing of each other: BENCHMARKS.md measures it.

With ``fairness.share_bus`` too, the same messages carry what each process's fair queue
charged each tenant (weighted tokens, ``service``) and how far ahead that tenant's counter is
there (``lead``), and with ``fairness.by: program`` what each program received; each applies
the others' to its own fair queue (kvcore/fair_queue.py ``apply_remote``), so a tenant's share
(and a program's attained service) holds across routers, and a router that starts late takes
each tenant's lead from an older one, as it takes a budget's level. Routers without it ignore
the extra fields; routers with it read none from older ones.

With ``fairness.share_slots`` too, each message carries the sender's slot limit and each tenant's
demand there (requests in service + waiting), sent every interval even with nothing charged, and
each router admits each tenant up to its part of the fleet's slots (kvcore/fleet_slots.py,
router/admission.py ``refresh``). A message without them (a router without share_slots, or an
older kvroute) counts no slots: that router's tenants are not in the sum, and this one says so
once in its log. A peer silent for ``stale_intervals`` intervals drops out of the sum.

NATS core pub/sub, at most once: a lost message lets a tenant a little over its budget (or its
share) for a moment, never blocks it. Load and predictions are router/ledger_bus.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec

from kvroute.kvcore.budgets import ChargeLog
from kvroute.kvcore.fair_queue import FairQueue

from .nats_link import NatsLink
from .tenants import Tenants

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from .admission import Admission

log = logging.getLogger(__name__)

# Routers that started within this of each other share every charge from the start.
JOINED_LATE_S = 1.0
# fairness.share_slots: a peer not heard from for this many intervals (at least STALE_MIN_S: an
# event loop stalls a moment, and the fleet's slots must not flap) drops out of the sum.
STALE_INTERVALS = 10
STALE_MIN_S = 0.5


class TenantCharge(msgspec.Struct, array_like=True):
    tenant: str
    input_tokens: float
    output_tokens: float
    input_level: float | None
    output_level: float | None
    # fairness.share_bus: weighted tokens the sender's fair queue charged, and the tenant's lead
    # there (last, with defaults: routers of either version read each other's messages).
    service: float = 0.0
    lead: float | None = None


class ProgramCharge(msgspec.Struct, array_like=True):
    program: str
    service: float  # weighted tokens the sender's fair queue charged it (fairness.by: program)


class TenantDemand(msgspec.Struct, array_like=True):
    tenant: str
    demand: int  # its requests in service and waiting at the sender (fairness.share_slots)


class Charges(msgspec.Struct, array_like=True):
    origin: str
    started: float  # the sender's start, wall-clock seconds
    charges: list[TenantCharge]
    # fairness.share_bus with fairness.by: program (last, with a default, as TenantCharge's).
    programs: list[ProgramCharge] = msgspec.field(default_factory=list)
    # fairness.share_slots (last, with defaults: older routers ignore them, and a message
    # without them counts no slots): the sender's limits.max_concurrent_requests (0: it shares
    # none) and each tenant's demand there.
    slots: int = 0
    demands: list[TenantDemand] = msgspec.field(default_factory=list)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Charges)


class BudgetBus:
    def __init__(
        self,
        url: str,
        subject: str,
        tenants: Tenants,
        interval_s: float,
        fair: FairQueue | None = None,
    ) -> None:
        self.url = url
        self.subject = subject
        self.tenants = tenants
        # fairness.share_bus: the fair queue whose service is shared (None: budgets only).
        self.fair = fair
        self._adopted: set[str] = set()  # tenants whose lead was taken from an older router
        self.interval_s = interval_s
        self.origin = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
        self.started = time.time()
        self._link: NatsLink | None = None
        self._client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.applied = 0
        # fairness.share_slots: the admission whose slots are shared (None: not shared).
        self.admission: Admission | None = None
        self._slotless: set[str] = set()  # peers that share no slots, said once in the log

    def share_slots(self, admission: Admission, max_factor: float) -> None:
        """Share ``admission``'s slots with the other routers' (fairness.share_slots)."""
        self.admission = admission
        admission.share_slots(
            self.origin, max_factor, max(STALE_MIN_S, STALE_INTERVALS * self.interval_s)
        )

    async def start(self) -> None:
        if self.tenants.shared is None:
            self.tenants.shared = ChargeLog()
        if self.fair is not None and self.fair.served is None:
            self.fair.served = {}
        self._link = NatsLink(
            self.url, f"kvroute-budgets {self.origin}", "budget bus", self._connected
        )
        await self._link.start()

    @property
    def connected(self) -> bool:
        """Whether NATS has answered (the bus starts alone when it does not, and joins later)."""
        return self._client is not None

    async def _connected(self, client: Client) -> None:
        self._client = client
        await client.subscribe(self.subject, cb=self._on_message)
        self._task = asyncio.create_task(self._publish_loop(), name="kvroute-budget-bus")
        log.info("sharing tenants' budget charges on %s %s", self.url, self.subject)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            # What this router charged last is not lost to the others; with its slots shared,
            # it says it leaves (no slots): the others drop it from the fleet's at once.
            await self.flush(leaving=True)
        if self._link is not None:
            await self._link.close()

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self, leaving: bool = False) -> None:
        shared, fair = self.tenants.shared, self.fair
        if self._client is None or shared is None:
            return
        budgets = shared.drain() if len(shared) else {}
        served = fair.drain_served() if fair is not None else {}
        programs = fair.drain_programs() if fair is not None else {}
        admission, demand = self.admission, None
        if admission is not None:
            # This router's split uses what it tells the others (the peers' split does).
            demand = admission.fair.drain_demand()
            admission.refresh(time.monotonic(), demand)  # peers gone silent drop out here too
        elif not (budgets or served or programs):
            return
        now = time.monotonic()
        charges = []
        for tenant in budgets.keys() | served.keys():
            i, o = budgets.get(tenant, (0.0, 0.0))
            charge = TenantCharge(tenant, i, o, *self.tenants.levels(tenant, now))
            if fair is not None:
                charge.service, charge.lead = served.get(tenant, 0.0), fair.lead(tenant)
            charges.append(charge)
        message = Charges(
            self.origin,
            self.started,
            charges,
            [ProgramCharge(p, tokens) for p, tokens in programs.items()],
        )
        if admission is not None and demand is not None:
            message.slots = 0 if leaving else admission.limit
            message.demands = [TenantDemand(t, n) for t, n in demand.items()]
        try:
            await self._client.publish(self.subject, _encoder.encode(message))
            self.published += 1
        except Exception as exc:  # at most once: the others miss this interval's charges
            log.debug("budget bus publish failed: %s", exc)

    async def _on_message(self, message: Msg) -> None:
        try:
            batch = _decoder.decode(message.data)
        except msgspec.DecodeError:
            log.warning("budget bus: undecodable message on %s", self.subject)
            return
        if batch.origin == self.origin:
            return
        now = time.monotonic()
        # A router that started well before this one has been charging all along: this one's
        # buckets, full at its start, take that router's levels the first time they hear it.
        older = batch.started < self.started - JOINED_LATE_S
        for c in batch.charges:
            levels = (c.input_level, c.output_level)
            if c.input_tokens or c.output_tokens or levels != (None, None):
                self.tenants.apply_remote(
                    c.tenant, (c.input_tokens, c.output_tokens), levels if older else None, now
                )
            if self.fair is not None and (c.service or c.lead is not None):
                self._apply_service(c, older)
        if self.fair is not None:
            for program in batch.programs:
                self.fair.apply_remote_program(program.program, program.service)
        if self.admission is not None:
            self._apply_slots(batch, now)
        self.applied += 1

    def _apply_slots(self, batch: Charges, now: float) -> None:
        """A peer's slots and demand into the fleet's (fairness.share_slots). This router's
        parts are recomputed every interval (``flush``; a split costs ~0.2 ms, and each peer
        reports every interval), at once when a router joins or leaves."""
        admission = self.admission
        if admission is None or admission.fleet is None:
            return
        fleet = admission.fleet
        if (
            batch.slots <= 0
            and batch.origin not in fleet.peers
            and batch.origin not in self._slotless
        ):
            # (one that shared its slots and sends none now is leaving: it drops out, unsaid)
            self._slotless.add(batch.origin)
            log.warning(
                "budget bus: router %s shares no slots (fairness.share_slots off there, no "
                "limits.max_concurrent_requests, or an older kvroute): its tenants' requests "
                "are not in the fleet's slots this router shares",
                batch.origin,
            )
        tracks = self.tenants.tracks
        demand = {d.tenant: d.demand for d in batch.demands if tracks(d.tenant)}
        if fleet.heard(batch.origin, batch.slots, demand, now):
            admission.refresh(now)  # a router joined or left: at once; else on the next tick

    def _apply_service(self, c: TenantCharge, older: bool) -> None:
        """A peer's service to ``c.tenant`` into this fair queue; from a router that ran long
        before this one started, its lead the first time (that lead holds the service)."""
        fair = self.fair
        if fair is None or not self.tenants.tracks(c.tenant):
            return
        if older and c.lead is not None and c.tenant not in self._adopted:
            self._adopted.add(c.tenant)
            fair.adopt_lead(c.tenant, c.lead)
            return
        fair.apply_remote(c.tenant, c.service)
