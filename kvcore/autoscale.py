"""How many replicas a launched fleet should run: a decision from the replicas' own signals.

Every ``interval_s`` the autoscaler reads each serving replica's queue (vLLM's
``num_requests_waiting``) and KV-cache usage, and what is already starting or draining:

* **up** when the mean queue per serving replica exceeds ``target_queue_per_replica`` or the
  mean KV usage exceeds ``kv_high`` (new blocks would preempt): enough replicas to bring the queue
  back to its target and the KV usage half way between ``kv_low`` and ``kv_high``, at least one, never past ``max`` counting those already starting (a replica
  takes a while to load its model; asking again every interval would overshoot);
* **down** by one when, for ``scale_down_idle_s`` without a break, no replica had a queue and the
  fleet's KV usage would stay under ``kv_low`` on one replica fewer; then one more per interval
  while that still holds: never below ``min``, never while a replica is still starting or
  draining (the drained replica's traffic lands on the others before the next is judged).

With ``target_in_flight_per_replica`` set, the router's own count of requests in flight on each
serving replica (its dispatch ledger's, known the moment it routes) replaces the replicas' queue
as the load signal, which vLLM shows only once a step's token budget is spent, after TTFT has
gone:

* **up** when the requests in flight per serving replica exceed the target: enough replicas,
  counting those already starting, for the target, never past ``max`` (and on KV usage past
  ``kv_high``, as above);
* **down** by one when, for ``scale_down_idle_s`` without a break, the fleet's requests in flight
  would stay under ``in_flight_low`` of the target on one replica fewer, and its KV usage under
  ``kv_low``; then one more per interval while that holds, as above. A queue does not block it.

Which replica leaves is the caller's choice (the router drains the one with the least in flight
and moves what it cannot finish). Pure: ``now`` is passed in, no I/O; the simulator and the
router's launched fleets share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscaleSettings:
    min: int = 1
    max: int = 8
    # Tuned in the simulator (docs/simulator.md, "Autoscaling"): a queue of one per replica and
    # KV usage past 0.6 are the first signs of a fleet running out of prefill; later ones (a
    # longer queue, a fuller cache) started replicas after TTFT had already gone.
    target_queue_per_replica: float = 1.0
    kv_high: float = 0.6
    kv_low: float = 0.35
    scale_down_idle_s: float = 60.0
    interval_s: float = 10.0
    # 0: off (the replicas' own queue and KV usage). Else the router's requests in flight per
    # serving replica to scale to (a leading signal; docs/simulator.md, "Autoscaling"), and the
    # fraction of it the fleet must stay under on one replica fewer before one leaves.
    target_in_flight_per_replica: float = 0.0
    in_flight_low: float = 0.8

    def problems(self, prefix: str = "autoscale") -> list[str]:
        """One line per unusable setting, naming the key."""
        out = []
        if self.min < 1:
            out.append(f"{prefix}.min: must be >= 1, got {self.min}")
        if self.max < self.min:
            out.append(f"{prefix}.max: must be >= min ({self.min}), got {self.max}")
        for key in ("target_queue_per_replica", "scale_down_idle_s", "interval_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                out.append(f"{prefix}.{key}: must be a number > 0, got {value}")
        target = self.target_in_flight_per_replica
        if not (math.isfinite(target) and target >= 0):
            out.append(
                f"{prefix}.target_in_flight_per_replica: must be a number >= 0, got {target}"
            )
        if not 0 < self.in_flight_low <= 1:
            out.append(
                f"{prefix}.in_flight_low: need 0 < in_flight_low <= 1, got {self.in_flight_low}"
            )
        if not 0 < self.kv_low < self.kv_high <= 1:
            out.append(
                f"{prefix}.kv_low/kv_high: need 0 < kv_low < kv_high <= 1, "
                f"got {self.kv_low} and {self.kv_high}"
            )
        return out


@dataclass(frozen=True)
class ReplicaSignal:
    """One serving replica's own numbers at the last scrape, and the router's requests in flight
    there (its dispatch ledger's count, read only with ``target_in_flight_per_replica``)."""

    waiting: int
    kv_usage: float
    in_flight: int = 0


class Autoscaler:
    """``decide`` once per interval: +N to start, -1 to drain one, 0 to hold."""

    def __init__(self, settings: AutoscaleSettings) -> None:
        self.settings = settings
        self._quiet_since: float | None = None

    def decide(self, now: float, serving: list[ReplicaSignal], starting: int, draining: int) -> int:
        s = self.settings
        n = len(serving)
        if n == 0:
            self._quiet_since = None
            return max(0, s.min - starting)
        queue = sum(r.waiting for r in serving)
        usage = sum(r.kv_usage for r in serving) / n
        room = s.max - n - starting
        if n + starting < s.min:
            self._quiet_since = None
            return min(s.min - n - starting, max(room, 0))
        if s.target_in_flight_per_replica > 0:
            return self._by_in_flight(now, serving, starting, draining, usage, room)
        if queue / n > s.target_queue_per_replica or usage > s.kv_high:
            self._quiet_since = None
            if starting or room <= 0:
                return 0  # what is starting will take its share of the load first
            # Enough for the queue at its target and the KV usage back between the marks.
            by_queue = math.ceil(queue / s.target_queue_per_replica)
            by_usage = math.ceil(usage * n / ((s.kv_high + s.kv_low) / 2))
            return max(1, min(max(by_queue, by_usage) - n, room))
        quiet = queue == 0 and (n > 1 and usage * n / (n - 1) < s.kv_low)
        return self._step_down(now, quiet, n, starting, draining)

    def _step_down(self, now: float, quiet: bool, n: int, starting: int, draining: int) -> int:
        """-1 once the fleet has been ``quiet`` (it would do with one fewer) for
        ``scale_down_idle_s``, with nothing starting or draining and above ``min``; else 0."""
        if not quiet or n <= self.settings.min or starting or draining:
            if not quiet:
                self._quiet_since = None
            return 0
        if self._quiet_since is None:
            self._quiet_since = now
        if now - self._quiet_since < self.settings.scale_down_idle_s:
            return 0
        # Still quiet after the last one left (its load landed on the others): the next goes
        # one interval later, not a whole quiet spell: a day's evening is hours of decline.
        return -1

    def _by_in_flight(
        self,
        now: float,
        serving: list[ReplicaSignal],
        starting: int,
        draining: int,
        usage: float,
        room: int,
    ) -> int:
        """``decide`` on the router's requests in flight (``target_in_flight_per_replica``)."""
        s = self.settings
        n = len(serving)
        target = s.target_in_flight_per_replica
        load = sum(r.in_flight for r in serving)
        # Replicas for the load at its target; those starting count (they take their share).
        want = max(math.ceil(load / target), math.ceil(usage * n / ((s.kv_high + s.kv_low) / 2)))
        if load > target * n or usage > s.kv_high:
            self._quiet_since = None
            return max(0, min(want - n - starting, room))
        quiet = n > 1 and load / (n - 1) < target * s.in_flight_low
        quiet = quiet and usage * n / (n - 1) < s.kv_low
        return self._step_down(now, quiet, n, starting, draining)
