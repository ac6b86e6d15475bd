"""Two reference hit rates for a trace, to read a policy's hit rate against.

* ``infinite_cache_hit_rate``: one cache that never evicts: a prompt hits its longest prefix
  that any earlier request had. No routing can beat it (the trace's own reuse).
* ``pooled_lru_hit_rate``: one LRU cache as large as the whole fleet's KV capacity, as if every
  replica shared one pool. Routing that keeps each prefix on one replica approaches it; random
  routing spreads copies of hot prefixes and falls well below.

Both count what an engine counts: hit tokens over prompt tokens, in whole KV blocks of
``block_size`` tokens, at most every block but the one holding the last prompt token (vLLM
always computes that token). Requests are taken in arrival order; the unit (trace block) is the
caching granularity, as in the fast engine. ``unit_rate`` is the plain fraction of units hit,
the figure the traces' README quotes.

``prefill_alone_s`` times each prompt's prefill on an idle replica of a given engine: with the
infinite cache's hits it is a lower bound on the request's TTFT in any fleet of that engine
(sharing a step or missing the cache only adds time), so ``kvroute plan`` can tell an SLO no
fleet size meets; with nothing cached it is the request's own prefill work, which ``kvroute
replay`` compares TTFTs against to tell queueing from service.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.simulator.engine.config import EngineConfig

from .units import SimRequest, UnitTrace


@dataclass(frozen=True)
class HitRate:
    token_rate: float  # hit tokens / prompt tokens
    unit_rate: float  # hit units / units


def _unit_blocks(request: SimRequest, block_tokens: int, block_size: int) -> list[int]:
    n = request.input_tokens
    out: list[int] = []
    previous = 0
    for i in range(len(request.unit_keys)):
        bound = min((i + 1) * block_tokens, n) // block_size
        out.append(bound - previous)
        previous = bound
    return out


def _hit_tokens(request: SimRequest, hit_blocks: int, block_size: int) -> int:
    return min(hit_blocks * block_size, (request.input_tokens - 1) // block_size * block_size)


def infinite_cache_hit_rate(trace: UnitTrace, block_size: int = 16) -> HitRate:
    hit_tokens = tokens = hit_units = units = 0
    for request, hit, matched in _infinite_hits(trace, block_size):
        hit_units += matched
        units += len(request.unit_keys)
        hit_tokens += hit
        tokens += request.input_tokens
    return HitRate(_ratio(hit_tokens, tokens), _ratio(hit_units, units))


def _infinite_hits(trace: UnitTrace, block_size: int) -> Iterator[tuple[SimRequest, int, int]]:
    """(request, hit tokens, hit units) of each request with one cache that never evicts."""
    seen: set[int] = set()
    for request in trace.requests:
        keys = request.unit_keys
        blocks = _unit_blocks(request, trace.block_tokens, block_size)
        matched = hit_blocks = 0
        for key, b in zip(keys, blocks, strict=True):
            if key not in seen:
                break
            matched += 1
            hit_blocks += b
        yield request, _hit_tokens(request, hit_blocks, block_size), matched
        seen.update(keys)


def prefill_alone_s(trace: UnitTrace, engine: EngineConfig, *, cached: bool) -> list[float]:
    """Per request, seconds from admission to first token on an idle replica of ``engine``:
    chunks of ``max_num_batched_tokens`` timed as the fast engine times them, starting after
    the infinite cache's hits when ``cached``, from the first token otherwise."""
    step_time = engine.latency.step_time
    budget = engine.max_num_batched_tokens
    out: list[float] = []
    for request, hit, _ in _infinite_hits(trace, engine.block_size):
        done = hit if cached else 0
        total = 0.0
        while done < request.input_tokens:
            n = min(request.input_tokens - done, budget)
            total += step_time(n, n * done + n * (n + 1) // 2, done + n)
            done += n
        out.append(total)
    return out


def pooled_lru_hit_rate(trace: UnitTrace, capacity_blocks: int, block_size: int = 16) -> HitRate:
    """One LRU cache of ``capacity_blocks`` KV blocks over the whole trace."""
    hit_tokens = tokens = hit_units = units = 0
    for request, hit, matched in pooled_lru_hits(trace, capacity_blocks, block_size):
        hit_units += matched
        units += len(request.unit_keys)
        hit_tokens += hit
        tokens += request.input_tokens
    return HitRate(_ratio(hit_tokens, tokens), _ratio(hit_units, units))


def pooled_lru_hits(
    trace: UnitTrace, capacity_blocks: int, block_size: int = 16
) -> Iterator[tuple[SimRequest, int, int]]:
    """(request, hit tokens, hit units) of each request with one LRU cache of
    ``capacity_blocks`` KV blocks: the bound's per-request figure (``loss.py`` reads it)."""
    lru: OrderedDict[int, int] = OrderedDict()  # unit key -> its blocks, least recent first
    size = 0
    for request in trace.requests:
        keys = request.unit_keys
        blocks = _unit_blocks(request, trace.block_tokens, block_size)
        matched = hit_blocks = 0
        prefix = True
        for key, b in zip(keys, blocks, strict=True):
            if key in lru:
                lru.move_to_end(key)
                if prefix:
                    matched += 1
                    hit_blocks += b
                continue
            prefix = False
            if b > capacity_blocks:
                continue
            lru[key] = b
            size += b
            while size > capacity_blocks:
                size -= lru.popitem(last=False)[1]
        yield request, _hit_tokens(request, hit_blocks, block_size), matched


def _ratio(a: int, b: int) -> float:
    return a / b if b else float("nan")
