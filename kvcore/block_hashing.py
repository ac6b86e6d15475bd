"""Router-owned chained block hashes (DESIGN.md principle 2).

A prompt's token ids are cut into blocks of ``block_size``; every FULL block gets
``xxh3_64(tokens as little-endian uint32, seed=parent hash)``, the first block seeded by
:func:`root_seed` (0, or a hash of an extra key such as a LoRA name or cache salt). Equal hashes
mean equal prefixes (and equal extra key), like a path in a radix tree. A trailing partial block
gets no hash. Nothing here depends on vLLM's hash algorithm, its seed or ``PYTHONHASHSEED``.

Two implementations give the same hashes (the tests compare them, and the C one with the xxhash
package): the C extension ``router._speedups`` (built by ``pip install -e .``, see setup.py),
and a pure-Python loop used where it is not built (or after ``use_speedups(False)``). The C code
reads each token id straight from the int and hashes each block without a Python call, where
the Python loop pays a list -> array conversion and a call and a bytes slice per block. Counted
with valgrind (CPython 3.11), 128 blocks of 16 tokens: ~118k instructions in C, ~418k in Python;
a BlockStored event of 16 blocks: ~16k and ~58k. ``kvroute bench index`` on the dev box (2 vCPU
EPYC, shared), hashing a 128-block prompt: p50 ~23-25 us in C, ~75-90 us in Python.

The Python loop packs with ``array("I", tokens).tobytes()`` once, then a bytes slice per block
(``struct.pack`` was ~10% slower, memoryview slices ~5% slower, ``itertools.accumulate`` ~30%
slower). ``array("I")`` is native-endian; on a big-endian host the buffer is byteswapped so
hashes are the same everywhere.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from types import ModuleType

from xxhash import xxh3_64_intdigest

ChainHashes = Callable[[Sequence[int], int, int], list[int]]

# Names this scheme in what carries router hashes beyond one process (index snapshots): change
# it with any change to the hashes.
HASH_SCHEME = "xxh3_64-chain-u32le-v1"

_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover - every CPython platform we run on has 4
    raise ImportError("array('I') is not 4 bytes on this platform")


def extra_key(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The key that seeds a sequence's first block: its LoRA adapter and its cache salt.

    An adapter's key always has the NUL after its name, so adapter "a" and salt "a" differ.
    """
    if lora_name is None:
        return cache_salt
    return f"{lora_name}\x00{cache_salt or ''}"


def root_seed(extra_key: str | None = None) -> int:
    """Seed of a sequence's first block: 0 without an extra key, else a hash of the key."""
    if extra_key is None:
        return 0
    return xxh3_64_intdigest(b"kvroute-extra-key:" + extra_key.encode())


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes. OverflowError for ids outside [0, 2**32)."""
    buf = array("I", token_ids)
    if _BIG_ENDIAN:  # pragma: no cover
        buf.byteswap()
    return buf.tobytes()


def chain_hashes_python(token_ids: Sequence[int], block_size: int, parent: int) -> list[int]:
    """:func:`chain_hashes` in pure Python (``block_size`` >= 1)."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    if len(token_ids) != n * block_size:
        token_ids = token_ids[: n * block_size]
    buf = pack_tokens(token_ids)
    width = block_size * 4
    out: list[int] = []
    append = out.append
    h = xxh3_64_intdigest
    for off in range(0, n * width, width):
        parent = h(buf[off : off + width], parent)
        append(parent)
    return out


_native: ModuleType | None
try:
    from kvroute.kvcore import _speedups as _native
except ImportError:  # not built (no C compiler at install time): the Python loop
    _native = None

_chain: ChainHashes = chain_hashes_python


def use_speedups(on: bool = True) -> bool:
    """Hash in C (kvcore/_speedups.c, if built) or with the Python loop: the same hashes.
    Returns whether C hashes now. C is the default; the Python loop is for comparisons."""
    global _chain
    _chain = _native.chain_hashes if on and _native is not None else chain_hashes_python
    return _chain is not chain_hashes_python


use_speedups()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Hashes of the full blocks of ``token_ids``, chained from ``parent`` (a hash or a seed).

    OverflowError for a token id outside [0, 2**32), TypeError for one that is not an int.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if block_size > len(token_ids):  # no full block (and no size the C code must check)
        return []
    return _chain(token_ids, block_size, parent)


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: str | None = None
) -> list[int]:
    """The router hashes of the full blocks of a prompt (a trailing partial block is skipped)."""
    return chain_hashes(token_ids, block_size, root_seed(extra_key))
