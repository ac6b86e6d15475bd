"""Router-owned chained block hashes (DESIGN.md principle 2).

A prompt's token ids are cut into blocks of ``block_size``; every FULL block gets
``xxh3_64(tokens as little-endian uint32, seed=parent hash)``, the first block seeded by
:func:`root_seed` (0, or a hash of an extra key such as a LoRA name or cache salt). Equal hashes
mean equal prefixes (and equal extra key), like a path in a radix tree. A trailing partial block
gets no hash. Nothing here depends on vLLM's hash algorithm, its seed or ``PYTHONHASHSEED``.

Packing: ``array("I", tokens).tobytes()`` once, then a bytes slice per block; measured on the dev
box (2 vCPU EPYC, Python 3.11) for 128 blocks of 16: ~37-62 us per prompt, of which ~25 us is the
list -> array conversion; ``struct.pack`` was ~10% slower, memoryview slices ~5% slower,
``itertools.accumulate`` ~30% slower. ``array("I")`` is native-endian; on a big-endian host the
buffer is byteswapped so hashes are the same everywhere.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover - every CPython platform we run on has 4
    raise ImportError("array('I') is not 4 bytes on this platform")


def extra_key(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The key that seeds a sequence's first block: its LoRA adapter and its cache salt."""
    if lora_name is None and cache_salt is None:
        return None
    if lora_name is None:
        return cache_salt
    return lora_name if cache_salt is None else f"{lora_name}\x00{cache_salt}"


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


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Hashes of the full blocks of ``token_ids``, chained from ``parent`` (a hash or a seed)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
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


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: str | None = None
) -> list[int]:
    """The router hashes of the full blocks of a prompt (a trailing partial block is skipped)."""
    return chain_hashes(token_ids, block_size, root_seed(extra_key))
