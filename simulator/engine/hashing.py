"""Chained block hashes for the prefix cache.

Like vLLM, a full block's hash covers its parent's hash, its tokens and its extra keys (LoRA name
on every block, cache salt on the first block only), so equal hashes mean equal prefixes. vLLM uses
sha256 over pickled tuples; the engine model needs only the same *structure*, so it uses xxh3_64
with the parent hash as the seed: fast, 64-bit like the ints vLLM publishes by default, and the
same for the same tokens in every process (as vLLM >= 0.29 with its fixed default seed). The router
never depends on these values: it maps them to its own hashes through the events' token_ids.
"""

from __future__ import annotations

from array import array

from xxhash import xxh3_64_intdigest

NONE_HASH = xxh3_64_intdigest(b"kvroute-engine-none-hash")
"""Parent of a sequence's first block (vLLM's NONE_HASH)."""


def extra_key_bytes(lora_name: str | None, cache_salt: str | None) -> tuple[bytes, bytes]:
    """Extra-key bytes mixed into (first block, later blocks), length-prefixed to be unambiguous."""
    rest = b""
    if lora_name is not None:
        data = lora_name.encode()
        rest = b"L" + len(data).to_bytes(4, "little") + data
    first = rest
    if cache_salt is not None:
        data = cache_salt.encode()
        first += b"S" + len(data).to_bytes(4, "little") + data
    return first, rest


def token_bytes(token_ids: list[int]) -> bytes:
    """Tokens as little-endian int64s. Raises OverflowError/TypeError for non-int64 items."""
    return array("q", token_ids).tobytes()


def extend_block_hashes(
    hashes: list[int],
    token_ids: list[int],
    block_size: int,
    extra_first: bytes,
    extra_rest: bytes,
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` does not cover yet."""
    start = len(hashes)
    end = len(token_ids) // block_size
    if start >= end:
        return
    parent = hashes[-1] if hashes else NONE_HASH
    buf = token_bytes(token_ids[start * block_size : end * block_size])
    width = block_size * 8
    offset = 0
    for index in range(start, end):
        extra = extra_first if index == 0 else extra_rest
        chunk = buf[offset : offset + width]
        offset += width
        # Never 0: "0" means "no parent" to some consumers (the llm-d simulator's legacy events).
        parent = xxh3_64_intdigest(chunk + extra if extra else chunk, parent) or 1
        hashes.append(parent)
