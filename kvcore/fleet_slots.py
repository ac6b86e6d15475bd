"""Fleet-wide admission of tenants (``fairness.share_slots``): the fleet's slots shared over
the tenants with demand, whichever routers their requests reach.

Ordering within one router (``fairness.share_bus``) cannot give a tenant that sends to one
router more than that router's ``limits.max_concurrent_requests`` slots, while a tenant spread
over N routers has slots on all of them. With ``share_slots`` each router tells the others (over
the budget bus, router/budget_bus.py) its slot limit and each tenant's demand there (requests in
service + waiting), and every router computes the same thing from the same reports:

1. **Water-fill** the fleet's slots (the sum of the limits of the routers heard from) over the
   tenants with demand, by weight: a tenant never gets more than it demands, what it leaves is
   shared among the others by weight (max-min fairness).
2. **Place** each tenant's fleet share over the routers in proportion to its demand at each.
   A router may hold up to ``max_factor`` x its own limit (its *ceiling*): the routers split
   from each other's reports, an interval old, while the replicas take what they all admit at
   once, so the ceiling bounds what one router can add while the reports lag (a tenant's load
   moving, a peer starting or stalling), and a router whose replicas are its own is never
   driven past twice (by default) what it was sized for. A router above its ceiling gives the
   tenants that have demand with room elsewhere their part there (each keeps one slot where
   it has demand, so none starves on a router), and what is still above is cut there in
   proportion (the cut moved elsewhere where the tenant has room).
3. **Work-conserving**: a tenant the ceilings keep from holding its share (it sends to too few
   routers) wants no more than it holds; the water-fill runs again and the others get the rest
   (no fleet slot idles while someone waits).
4. **Round** to whole slots (largest remainders, ties by name: every router rounds alike). A
   rounded-up slot that finds no room on the routers where its tenant sends moves others' slots
   along to routers with room (an augmenting path, searched in name order), or else goes to the
   tenant furthest below its share that can place one: no fleet slot idles to rounding.

Each router splits by the demand it tells the others (the peak over the interval: see
FairQueue.drain_demand), so all of them compute from the same numbers and agree.

A router admits each tenant up to its part there (``allowances``). Peers not heard from within
``stale_s`` drop out of the sum; with no peer heard from, there is nothing to compute
(``FleetSlots.allowances`` returns None) and admission is a single router's.

Pure: no I/O, no asyncio, no clock (``now`` is passed in).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Weight = Callable[[str], float]
EPS = 1e-9  # parts are sums of fractions: 2.9999999 is 3 slots
# The fill below converges on what a tenant sent to too few routers can hold, from above: what
# it leaves the others is this short of a slot at most, and counts as one.
SLACK = 0.02
ROUNDS = 8


def water_fill(capacity: float, demands: Mapping[str, float], weight: Weight) -> dict[str, float]:
    """``capacity`` shared over the tenants of ``demands`` (> 0) by ``weight``, none above its
    demand: max-min fair. The shares sum to min(capacity, total demand)."""
    wanting = sorted(
        ((d / weight(t), t) for t, d in demands.items() if d > 0 and weight(t) > 0),
        key=lambda item: (item[0], item[1]),
    )
    shares: dict[str, float] = {}
    left = max(0.0, capacity)
    total_weight = sum(weight(t) for _, t in wanting)
    for k, (_, tenant) in enumerate(wanting):
        fair = left * weight(tenant) / total_weight if total_weight > 0 else 0.0
        if demands[tenant] <= fair:
            shares[tenant] = float(demands[tenant])
        else:
            # Everyone from here on wants more than its fair part of what is left: split it.
            for _, rest in wanting[k:]:
                shares[rest] = left * weight(rest) / total_weight
            return shares
        left -= shares[tenant]
        total_weight -= weight(tenant)
    return shares


def place(
    shares: Mapping[str, float],
    demand: Mapping[str, Mapping[str, float]],
    ceilings: Mapping[str, float],
) -> dict[str, dict[str, float]]:
    """Each tenant's fleet share over the routers (``demand[router][tenant]``), in proportion to
    its demand at each; a router above its ceiling moves what it can of the tenants with room
    elsewhere (each keeps one slot there), then is cut to the ceiling in proportion. Returns
    ``parts[router][tenant]``."""
    routers = sorted(demand)
    totals: dict[str, float] = {}
    for r in routers:
        for t, d in demand[r].items():
            if d > 0:
                totals[t] = totals.get(t, 0.0) + d
    parts: dict[str, dict[str, float]] = {r: {} for r in routers}
    for r in routers:
        for t, d in demand[r].items():
            if d > 0 and totals.get(t) and shares.get(t, 0.0) > 0:
                parts[r][t] = shares[t] * d / totals[t]

    def room(r: str) -> float:
        return ceilings[r] - sum(parts[r].values())

    def elsewhere(r: str, t: str, amount: float) -> float:
        """Up to ``amount`` of ``t``'s part moved off ``r`` to the other routers where it has
        demand beyond its part and there is room, in proportion to what each can take."""
        spare = {
            o: min(room(o), demand[o].get(t, 0.0) - parts[o].get(t, 0.0)) for o in routers if o != r
        }
        spare = {o: x for o, x in spare.items() if x > EPS}
        available = sum(spare.values())
        moved = min(amount, available)
        if moved <= 0:
            return 0.0
        for o, x in spare.items():
            parts[o][t] = parts[o].get(t, 0.0) + moved * x / available
        return moved

    for r in routers:
        excess = -room(r)
        if excess <= EPS:
            continue
        for t in sorted(parts[r]):
            # Each keeps one slot where it has demand (its requests there do not starve).
            movable = min(excess, parts[r][t] - min(1.0, parts[r][t]))
            if movable > 0:
                moved = elsewhere(r, t, movable)
                parts[r][t] -= moved
                excess -= moved
            if excess <= EPS:
                break
        if excess > EPS:
            held = sum(parts[r].values())
            scale = max(0.0, ceilings[r]) / held if held > 0 else 0.0
            cut = {t: p * (1 - scale) for t, p in parts[r].items()}
            parts[r] = {t: p * scale for t, p in parts[r].items()}
            for t, amount in sorted(cut.items()):
                elsewhere(r, t, amount)  # what was cut here, where it has room elsewhere
    return parts


def whole(parts: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, int]]:
    """``parts`` in whole slots, by largest remainders twice (ties by name, so every router
    rounds alike): each tenant's total (the sum of all parts, rounded down, over the tenants),
    then each tenant's over the routers, none getting more than its parts there rounded up."""
    tenants: dict[str, float] = {}
    for row in parts.values():
        for t, p in row.items():
            tenants[t] = tenants.get(t, 0.0) + p
    totals = _largest_remainders(tenants, math.floor(sum(tenants.values()) + SLACK))
    room = {r: math.ceil(sum(row.values()) - SLACK) for r, row in parts.items()}
    out: dict[str, dict[str, int]] = {r: {} for r in parts}
    for t in sorted(tenants):
        cells = {r: row[t] for r, row in parts.items() if t in row}
        for r, n in _largest_remainders(cells, totals[t], room).items():
            out[r][t] = n
            room[r] -= n
    # Tenant by tenant, an earlier tenant's rounding can take the last room on the one router
    # where a later one has its part (two ties rounded up there, one left with none): move
    # earlier units along to where they also fit, so the later one's slot is placed.
    cap = {r: {t: math.ceil(p - EPS) for t, p in row.items()} for r, row in parts.items()}

    def given(t: str) -> int:
        return sum(row.get(t, 0) for row in out.values())

    for t in sorted(tenants):
        while given(t) < totals[t]:
            if not _augment(t, out, cap, room):
                break
    # A slot the rounding gave a tenant that has no room left where it sends (both rounded-up
    # tenants on one full router) goes to the tenant furthest below its share that can still
    # place one, never past its share rounded up: no fleet slot idles.
    while sum(given(t) for t in tenants) < sum(totals.values()):
        wanting = sorted(
            (t for t in tenants if given(t) < math.ceil(tenants[t] - EPS)),
            key=lambda t: (-(tenants[t] - given(t)), t),
        )
        if not any(_augment(t, out, cap, room) for t in wanting):
            break
    return out


def _augment(
    tenant: str,
    out: dict[str, dict[str, int]],
    cap: Mapping[str, Mapping[str, int]],
    room: dict[str, int],
) -> bool:
    """One more slot for ``tenant`` (within its rounded-up part at a router), making room by
    moving other tenants' slots along a chain of routers to one with room; False: none.
    Breadth first over the routers in name order, so every router finds the same chain."""
    routers = sorted(out)
    start = [r for r in routers if out[r].get(tenant, 0) < cap[r].get(tenant, 0)]
    came: dict[str, tuple[str, str] | None] = dict.fromkeys(start)
    frontier = list(start)
    while frontier:
        nxt: list[str] = []
        for r in frontier:
            if room[r] > 0:
                # Unwind: each step moves one slot of its tenant from the router before to r.
                room[r] -= 1
                at = r
                step = came[at]
                while step is not None:
                    before, moved = step
                    out[before][moved] -= 1
                    out[at][moved] = out[at].get(moved, 0) + 1
                    at, step = before, came[before]
                out[at][tenant] = out[at].get(tenant, 0) + 1
                return True
            for moved in sorted(out[r]):
                if out[r][moved] <= 0:
                    continue
                for other in routers:
                    if other not in came and out[other].get(moved, 0) < cap[other].get(moved, 0):
                        came[other] = (r, moved)
                        nxt.append(other)
        frontier = nxt
    return False


def _largest_remainders(
    amounts: Mapping[str, float], total: int, room: Mapping[str, int] | None = None
) -> dict[str, int]:
    """``total`` whole units over ``amounts``: each rounded down, the rest one each to the
    largest remainders (ties by name); none above its amount rounded up, nor its ``room``."""
    out = {k: math.floor(a + EPS) for k, a in amounts.items()}
    if room is not None:
        out = {k: min(n, max(0, room[k])) for k, n in out.items()}
    left = total - sum(out.values())
    for k in sorted(amounts, key=lambda k: (-(amounts[k] - out[k]), k)):
        if left <= 0:
            break
        if amounts[k] - out[k] > EPS and (room is None or out[k] < room[k]):
            out[k] += 1
            left -= 1
    return out


@dataclass
class _Peer:
    limit: int
    demand: dict[str, int]
    heard: float


@dataclass
class FleetSlots:
    """What this router (``origin``, ``limit`` slots) heard of its peers' slots and demand, and
    this router's allowance per tenant from it. ``max_factor``: how far above its own limit a
    router may admit (its ceiling, ``max_factor`` x its limit, at least the limit), the same on
    every router. ``stale_s``: a peer not heard from for this long drops out."""

    origin: str
    limit: int
    weight: Weight
    max_factor: float = 2.0
    stale_s: float = 0.5
    peers: dict[str, _Peer] = field(default_factory=dict)

    @property
    def ceiling(self) -> int:
        return _ceiling(self.limit, self.max_factor)

    def heard(self, origin: str, limit: int, demand: Mapping[str, int], now: float) -> bool:
        """A peer's report: its limit and each tenant's demand there (in service + waiting).
        Whether the fleet changed (a peer joined or left, or its limit did)."""
        if origin == self.origin:
            return False
        if limit <= 0:
            # It shares no slots (it left, or has no limit).
            return self.peers.pop(origin, None) is not None
        known = self.peers.get(origin)
        self.peers[origin] = _Peer(limit, {t: d for t, d in demand.items() if d > 0}, now)
        return known is None or known.limit != limit

    def live(self, now: float) -> dict[str, _Peer]:
        """The peers heard from within ``stale_s`` (the others forgotten)."""
        for origin in [o for o, p in self.peers.items() if now - p.heard > self.stale_s]:
            del self.peers[origin]
        return self.peers

    def allowances(self, demand: Mapping[str, int], now: float) -> dict[str, int] | None:
        """Slots each tenant may hold here, from this router's ``demand`` and its live peers';
        None with no live peer (this router admits alone, by its own limit)."""
        peers = self.live(now)
        if not peers:
            return None
        demands: dict[str, Mapping[str, float]] = {o: p.demand for o, p in peers.items()}
        demands[self.origin] = {t: d for t, d in demand.items() if d > 0}
        limits = {o: p.limit for o, p in peers.items()}
        limits[self.origin] = self.limit
        return share_slots(self.origin, limits, demands, self.weight, self.max_factor)


def share_slots(
    me: str,
    limits: Mapping[str, int],
    demand: Mapping[str, Mapping[str, float]],
    weight: Weight,
    max_factor: float,
) -> dict[str, int]:
    """Router ``me``'s whole slots per tenant: the fleet's slots (the sum of ``limits``)
    water-filled over the tenants by weight, placed over the routers by demand, rounded."""
    totals: dict[str, float] = {}
    for row in demand.values():
        for t, d in row.items():
            if d > 0:
                totals[t] = totals.get(t, 0.0) + d
    capacity = float(sum(limits.values()))
    ceilings = {r: float(_ceiling(limits[r], max_factor)) for r in demand}
    # Work-conserving: a tenant whose share the ceilings keep from being placed in full (it
    # sends to too few routers) wants no more than what was placed; what it leaves goes to the
    # others, filled again (converging from above, ``ROUNDS`` at most).
    wants = dict(totals)
    for _ in range(ROUNDS):
        shares = water_fill(capacity, wants, weight)
        parts = place(shares, demand, ceilings)
        placed: dict[str, float] = {}
        for row in parts.values():
            for t, p in row.items():
                placed[t] = placed.get(t, 0.0) + p
        short = [t for t, s in shares.items() if placed.get(t, 0.0) < s - 1e-6]
        if not short:
            break
        for t in short:
            wants[t] = placed.get(t, 0.0)
    return whole(parts).get(me, {})


def _ceiling(limit: int, max_factor: float) -> int:
    return max(limit, math.floor(limit * max_factor))
