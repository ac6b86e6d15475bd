"""A trace as the simulator and the live replayer read it (pure data).

Every loader (Mooncake, Azure, Claude Code sessions, synthetic generators) produces a ``Trace``.
Prefix structure is carried as block ids: ``block_ids[i]`` names the content of tokens
``[i * block_tokens, (i + 1) * block_tokens)`` of the prompt, chained like a radix path, so two
requests share a prefix of k blocks exactly when their first k ids are equal. The last block may
be partial (``input_tokens`` need not be a multiple of ``block_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float  # seconds since the trace's start
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]  # ceil(input_tokens / block_tokens) ids; () = no prefix information
    session_id: str | None = None  # conversation / tenant / agent the request belongs to
    # Seconds from the response to the session's previous request to this one (an agent's tool
    # call, a user's thinking); None: the first of its session, or not recorded. A closed-loop
    # replay sends it that long after that response ends instead of at ``arrival_s``.
    gap_s: float | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests sorted by arrival, with the size of the token blocks their ids name."""

    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


class _Turn(Protocol):
    @property
    def session_id(self) -> str | None: ...
    @property
    def gap_s(self) -> float | None: ...


def next_turns(requests: Sequence[_Turn]) -> dict[int, int]:
    """Per request position, the next request of its session that has a recorded gap: what a
    closed loop sends that long after this one's response (the simulated fleet's and the live
    replay's). A request without a session, or without a gap, keeps its recorded time."""
    last: dict[str, int] = {}
    following: dict[int, int] = {}
    for index, request in enumerate(requests):
        session = request.session_id
        if session is None:
            continue
        previous = last.get(session)
        if previous is not None and request.gap_s is not None:
            following[previous] = index
        last[session] = index
    return following
