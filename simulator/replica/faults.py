"""Fault injection for drills: set by flags at start or by POST /admin/faults at run time."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec


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

    def stall_remaining(self) -> float:
        return max(0.0, self.stall_until - time.monotonic())

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.spec)  # type: ignore[no-any-return]
