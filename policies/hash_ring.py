"""A consistent-hash ring of virtual nodes with bounded loads.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
SODA 2018): with ``m`` requests in flight (this one included) over ``n`` replicas, a replica
may hold at most ``ceil((1 + eps) * m / n)``; a key whose home is full walks clockwise to the
next replica with room. A key keeps its home while there is room, and adding or removing a
replica moves only the keys whose nearest vnode changed (about 1/n of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import xxhash
from sortedcontainers import SortedList

from .types import FleetView, ReplicaState


def hash_key(key: str) -> int:
    # surrogateescape: header values arrive decoded that way, and any byte string is a valid key.
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogateescape"))


class HashRing:
    def __init__(self, replica_ids: list[str], vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._points: SortedList = SortedList()
        for replica_id in replica_ids:
            self.add(replica_id)

    def add(self, replica_id: str) -> None:
        for i in range(self.vnodes):
            self._points.add((hash_key(f"{replica_id}#{i}"), replica_id))

    def remove(self, replica_id: str) -> None:
        for i in range(self.vnodes):
            self._points.discard((hash_key(f"{replica_id}#{i}"), replica_id))

    def walk(self, key_hash: int) -> Iterator[str]:
        """Distinct replicas in clockwise order from ``key_hash``."""
        points = self._points
        n = len(points)
        if n == 0:
            return
        start = points.bisect_left((key_hash, ""))
        seen: set[str] = set()
        for i in range(n):
            replica_id = points[(start + i) % n][1]
            if replica_id not in seen:
                seen.add(replica_id)
                yield replica_id


class FleetRing:
    """A ring kept in step with the fleet: rebuilt only when its membership version changes."""

    def __init__(self, vnodes: int = 160) -> None:
        self.ring = HashRing([], vnodes)
        self._members: set[str] = set()
        self._version: int | None = None

    def synced(self, fleet: FleetView) -> HashRing:
        if fleet.membership_version != self._version:
            members = {r.replica_id for r in fleet.replicas}
            for gone in self._members - members:
                self.ring.remove(gone)
            for new in members - self._members:
                self.ring.add(new)
            self._members = members
            self._version = fleet.membership_version
        return self.ring


def load_bound(total_in_flight: int, replicas: int, eps: float) -> int:
    """Most requests one replica may hold once the next request is placed."""
    return max(1, math.ceil((1.0 + eps) * (total_in_flight + 1) / replicas))


def bounded_walk(
    ring: HashRing,
    key_hash: int,
    healthy: dict[str, ReplicaState],
    eps: float,
    load_of: Callable[[ReplicaState], int] = lambda r: r.in_flight,
) -> tuple[list[str], bool]:
    """Healthy replicas in ring order, those with room first.

    Returns the ranking and whether the key's home (its first healthy replica) was full.
    """
    total = sum(load_of(r) for r in healthy.values())
    bound = load_bound(total, len(healthy), eps)
    with_room: list[str] = []
    full: list[str] = []
    home_full: bool | None = None
    for replica_id in ring.walk(key_hash):
        replica = healthy.get(replica_id)
        if replica is None:
            continue
        has_room = load_of(replica) < bound
        if home_full is None:
            home_full = not has_room
        (with_room if has_room else full).append(replica_id)
        if len(with_room) + len(full) == len(healthy):
            break
    return with_room + full, bool(home_full)
