"""A trace as the fleet simulator reads it: each request's prompt as a chain of *units*.

A unit is one trace block (``Trace.block_tokens`` tokens, the last one possibly partial). Units
are interned into chain keys: two requests get the same key for their i-th unit exactly when
their first i + 1 block ids are equal, so a key stands for a whole prefix, like a radix path.
A partial last unit gets a key of its own (its content is only the start of that block).
Requests without block ids (no prefix information) get fresh keys: nothing is shared.

Keys are small positive ints (< 2**32), so they also serve as the one "token" per unit that the
simulator feeds the router's prefix index (block size 1): the index chains its router hashes over
them exactly as the live router chains them over token blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvroute.kvcore.block_hashing import chain_hashes, root_seed
from kvroute.simulator.traces.model import Trace, TraceRequest

_MAX_KEY = 2**32 - 1


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request to simulate: a trace request with its prompt as unit keys."""

    index: int  # position in the trace (results are reported by it)
    arrival_s: float
    input_tokens: int
    output_tokens: int
    unit_keys: tuple[int, ...]  # one per unit, the last one partial when input % block != 0
    full_units: int  # how many of unit_keys are whole blocks
    route_hashes: tuple[int, ...]  # router chain hashes of the full units (index block size 1)
    session_id: str | None = None
    gap_s: float | None = None  # TraceRequest.gap_s: after the session's previous response


@dataclass(frozen=True, slots=True)
class UnitTrace:
    """A trace prepared for simulation (built once, shared by every policy compared)."""

    name: str
    block_tokens: int
    requests: tuple[SimRequest, ...]
    distinct_units: int

    @property
    def duration_s(self) -> float:
        reqs = self.requests
        return reqs[-1].arrival_s - reqs[0].arrival_s if reqs else 0.0


class _Interner:
    def __init__(self) -> None:
        self.keys: dict[tuple[int, ...], int] = {}

    def key(self, parent: int, item: int, partial: int = 0) -> int:
        token = (parent, item, partial) if partial else (parent, item)
        key = self.keys.get(token)
        if key is None:
            key = len(self.keys) + 1  # never 0: the index reads 0 as "no parent"
            if key > _MAX_KEY:
                raise ValueError("trace has more than 2**32 distinct prefix blocks")
            self.keys[token] = key
        return key

    def fresh(self) -> int:
        return self.key(-1, -len(self.keys) - 1)


def prepare(trace: Trace) -> UnitTrace:
    """Intern every request's block ids into unit keys and compute their router hashes."""
    interner = _Interner()
    block = trace.block_tokens
    if block < 1:
        raise ValueError(f"trace block size must be >= 1, got {block}")
    seed = root_seed(None)
    out = [
        _prepare_one(i, request, block, interner, seed) for i, request in enumerate(trace.requests)
    ]
    return UnitTrace(trace.name, block, tuple(out), len(interner.keys))


def _prepare_one(
    index: int, request: TraceRequest, block: int, interner: _Interner, seed: int
) -> SimRequest:
    tokens = max(1, request.input_tokens)  # an empty prompt still costs a token
    n_units = -(-tokens // block)
    full = tokens // block
    ids: Iterable[int] = request.block_ids
    keys: list[int] = []
    parent = 0
    if request.block_ids:
        for i, block_id in enumerate(ids):
            if i >= n_units:
                break
            partial = tokens - i * block if i == full else 0
            parent = interner.key(parent, block_id, partial)
            keys.append(parent)
    while len(keys) < n_units:  # no (or too few) ids: content nobody else has
        keys.append(interner.fresh())
    hashes = chain_hashes(keys[:full], 1, seed)
    return SimRequest(
        index=index,
        arrival_s=request.arrival_s,
        input_tokens=tokens,
        output_tokens=max(1, request.output_tokens),
        unit_keys=tuple(keys),
        full_units=full,
        route_hashes=tuple(hashes),
        session_id=request.session_id,
        gap_s=request.gap_s,
    )


def scaled(trace: UnitTrace, rate_multiplier: float) -> UnitTrace:
    """The same requests arriving ``rate_multiplier`` times as fast (from the first arrival)."""
    if rate_multiplier == 1.0 or not trace.requests:
        return trace
    t0 = trace.requests[0].arrival_s
    requests = tuple(
        replace(r, arrival_s=t0 + (r.arrival_s - t0) / rate_multiplier) for r in trace.requests
    )
    return UnitTrace(trace.name, trace.block_tokens, requests, trace.distinct_units)
