"""Circuit breaker per replica: passive outlier detection from live traffic (pure, no clock).

Failures are transport errors (connect, timeout, broken connection) and 5xx answers but 501 and
505 (what the request asks is not implemented: the caller records those as successes, as a 4xx,
the client's fault, counts). The breaker:

- opens after ``consecutive_failures`` failures in a row, or when at least ``min_requests``
  outcomes in the last ``window_s`` seconds failed at a rate of ``failure_rate`` or more, or at
  once on a replica that stalls (``trip``: it accepted a request and sent nothing in time);
- stays open for a cool-down that doubles with each consecutive opening (up to
  ``max_cooldown_s``), like Envoy's outlier ejection, so a flapping replica is kept out longer;
- then half-opens: up to ``half_open_requests`` trial requests at a time, and closes after
  ``close_after_successes`` of them succeed; one failure re-opens it.

The caller passes ``now`` (monotonic seconds) to every call, so the simulator can drive it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    consecutive_failures: int = 5
    failure_rate: float = 0.5
    min_requests: int = 20
    window_s: float = 10.0
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    half_open_requests: int = 1
    close_after_successes: int = 2


# The failure-rate window is kept as this many buckets (O(1) memory per replica).
_BUCKETS = 10


class CircuitBreaker:
    """One replica's breaker. Call ``allows`` before sending, then ``record`` the outcome."""

    def __init__(self, settings: BreakerSettings) -> None:
        self.settings = settings
        self.state = BreakerState.CLOSED
        self.opened_at = 0.0
        self.open_until = 0.0
        self.openings = 0  # consecutive openings without closing in between
        self.last_reason = ""
        self._consecutive = 0
        self._trials = 0  # half-open requests in flight
        self._trial_successes = 0
        self._bucket_s = settings.window_s / _BUCKETS
        self._bucket_start = [0.0] * _BUCKETS
        self._ok = [0] * _BUCKETS
        self._failed = [0] * _BUCKETS

    def allows(self, now: float) -> bool:
        """May a request be sent now? Moves an open breaker to half-open once cooled down."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now < self.open_until:
                return False
            self.state = BreakerState.HALF_OPEN
            self._trials = 0
            self._trial_successes = 0
        return self._trials < self.settings.half_open_requests

    def dispatched(self) -> None:
        """A request was sent (after ``allows`` said yes)."""
        if self.state is BreakerState.HALF_OPEN:
            self._trials += 1

    def record(self, now: float, ok: bool, reason: str = "failure") -> bool:
        """Record an outcome; True when this outcome opened the breaker."""
        if self.state is BreakerState.HALF_OPEN:
            self._trials = max(0, self._trials - 1)
            if not ok:
                self._open(now, f"half-open trial failed: {reason}")
                return True
            self._trial_successes += 1
            if self._trial_successes >= self.settings.close_after_successes:
                self._close()
            return False
        if self.state is BreakerState.OPEN:
            return False  # a request sent before it opened; already counted out
        bucket = self._bucket(now)
        if ok:
            self._consecutive = 0
            self._ok[bucket] += 1
            return False
        self._consecutive += 1
        self._failed[bucket] += 1
        s = self.settings
        if self._consecutive >= s.consecutive_failures:
            self._open(now, f"{self._consecutive} consecutive failures ({reason})")
            return True
        failed, total = self._window_counts(now)
        if total >= s.min_requests and failed >= s.failure_rate * total:
            self._open(now, f"{failed}/{total} failed in {s.window_s:g}s ({reason})")
            return True
        return False

    def trip(self, now: float, reason: str) -> bool:
        """Open now (a replica that stalls); True unless it was already open."""
        if self.state is BreakerState.OPEN:
            return False
        self._open(now, reason)
        return True

    def _open(self, now: float, reason: str) -> None:
        s = self.settings
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.open_until = now + min(s.max_cooldown_s, s.cooldown_s * 2**self.openings)
        self.openings += 1
        self.last_reason = reason
        self._consecutive = 0
        self._trials = 0
        self._ok = [0] * _BUCKETS
        self._failed = [0] * _BUCKETS

    def _close(self) -> None:
        self.state = BreakerState.CLOSED
        self.openings = 0
        self._consecutive = 0

    def _bucket(self, now: float) -> int:
        slot = int(now / self._bucket_s)
        i = slot % _BUCKETS
        start = slot * self._bucket_s
        if self._bucket_start[i] != start:
            self._bucket_start[i] = start
            self._ok[i] = 0
            self._failed[i] = 0
        return i

    def _window_counts(self, now: float) -> tuple[int, int]:
        oldest = now - self.settings.window_s
        failed = ok = 0
        for i in range(_BUCKETS):
            if self._bucket_start[i] > oldest:
                failed += self._failed[i]
                ok += self._ok[i]
        return failed, failed + ok
