"""Fault injection for drills: set by flags at start or by POST /admin/faults at run time."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from xxhash import xxh3_64_intdigest


class FaultSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Fraction of generation requests answered with a 500 error (0-1).
    error_rate: float = 0.0
    # Accept requests but send nothing for this many seconds (from when it is set).
    stall_s: float = 0.0
    # Every engine step takes this many times longer.
    slowdown: float = 1.0
    # Close streaming connections after this many chunks (0 = never).
    drop_after_chunks: int = 0
    # Exit the process (code 1) this many seconds from now (negative = never).
    exit_after_s: float = -1.0
    # Output drift: from this output position on (0: the first token), every generated token
    # is another one, confidently (as from wrong weights or a broken kernel); negative = never.
    drift: int = -1


@dataclass
class Faults:
    spec: FaultSpec = field(default_factory=FaultSpec)
    stall_until: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def update(self, spec: FaultSpec) -> None:
        if not 0.0 <= spec.error_rate <= 1.0:
            raise ValueError("error_rate must be between 0 and 1")
        if spec.slowdown <= 0:
            raise ValueError("slowdown must be > 0")
        if spec.stall_s < 0 or spec.drop_after_chunks < 0:
            raise ValueError("stall_s and drop_after_chunks must be >= 0")
        self.spec = spec
        self.stall_until = time.monotonic() + spec.stall_s if spec.stall_s else 0.0

    def should_error(self) -> bool:
        return self.spec.error_rate > 0 and self.rng.random() < self.spec.error_rate

    def drifted(self, token_ids: list[int], start: int, vocab_size: int) -> list[int]:
        """``token_ids`` (output positions ``start``...) as this replica's drift makes them."""
        at = self.spec.drift
        if at < 0 or start + len(token_ids) <= at:
            return token_ids
        return [
            t if start + i < at else drifted_token(t, start + i, vocab_size)
            for i, t in enumerate(token_ids)
        ]

    def stall_remaining(self) -> float:
        return max(0.0, self.stall_until - time.monotonic())

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.spec)  # type: ignore[no-any-return]


def drifted_token(token: int, position: int, vocab_size: int) -> int:
    """Another token than ``token``, the same one on every drifted replica."""
    if vocab_size < 2:
        return token
    step = 1 + xxh3_64_intdigest(b"drift", position) % (vocab_size - 1)
    return (token + step) % vocab_size
