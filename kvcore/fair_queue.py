"""Who goes next when the fleet is saturated: priority classes, then token-weighted fairness
between tenants (a Virtual Token Counter), bent toward cache hits within a bound.

The rules, in the order they apply:

* **Priority classes** ``critical > standard > sheddable`` (the Gateway API Inference
  Extension's names): a queued request of a higher class is always admitted before any of a
  lower one.
* **Virtual Token Counter** (Sheng et al., "Fairness in Serving Large Language Models", OSDI
  '24): each tenant has a counter of the service it received, ``input tokens + output_weight x
  output tokens``, divided by its weight. Within a class the queued request of the tenant with
  the lowest counter goes first. A tenant that becomes backlogged is lifted to the lowest counter
  of the tenants already backlogged (or to the last admitted one's, when nobody waits), so time
  spent idle is not banked as credit to spend in a burst later. Ties (what the lift makes) go
  to the tenant with the lighter load, requests in service and waiting per weight: the sparse
  tenant before the flooding one (FQ-CoDel's new flows before old ones, RFC 8290).
* **Programs** (``by="program"``, least attained service): within a tenant and class, the
  queued request whose *program* (an agent session and its sub-agents, kvcore/agent_identity.py)
  will have received the least service once it is served goes first: ``program_attained_weight``
  x the weighted tokens the program received so far, plus what this request costs, the prompt
  tokens no replica holds (``cost``, from the prefix index; the whole prompt without one). A new
  program has received nothing, so short programs finish while long ones wait (Schrage's LAS;
  Autellix's program-level LAS, Luo et al. 2025; llm-d's program-aware fairness). The request's
  own cost keeps a running program's next turn, whose context is still cached (a few thousand
  new tokens), from waiting behind a cold prompt: the cache it would lose while waiting is
  what saturation cannot afford (measured: docs/agents.md, "Programs under saturation"). Ties go
  to the older request. A request that has waited ``program_max_wait_s`` goes first whatever
  its program, oldest first: a long program's wait is bounded. With ``program_wait_share`` > 0
  the order mixes that service with the wait instead, each normalised over the queue (llm-d's
  program-aware order: 0.2 of wait). What programs received is
  remembered for the ``max_programs`` programs served last (the least recently served
  forgotten: it starts over as new). ``by="tenant"`` (the default) keeps each tenant's
  requests in arrival order, bent by locality (below); by program the cost replaces it.
* **Locality** (in the spirit of DLPM, Cao et al. 2025): a slot frees on some replica; among the
  queued requests of tenants whose counter is within ``locality_bound_tokens`` of the lowest,
  the one whose prompt that replica holds most of goes first. No tenant falls more than the
  bound behind what strict VTC order would give it, and fairness does not throw cache hits away.
* **Reserved slots** (``reserved_slots``): slots cannot be preempted, so a request that is
  next in that order still waits for one to free, and under a flood of alike requests that
  finish together that is up to a whole request's time. So an arrival that finds every slot
  taken while other tenants' requests of its class wait, and that the queue would admit next
  (lifted and tie-broken as above: in practice a tenant below its share, with nothing
  waiting), starts at once above the limit on one of ``reserved_slots``. The next slots to
  free are not refilled until the count is back under the limit: the admission stays
  work-conserving, the order stays VTC's, at most ``limit + reserved_slots`` run at once.
  Fairness within a class only: never for sheddable work, nor past a tenant's own cap; a
  lone tenant has nobody waiting to go ahead of.
* **Shedding**: with the queue full, an arrival takes the place of a queued request of a lower
  class (sheddable first; from the tenant furthest ahead, its newest request), or is refused
  itself when nothing lower waits. Critical work is never shed while lower work is queued.
  Sheddable work waits at most ``sheddable_max_wait_s``.
* **Several routers** (``apply_remote``): with the routers sharing what they served
  (router/budget_bus.py, ``fairness.share_bus``), the service another router gave a tenant
  raises its counter here as this router's own does, so a tenant spreading its requests over N
  routers is not counted a Nth on each. It may put a tenant at most ``share_max_lead_tokens``
  ahead of the lowest of the others waiting here (of the last admitted, when none waits): that
  lead is the most a router that fell silent (or what this one never sees of a tenant's history)
  can cost the tenant here, and once the others have received that much more it is gone, as
  VTC's lift forgets idle time. A router that starts late takes each tenant's lead from a peer
  (``lead``, ``adopt_lead``) instead of starting everyone level. By program, what a program
  received elsewhere adds to what it received here (``apply_remote_program``). A tenant served
  elsewhere stays ahead here as long as it is, so its requests that land here would wait while
  the others' backlog lasts: ``max_wait_s`` (``fairness.share_max_wait_s`` with the shares on)
  admits a request that has waited that long first, the oldest first, whatever the counters.
* **The fleet's slots** (``allowed``, ``demand``): with ``fairness.share_slots`` each tenant
  may hold at most its part of the fleet's slots here (kvcore/fleet_slots.py computes it from
  every router's ``demand``: requests in service and waiting); a tenant at its part waits as at
  its own cap. A request past ``max_wait_s`` still gets one slot when its tenant holds none
  here (its part rounded to none must not starve it). None: no parts (one router alone).

Pure: no I/O, no asyncio, no clock. The front end (router/admission.py) owns the waiting and
counts the slots; it calls ``may_start``, ``sparse``, ``offer``, ``pick``, ``remove``,
``started`` and ``finished`` and passes ``now`` in.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum


class Priority(IntEnum):
    SHEDDABLE = 0
    STANDARD = 1
    CRITICAL = 2


PRIORITY_NAMES = {"critical": Priority.CRITICAL, "standard": Priority.STANDARD}
PRIORITY_NAMES["sheddable"] = Priority.SHEDDABLE


def priority_of(value: str) -> Priority | None:
    """A class from its name, or from an InferenceObjective-style integer priority (higher is
    more important, 0 the default: > 0 critical, 0 standard, < 0 sheddable); None if neither."""
    text = value.strip().lower()
    named = PRIORITY_NAMES.get(text)
    if named is not None:
        return named
    try:
        number = int(text)
    except ValueError:
        return None
    if number > 0:
        return Priority.CRITICAL
    return Priority.STANDARD if number == 0 else Priority.SHEDDABLE


@dataclass(frozen=True, slots=True)
class FairnessParams:
    output_weight: float = 2.0  # an output token costs this many input tokens of service
    locality_bound_tokens: float = 4096.0  # how far behind VTC order locality may bend it
    sheddable_max_wait_s: float = 5.0
    locality_scan: int = 32  # queued requests at most looked at for locality per pick
    reserved_slots: int = 3  # above the admission limit, for requests next in fair order only
    by: str = "tenant"  # "program": least attained service between programs within a tenant
    program_max_wait_s: float = 300.0  # a request waiting this long goes first (by="program")
    program_attained_weight: float = 0.05  # per token a program received, beside its cost
    max_programs: int = 65536  # programs whose attained service is remembered
    share_max_lead_tokens: float = 32768.0  # how far other routers' service may put a tenant ahead
    max_wait_s: float = 0.0  # a request waiting this long goes first, oldest first (0: never)
    # By program: the share of the queued requests' normalised wait in their order, beside their
    # normalised service (0: least service alone; llm-d's program-aware order is 0.2).
    program_wait_share: float = 0.0


BY = ("tenant", "program")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    weight: float = 1.0
    max_concurrent: int = 0  # 0: no cap of its own


@dataclass(eq=False, slots=True)
class Ticket:
    """One request asking to be admitted (compared by identity)."""

    tenant: str
    priority: Priority
    input_tokens: int  # the router's estimate until the replica's usage says
    arrived: float = 0.0
    block_hashes: Sequence[int] = ()  # filled while it waits, for locality (may stay empty)
    charged: float = 0.0  # weighted service charged to the tenant's counter so far
    program: str = ""  # its agent program ("" : none known; each such request on its own)
    seq: int = 0
    queued: bool = False
    running: bool = False


@dataclass(slots=True)
class _Tenant:
    limits: TenantLimits
    counter: float = 0.0  # weighted service received (tokens / weight)
    active: int = 0  # admitted and not finished
    waiting: list[deque[Ticket]] = field(default_factory=lambda: [deque(), deque(), deque()])
    name: str = ""

    @property
    def backlogged(self) -> bool:
        return any(self.waiting)

    @property
    def demand(self) -> int:
        """Requests in service and waiting."""
        return self.active + sum(map(len, self.waiting))


class QueueFull(Exception):
    """The queue is full and nothing of a lower class waits to make room."""


class FairQueue:
    def __init__(
        self,
        params: FairnessParams,
        limits: Callable[[str], TenantLimits],
        capacity: int,
    ) -> None:
        self.params = params
        self._limits = limits
        self.capacity = capacity  # queued requests at most
        self.tenants: dict[str, _Tenant] = {}
        self.queued = 0
        self._floor = 0.0  # the counter of the tenant admitted last
        self._seq = itertools.count()
        self.by_program = params.by == "program"
        # Weighted tokens each program received, least recently served first (by="program").
        self.programs: OrderedDict[str, float] = OrderedDict()
        # Weighted tokens charged here per tenant since the last ``drain_served``, for the other
        # routers (None: not shared; router/budget_bus.py sets it with fairness.share_bus).
        self.served: dict[str, float] | None = None
        # And per program (by="program", while ``served`` is set): what each program received here.
        self.served_programs: dict[str, float] = {}
        # Slots each tenant may hold here, its part of the fleet's (kvcore/fleet_slots.py,
        # fairness.share_slots); None: no such bound (one router alone, or the option off).
        self.allowed: dict[str, int] | None = None
        # The most requests in service and waiting each tenant had since ``drain_demand``.
        self._peak: dict[str, int] = {}

    def weight(self, name: str) -> float:
        """``name``'s weight (its settings; without making it a tenant here)."""
        t = self.tenants.get(name)
        return (t.limits if t is not None else self._limits(name)).weight

    def tenant(self, name: str) -> _Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = _Tenant(self._limits(name), name=name)
            t.counter = self._floor  # a newcomer starts level, not with a lifetime of credit
        return t

    # -- the fast path -------------------------------------------------------------------

    def may_start(self, ticket: Ticket) -> bool:
        """Nothing waits and the tenant is under its own cap: admit without queueing."""
        if self.queued:
            return False
        t = self.tenant(ticket.tenant)
        return _may_run(t) and self._within(t)

    def _within(self, t: _Tenant) -> bool:
        """Under its part of the fleet's slots here (``allowed``; a tenant the last share did
        not know yet, one slot until the next share counts its demand)."""
        allowed = self.allowed
        return allowed is None or t.active < allowed.get(t.name, 1)

    def demand(self) -> dict[str, int]:
        """Requests in service and waiting per tenant (those with any)."""
        out = {}
        for name, t in self.tenants.items():
            n = t.demand
            if n > 0:
                out[name] = n
        return out

    def drain_demand(self) -> dict[str, int]:
        """The most requests each tenant had in service and waiting at once since the last
        drain (or now, if more): what this router tells the others with fairness.share_slots,
        and splits the fleet's slots by. The peak, not a sample: a closed loop's demand dips
        by one between a request's end and the next one's arrival, and samples taken at
        different moments would have the routers split the slots differently, idling some."""
        out = self.demand()
        for name, n in self._peak.items():
            if n > out.get(name, 0) and name in self.tenants:
                out[name] = n
        self._peak = {}
        return out

    def _note_demand(self, name: str, t: _Tenant) -> None:
        n = t.demand
        if n > self._peak.get(name, 0):
            self._peak[name] = n

    def sparse(self, ticket: Ticket) -> bool:
        """Whether ``ticket``, arriving with every slot taken while other tenants' requests of
        its class wait, is the one the queue would admit next (its tenant lifted as ``offer``
        would lift it, ties to the lighter load as in ``pick``): then it may start at once on a
        reserved slot (the caller counts those) instead of waiting for one. Never for
        sheddable work or past the tenant's own cap; a tenant with requests waiting is never
        next with a new one."""
        priority = ticket.priority
        if priority == Priority.SHEDDABLE or self.params.reserved_slots <= 0:
            return False
        t = self.tenant(ticket.tenant)
        if t.backlogged or not _may_run(t) or not self._within(t):
            return False
        backlogged = [o for o in self.tenants.values() if o is not t and o.backlogged]
        rivals = [o for o in backlogged if o.waiting[priority]]
        if not rivals:
            return False  # none of its class waits: no flood to skip, nobody to go ahead of
        if any(o.waiting[p] for o in backlogged for p in Priority if p > priority):
            return False
        lifted = max(t.counter, min(o.counter for o in backlogged))
        mine = (lifted, (t.active + 1) / t.limits.weight)
        # A rival at least as low goes first (on a tie its request is the older one).
        return all((o.counter, _load(o)) > mine for o in rivals if _may_run(o) and self._within(o))

    def started(self, ticket: Ticket) -> None:
        """``ticket`` was admitted: it runs, and its input is charged now."""
        t = self.tenant(ticket.tenant)
        t.active += 1
        ticket.running = True
        if self.allowed is not None:
            self._note_demand(ticket.tenant, t)
        self._floor = max(self._floor, t.counter)
        self._charge(t, ticket, ticket.input_tokens)

    def finished(self, ticket: Ticket, input_tokens: int | None, output_tokens: int) -> None:
        """It left: charge its output, and correct its input to what the replica counted."""
        t = self.tenants.get(ticket.tenant)
        if t is None or not ticket.running:
            return
        ticket.running = False
        t.active -= 1
        extra = output_tokens * self.params.output_weight
        if input_tokens is not None:
            extra += input_tokens - ticket.input_tokens
        self._charge(t, ticket, extra)

    def _charge(self, t: _Tenant, ticket: Ticket, tokens: float) -> None:
        share = tokens / t.limits.weight
        t.counter += share
        ticket.charged += share
        if self.served is not None:
            self.served[ticket.tenant] = self.served.get(ticket.tenant, 0.0) + tokens
            if self.by_program and ticket.program:
                held = self.served_programs
                held[ticket.program] = held.get(ticket.program, 0.0) + tokens
        if self.by_program and ticket.program:
            programs = self.programs
            programs[ticket.program] = programs.pop(ticket.program, 0.0) + tokens
            if len(programs) > self.params.max_programs:
                programs.popitem(last=False)

    # -- several routers -------------------------------------------------------------------

    def drain_served(self) -> dict[str, float]:
        """Weighted tokens (not yet over the weight) charged here per tenant since the last
        drain, net zero ones left out: what this router tells the others."""
        served = self.served
        if not served:
            return {}
        self.served = {}
        return {tenant: tokens for tenant, tokens in served.items() if tokens}

    def apply_remote(self, tenant: str, tokens: float) -> None:
        """Another router served ``tenant`` ``tokens`` weighted tokens: its counter rises by
        them over its weight, to at most ``share_max_lead_tokens`` ahead of the reference (the
        lowest of the other tenants waiting here, else the last admitted). Never lowers it: a
        net negative (a correction of an estimate) is dropped, at most a request's error."""
        if tokens <= 0:
            return
        t = self.tenant(tenant)
        cap = self._reference(t) + self.params.share_max_lead_tokens
        t.counter = max(t.counter, min(t.counter + tokens / t.limits.weight, cap))

    def drain_programs(self) -> dict[str, float]:
        """As ``drain_served``, per program (by="program")."""
        served, self.served_programs = self.served_programs, {}
        return {program: tokens for program, tokens in served.items() if tokens}

    def apply_remote_program(self, program: str, tokens: float) -> None:
        """Another router served ``program`` ``tokens`` weighted tokens (by="program"): it has
        received them, whichever router its turns reached. Absolute, not relative, so not
        bounded; forgotten as the programs served here are (the least recently served first)."""
        if not (self.by_program and program) or tokens <= 0:
            return
        programs = self.programs
        programs[program] = programs.pop(program, 0.0) + tokens
        if len(programs) > self.params.max_programs:
            programs.popitem(last=False)

    def lead(self, tenant: str) -> float:
        """How far ``tenant``'s counter is ahead of the last admitted (0 when behind): what a
        router that starts late takes from this one (``adopt_lead``)."""
        t = self.tenants.get(tenant)
        return max(0.0, t.counter - self._floor) if t is not None else 0.0

    def adopt_lead(self, tenant: str, lead: float) -> None:
        """A peer that has been serving for a while has ``tenant`` ``lead`` ahead: start it
        that far ahead of this router's last admitted (bounded as ``apply_remote``), not level
        with everyone as a newcomer; never lowers it."""
        t = self.tenant(tenant)
        lead = min(max(0.0, lead), self.params.share_max_lead_tokens)
        t.counter = max(t.counter, self._floor + lead)

    def _reference(self, t: _Tenant) -> float:
        """What a remote charge's lead is measured from: the lowest counter of the other
        tenants waiting here (whom it would go behind), else the last admitted one's."""
        waiting = [o.counter for o in self.tenants.values() if o is not t and o.backlogged]
        return min(waiting) if waiting else self._floor

    def attained(self, program: str) -> float:
        """Weighted tokens ``program`` has received (0 for a new or forgotten one)."""
        return self.programs.get(program, 0.0) if program else 0.0

    # -- the queue -------------------------------------------------------------------------

    def offer(self, ticket: Ticket) -> Ticket | None:
        """Queue ``ticket``; the queued ticket it displaced (shed), if any. Raises QueueFull
        when the queue is full and nothing of a lower class waits."""
        victim = None
        if self.queued >= self.capacity:
            victim = self._victim(ticket.priority)
            if victim is None:
                raise QueueFull
            self.remove(victim)
        t = self.tenant(ticket.tenant)
        if not t.backlogged:
            # VTC's lift: back from idle at the level of those who waited meanwhile.
            waiting = [o.counter for o in self.tenants.values() if o is not t and o.backlogged]
            t.counter = max(t.counter, min(waiting) if waiting else self._floor)
        ticket.seq = next(self._seq)
        ticket.queued = True
        t.waiting[ticket.priority].append(ticket)
        self.queued += 1
        if self.allowed is not None:
            self._note_demand(ticket.tenant, t)
        return victim

    def remove(self, ticket: Ticket) -> None:
        """Take a queued ticket out (it gave up, timed out or was shed); no-op otherwise."""
        if not ticket.queued:
            return
        ticket.queued = False
        self.tenants[ticket.tenant].waiting[ticket.priority].remove(ticket)
        self.queued -= 1

    def would_refuse(self, priority: Priority) -> bool:
        """Whether an arrival of class ``priority`` would find no place in the queue."""
        return self.queued >= self.capacity and self._victim(priority) is None

    def _victim(self, arriving: Priority) -> Ticket | None:
        """The ticket to shed for an arrival of class ``arriving``: from the lowest class below
        it that has any, the newest of the tenant furthest ahead."""
        for priority in Priority:
            if priority >= arriving:
                return None
            holders = [t for t in self.tenants.values() if t.waiting[priority]]
            if holders:
                furthest = max(holders, key=lambda t: t.counter)
                return furthest.waiting[priority][-1]
        return None

    def max_wait_s(self, priority: Priority, queue_timeout_s: float) -> float:
        if priority == Priority.SHEDDABLE:
            return min(queue_timeout_s, self.params.sheddable_max_wait_s)
        return queue_timeout_s

    def pick(
        self,
        locality: Callable[[Ticket], int] | None = None,
        now: float | None = None,
        cost: Callable[[Ticket], int] | None = None,
    ) -> Ticket | None:
        """The queued ticket to admit next (taken out of the queue), or None when nothing
        queued may start (empty, or every waiting tenant is at its own cap, or at its part of
        the fleet's slots, ``allowed``).

        ``locality(ticket)``: prompt tokens the replica that freed the slot holds of it.
        ``now``: the clock ``Ticket.arrived`` is on, for ``max_wait_s`` and, by program,
        ``program_max_wait_s`` (without it no wait counts as long). By program,
        ``cost(ticket)``: its prompt tokens no replica holds (without it, all of them)."""
        if not self.queued:
            return None
        for priority in reversed(Priority):
            heads = [t for t in self.tenants.values() if t.waiting[priority] and _may_run(t)]
            if not heads:
                continue
            if self.params.max_wait_s > 0 and now is not None:
                # The request waiting longest (each tenant's first is its oldest) goes first once
                # it has waited max_wait_s: other routers' service must not hold it here unbounded.
                # Its tenant's part of the fleet's slots still holds, but one slot here always
                # (a part that rounded to none here must not starve it).
                late = [t for t in heads if self._within(t) or t.active == 0]
                if late:
                    head = min((t.waiting[priority][0] for t in late), key=lambda k: k.seq)
                    if now - head.arrived >= self.params.max_wait_s:
                        self.remove(head)
                        return head
            if self.allowed is not None:
                heads = [t for t in heads if self._within(t)]
                if not heads:
                    continue
            # Ties (a tenant back from idle is lifted level with the rest) go to the tenant
            # with the lighter load (requests in service and waiting, per weight): the sparse
            # one before the flood. Then to the older request.
            lowest = min(heads, key=lambda t: (t.counter, _load(t), t.waiting[priority][0].seq))
            chosen = lowest.waiting[priority][0]
            if self.by_program:
                chosen = self._least_service(lowest.waiting[priority], now, cost)
            elif locality is not None:
                chosen = self._local(chosen, heads, priority, lowest.counter, locality)
            self.remove(chosen)
            return chosen
        return None

    def _least_service(
        self, waiting: deque[Ticket], now: float | None, cost: Callable[[Ticket], int] | None
    ) -> Ticket:
        """The ticket whose program will have received the least once it is served (ties: the
        older), or the oldest when it has waited ``program_max_wait_s``."""
        oldest = waiting[0]
        if now is not None and now - oldest.arrived >= self.params.program_max_wait_s:
            return oldest
        weight, programs = self.params.program_attained_weight, self.programs

        def service(ticket: Ticket) -> tuple[float, int]:
            own = cost(ticket) if cost is not None else ticket.input_tokens
            received = programs.get(ticket.program, 0.0) if ticket.program else 0.0
            return weight * received + own, ticket.seq

        share = self.params.program_wait_share
        if share <= 0 or now is None or len(waiting) < 2:
            return min(waiting, key=service)
        return _service_and_wait(list(waiting), [service(t)[0] for t in waiting], now, share)

    def _local(
        self,
        fair: Ticket,
        heads: list[_Tenant],
        priority: Priority,
        lowest: float,
        locality: Callable[[Ticket], int],
    ) -> Ticket:
        """Within the bound, the ticket whose prefix the freed replica holds most of; the VTC
        choice unless another holds strictly more."""
        bound = lowest + self.params.locality_bound_tokens
        best, best_hit = fair, locality(fair)
        budget = self.params.locality_scan
        for t in sorted(heads, key=lambda t: t.counter):
            if t.counter > bound or budget <= 0:
                break
            for ticket in itertools.islice(t.waiting[priority], budget):
                budget -= 1
                if ticket is fair:
                    continue
                hit = locality(ticket)
                if hit > best_hit:
                    best, best_hit = ticket, hit
        return best

    # -- reading ---------------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        return {name: t.counter for name, t in self.tenants.items()}

    def queued_programs(self) -> dict[str, int]:
        """Requests waiting per program (by="program"; "" gathers those without one)."""
        counts: dict[str, int] = {}
        for t in self.tenants.values():
            for waiting in t.waiting:
                for ticket in waiting:
                    counts[ticket.program] = counts.get(ticket.program, 0) + 1
        return counts

    def oldest_arrival(self, above: Priority) -> float | None:
        """When the longest-waiting queued request of a class above ``above`` arrived (None:
        none waits). The batch lane preempts its own work for such a request."""
        heads = [
            t.waiting[p][0].arrived
            for t in self.tenants.values()
            for p in Priority
            if p > above and t.waiting[p]
        ]
        return min(heads) if heads else None

    def waiting(self, name: str) -> dict[str, int]:
        t = self.tenants.get(name)
        if t is None:
            return {p.name.lower(): 0 for p in reversed(Priority)}
        return {p.name.lower(): len(t.waiting[p]) for p in reversed(Priority)}


def _may_run(t: _Tenant) -> bool:
    """Under its own cap (if it has one)."""
    return not t.limits.max_concurrent or t.active < t.limits.max_concurrent


def _load(t: _Tenant) -> float:
    """Requests in service and waiting, per weight: who is lighter when counters tie."""
    return t.demand / t.limits.weight


def _service_and_wait(
    tickets: list[Ticket], services: list[float], now: float, share: float
) -> Ticket:
    """The ticket with the best mix of little service and a long wait, each normalised over
    the queue (0 the least, 1 the most of the tickets waiting): ``(1 - share) x (1 - service)
    + share x wait``, ties to the older (llm-d's program-aware order, with share 0.2)."""
    waits = [now - t.arrived for t in tickets]
    low, high = min(services), max(services)
    early, late = min(waits), max(waits)

    def score(i: int) -> tuple[float, int]:
        served = (services[i] - low) / (high - low) if high > low else 0.0
        waited = (waits[i] - early) / (late - early) if late > early else 0.0
        return (1 - share) * (1 - served) + share * waited, -tickets[i].seq

    return tickets[max(range(len(tickets)), key=score)]
