"""A batch job beside an online trace, and a capacity dip: the batch lane in the simulator.

The simulated router starts a job's lines as the live runner does (``router/batch/runner.py``),
with the same rules (``kvcore/batch_pacing.py``): on spare capacity, while the router's requests
in flight on the replicas in rotation leave room under ``max_in_flight_per_replica`` each; and,
for a job that falls behind a straight line to ``pace_fraction`` of its window, the lines it
lacks whatever the spare capacity (promoted). A started line is routed by the same policy as
any request (cache-aware placement included) and served like one.

One difference from the live router, by construction: the simulated router has no admission
queue (``limits.max_concurrent_requests``), so no online request ever waits there and the live
runner's preemption (an online request waiting past ``preempt_after_s`` aborts a batch line)
never fires; the spare-capacity rule alone makes room, as it does in a live router without
that limit.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from kvroute.kvcore.batch_pacing import behind, spare_slots
from kvroute.kvcore.block_hashing import chain_hashes, root_seed

from .results import NAN, SimResult
from .units import SimRequest, UnitTrace

_MAX_KEY = 2**32 - 1  # unit keys feed the prefix index as 32-bit tokens (units.py)


@dataclass(frozen=True)
class BatchJob:
    """One job: ``lines`` requests of ``input_tokens`` in, ``output_tokens`` out, the first
    ``shared_prefix_tokens`` of every prompt alike (a job's common instructions), submitted
    ``start_s`` after the trace's first arrival with ``window_s`` to finish."""

    lines: int
    input_tokens: int = 1000
    output_tokens: int = 200
    shared_prefix_tokens: int = 0
    start_s: float = 0.0
    window_s: float = 86400.0
    # batch: in the router's config, with the same meanings.
    max_in_flight_per_replica: int = 4
    pace_fraction: float = 0.8
    poll_s: float = 1.0

    def problems(self) -> list[str]:
        out = []
        for name in ("lines", "input_tokens", "output_tokens", "max_in_flight_per_replica"):
            if getattr(self, name) < 1:
                out.append(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.shared_prefix_tokens <= self.input_tokens:
            out.append(
                f"shared_prefix_tokens: must be between 0 and input_tokens "
                f"({self.input_tokens}), got {self.shared_prefix_tokens}"
            )
        for name in ("window_s", "poll_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                out.append(f"{name}: must be a number > 0, got {value}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            out.append(f"start_s: must be a number >= 0, got {self.start_s}")
        if not 0 < self.pace_fraction <= 1:
            out.append(f"pace_fraction: must be in (0, 1], got {self.pace_fraction}")
        return out


@dataclass(frozen=True)
class CapacityDip:
    """``fraction`` of the replicas (the highest-numbered) gone from ``start_s`` to ``end_s``
    (seconds on the trace's clock, as ``--fail``): their requests resume elsewhere, and they
    come back with empty caches."""

    fraction: float
    start_s: float
    end_s: float

    def replicas(self, fleet: int) -> list[int]:
        gone = min(fleet, max(1, round(self.fraction * fleet)))
        return list(range(fleet - gone, fleet))

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.fraction <= 1:
            out.append(f"dip fraction: must be in (0, 1], got {self.fraction}")
        if not (math.isfinite(self.start_s) and 0 <= self.start_s < self.end_s):
            out.append(f"dip window: need 0 <= start < end, got {self.start_s}-{self.end_s}")
        if not math.isfinite(self.end_s):
            out.append(f"dip end: must be a finite number, got {self.end_s}")
        return out


def batch_lines(units: UnitTrace, job: BatchJob) -> tuple[SimRequest, ...]:
    """The job's lines as requests to simulate beside ``units``: numbered after its requests,
    each prompt ``shared_prefix_tokens`` alike then its own, with unit keys past the trace's
    (so a line never passes for an online prefix). A line's arrival is when the lane starts
    it; until then it holds the job's submission time."""
    block = units.block_tokens
    first = units.requests[0].arrival_s if units.requests else 0.0
    n_units = -(-job.input_tokens // block)
    full = job.input_tokens // block
    shared = min(job.shared_prefix_tokens // block, full)
    seed = root_seed(None)
    next_key = units.distinct_units + 1
    prefix = list(range(next_key, next_key + shared))
    next_key += shared
    lines = []
    for k in range(job.lines):
        own = list(range(next_key, next_key + n_units - shared))
        next_key += n_units - shared
        keys = prefix + own
        lines.append(
            SimRequest(
                index=len(units.requests) + k,
                arrival_s=first + job.start_s,
                input_tokens=job.input_tokens,
                output_tokens=job.output_tokens,
                unit_keys=tuple(keys),
                full_units=full,
                route_hashes=tuple(chain_hashes(keys[:full], 1, seed)),
            )
        )
    if next_key > _MAX_KEY:
        raise ValueError("the batch job has more than 2**32 distinct prefix blocks")
    return tuple(lines)


@dataclass
class BatchOutcome:
    """What the job got: when it was done against its window, and what it took."""

    lines: int
    completed: int  # lines finished
    on_time: int  # of them, within the window
    submitted_s: float  # trace clock
    window_s: float
    done_s: float  # the last line's finish (NaN: not all finished)
    promoted: int  # lines started behind pace, whatever the spare capacity
    computed_tokens: int  # prefill not found cached + output, over its lines
    online_computed_tokens: int  # the same over the online requests

    @property
    def met_window(self) -> bool:
        return self.on_time == self.lines

    @property
    def token_share(self) -> float:
        total = self.computed_tokens + self.online_computed_tokens
        return self.computed_tokens / total if total else NAN

    def as_dict(self) -> dict[str, object]:
        took = self.done_s - self.submitted_s
        return {
            "lines": self.lines,
            "completed": self.completed,
            "on_time": self.on_time,
            "window_s": self.window_s,
            "completion_s": None if math.isnan(took) else took,
            "completion_of_window": None if math.isnan(took) else took / self.window_s,
            "met_window": self.met_window,
            "promoted": self.promoted,
            "computed_tokens": self.computed_tokens,
            "share_of_computed_tokens": self.token_share,
        }


class BatchLane:
    """The job's lines not started, started, and finished, and the runner's choice each tick."""

    def __init__(self, job: BatchJob, lines: tuple[SimRequest, ...]) -> None:
        self.job = job
        self.pending: deque[SimRequest] = deque(lines)
        self.submitted_s = lines[0].arrival_s if lines else 0.0
        self.expires_s = self.submitted_s + job.window_s
        self.running: dict[int, bool] = {}  # line index -> promoted
        self.finished = 0
        self.promoted = 0

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def to_start(self, now: float, in_flight: list[int]) -> list[SimRequest]:
        """Lines to start now: spare capacity first, then what pacing promotes.
        ``in_flight``: the router's requests in flight on each replica in rotation."""
        job = self.job
        if now >= self.expires_s or not self.pending:
            return []
        plain = sum(1 for p in self.running.values() if not p)
        slots = spare_slots(in_flight, job.max_in_flight_per_replica, False, plain, None)
        started = [self._start(now, promoted=False) for _ in range(min(slots, len(self.pending)))]
        cap = job.max_in_flight_per_replica * len(in_flight)
        promoted = sum(1 for p in self.running.values() if p)
        lag = behind(
            job.lines, self.finished, len(self.running), self.submitted_s, self.expires_s, now,
            job.pace_fraction,
        )  # fmt: skip
        for _ in range(max(0, min(lag, cap - promoted, len(self.pending)))):
            started.append(self._start(now, promoted=True))
            self.promoted += 1
        return started

    def _start(self, now: float, promoted: bool) -> SimRequest:
        line = replace(self.pending.popleft(), arrival_s=now)
        self.running[line.index] = promoted
        return line

    def finish(self, index: int) -> None:
        if self.running.pop(index, None) is not None:
            self.finished += 1

    def lost(self, line: SimRequest) -> None:
        """A line whose request failed (no replica left): back to the queue, to run again."""
        self.running.pop(line.index, None)
        self.pending.appendleft(line)


def split_batch(result: SimResult, online: int, lane: BatchLane) -> BatchOutcome:
    """Cut the job's lines out of ``result`` (its per-request lists then hold the online
    requests only, as without a batch job) into their outcome."""
    tail = slice(online, None)
    finish = result.finish_s[tail]
    done = [f for f in finish if not math.isnan(f)]
    outcome = BatchOutcome(
        lines=len(finish),
        completed=len(done),
        on_time=sum(1 for f in done if f <= lane.expires_s),
        submitted_s=lane.submitted_s,
        window_s=lane.job.window_s,
        done_s=max(done) if len(done) == len(finish) and done else NAN,
        promoted=lane.promoted,
        computed_tokens=_computed(result, tail),
        online_computed_tokens=_computed(result, slice(0, online)),
    )
    for name in (
        "arrival_s", "input_tokens", "output_tokens", "first_token_s", "finish_s", "replica",
        "queried_tokens", "hit_tokens", "reroutes", "rejected",
    ):  # fmt: skip
        del getattr(result, name)[tail]
    if result.estimated_ttft_s is not None:
        for values in result.estimated_ttft_s.values():
            del values[tail]
    return outcome


def _computed(result: SimResult, part: slice) -> int:
    """Tokens the engines computed for these requests: prompt not found cached, and output."""
    total = 0
    for queried, hit, out, fin in zip(
        result.queried_tokens[part], result.hit_tokens[part], result.output_tokens[part],
        result.finish_s[part], strict=True,
    ):  # fmt: skip
        if not math.isnan(fin):
            total += queried - hit + out
    return total
