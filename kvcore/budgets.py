"""Token budgets per tenant: input and output tokens per minute, as token buckets.

A bucket holds at most a minute's worth and refills continuously. Input is reserved when a
request is let in (the router's estimate), then corrected to what the replica counted when the
answer ends; output is charged then, from the replica's usage. A bucket may go below zero (an
answer longer than what was left): the debt is repaid by refill before the next request passes,
so over time a tenant gets exactly its rate, streamed answers included.

A request passes when the input bucket holds its estimate (at most the bucket's size: a prompt
larger than a minute's budget passes once the bucket is full, or it could never pass) and the
output bucket holds at least a token (it is not spent, nor in debt). Otherwise ``wait_s`` says when it would: the Retry-After.

Several routers (or workers) enforce one budget by sharing what they charge
(router/budget_bus.py): each records its own charges in a :class:`ChargeLog`, publishes them,
and applies the others' with :meth:`TenantBudget.apply_remote`, so every bucket drains at the
fleet's rate, not one router's.

Pure: no I/O, no clock (``now`` is passed in, monotonic seconds).
"""

from __future__ import annotations

from dataclasses import dataclass


class TokenBucket:
    __slots__ = ("_at", "capacity", "level", "rate")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.level = self.capacity
        self._at = now

    def refill(self, now: float) -> float:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
            self._at = now
        return self.level

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until the bucket holds ``need`` tokens (at most its capacity); 0: now."""
        short = min(need, self.capacity) - self.refill(now)
        return short / self.rate if short > 0 else 0.0

    def take(self, tokens: float, now: float) -> None:
        """Take (or give back, negative) tokens; the level may go below zero, never above full."""
        self.refill(now)
        self.level = min(self.capacity, self.level - tokens)


@dataclass(frozen=True, slots=True)
class Refusal:
    kind: str  # "input" or "output": the bucket that is short
    wait_s: float  # until it would pass


class TenantBudget:
    """A tenant's two buckets; None for a budget that is not set (unlimited)."""

    __slots__ = ("input", "output")

    def __init__(
        self, input_per_minute: float | None, output_per_minute: float | None, now: float
    ) -> None:
        self.input = TokenBucket(input_per_minute, now) if input_per_minute else None
        self.output = TokenBucket(output_per_minute, now) if output_per_minute else None

    def check(self, input_tokens: int, now: float) -> Refusal | None:
        """Why a request of ``input_tokens`` may not start now, or None when it may."""
        worst: Refusal | None = None
        if self.input is not None:
            wait = self.input.wait_s(input_tokens, now)
            if wait > 0:
                worst = Refusal("input", wait)
        if self.output is not None:
            # Output is unknown before the answer: only a spent bucket (not one token left,
            # or a debt) holds a request.
            wait = self.output.wait_s(1.0, now)
            if wait > 0 and (worst is None or wait > worst.wait_s):
                worst = Refusal("output", wait)
        return worst

    def reserve(self, input_tokens: int, now: float) -> None:
        if self.input is not None:
            self.input.take(input_tokens, now)

    def settle(self, reserved: int, input_tokens: int, output_tokens: int, now: float) -> None:
        """The answer ended: input corrected from the reservation, output charged."""
        if self.input is not None and input_tokens != reserved:
            self.input.take(input_tokens - reserved, now)
        if self.output is not None and output_tokens:
            self.output.take(output_tokens, now)

    def refund(self, reserved: int, now: float) -> None:
        """Nothing was served (refused later, in the queue): give the reservation back."""
        if self.input is not None:
            self.input.take(-reserved, now)

    def apply_remote(self, input_tokens: float, output_tokens: float, now: float) -> None:
        """Another router's net charges (its reservations, corrections, output and refunds)."""
        if self.input is not None and input_tokens:
            self.input.take(input_tokens, now)
        if self.output is not None and output_tokens:
            self.output.take(output_tokens, now)

    def adopt_level(self, input_level: float | None, output_level: float | None) -> None:
        """Start no fuller than a peer that has been charging for a while: a router that
        starts (or restarts) must not hand out a full minute on top of what was spent."""
        if self.input is not None and input_level is not None:
            self.input.level = min(self.input.level, input_level)
        if self.output is not None and output_level is not None:
            self.output.level = min(self.output.level, output_level)

    def levels(self, now: float) -> tuple[float | None, float | None]:
        return (
            self.input.refill(now) if self.input is not None else None,
            self.output.refill(now) if self.output is not None else None,
        )

    def describe(self, now: float) -> dict[str, object]:
        out: dict[str, object] = {}
        for kind, bucket in (("input", self.input), ("output", self.output)):
            if bucket is None:
                out[kind] = None
                continue
            out[kind] = {
                "per_minute": bucket.capacity,
                "available": round(bucket.refill(now), 1),
                "exhausted": bucket.level < 1,
            }
        return out


class ChargeLog:
    """This router's net charges per tenant since the last :meth:`drain`: what it shares."""

    __slots__ = ("_charges",)

    def __init__(self) -> None:
        self._charges: dict[str, list[float]] = {}

    def add(self, tenant: str, input_tokens: float, output_tokens: float) -> None:
        entry = self._charges.get(tenant)
        if entry is None:
            self._charges[tenant] = [input_tokens, output_tokens]
        else:
            entry[0] += input_tokens
            entry[1] += output_tokens

    def drain(self) -> dict[str, tuple[float, float]]:
        """The charges since the last drain (net zero ones left out), and a fresh log."""
        charges, self._charges = self._charges, {}
        return {t: (i, o) for t, (i, o) in charges.items() if i or o}

    def __len__(self) -> int:
        return len(self._charges)
