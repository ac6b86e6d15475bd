"""Types of the C extension built from _speedups.c (see setup.py)."""

from collections.abc import Sequence
from typing import TypeVar

_M = TypeVar("_M", bound=tuple[int, int])

def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int, /) -> list[int]: ...
def xxh3_64(data: bytes, seed: int, /) -> int: ...
def pack_u64(ints: Sequence[int], /) -> bytes: ...
def follow(run: bytes, hashes: Sequence[int], i: int, limit: int, /) -> tuple[int, int]: ...
def walk(
    pieces: tuple[int, ...], j: int, end: int, i: int, alive: int, ends: list[tuple[int, int]], /
) -> int: ...
def assemble(
    ends: list[tuple[int, int]],
    low: int,
    shift: int,
    names: list[str],
    same: list[_M],
    match_type: type[_M],
    /,
) -> dict[str, _M]: ...
