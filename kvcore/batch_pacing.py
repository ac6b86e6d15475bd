"""When batch lines may run: spare capacity, preemption and deadline pacing. Pure arithmetic.

Batch work fills what online traffic leaves: a replica has room for batch lines while the
router's own in-flight count on it is below ``batch.max_in_flight_per_replica`` and no online
request waits in admission. A job that falls behind a straight line from its start to a point
``pace_fraction`` of the way through its window is promoted: the lines it lacks run in the
standard class, queueing like online work instead of waiting for spare capacity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def spare_slots(
    in_flight: Iterable[int],
    per_replica: int,
    online_waiting: bool,
    batch_running: int,
    admission_free: int | None,
) -> int:
    """Batch lines that may start now. ``in_flight``: each replica in rotation's requests in
    flight (batch ones included); ``batch_running``: this router's batch lines started and
    not finished (some not dispatched yet, so not counted in ``in_flight``);
    ``admission_free``: slots left under limits.max_concurrent_requests (None: no limit)."""
    if online_waiting:
        return 0
    loads = list(in_flight)
    room = sum(max(0, per_replica - n) for n in loads)
    room = min(room, per_replica * len(loads) - batch_running)
    if admission_free is not None:
        room = min(room, admission_free)
    return max(0, room)


def due(total: int, started_at: float, expires_at: float, now: float, pace_fraction: float) -> int:
    """Lines a job should have finished by ``now`` to end by ``pace_fraction`` of its window."""
    target = started_at + (expires_at - started_at) * pace_fraction
    if now >= target:
        return total
    if now <= started_at:
        return 0
    return min(total, math.ceil(total * (now - started_at) / (target - started_at)))


def behind(
    total: int,
    finished: int,
    running: int,
    started_at: float,
    expires_at: float,
    now: float,
    pace_fraction: float,
) -> int:
    """Lines to promote now: what is due less what is finished or already running."""
    return max(0, due(total, started_at, expires_at, now, pace_fraction) - finished - running)


def should_preempt(oldest_online_wait_s: float | None, bound_s: float, preemptible: int) -> bool:
    """Whether to abort a running batch line: an online request has waited past the bound and
    a batch line that is not promoted holds a slot it could have."""
    return preemptible > 0 and oldest_online_wait_s is not None and oldest_online_wait_s > bound_s
