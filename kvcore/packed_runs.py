"""Runs of router block hashes packed as native uint64 bytes, and the lookup loops over them.

The prefix index (kvcore/prefix_index.py) keeps each run of blocks it indexes as one ``bytes``
of their hashes: a lookup compares them as contiguous memory, where a tuple of ints made it
load each block's int object (scattered over a heap of millions), and a run costs the same
memory (8 bytes a block, as a tuple's pointer).

Four loops of a lookup or an event have C twins in kvcore/_speedups.c that give the same
results (used when built, see setup.py; the tests run both). Counted with valgrind on CPython
3.11, in instructions, C vs Python: ``follow`` over 128 hashes (97 the run's) ~5k vs ~49k;
``walk`` over 5 pieces ~11k vs ~18k (big-int ANDs either way); ``pack`` of an event's 16
hashes ~1.5k vs ~5k. ``assemble`` builds a lookup's result: in Python it cost more than the
rest of a lookup (timeit, warm, 200k entries: ~10 us of a 10-13 us lookup with ~40 replicas
matched, 11 of them with predictions; follow and walk ~0.6 us each).

Pure: no I/O, no asyncio, no clock.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

Run = bytes  # the router hashes of a run's blocks, in order, as native uint64
W = 8  # bytes per hash in a run
_ORDER = sys.byteorder
# Unsigned 64-bit: "L" where it is (Linux, macOS), as array("L", ints) is ~2-3x faster than
# array("Q", ints) on CPython 3.11 (PyLong_AsUnsignedLong has a fast path, ...LongLong not).
_TYPECODE = "L" if array("L").itemsize == W else "Q"

_M = TypeVar("_M", bound=tuple[int, int])
_tuple_new = tuple.__new__  # a NamedTuple's own __new__ runs Python code, ~1 us


def pack_python(hashes: Sequence[int]) -> Run:
    """Hashes as a run: OverflowError for one outside [0, 2**64), TypeError for a non-int."""
    return array(_TYPECODE, hashes).tobytes()


def unpack(run: Run) -> list[int]:
    """A run's hashes."""
    return array(_TYPECODE, run).tolist()


def word(router_hash: int) -> bytes:
    """One hash as it is in a run."""
    return router_hash.to_bytes(W, _ORDER)


def find(run: Run, packed_hash: bytes) -> int:
    """Where this hash (packed) is in the run; -1 if it is not there."""
    if run.startswith(packed_hash):
        return 0
    at = run.find(packed_hash)
    while at > 0 and at & 7:  # equal bytes across two hashes: look on
        at = run.find(packed_hash, at + 1)
    return at >> 3 if at > 0 else -1


def follow_python(run: Run, hashes: Sequence[int], i: int, limit: int) -> tuple[int, int]:
    """``(j, n)``: where ``hashes[i]`` is in the run, and how many of ``hashes[i:i + limit]``
    equal (``==``) the run's from there; ``(-1, 0)`` if it is not there. Exact for any hashes,
    chained or not."""
    if not 0 <= i < len(hashes) or limit <= 0:
        return -1, 0
    stretch = hashes[i : i + limit]
    try:
        packed = pack_python(stretch)
    except (OverflowError, TypeError):  # not all 64-bit ints (never from block_hashes)
        return _follow_by_equality(run, stretch)
    j = find(run, packed[:W])
    if j < 0:
        return -1, 0
    most = min(len(run) // W - j, len(stretch))
    start = j * W
    if run.startswith(packed[: most * W], start):
        return j, most
    lo, hi = 1, most  # the run has the first lo from j on, not the first hi
    while hi - lo > 1:  # exact for any hashes: equal stretches only shrink
        mid = (lo + hi) >> 1
        if run.startswith(packed[: mid * W], start):
            lo = mid
        else:
            hi = mid
    return j, lo


def _follow_by_equality(run: Run, stretch: Sequence[object]) -> tuple[int, int]:
    blocks = unpack(run)
    try:
        j = blocks.index(stretch[0])  # type: ignore[arg-type]
    except ValueError:
        return -1, 0
    n = 1
    while n < len(stretch) and j + n < len(blocks) and blocks[j + n] == stretch[n]:
        n += 1
    return j, n


def walk_python(
    pieces: tuple[int, ...], j: int, end: int, i: int, alive: int, ends: list[tuple[int, int]]
) -> int:
    """The running AND of a run's values (``pieces``: value, start, value, ...) over its blocks
    ``j:end``, which are the request's from block ``i`` on, into ``alive``; where it loses
    replicas, ``ends`` gets (the request's block there, the replicas lost). At the request's
    first block (``i == 0``) ``alive`` starts as that block's value. Returns ``alive``."""
    last = len(pieces) - 1
    t = 0
    while t < last and pieces[t + 1] <= j:
        t += 2
    at = i  # where the piece starts in the request
    while True:
        value = pieces[t]
        if at:
            kept = alive & value
            if kept != alive:
                ends.append((at, alive ^ kept))  # no ~: bitwise ops on negative ints are slow
                alive = kept
                if not alive:
                    return 0
        else:
            alive = value
        if t == last or pieces[t + 1] >= end:
            return alive
        at = i + pieces[t + 1] - j
        t += 2


def assemble_python(
    ends: list[tuple[int, int]],
    low: int,
    shift: int,
    names: list[str],
    same: list[_M],
    match_type: type[_M],
) -> dict[str, _M]:
    """A lookup's result from ``ends`` (the request's block where replicas' runs end, and
    their bits: held runs in ``low``, runs held or predicted above ``shift``): per replica,
    ``match_type((blocks, confirmed))``, ``same[n]`` where both are ``n``."""
    out: dict[str, _M] = {}
    confirmed: dict[int, int] = {}  # replica index -> where its held run ended
    for length, ended in ends:
        held = ended & low
        ended >>= shift
        while held:  # measured faster than bin()/str.find
            top = held.bit_length() - 1
            confirmed[top] = length
            held ^= 1 << top
        while ended:
            top = ended.bit_length() - 1
            c = confirmed.get(top, 0)
            out[names[top]] = same[length] if c == length else _tuple_new(match_type, (length, c))
            ended ^= 1 << top
    return out


_native: ModuleType | None
try:
    from kvroute.kvcore import _speedups as _native
except ImportError:  # not built (no C compiler at install time): the Python twins
    _native = None

Walk = Callable[[tuple[int, ...], int, int, int, int, list[tuple[int, int]]], int]
Assemble = Callable[
    [list[tuple[int, int]], int, int, list[str], list[Any], type[Any]], dict[str, Any]
]
pack: Callable[[Sequence[int]], Run] = pack_python
follow: Callable[[Run, Sequence[int], int, int], tuple[int, int]] = follow_python
walk: Walk = walk_python
assemble: Assemble = assemble_python


def use_speedups(on: bool = True) -> bool:
    """Run ``pack``, ``follow``, ``walk`` and ``assemble`` in C (kvcore/_speedups.c, if
    built) or as their Python twins: the same results. Returns whether C runs them now. C is
    the default; the twins are for comparisons."""
    global pack, follow, walk, assemble
    if on and _native is not None:
        pack, follow, walk = _native.pack_u64, _native.follow, _native.walk
        assemble = _native.assemble
        return True
    pack, follow, walk, assemble = pack_python, follow_python, walk_python, assemble_python
    return False


use_speedups()
