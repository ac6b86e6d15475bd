"""The circuit breaker's state machine (pure: the clock is passed in)."""

from __future__ import annotations

from kvroute.health.breaker import BreakerSettings, BreakerState, CircuitBreaker

SETTINGS = BreakerSettings(
    consecutive_failures=3,
    failure_rate=0.5,
    min_requests=10,
    window_s=10.0,
    cooldown_s=5.0,
    max_cooldown_s=20.0,
    half_open_requests=1,
    close_after_successes=2,
)


def test_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    b = CircuitBreaker(SETTINGS)
    assert not b.record(0.0, False) and not b.record(0.1, False)
    b.record(0.2, True)  # the streak is broken
    assert not b.record(0.3, False) and not b.record(0.4, False)
    assert b.state is BreakerState.CLOSED and b.allows(0.4)
    assert b.record(0.5, False)
    assert b.state is BreakerState.OPEN and not b.allows(0.6)
    assert "3 consecutive failures" in b.last_reason


def test_opens_on_the_failure_rate_over_the_window_only_with_enough_requests() -> None:
    b = CircuitBreaker(SETTINGS)
    now = 0.0
    for _ in range(4):  # fail, ok, fail, ok ... never 3 in a row
        b.record(now, False)
        b.record(now + 0.01, True)
        now += 0.1
    assert b.state is BreakerState.CLOSED  # 8 outcomes < min_requests
    b.record(now, False)
    assert b.state is BreakerState.CLOSED  # 9 outcomes
    assert b.record(now + 0.01, False)  # 10 outcomes, 6 failed
    assert "failed in 10s" in b.last_reason


def test_old_failures_leave_the_window() -> None:
    b = CircuitBreaker(SETTINGS)
    for i in range(9):
        b.record(i * 0.01, i % 3 != 0)  # 3 failures, none consecutive
    # 30 s later the window is empty again: a few failures among successes do not open it.
    b.record(30.0, False)
    b.record(30.01, True)
    assert b.state is BreakerState.CLOSED


def test_half_open_after_the_cooldown_lets_one_trial_through_and_closes_after_successes() -> None:
    b = CircuitBreaker(SETTINGS)
    b.trip(100.0, "stalled")
    assert not b.allows(104.9)
    assert b.allows(105.0) and b.state is BreakerState.HALF_OPEN
    b.dispatched()
    assert not b.allows(105.1)  # one trial at a time
    b.record(105.2, True)
    assert b.state is BreakerState.HALF_OPEN and b.allows(105.2)
    b.dispatched()
    b.record(105.3, True)
    assert b.state is BreakerState.CLOSED


def test_a_failed_trial_reopens_with_a_doubled_cooldown_capped() -> None:
    b = CircuitBreaker(SETTINGS)
    now = 0.0
    for expected in (5.0, 10.0, 20.0, 20.0):
        b.trip(now, "x") if b.state is BreakerState.CLOSED else None
        assert b.open_until - b.opened_at == expected
        now = b.open_until
        assert b.allows(now)
        b.dispatched()
        assert b.record(now, False, "timeout")
        assert b.state is BreakerState.OPEN
    # Closing resets the backoff.
    now = b.open_until
    for _ in range(2):
        assert b.allows(now)
        b.dispatched()
        b.record(now, True)
    assert b.state is BreakerState.CLOSED
    b.trip(now, "again")
    assert b.open_until - b.opened_at == 5.0


def test_outcomes_of_requests_sent_before_it_opened_do_not_count() -> None:
    b = CircuitBreaker(SETTINGS)
    b.trip(0.0, "stalled")
    assert not b.record(1.0, False)
    b.record(1.0, True)
    assert b.state is BreakerState.OPEN and b.open_until == 5.0
