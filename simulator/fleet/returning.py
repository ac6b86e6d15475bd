"""The hit rate of sessions' returning turns, against the pooled-LRU bound on the same turns.

A returning turn is a request whose session (``SimRequest.session_id``) sent an earlier one: an
agent back from a tool call, a user's next message. Its prompt is the last turn's plus a little,
so its hit rate says how well the fleet kept a session's cache warm across the gap. First turns
are left out: nothing of theirs could have been kept. Only turns that were served count (one
larger than a replica's KV cache is rejected), for the policy and the bound alike; the bound is
``bounds.pooled_lru_hits`` (one LRU as large as the fleet) over the whole trace, read on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .bounds import pooled_lru_hits
from .results import SimResult
from .units import UnitTrace


def returning_indices(trace: UnitTrace) -> list[int]:
    """Trace indices of the requests whose session sent an earlier request."""
    seen: set[str] = set()
    out: list[int] = []
    for request in trace.requests:
        session = request.session_id
        if session is None:
            continue
        if session in seen:
            out.append(request.index)
        else:
            seen.add(session)
    return out


def pooled_bound_hits(trace: UnitTrace, capacity_blocks: int, block_size: int) -> list[int]:
    """Per request (by trace index), the pooled LRU's hit tokens."""
    hits = [0] * len(trace.requests)
    for request, hit, _ in pooled_lru_hits(trace, capacity_blocks, block_size):
        hits[request.index] = hit
    return hits


def returning_summary(
    trace: UnitTrace, result: SimResult, returning: Sequence[int], bound_hits: Sequence[int]
) -> dict[str, Any] | None:
    """``summary.json``'s ``returning_turns``: None when the trace has no returning turn."""
    served = [i for i in returning if not math.isnan(result.finish_s[i])]
    if not served:
        return None
    hit = sum(result.hit_tokens[i] for i in served)
    queried = sum(result.queried_tokens[i] for i in served)
    bound = sum(bound_hits[i] for i in served)
    prompt = sum(trace.requests[i].input_tokens for i in served)
    rate = hit / queried if queried else math.nan
    bound_rate = bound / prompt if prompt else math.nan
    return {
        "requests": len(served),
        "hit_rate": _num(rate),  # token-weighted, as prefix_hit_rate
        "pooled_lru_hit_rate": _num(bound_rate),
        "vs_pooled_lru": _num(rate / bound_rate) if bound_rate else None,
    }


def _num(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 6)
