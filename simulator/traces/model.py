"""A trace as the simulator and the live replayer read it (pure data).

Every loader (Mooncake, Azure, Claude Code sessions, synthetic generators) produces a ``Trace``.
Prefix structure is carried as block ids: ``block_ids[i]`` names the content of tokens
``[i * block_tokens, (i + 1) * block_tokens)`` of the prompt, chained like a radix path, so two
requests share a prefix of k blocks exactly when their first k ids are equal. The last block may
be partial (``input_tokens`` need not be a multiple of ``block_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass


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
