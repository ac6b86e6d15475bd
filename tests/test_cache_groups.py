"""Cache groups of hybrid models (issue 34 item 3): per-group events and vLLM's hybrid hit rule.

The property test generates random event histories of a hybrid model (a full-attention group and
a sliding-window group) as vLLM's own msgspec classes, feeds them to the prefix index through
the subscriber's decoding and dispatch, and checks the index's confirmed match against vLLM's
own ``HybridKVCacheCoordinator.find_longest_cache_hit`` run over a block pool holding the same
blocks (the coordinator's method and managers are vLLM's; only the block pool is a stand-in).
"""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import zmq.asyncio

from kvroute.kvcore.block_hashing import chain_hashes, root_seed
from kvroute.kvcore.cache_groups import GroupHoldings, hybrid_hit
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.router.kv_subscriber import KVEventSubscriber

BS = 4  # tokens per block


def _holdings(kind: str | None, window: int | None, held: list[int]) -> GroupHoldings:
    g = GroupHoldings()
    g.learn(kind, window)
    g.add(held)
    return g


def test_sliding_window_needs_only_the_window_before_the_hit() -> None:
    q = list(range(10))
    full = _holdings("full_attention", None, q[:8])
    # window 9 tokens -> cdiv(8, 4) = 2 blocks; blocks 0-3 evicted from the window group
    swa = _holdings("sliding_window", 9, q[4:8])
    assert hybrid_hit([full, swa], q, 10, BS) == 8
    swa.drop([q[7]])  # the last window before 8 is broken: the next one ends at 7 (blocks 5, 6)
    assert hybrid_hit([full, swa], q, 10, BS) == 7
    swa.drop([q[5]])  # no two in a row now, and block 0 is gone: no hit
    assert hybrid_hit([full, swa], q, 10, BS) == 0


def test_mamba_needs_only_the_last_block() -> None:
    q = list(range(6))
    full = _holdings("full_attention", None, q[:5])
    mamba = _holdings("mamba", None, [q[2]])
    assert hybrid_hit([full, mamba], q, 6, BS) == 3


def _stored(hashes: list[int], parent: int | None, tokens: list[int], group: int, window: int):
    from vllm.distributed.kv_events import BlockStored

    kind = "sliding_window" if group else "full_attention"
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window if group else None,
    )


def _removed(hashes: list[int], group: int):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=group)


def _encode(events: list[Any]) -> bytes:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=events))


class _Pool:
    """vLLM's BlockPool as the finders use it: how many copies of each (block hash, group)
    are cached (a block cached while a copy is held is a second copy, vLLM's duplicate)."""

    def __init__(self) -> None:
        self.cached: Counter[tuple[int, int]] = Counter()
        self.hash_block_size = BS
        self.null_block = None

    def get_cached_block(self, block_hash: int, group_ids: list[int]) -> list[object] | None:
        if all(self.cached[(block_hash, g)] > 0 for g in group_ids):
            return [object() for _ in group_ids]
        return None


def _vllm_hit(pool: _Pool, engine_hashes: list[int], window: int) -> int:
    """vLLM's HybridKVCacheCoordinator.find_longest_cache_hit over ``pool``, in blocks."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, SpecGroup
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager,
        SlidingWindowManager,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    torch = pytest.importorskip("torch")
    common = {"block_size": BS, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    full = FullAttentionSpec(**common)
    swa = SlidingWindowSpec(**common, sliding_window=window)
    manager = SimpleNamespace(
        block_size=BS, block_pool=pool, dcp_world_size=1, pcp_world_size=1, retains_longer_hit=False
    )
    coordinator = SimpleNamespace(
        kv_cache_config=SimpleNamespace(kv_cache_groups=[0, 1]),
        attention_groups=[
            SpecGroup(full, [0], FullAttentionManager, False),
            SpecGroup(swa, [1], SlidingWindowManager, False),
        ],
        single_type_managers=[manager, manager],
        _cache_hit_alignment_tokens=BS,
        hash_block_size=BS,
        enable_partial_hash_hits=False,
    )
    _, hit_tokens, _ = HybridKVCacheCoordinator.find_longest_cache_hit(
        coordinator,  # type: ignore[arg-type]
        engine_hashes,  # type: ignore[arg-type]
        len(engine_hashes) * BS,
    )
    assert hit_tokens % BS == 0
    return int(hit_tokens // BS)


@pytest.mark.parametrize("seed", range(40))
def test_index_hit_equals_vllm_hybrid_coordinator(seed: int) -> None:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")
    rng = random.Random(seed)
    window = rng.choice([BS + 1, 2 * BS, 2 * BS + 1, 3 * BS - 1, 3 * BS + 2])
    # Prompts sharing a trunk, so groups and replicas hold overlapping chains.
    n_blocks = 12
    trunk = [rng.randrange(1000) for _ in range(rng.randrange(0, 6) * BS)]
    prompts = [trunk + [rng.randrange(1000) for _ in range(n_blocks * BS - len(trunk))]]
    prompts += [prompts[0][: rng.randrange(len(trunk), n_blocks * BS)] for _ in range(2)]
    prompts = [p + [rng.randrange(1000) for _ in range(n_blocks * BS - len(p))] for p in prompts]
    # vLLM's engine hash of a block: its content chained from the first block (any int does).
    engine = [
        [hash(tuple(p[: (k + 1) * BS])) & (2**63 - 1) for k in range(n_blocks)] for p in prompts
    ]
    replicas = ["r0", "r1"]
    pools = {r: _Pool() for r in replicas}
    index = PrefixIndex()
    subs = {
        r: KVEventSubscriber(r, "inproc://unused", None, index, context=zmq.asyncio.Context())
        for r in replicas
    }
    for step in range(60):
        r = rng.choice(replicas)
        pool = pools[r]
        group = rng.randrange(2)
        p = rng.randrange(len(prompts))
        held = [k for k in range(n_blocks) if pool.cached[(engine[p][k], group)] > 0]
        if held and rng.random() < 0.4:
            gone = rng.sample(held, rng.randint(1, len(held)))
            events = [_removed([engine[p][k]], group) for k in gone]  # one per copy, as vLLM
            for k in gone:
                pool.cached[(engine[p][k], group)] -= 1
        else:
            # A stretch whose parent this replica holds in some group (else vLLM would not
            # name it as parent); the sliding-window group stores stretches past a gap too.
            known = {h for (h, _), n in pool.cached.items() if n > 0}
            starts = [0] + [k + 1 for k in range(n_blocks - 1) if engine[p][k] in known]
            a = rng.choice(starts)
            b = rng.randint(a + 1, n_blocks)
            parent = engine[p][a - 1] if a else None
            tokens = prompts[p][a * BS : b * BS]
            events = [_stored(engine[p][a:b], parent, tokens, group, window)]
            pool.cached.update((engine[p][k], group) for k in range(a, b))  # a copy each
            if not group and rng.random() < 0.5:
                # One step of a request, as vLLM's coordinator caches it: the full group, then
                # the window group, whose blocks out of the window are null and left out of
                # the event (its hashes fewer than its token blocks).
                z = rng.randrange(a, b)
                window_event = _stored(engine[p][z:b], parent, tokens, 1, window)
                # Either group may be cached first in the step (Gemma 3's window group is 0).
                events.insert(rng.randrange(2), window_event)
                pool.cached.update((engine[p][k], 1) for k in range(z, b))
        subs[r]._apply(step, _encode(events))
    for p, tokens in enumerate(prompts):
        router = chain_hashes(tokens, BS, root_seed(None))
        found = index.match(router, 0.0)
        for r in replicas:
            expected = _vllm_hit(pools[r], engine[p], window)
            m = found.get(r)
            assert (m.confirmed if m else 0) == expected, (seed, r, p)


def test_removal_in_one_group_keeps_the_other_groups_block() -> None:
    """The bug this fixes: a group's removal erased the block another group holds."""
    index = PrefixIndex()
    tokens = list(range(3 * BS))
    router = chain_hashes(tokens, BS, root_seed(None))
    engine = [11, 12, 13]
    index.apply_stored("r", engine, None, tokens, BS)  # group 0: full attention, as vLLM says
    index.apply_stored("r", engine, None, tokens, BS, "GPU", None, 1, "sliding_window", 2 * BS)
    index.apply_removed("r", [11], "GPU", 1)  # out of the window
    assert index.match(router, 0.0)["r"].confirmed == 3
    # The full group loses the last block: a hit of 2 would need the window group's blocks 0-1
    # (window 8 tokens: 2 blocks before the hit point), and block 0 left it: no hit (vLLM's).
    index.apply_removed("r", [13], "GPU", 0)
    assert "r" not in index.match(router, 0.0)
    assert index.replicas_holding(router[2]) == frozenset({"r"})  # group 1 still holds it


def test_window_group_event_without_its_null_blocks() -> None:
    """vLLM leaves a window group's null blocks out of the event, not out of its tokens."""
    index = PrefixIndex()
    tokens = list(range(5 * BS))
    router = chain_hashes(tokens, BS, root_seed(None))
    index.apply_stored("r", [1, 2, 3, 4, 5], None, tokens, BS)
    index.apply_stored("r", [4, 5], None, tokens, BS, "GPU", None, 1, "sliding_window", 2 * BS)
    assert index.match(router, 0.0)["r"].confirmed == 5  # blocks 3-4 fill the window before 5
    assert index.stats.unplaced_group_blocks == 0
    index.apply_removed("r", [4], "GPU", 1)
    assert "r" not in index.match(router, 0.0)  # the window group kept no leading block


def test_single_group_model_is_not_hybrid() -> None:
    index = PrefixIndex()
    tokens = list(range(2 * BS))
    index.apply_stored("r", [1, 2], None, tokens, BS)
    assert not index.hybrid
