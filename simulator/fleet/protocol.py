"""What the fleet loop needs from an engine model, and what a step reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .kv_units import IndexOp
from .units import SimRequest


@dataclass(slots=True)
class StepReport:
    """What became visible when a step (or a run of decode steps) ended."""

    first_tokens: list[tuple[int, float]] = field(default_factory=list)  # (trace index, time)
    finished: list[tuple[int, float]] = field(default_factory=list)  # (trace index, time)
    # Prefix-cache lookups of newly scheduled requests: (trace index, prompt tokens, hit tokens)
    lookups: list[tuple[int, int, int]] = field(default_factory=list)
    index_ops: list[IndexOp] = field(default_factory=list)


class SimEngine(Protocol):
    """One replica's engine in virtual time, stepped by the fleet loop.

    ``start`` plans the next step at ``now`` and returns when it ends (None: nothing to do);
    requests added meanwhile wait for the next step. ``split`` may end a long planned run
    earlier (at the first step boundary at or after ``now``) so a new request joins sooner.
    """

    index_block_tokens: int  # prompt tokens per block of the index's hashes

    def route_hashes(self, request: SimRequest) -> tuple[int, ...]: ...

    def add(self, request: SimRequest, extra_tokens: int, to_generate: int) -> None: ...

    def start(self, now: float) -> float | None: ...

    def split(self, now: float) -> float: ...

    def complete(self) -> StepReport: ...

    def fail(self, now: float) -> tuple[StepReport, dict[int, int]]:
        """The replica dies at ``now``: what was delivered by then, and per unfinished
        request (trace index) the tokens it generated here."""
        ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...
