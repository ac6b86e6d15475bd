"""``kvroute plan --pd``'s search: the P/D fleet with the fewest replicas that meets an SLO.

Pure: ``meets(prefill, decode)`` simulates (the caller's); this only chooses which fleets to
try. Each try is a whole replay, so the search is cheap rather than exhaustive:

1. prefill pools of a quarter, half, three quarters and all of ``around`` (the aggregated
   fleet's size: the same work fits in one pool of it) form a coarse grid;
2. for each, the smallest decode pool meeting the SLO, by bisection, looking only below the
   best total found so far (a fleet as large as the best one cannot beat it) and at most
   2 x ``around`` in all (a prefill and a decode pool each as large as the aggregated fleet): a
   prefill pool whose largest useful decode pool misses costs one try;
3. then the best prefill pool's neighbours, one step at a time while they do better;
4. when nothing met the SLO, the same again around twice the size, up to ``max_replicas``.

It assumes a replica more in either pool never makes a fleet miss: the bisection rests on it,
and a fleet that contains one that met (or is contained in one that missed) is not simulated
but taken to meet (miss) too. It also assumes the best prefill pool lies near the grid's best
(the walk). Neither holds exactly in a simulation with queues and caches; ``simulated`` keeps
what was actually run, so the plan shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

GRID = (0.25, 0.5, 0.75, 1.0)


@dataclass
class PdSearch:
    """The best fleet found, as (prefill, decode), or None; and every fleet tried."""

    best: tuple[int, int] | None = None
    simulated: dict[tuple[int, int], bool] = field(default_factory=dict)


def search_pd(meets: Callable[[int, int], bool], around: int, max_replicas: int) -> PdSearch:
    """The (prefill, decode) fleet of fewest replicas, at most ``max_replicas``, for which
    ``meets`` holds (see the module doc); ``around`` >= 1 sizes the grid."""
    search = PdSearch()
    cap = min(max_replicas, 2 * around)

    def ok(p: int, d: int) -> bool:
        known = search.simulated
        if (p, d) not in known:
            for (p2, d2), met in known.items():
                if met and p2 <= p and d2 <= d:
                    return True
                if not met and p2 >= p and d2 >= d:
                    return False
            known[p, d] = meets(p, d)
        return known[p, d]

    def smallest_decode(p: int) -> int | None:
        """The fewest decode replicas meeting the SLO beside ``p`` prefill, below the best."""
        limit = cap if search.best is None else sum(search.best) - 1
        high = limit - p
        if high < 1 or not ok(p, high):
            return None
        low = 0  # known to miss (no decode pool)
        while high - low > 1:
            mid = (low + high) // 2
            if ok(p, mid):
                high = mid
            else:
                low = mid
        return high

    def better(p: int) -> bool:
        d = smallest_decode(p) if 1 <= p < cap else None
        if d is None:
            return False
        search.best = (p, d)
        return True

    while True:
        grid = sorted({max(1, round(f * cap / 2)) for f in GRID})
        # Largest prefill pool first: its decode pool is found fast and bounds the others.
        for p in reversed(grid):
            better(p)
        if search.best is not None:
            for step in (-1, 1):
                p = search.best[0] + step
                while better(p):
                    p += step
            return search
        if cap >= max_replicas:
            return search
        cap = min(max_replicas, 2 * cap)
