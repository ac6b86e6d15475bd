"""The engine model: prefix caching, eviction, events, batching, preemption, abort, reset."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.kvcore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.simulator.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    StepOutput,
    latency_preset,
)
from kvroute.simulator.engine.block_pool import Block, BlockPool

TINY = latency_preset("tiny-cpu")


def make_engine(**overrides: object) -> Engine:
    params: dict[str, object] = {"block_size": 16, "num_blocks": 256, "latency": TINY}
    params.update(overrides)
    return Engine(EngineConfig(**params))  # type: ignore[arg-type]


def req(rid: str, prompt: list[int], max_tokens: int = 1, **kw: str | None) -> EngineRequest:
    return EngineRequest(rid, prompt, max_tokens, 0.0, **kw)


def run(engine: Engine, max_steps: int = 10_000) -> list[StepOutput]:
    """Step until the engine is idle; return every step's output."""
    steps: list[StepOutput] = []
    t = 0.0
    while engine.has_unfinished_requests():
        out = engine.step(t)
        t += out.duration_s
        steps.append(out)
        assert len(steps) < max_steps, "engine did not finish"
    return steps


def events_of(steps: list[StepOutput]) -> list[KVEvent]:
    return [e for s in steps for e in s.events]


def tokens_by_request(steps: list[StepOutput]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in steps:
        for o in s.outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def cached_tokens(steps: list[StepOutput], rid: str) -> int:
    return next(o.num_cached_tokens for s in steps for o in s.outputs if o.request_id == rid)


# --- prefix cache hits and misses -----------------------------------------------------------------


def test_identical_prompt_hits_every_full_block_but_recomputes_the_last_token() -> None:
    engine = make_engine()
    prompt = list(range(64))  # exactly 4 blocks of 16
    engine.add_request(req("a", prompt))
    first = run(engine)
    engine.add_request(req("b", prompt))
    second = run(engine)
    assert cached_tokens(first, "a") == 0
    # 4 full blocks are cached, but the last token must be computed: 3 blocks hit.
    assert cached_tokens(second, "b") == 48
    stats = engine.stats
    assert stats.prefix_cache_queries == 128
    assert stats.prefix_cache_hits == 48

    engine.add_request(req("c", [*prompt, 999]))  # one more token: all 4 blocks can hit
    assert cached_tokens(run(engine), "c") == 64
    assert engine.stats.prefix_cache_queries == 128 + 65
    assert engine.stats.prefix_cache_hits == 48 + 64


def test_partial_blocks_are_never_cached_so_never_hit() -> None:
    engine = make_engine()
    engine.add_request(req("a", list(range(20))))  # 1 full block + 4 tokens
    steps = run(engine)
    stored = [e for e in events_of(steps) if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [1]
    engine.add_request(req("b", list(range(40))))
    assert cached_tokens(run(engine), "b") == 16
    engine.add_request(req("c", list(range(10))))  # shorter than a block
    assert cached_tokens(run(engine), "c") == 0


def test_a_different_prefix_misses_from_the_first_differing_block() -> None:
    engine = make_engine()
    engine.add_request(req("a", list(range(64))))
    run(engine)
    engine.add_request(req("b", [*range(20), -1, *range(21, 64)]))  # differs in block 1
    assert cached_tokens(run(engine), "b") == 16


def test_lora_name_and_cache_salt_are_part_of_the_hash_key() -> None:
    engine = make_engine()
    prompt = list(range(48))
    engine.add_request(req("plain", prompt))
    run(engine)
    engine.add_request(req("lora", prompt, lora_name="adapter-1"))
    assert cached_tokens(run(engine), "lora") == 0
    engine.add_request(req("lora2", prompt, lora_name="adapter-1"))
    assert cached_tokens(run(engine), "lora2") == 32
    engine.add_request(req("salted", prompt, cache_salt="tenant-a"))
    assert cached_tokens(run(engine), "salted") == 0  # salt in block 0 changes the whole chain
    engine.add_request(req("salted2", prompt, cache_salt="tenant-a"))
    assert cached_tokens(run(engine), "salted2") == 32


def test_lora_and_salt_appear_in_stored_events_like_vllm() -> None:
    engine = make_engine()
    engine.add_request(req("a", list(range(48)), lora_name="ad", cache_salt="s"))
    [stored] = [e for e in events_of(run(engine)) if isinstance(e, BlockStored)]
    assert stored.lora_name == "ad"
    assert stored.extra_keys == [("ad", "s"), ("ad",), ("ad",)]


def test_prefix_caching_disabled_means_no_hits_and_no_events() -> None:
    engine = make_engine(enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(req(rid, list(range(64)), max_tokens=20))
    steps = run(engine)
    assert events_of(steps) == []
    assert cached_tokens(steps, "b") == 0
    assert engine.stats.prefix_cache_queries == 0


# --- eviction ------------------------------------------------------------------------------------


def test_block_pool_evicts_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=1, enable_caching=True)

    def store(blocks: list[Block], hashes: list[int]) -> None:
        pool.cache_full_blocks(blocks, hashes, 0, len(hashes), hashes, None, [None] * len(hashes))

    first = pool.get_new_blocks(2)
    store(first, [10, 11])
    pool.free_blocks(reversed(first))  # a request frees its tail first
    second = pool.get_new_blocks(2)  # the two never-used blocks: nothing evicted
    store(second, [20, 21])
    pool.free_blocks(reversed(second))
    pool.take_events()
    hit = pool.get_cached_block(10)
    assert hit is not None
    pool.touch([hit])  # reused: leaves the free queue...
    pool.free_blocks([hit])  # ...and becomes the most recently freed
    pool.get_new_blocks(4)
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [11, 21, 20, 10]


def test_freed_blocks_without_a_hash_are_reused_before_any_cached_block() -> None:
    pool = BlockPool(num_blocks=3, block_size=1, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [7], 0, 1, [7], None, [None])  # only block 0 is full
    pool.free_blocks(reversed(blocks))
    # vLLM 0.32: unhashed blocks go to the head of the free queue, in freeing order (LIFO).
    assert list(pool.free_queue) == [2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert [e for e in pool.take_events() if isinstance(e, BlockRemoved)] == []


def test_allocation_evicts_cached_blocks_in_lru_order_with_block_removed_events() -> None:
    engine = make_engine(block_size=4, num_blocks=4)
    engine.add_request(req("a", list(range(8))))
    a_stored = [e for e in events_of(run(engine)) if isinstance(e, BlockStored)]
    engine.add_request(req("b", list(range(100, 108))))
    b_stored = [e for e in events_of(run(engine)) if isinstance(e, BlockStored)]
    a0, a1 = a_stored[0].block_hashes
    b0, b1 = b_stored[0].block_hashes
    assert engine.stats.kv_cache_usage == 0.0  # cached but evictable blocks count as free

    engine.add_request(req("c", list(range(200, 216))))  # needs all 4 blocks
    events = events_of(run(engine))
    removed = [e.block_hashes for e in events if isinstance(e, BlockRemoved)]
    assert removed == [[a1], [a0], [b1], [b0]]
    # Evictions happen while allocating, before the new blocks are stored.
    assert isinstance(events[-1], BlockStored) and len(events[-1].block_hashes) == 4
    assert all(isinstance(e, BlockRemoved) for e in events[:4])
    engine.add_request(req("a-again", list(range(8))))
    assert cached_tokens(run(engine), "a-again") == 0  # a's blocks are gone


# --- events --------------------------------------------------------------------------------------


def test_prompt_and_output_blocks_are_announced_as_they_fill() -> None:
    engine = make_engine(block_size=4)
    prompt = [5, 6, 7, 8]
    engine.add_request(req("a", prompt, max_tokens=9))
    steps = run(engine)
    out = tokens_by_request(steps)["a"]
    assert len(out) == 9
    stored = [e for e in events_of(steps) if isinstance(e, BlockStored)]
    # KV holds prompt + 8 outputs (the 9th is never fed back): 3 full blocks, one event each.
    assert [e.token_ids for e in stored] == [prompt, out[0:4], out[4:8]]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert stored[2].parent_block_hash == stored[1].block_hashes[0]
    for e in stored:
        assert (e.block_size, e.medium, e.lora_id, e.lora_name, e.group_idx) == (
            4,
            "GPU",
            None,
            None,
            0,
        )
        assert e.extra_keys == [None]
        assert e.kv_cache_spec_kind == "full_attention"
    # The output block is announced in the step that computes its last token (the one that
    # samples the next token), as vLLM's allocate-time caching does.
    step_of_second = next(i for i, s in enumerate(steps) if stored[1] in s.events)
    assert [o.new_token_ids for o in steps[step_of_second].outputs] == [[out[4]]]
    # Output blocks are real prefix-cache entries: a follow-up turn hits them.
    engine.add_request(req("turn2", [*prompt, *out[:8], 1]))
    assert cached_tokens(run(engine), "turn2") == 12


def test_one_stored_event_covers_all_blocks_a_step_fills() -> None:
    engine = make_engine()
    engine.add_request(req("a", list(range(100))))
    stored = [e for e in events_of(run(engine)) if isinstance(e, BlockStored)]
    assert len(stored) == 1
    assert len(stored[0].block_hashes) == 6
    assert stored[0].token_ids == list(range(96))


def test_kv_events_describe_the_cache_exactly() -> None:
    """An index built from the events alone equals the engine's cache at every step."""
    engine = make_engine(block_size=4, num_blocks=24, max_num_batched_tokens=32)
    shared = list(range(12))
    for i in range(12):
        engine.add_request(req(f"r{i}", [*shared[: 4 + i % 9], *range(1000 * i, 1000 * i + 9)], 7))
    check_index_matches_cache(engine)


def apply_events(index: Counter[int | bytes], events: list[KVEvent]) -> None:
    """What a router's index does with events: count each stored copy, drop removed ones."""
    for e in events:
        if isinstance(e, BlockStored):
            assert len(e.token_ids) == len(e.block_hashes) * e.block_size
            index.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index.subtract(e.block_hashes)
        else:
            index.clear()


def check_index_matches_cache(engine: Engine, index: Counter[int | bytes] | None = None) -> None:
    """Step to idle; after every step the event-built index must equal the engine's cache."""
    index = Counter() if index is None else index
    t = 0.0
    while engine.has_unfinished_requests():
        out = engine.step(t)
        t += out.duration_s
        apply_events(index, out.events)
        pool = engine._kv.pool
        actual = Counter(b.block_hash for b in pool.blocks if b.block_hash is not None)
        assert +index == actual
        held = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert held + pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt >= 0 for b in pool.blocks)


# --- batching ------------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_within_the_token_budget() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request(req("long", list(range(200)), max_tokens=2))
    steps = run(engine)
    assert [len(s.outputs) for s in steps] == [0, 0, 0, 1, 1]
    stored = [[e for e in s.events if isinstance(e, BlockStored)] for s in steps]
    # 64 + 64 + 64 + 8 tokens; blocks are stored as chunks complete them.
    assert [sum(len(e.block_hashes) for e in evs) for evs in stored] == [4, 4, 4, 0, 0]
    assert steps[0].duration_s > steps[4].duration_s


def test_decodes_and_a_prefill_chunk_share_the_step_budget() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request(req("short", list(range(1000, 1010)), max_tokens=20))
    engine.step(0.0)  # short's prefill; it decodes from now on
    engine.add_request(req("long", list(range(200)), max_tokens=1))
    out = engine.step(0.0)
    assert [o.request_id for o in out.outputs] == ["short"]
    [stored] = [e for e in out.events if isinstance(e, BlockStored)]
    assert stored.token_ids == list(range(48))  # 63 tokens computed: 3 full blocks
    out = engine.step(0.0)
    [stored] = [e for e in out.events if isinstance(e, BlockStored)]
    assert stored.token_ids == list(range(48, 112))  # 126 computed: blocks 3..6


def test_max_num_seqs_bounds_the_running_batch() -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(req(f"r{i}", [i] * 8, max_tokens=3))
    seen_running = []
    t = 0.0
    while engine.has_unfinished_requests():
        out = engine.step(t)
        t += out.duration_s
        assert len(out.outputs) <= 2
        seen_running.append(engine.stats.num_running)
    assert max(seen_running) == 2
    assert engine.stats.generation_tokens == 15


def test_requests_start_in_arrival_order() -> None:
    engine = make_engine(max_num_seqs=1)
    for i in range(3):
        engine.add_request(req(f"r{i}", [i] * 8, max_tokens=2))
    order = [o.request_id for s in run(engine) for o in s.outputs if o.finished]
    assert order == ["r0", "r1", "r2"]


def test_every_request_gets_exactly_max_tokens() -> None:
    engine = make_engine()
    for i in range(10):
        engine.add_request(req(f"r{i}", list(range(i, i + 30)), max_tokens=1 + i))
    steps = run(engine)
    got = tokens_by_request(steps)
    assert {rid: len(toks) for rid, toks in got.items()} == {f"r{i}": 1 + i for i in range(10)}
    finals = [o for s in steps for o in s.outputs if o.finished]
    assert {o.finish_reason for o in finals} == {"length"}
    assert all(0 <= t < 32000 for toks in got.values() for t in toks)
    stats = engine.stats
    assert stats.generation_tokens == sum(1 + i for i in range(10))
    assert stats.prompt_tokens == 300
    assert (stats.num_running, stats.num_waiting) == (0, 0)


# --- preemption ----------------------------------------------------------------------------------


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    prompts = {f"r{i}": list(range(100 * i, 100 * i + 8)) for i in range(3)}

    def serve(num_blocks: int) -> tuple[Engine, list[StepOutput]]:
        engine = make_engine(block_size=4, num_blocks=num_blocks)
        for rid, prompt in prompts.items():
            engine.add_request(req(rid, prompt, max_tokens=12))
        return engine, run(engine)

    roomy_engine, roomy = serve(64)
    tight_engine, tight = serve(6)  # each request needs 5 blocks at its longest
    assert roomy_engine.stats.num_preemptions == 0
    assert tight_engine.stats.num_preemptions >= 1
    # Recompute changes when tokens come out, never which tokens.
    assert tokens_by_request(tight) == tokens_by_request(roomy)
    stats = tight_engine.stats
    # A resumed request's lookup is not a new query (vLLM counts preempted lookups apart).
    assert stats.prefix_cache_queries == 24
    assert stats.generation_tokens == 36
    assert stats.kv_cache_usage == 0.0


def test_preemption_takes_the_youngest_running_request() -> None:
    engine = make_engine(block_size=4, num_blocks=6)
    engine.add_request(req("old", list(range(8)), max_tokens=12))
    engine.add_request(req("young", list(range(100, 108)), max_tokens=12))
    t = 0.0
    while engine.stats.num_preemptions == 0:
        t += engine.step(t).duration_s
    assert [s.request_id for s in engine._scheduler.waiting] == ["young"]
    assert [s.request_id for s in engine._scheduler.running] == ["old"]


# --- abort and reset -----------------------------------------------------------------------------


def test_abort_frees_blocks_keeps_them_cached_and_reports_next_step() -> None:
    engine = make_engine()
    engine.add_request(req("a", list(range(64)), max_tokens=50))
    engine.add_request(req("queued", list(range(500, 520)), max_tokens=5))
    engine.step(0.0)
    engine.step(0.0)
    assert engine.stats.kv_cache_usage > 0
    engine.abort_request("a")
    engine.abort_request("nope")  # unknown ids are ignored, as in vLLM
    engine.abort_request("a")  # and so is a second abort
    out = engine.step(0.0)
    aborted = [o for o in out.outputs if o.request_id == "a"]
    assert len(aborted) == 1
    assert (aborted[0].finished, aborted[0].finish_reason, aborted[0].new_token_ids) == (
        True,
        "abort",
        [],
    )
    run(engine)
    assert engine.stats.kv_cache_usage == 0.0
    engine.add_request(req("a2", list(range(64))))
    assert cached_tokens(run(engine), "a2") == 48


def test_abort_of_a_waiting_request() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request(req("running", [1] * 8, max_tokens=4))
    engine.add_request(req("waiting", [2] * 8, max_tokens=4))
    engine.step(0.0)
    engine.abort_request("waiting")
    assert engine.stats.num_waiting == 0
    steps = run(engine)
    outs = [o for s in steps for o in s.outputs if o.request_id == "waiting"]
    assert [(o.finish_reason, o.num_cached_tokens) for o in outs] == [("abort", 0)]


def test_abort_alone_keeps_the_engine_busy_until_reported() -> None:
    engine = make_engine()
    engine.add_request(req("a", [1] * 8, max_tokens=4))
    engine.abort_request("a")
    assert engine.has_unfinished_requests()
    out = engine.step(0.0)
    assert out.duration_s == 0.0
    assert [o.finish_reason for o in out.outputs] == ["abort"]
    assert not engine.has_unfinished_requests()


def test_reset_prefix_cache_refused_while_running_then_clears() -> None:
    engine = make_engine()
    prompt = list(range(64))
    engine.add_request(req("a", prompt, max_tokens=5))
    engine.step(0.0)
    assert engine.reset_prefix_cache() is False
    run(engine)
    assert engine.reset_prefix_cache() is True
    assert not engine.has_unfinished_requests()
    flush = engine.step(1.0)  # an idle step delivers the reset's event
    assert flush.events == [AllBlocksCleared()]
    assert (flush.outputs, flush.duration_s) == ([], 0.0)
    engine.add_request(req("b", prompt))
    assert cached_tokens(run(engine), "b") == 0


def test_reset_with_only_waiting_requests_is_allowed() -> None:
    engine = make_engine()
    engine.add_request(req("a", [1] * 8))
    assert engine.reset_prefix_cache() is True
    steps = run(engine)
    assert isinstance(steps[0].events[0], AllBlocksCleared)


# --- determinism and validation ------------------------------------------------------------------


def workload(engine: Engine) -> list[StepOutput]:
    for i in range(8):
        engine.add_request(req(f"r{i}", list(range(i * 7, i * 7 + 40)), max_tokens=10 + i))
    return run(engine)


def test_same_seed_same_run_different_seed_different_tokens() -> None:
    a = workload(make_engine(seed=1))
    b = workload(make_engine(seed=1))
    c = workload(make_engine(seed=2))
    assert a == b
    assert tokens_by_request(a) != tokens_by_request(c)
    assert [s.duration_s for s in a] == [s.duration_s for s in c]


def test_generated_tokens_respect_vocab_size() -> None:
    engine = make_engine(vocab_size=7)
    engine.add_request(req("a", [1, 2, 3], max_tokens=200))
    toks = tokens_by_request(run(engine))["a"]
    assert set(toks) == set(range(7))


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        ([], 4, "prompt is empty"),
        ([1] * 100, 29, "exceeds max_model_len 128"),
        ([1] * 10, 0, "max_tokens must be >= 1"),
        ([1, "x"], 4, "int64"),
        ([1, 2**70], 4, "int64"),
    ],
)
def test_add_request_rejects_what_can_never_run(
    prompt: list[int], max_tokens: int, message: str
) -> None:
    engine = make_engine(max_model_len=128)
    with pytest.raises(ValueError, match=message):
        engine.add_request(req("bad", prompt, max_tokens=max_tokens))
    assert not engine.has_unfinished_requests()


def test_add_request_rejects_duplicates_and_requests_larger_than_the_cache() -> None:
    engine = make_engine(block_size=4, num_blocks=4)
    engine.add_request(req("a", [1] * 8))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request(req("a", [1] * 8))
    with pytest.raises(ValueError, match="needs 5 KV blocks but the cache has 4"):
        engine.add_request(req("big", [1] * 17, max_tokens=1))
    engine.add_request(req("fits", [1] * 16, max_tokens=1))


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=-1)


# --- randomized invariants -----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.integers(0, 3),  # shared-prefix family
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max_tokens
            st.booleans(),  # abort it after a few steps
        ),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(14, 40),
    budget=st.sampled_from([8, 16, 64]),
)
def test_random_workloads_keep_every_invariant(
    specs: list[tuple[int, int, int, bool]], num_blocks: int, budget: int
) -> None:
    engine = make_engine(
        block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4
    )
    families = {f: [f * 1000 + k for k in range(40)] for f in range(4)}
    for i, (family, length, max_tokens, _) in enumerate(specs):
        engine.add_request(req(f"r{i}", families[family][:length], max_tokens=max_tokens))
    to_abort = [f"r{i}" for i, spec in enumerate(specs) if spec[3]]
    index: Counter[int | bytes] = Counter()
    for _ in range(3):
        apply_events(index, engine.step(0.0).events)
    for rid in to_abort:
        engine.abort_request(rid)
    check_index_matches_cache(engine, index)
    stats = engine.stats
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
