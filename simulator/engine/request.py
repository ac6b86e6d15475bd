"""A request as submitted, and the engine's state for it while it lives (nano-vllm's Sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from xxhash import xxh3_64_intdigest

from .block_pool import Block
from .hashing import extend_block_hashes, extra_key_bytes


@dataclass
class EngineRequest:
    """What a client asked for, already tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    lora_name: str | None = None  # part of every block's hash key, like vLLM
    cache_salt: str | None = None  # part of the first block's hash key, like vLLM
    # Seed of the generated tokens; None: from the engine seed and the request id (sampling).
    # A greedy request passes one derived from its prompt, so that every replica answers it
    # alike, as replicas with the same weights do.
    token_seed: int | None = None
    # P/D disaggregation, decode side: the KV of the prompt's first N tokens was moved in from a
    # prefill replica, so they are not computed here (vLLM's external computed tokens).
    external_computed_tokens: int = 0
    # P/D, prefill side (do_remote_decode): when it finishes, its blocks stay held for a decode
    # replica to read until ``Engine.release_held`` (NixlConnector's delay_free_blocks).
    hold_blocks: bool = False


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Everything the engine tracks for one request.

    ``token_ids`` holds the prompt then the generated tokens, one list that grows: preemption by
    recompute re-prefills all of it, and output blocks are hashed and cached like prompt blocks.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    lora_name: str | None
    token_seed: int  # per-request seed of the generated tokens
    extra_first: bytes  # hash extra keys of block 0 (LoRA + cache salt)
    extra_rest: bytes  # hash extra keys of later blocks (LoRA)
    event_extra_first: tuple[Any, ...] | None  # the same, as vLLM publishes them in events
    event_extra_rest: tuple[Any, ...] | None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0  # blocks[:n] are in the prefix cache (stored or hit)
    block_hashes: list[int] = field(default_factory=list)  # one per full block of token_ids
    num_cached_tokens: int = -1  # prefix-hit tokens at the first schedule; -1 before it
    num_preemptions: int = 0
    external_tokens: int = 0  # prompt tokens moved in, taken as computed at the first schedule
    num_external_tokens: int = 0  # of those, the ones no local prefix hit covered (metrics)
    hold_blocks: bool = False  # keep the blocks held when it finishes (P/D prefill side)


def token_seed(seed: int, request_id: str) -> int:
    """Seed of a request's generated tokens: a function of the engine seed and the request id.

    63 bits, so that seed + position stays a valid 64-bit xxh3 seed.
    """
    return xxh3_64_intdigest(request_id.encode(), seed & 0xFFFF_FFFF_FFFF_FFFF) >> 1


def generated_token(seed: int, position: int, vocab_size: int) -> int:
    """The token at output ``position``: deterministic, uniform-looking in [0, vocab_size).

    xxh3 of empty input under seed ``seed + position`` is a full 64-bit avalanche of the seed,
    and needs no bytes object per token.
    """
    return xxh3_64_intdigest(b"", seed + position) % vocab_size


def new_sequence(request: EngineRequest, seed: int, block_size: int, caching: bool) -> Sequence:
    """The engine's state for a validated request, with its prompt's block hashes computed."""
    extra_first, extra_rest = extra_key_bytes(request.lora_name, request.cache_salt)
    # Extra keys as vLLM publishes them per block: LoRA name, then the salt on block 0 only.
    rest_key = (request.lora_name,) if request.lora_name is not None else None
    first_key = rest_key
    if request.cache_salt is not None:
        first_key = (*(rest_key or ()), request.cache_salt)
    seq = Sequence(
        request_id=request.request_id,
        token_ids=list(request.prompt_token_ids),
        num_prompt_tokens=len(request.prompt_token_ids),
        max_tokens=request.max_tokens,
        lora_name=request.lora_name,
        token_seed=token_seed(seed, request.request_id)
        if request.token_seed is None
        else request.token_seed & 0x7FFF_FFFF_FFFF_FFFF,
        extra_first=extra_first,
        extra_rest=extra_rest,
        event_extra_first=first_key,
        event_extra_rest=rest_key,
        external_tokens=request.external_computed_tokens,
        hold_blocks=request.hold_blocks,
    )
    if caching:
        extend_block_hashes(seq.block_hashes, seq.token_ids, block_size, extra_first, extra_rest)
    return seq
