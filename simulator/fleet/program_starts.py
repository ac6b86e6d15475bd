"""A fixed number of agent programs at a time (``kvroute replay --closed-loop
--programs-in-flight C``): the load of a benchmark client that keeps C agents running, each
replaced by the next when it ends (llm-d's program-aware fairness runs, "c=250"), instead of
the trace's own session start times.

The programs start in the order of their first recorded request. The first C start together at
the trace's first arrival; each later one starts when a running program's last request has left
the fleet. A program that starts at ``t`` sends each of its sessions' first requests (the
parent's and its sub-agents') at ``t`` plus that request's recorded offset from the program's
first request; every later turn follows the closed loop (its recorded gap after the previous
answer). Pure: the fleet asks what arrives when.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class ProgramStarts:
    """Which requests arrive when, ``limit`` programs at a time (by request index)."""

    def __init__(
        self,
        arrival_s: Sequence[float],
        programs: Sequence[str],
        held: set[int],
        limit: int,
    ) -> None:
        """``arrival_s[i]``, ``programs[i]``: request i's recorded arrival and program (only
        requests ``0 .. len(programs) - 1`` take part: batch lines past them do not);
        ``held``: the requests the closed loop sends after an earlier one (not started here)."""
        if limit < 1:
            raise ValueError(f"programs in flight must be >= 1, got {limit}")
        self.limit = limit
        self._arrival = arrival_s
        self._program = programs
        self.remaining: dict[str, int] = {}
        self.firsts: dict[str, list[int]] = {}
        order: list[str] = []
        for index, program in enumerate(programs):
            if program not in self.remaining:
                self.remaining[program] = 0
                self.firsts[program] = []
                order.append(program)
            self.remaining[program] += 1
            if index not in held:
                self.firsts[program].append(index)
        self._waiting = deque(order)
        self._left: set[int] = set()
        self.started = 0
        self.running = 0

    @property
    def deferred(self) -> set[int]:
        """Requests not sent at their recorded time: every program's first ones."""
        return {i for firsts in self.firsts.values() for i in firsts}

    def initial(self, t: float) -> list[tuple[float, int]]:
        """The first ``limit`` programs, started at ``t``: (arrival time, request index)."""
        return self._fill(t)

    def left(self, index: int, t: float) -> list[tuple[float, int]]:
        """Request ``index`` left the fleet at ``t`` (finished, failed or refused): the arrivals
        of the program started in its program's place, if that was its last request."""
        if index >= len(self._program) or index in self._left:
            return []
        self._left.add(index)
        program = self._program[index]
        self.remaining[program] -= 1
        if self.remaining[program] > 0:
            return []
        self.running -= 1
        return self._fill(t)

    def _fill(self, t: float) -> list[tuple[float, int]]:
        """Start waiting programs at ``t`` until ``limit`` run; their first requests' arrivals.
        A program's first request is never held (nothing precedes it), so each sends some."""
        arrivals: list[tuple[float, int]] = []
        while self._waiting and self.running < self.limit:
            firsts = self.firsts[self._waiting.popleft()]
            self.started += 1
            self.running += 1
            origin = self._arrival[firsts[0]]
            arrivals += [(t + self._arrival[i] - origin, i) for i in firsts]
        return arrivals
