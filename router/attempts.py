"""Retries as a loop over a ``try_one`` callable: replicas in ranked order, with backoff.

The loop knows nothing of HTTP or of the router's state: it asks ``pick`` for the next
replica, waits a jittered backoff before each retry, stays within the retry budget, and
tells ``try_one`` whether this is the last try (so the replica's own error answer is relayed
instead of thrown away).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class RetryPlan:
    max_attempts: int
    budget_s: float
    backoff_base_s: float
    backoff_max_s: float
    rng: random.Random = field(default_factory=random.Random)

    def backoff_s(self, retry: int) -> float:
        """Full jitter: a random wait up to the exponential bound for this retry (1, 2, ...)."""
        bound = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** (retry - 1))
        return self.rng.random() * bound


async def try_in_order(
    plan: RetryPlan,
    started: float,
    pick: Callable[[], str | None],
    try_one: Callable[[str, int, bool], Awaitable[T | None]],
    on_retry: Callable[[], None],
) -> T | None:
    """``try_one(replica, attempt, last)`` on replicas from ``pick`` until one gives a result.

    None when every try failed before the first byte, no replica may take traffic, or the
    next backoff would run past ``started + plan.budget_s``.
    """
    deadline = started + plan.budget_s
    for attempt in range(plan.max_attempts):
        replica = pick()
        if replica is None:
            return None
        if attempt:
            delay = plan.backoff_s(attempt)
            if time.monotonic() + delay >= deadline:
                return None
            if delay:
                await asyncio.sleep(delay)
            on_retry()
        last = attempt + 1 >= plan.max_attempts or time.monotonic() >= deadline
        result = await try_one(replica, attempt, last)
        if result is not None:
            return result
    return None
