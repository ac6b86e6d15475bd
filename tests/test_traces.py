"""Trace loaders on excerpts of the public traces (tests/data) and on small bad files, scaling and
windows, and the synthetic generators; with $KVROUTE_TRACES, also on the whole public files."""

from __future__ import annotations

import io
import json
import math
import tarfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from kvroute.simulator.traces import (
    FORMATS,
    SYNTHETIC_HELP,
    Trace,
    TraceError,
    detect_format,
    load_trace,
)

from .helpers import AZURE_CODE, AZURE_CONV, CLAUDE_CODE, MOONCAKE, full_traces_dir

FULL = full_traces_dir()
needs_full_traces = pytest.mark.skipif(
    FULL is None, reason="checks the whole public traces: set KVROUTE_TRACES (tests/data/README.md)"
)


def infinite_cache_hit_rate(trace: Trace) -> float:
    """Token-weighted prefix hit rate of one unlimited cache, replayed in arrival order."""
    root: dict[int, Any] = {}  # a trie of block ids: equal paths are equal prefixes
    hit = total = 0
    for request in trace.requests:
        node, cached = root, 0
        for block in request.block_ids:
            child = node.get(block)
            if child is None:  # a miss: everything below it is new too
                child = node[block] = {}
            else:
                cached += 1
            node = child
        hit += min(cached * trace.block_tokens, request.input_tokens)
        total += request.input_tokens
    return hit / total


def shared_prefix_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# Mooncake


def check_mooncake(
    path: Path, rows: int, blocks: tuple[int, int], rate: float, minutes: float, hit_rate: float
) -> None:
    trace = load_trace(str(path))
    ids = [i for r in trace.requests for i in r.block_ids]
    assert trace.block_tokens == 512
    assert len(trace.requests) == rows
    assert (len(ids), len(set(ids))) == blocks
    assert len(trace.requests) / trace.duration_s == pytest.approx(rate, abs=0.01)
    assert trace.duration_s / 60 == pytest.approx(minutes, abs=0.01)
    assert all(r.block_ids[0] == 0 for r in trace.requests)  # one shared system prompt
    assert all(len(r.block_ids) == math.ceil(r.input_tokens / 512) for r in trace.requests)
    assert infinite_cache_hit_rate(trace) == pytest.approx(hit_rate, abs=0.001)
    assert detect_format(str(path)) == "mooncake"


def test_mooncake_excerpt_loads_with_its_counts_rate_and_reuse() -> None:
    # The first 600 rows (201 s): less reuse than the whole hour, which has more history.
    check_mooncake(MOONCAKE, 600, (16_495, 13_712), 2.99, 3.35, 0.172)


@needs_full_traces
def test_mooncake_conversation_matches_the_published_figures() -> None:
    assert FULL is not None
    path = FULL / "mooncake" / "conversation_trace.jsonl"
    check_mooncake(path, 12_031, (288_500, 182_790), 3.40, 58.95, 0.374)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "rows.jsonl:2: not valid JSON"),
        ("[1, 2]", "rows.jsonl:2: expected a JSON object"),
        (
            '{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
            "'timestamp'",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "'input_length'",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}',
            "'hash_ids'",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}',
            "rows.jsonl:2: 1 hash_ids for input_length 600, expected 2",
        ),
    ],
)
def test_mooncake_bad_rows_name_the_line_and_the_problem(
    tmp_path: Path, line: str, expected: str
) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}'
    path = write(tmp_path / "rows.jsonl", f"{good}\n{line}\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path, "mooncake")
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_mooncake_block_size_option_and_unsorted_rows(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 2000, "input_length": 40, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 20, "output_length": 3, "hash_ids": [0, 1]},
    ]
    path = write(tmp_path / "t.jsonl", "\n".join(json.dumps(r) for r in rows))
    trace = load_trace(path, "mooncake:block_tokens=16")
    assert trace.block_tokens == 16
    assert [r.arrival_s for r in trace.requests] == [1.0, 2.0]
    assert trace.requests[0].block_ids == (0, 1)
    with pytest.raises(TraceError, match="expected 1"):
        load_trace(path, "mooncake")


def test_missing_empty_and_unknown_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "absent.jsonl"))
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path / "empty.jsonl", "\n"))
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        load_trace(write(tmp_path / "mystery.dat", "hello"))
    with pytest.raises(TraceError, match="unknown trace format 'parquet'"):
        load_trace(str(MOONCAKE), "parquet")
    with pytest.raises(TraceError, match="unknown option 'apps'"):
        load_trace(str(MOONCAKE), "mooncake:apps=3")
    assert FORMATS == ("mooncake", "azure", "claude-code", "synthetic")


def test_format_is_detected_from_content_when_the_name_does_not_say(tmp_path: Path) -> None:
    row = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}
    assert detect_format(write(tmp_path / "a.log", json.dumps(row))) == "mooncake"
    csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,2\n"
    assert detect_format(write(tmp_path / "b.txt", csv)) == "azure"
    assert detect_format("chat:rate=2") == "synthetic"


# Windows and scaling


def test_window_is_on_the_trace_clock_and_starts_at_zero() -> None:
    full = load_trace(str(MOONCAKE))
    inside = [r for r in full.requests if 60 <= r.arrival_s < 120]
    window = load_trace(str(MOONCAKE), window_s=(60, 120))
    assert len(window.requests) == len(inside) > 0
    assert [r.block_ids for r in window.requests] == [r.block_ids for r in inside]
    assert window.requests[0].arrival_s == pytest.approx(inside[0].arrival_s - 60)
    assert all(0 <= r.arrival_s < 60 for r in window.requests)
    # The window is taken before scaling: the same requests, on a clock twice as fast.
    faster = load_trace(str(MOONCAKE), window_s=(60, 120), rate_scale=2)
    assert [r.block_ids for r in faster.requests] == [r.block_ids for r in inside]
    assert all(0 <= r.arrival_s < 30 for r in faster.requests)


def test_rate_scale_multiplies_the_rate_and_time_scale_stretches_time() -> None:
    base = load_trace(str(MOONCAKE), max_requests=500)
    double_rate = load_trace(str(MOONCAKE), max_requests=500, rate_scale=2)
    slower = load_trace(str(MOONCAKE), max_requests=500, time_scale=3)
    assert len(base.requests) == len(double_rate.requests) == len(slower.requests) == 500
    rate = len(base.requests) / base.duration_s
    assert len(double_rate.requests) / double_rate.duration_s == pytest.approx(2 * rate)
    assert slower.duration_s == pytest.approx(3 * base.duration_s)
    assert [r.input_tokens for r in double_rate.requests] == [r.input_tokens for r in base.requests]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"rate_scale": 0}, "rate_scale must be a positive number"),
        ({"time_scale": -1}, "time_scale must be a positive number"),
        ({"window_s": (50, 10)}, "window must satisfy 0 <= start < end"),
        ({"max_requests": 0}, "max_requests must be at least 1"),
    ],
)
def test_bad_scaling_and_windows_are_clear_errors(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        load_trace("chat", **kwargs)


# Azure


def check_azure(path: Path, rows: int, rate: float) -> None:
    trace = load_trace(str(path))
    assert detect_format(str(path)) == "azure"
    assert len(trace.requests) == rows
    assert len(trace.requests) / trace.duration_s == pytest.approx(rate, abs=0.01)
    assert trace.block_tokens == 64
    assert all(len(r.block_ids) == math.ceil(r.input_tokens / 64) for r in trace.requests)
    # The reuse model makes a fair part of the prompt tokens cacheable, far from all.
    assert 0.2 < infinite_cache_hit_rate(trace) < 0.8


@pytest.mark.parametrize(("path", "rate"), [(AZURE_CODE, 1.92), (AZURE_CONV, 4.63)])
def test_azure_keeps_times_and_counts_and_synthesizes_reuse(path: Path, rate: float) -> None:
    check_azure(path, 1_000, rate)


@needs_full_traces
@pytest.mark.parametrize(("name", "rows", "rate"), [("code", 8_819, 2.57), ("conv", 19_366, 5.53)])
def test_azure_full_traces_match_the_published_figures(name: str, rows: int, rate: float) -> None:
    assert FULL is not None
    check_azure(FULL / "azure2023" / f"AzureLLMInferenceTrace_{name}.csv", rows, rate)


def test_azure_reuse_model_is_seeded_and_its_knobs_act() -> None:
    one = load_trace(str(AZURE_CODE), max_requests=1000, seed=1)
    again = load_trace(str(AZURE_CODE), max_requests=1000, seed=1)
    other = load_trace(str(AZURE_CODE), max_requests=1000, seed=2)
    assert one == again
    assert [r.block_ids for r in one.requests] != [r.block_ids for r in other.requests]
    assert [r.arrival_s for r in one.requests] == [r.arrival_s for r in other.requests]
    none = load_trace(str(AZURE_CODE), "azure:followup=0,system_share=0")
    assert infinite_cache_hit_rate(none) == 0.0
    system_only = load_trace(str(AZURE_CODE), "azure:followup=0,apps=1")
    heavy = load_trace(str(AZURE_CODE), "azure:followup=1")
    assert 0 < infinite_cache_hit_rate(system_only) < infinite_cache_hit_rate(heavy)


def test_azure_follow_ups_extend_their_conversation() -> None:
    trace = load_trace(str(AZURE_CONV))
    by_session: dict[str | None, list[Any]] = defaultdict(list)
    for request in trace.requests:
        by_session[request.session_id].append(request)
    conversations = [turns for turns in by_session.values() if len(turns) > 1]
    assert len(conversations) > 50
    for turns in conversations:
        for earlier, later in pairwise(turns):
            assert later.input_tokens >= earlier.input_tokens + earlier.output_tokens
            whole = earlier.input_tokens // 64
            assert later.block_ids[:whole] == earlier.block_ids[:whole]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("time,tokens\n1,2\n", "bad.csv:1: missing column(s) TIMESTAMP, ContextTokens"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n",
            "bad.csv:2: TIMESTAMP 'yesterday'",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,x,2\n",
            "bad.csv:2: ContextTokens",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10\n",
            "bad.csv:2: expected 3 fields",
        ),
        ("", "bad.csv: empty file"),
    ],
)
def test_azure_bad_files_name_the_line_and_the_problem(
    tmp_path: Path, text: str, expected: str
) -> None:
    with pytest.raises(TraceError) as caught:
        load_trace(write(tmp_path / "bad.csv", text))
    assert expected in str(caught.value)


def test_azure_bad_options_are_clear_errors(tmp_path: Path) -> None:
    path = write(
        tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,10,2\n"
    )
    with pytest.raises(TraceError, match="azure: option 'apps' must be an integer"):
        load_trace(path, "azure:apps=many")
    with pytest.raises(TraceError, match="azure: option 'followup': must be in"):
        load_trace(path, "azure:followup=1.5")


# Claude Code (kv-cache-tester)


def archive(
    tmp_path: Path, conversations: Iterable[tuple[str, Any]], *, compact: bool = False
) -> str:
    """A .tar.xz of conversation files, written as the kv-cache-tester writes them."""
    path = tmp_path / "sessions.tar.xz"
    separators = (",", ":") if compact else (", ", ": ")
    with tarfile.open(path, "w:xz") as tar:
        for name, body in conversations:
            data = (
                body
                if isinstance(body, bytes)
                else json.dumps(body, separators=separators).encode()
            )
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def conversation(requests: list[Any], scope: str = "local", name: str = "c") -> dict[str, Any]:
    return {"id": name, "block_size": 64, "hash_id_scope": scope, "requests": requests}


def call(t: float, ids: list[int], kind: str = "n", out: int = 10) -> dict[str, Any]:
    return {"t": t, "type": kind, "in": 64 * len(ids) + 5, "out": out, "hash_ids": ids}


def test_claude_code_ids_are_per_conversation_unless_global(tmp_path: Path) -> None:
    local = [call(0, [1, 2, 3, 4]), call(5, [1, 2, 3, 4, 5, 6])]
    path = archive(
        tmp_path,
        [
            ("trace_a.json", conversation(local, name="a")),
            ("trace_b.json", conversation(local, name="b")),
            ("trace_g1.json", conversation([call(0, [7, 8, 9])], "global", "g1")),
            ("trace_g2.json", conversation([call(0, [7, 8, 10])], "global", "g2")),
        ],
    )
    trace = load_trace(path, "claude-code:block_tokens=64")
    by_session = {r.session_id: [] for r in trace.requests}
    for request in trace.requests:
        by_session[request.session_id].append(request.block_ids)
    a, b = by_session["a"], by_session["b"]
    assert shared_prefix_blocks(a[0], a[1]) == 4  # a conversation reuses its own history
    assert not set(a[0] + a[1]) & set(b[0] + b[1])  # equal local ids in two conversations
    assert shared_prefix_blocks(by_session["g1"][0], by_session["g2"][0]) == 2
    assert [len(ids) for ids in a] == [5, 7]  # the partial tail block is a block of its own


def test_claude_code_flattens_sub_agents_and_collapses_stream_pairs(tmp_path: Path) -> None:
    sub = {
        "t": 100.0, "type": "subagent", "agent_id": "x1", "subagent_type": "Explore",
        "requests": [call(0, [1, 2, 50]), call(7, [1, 2, 50, 51])],
    }  # fmt: skip
    requests = [
        call(0, [1, 2, 3], "s", out=4),
        call(0.5, [1, 2, 3], "n", out=9),
        sub,
        call(120, [1, 2, 3, 4]),
    ]
    trace = load_trace(
        archive(tmp_path, [("trace_1.json", conversation(requests))]), "claude-code:block_tokens=64"
    )
    assert [(r.arrival_s, r.session_id, r.output_tokens) for r in trace.requests] == [
        (0.0, "c", 9), (100.0, "c/x1", 10), (107.0, "c/x1", 10), (120.0, "c", 10)
    ]  # fmt: skip
    parent, sub_first = trace.requests[0].block_ids, trace.requests[1].block_ids
    assert shared_prefix_blocks(parent, sub_first) == 2  # sub-agents share the parent's ids


def reference_blocks(
    path: Path, max_conversations: int, group: int
) -> dict[str, list[tuple[Any, ...]]]:
    """Block structure per session the slow, obvious way: decode every id, chain whole groups."""
    sessions: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    with tarfile.open(path, "r|*") as tar:
        for count, member in enumerate(tar):
            if count == max_conversations:
                break
            body = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
            name = body["id"]
            chain: dict[tuple[Any, ...], tuple[str, int]] = {}  # (parent, group of ids) -> block
            lists = [(body["requests"], name)]
            while lists:
                requests, session = lists.pop(0)
                for index, request in enumerate(requests):
                    if request["type"] == "subagent":
                        lists.append(
                            (request["requests"], f"{name}/{request['agent_id'] or index}")
                        )
                        continue
                    ids = request["hash_ids"][: request["in"] // 64]
                    blocks: list[Any] = []
                    for k in range(len(ids) // group):
                        key = (
                            blocks[-1] if blocks else name,
                            tuple(ids[k * group : (k + 1) * group]),
                        )
                        blocks.append(chain.setdefault(key, (name, len(chain))))
                    tail = math.ceil(request["in"] / (64 * group)) - len(blocks)
                    sessions[session].append((*blocks, *(object() for _ in range(tail))))
    return sessions


def canonical(sessions: dict[str, list[tuple[Any, ...]]]) -> list[list[tuple[int, ...]]]:
    """Ids renumbered by first appearance, so two numberings of one structure compare equal."""
    numbers: dict[Any, int] = {}
    return [
        [tuple(numbers.setdefault(i, len(numbers)) for i in ids) for ids in sessions[name]]
        for name in sorted(sessions)
    ]


@pytest.mark.parametrize("block_tokens", [64, 512])
def test_claude_code_archive_matches_a_plain_decode(block_tokens: int) -> None:
    # Sessions far apart: the first requests come from a few whole conversations.
    options = f"claude-code:block_tokens={block_tokens},session_rate=0.0001"
    trace = load_trace(str(CLAUDE_CODE), options, max_requests=400)
    loaded: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for request in trace.requests:
        loaded[request.session_id or ""].append(request.block_ids)
    conversations = len({name.split("/")[0] for name in loaded})
    expected = reference_blocks(CLAUDE_CODE, conversations, block_tokens // 64)
    assert sum(map(len, expected.values())) >= 400
    # Reading stopped early, so only the sessions' first requests are comparable.
    clipped = {name: expected[name][: len(loaded[name])] for name in loaded}
    assert canonical(loaded) == canonical(clipped)


def test_plain_decode_agrees_on_tricky_id_lists(tmp_path: Path) -> None:
    edits = [
        [1, 2, 3],
        [1, 2, 3],
        [1, 2, 34],
        [1, 2],
        [12, 2],
        [1, 2, 3, 4, 5],
        [],
        [9],
        [1, 2, 3, 4, 5],
    ]
    for compact in (False, True):
        path = archive(
            tmp_path, [("trace_t.json", conversation([call(i, ids) for i, ids in enumerate(edits)], name="t"))],
            compact=compact,
        )  # fmt: skip
        trace = load_trace(path, "claude-code:block_tokens=64")
        assert canonical({"t": [r.block_ids for r in trace.requests]}) == canonical(
            reference_blocks(Path(path), 1, 1)
        )


def test_claude_code_sessions_arrive_as_a_seeded_poisson_process() -> None:
    one = load_trace(str(CLAUDE_CODE), max_requests=400, seed=3)
    assert one == load_trace(str(CLAUDE_CODE), max_requests=400, seed=3)
    assert one != load_trace(str(CLAUDE_CODE), max_requests=400, seed=4)
    starts = sorted({r.session_id: r.arrival_s for r in reversed(one.requests)}.values())
    assert starts[0] == 0.0
    busier = load_trace(str(CLAUDE_CODE), "claude-code:session_rate=1", max_requests=400, seed=3)
    busier_starts = sorted({r.session_id: r.arrival_s for r in reversed(busier.requests)}.values())
    assert busier_starts[-1] < starts[-1]
    assert len(one.requests) == 400
    assert infinite_cache_hit_rate(one) > 0.8  # each turn resends the conversation so far


def test_claude_code_window_stops_reading_early_and_keeps_the_window() -> None:
    trace = load_trace(str(CLAUDE_CODE), window_s=(1000, 2000))
    assert trace.requests and all(0 <= r.arrival_s < 1000 for r in trace.requests)


def test_claude_code_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the archive"):
        load_trace(write(tmp_path / "x.tar.xz", "not an archive"), "claude-code")
    broken = archive(tmp_path, [("trace_9.json", b'{"requests": [')])
    with pytest.raises(TraceError, match=r"sessions.tar.xz:trace_9.json: not valid JSON"):
        load_trace(broken)
    wrong = archive(tmp_path, [("trace_8.json", conversation([{"t": "soon", "type": "n"}]))])
    with pytest.raises(
        TraceError, match=r"trace_8.json: Expected `float`, got `str` - at `\$.requests\[0\].t`"
    ):
        load_trace(wrong)
    scope = archive(tmp_path, [("trace_7.json", conversation([call(0, [1])], scope="team"))])
    with pytest.raises(TraceError, match="'hash_id_scope': must be 'local' or 'global'"):
        load_trace(scope)
    with pytest.raises(TraceError, match="block_tokens 100 is not a multiple"):
        load_trace(
            archive(tmp_path, [("trace_1.json", conversation([call(0, [1])]))]),
            "claude-code:block_tokens=100",
        )


# Synthetic


def test_synthetic_is_deterministic_for_a_seed() -> None:
    spec = "multi-tenant:tenants=4,rate=5,duration=60+chat:rate=1,duration=60"
    assert load_trace(spec, "synthetic", seed=7) == load_trace(spec, "synthetic", seed=7)
    assert load_trace(spec, "synthetic", seed=7) != load_trace(spec, "synthetic", seed=8)


def test_multi_tenant_shares_exactly_the_tenant_system_prompt() -> None:
    trace = load_trace(
        "multi-tenant:tenants=5,rate=20,duration=100,system_tokens=1024,block_tokens=64"
    )
    assert len(trace.requests) / trace.duration_s == pytest.approx(20, rel=0.15)
    firsts: dict[str | None, set[int]] = defaultdict(set)
    for request in trace.requests:
        firsts[request.session_id].add(request.block_ids[0])
    assert len(firsts) == 5 and all(len(ids) == 1 for ids in firsts.values())
    assert len({ids.pop() for ids in firsts.values()}) == 5
    same_tenant = [r for r in trace.requests if r.session_id == trace.requests[0].session_id]
    system_blocks = shared_prefix_blocks(same_tenant[0].block_ids, same_tenant[1].block_ids)
    assert 512 // 64 <= system_blocks <= 1536 // 64  # system_tokens is drawn in [0.5, 1.5] x 1024
    assert shared_prefix_blocks(same_tenant[1].block_ids, same_tenant[2].block_ids) == system_blocks


def test_multi_tenant_questions_repeat_a_fixed_set_per_tenant() -> None:
    trace = load_trace("multi-tenant:tenants=3,questions=2,rate=20,duration=60,block_tokens=64")
    prompts: dict[str | None, set[tuple[int, ...]]] = defaultdict(set)
    for request in trace.requests:
        prompts[request.session_id].add(tuple(request.block_ids))
    # ~400 requests, yet each tenant sends only its 2 prompts, again and again (identical).
    assert len(trace.requests) > 300
    assert sorted(len(p) for p in prompts.values()) == [2, 2, 2]


def test_chat_turns_resend_the_whole_conversation() -> None:
    trace = load_trace("chat:rate=2,duration=120,turns=5,think_s=5")
    turns: dict[str | None, list[Any]] = defaultdict(list)
    for request in trace.requests:
        turns[request.session_id].append(request)
    assert max(map(len, turns.values())) >= 3
    for requests in turns.values():
        for earlier, later in pairwise(requests):
            assert later.input_tokens > earlier.input_tokens + earlier.output_tokens
            whole = earlier.input_tokens // trace.block_tokens
            assert later.block_ids[:whole] == earlier.block_ids[:whole]


def test_agent_loops_are_long_shared_prefixes_with_quick_steps() -> None:
    trace = load_trace("agent:rate=0.5,duration=120,steps=10")
    assert infinite_cache_hit_rate(trace) > 0.85
    gaps = defaultdict(list)
    for request in trace.requests:
        gaps[request.session_id].append(request.arrival_s)
    steps = [b - a for times in gaps.values() for a, b in pairwise(times)]
    assert steps and sum(steps) / len(steps) < 10


def test_hot_bursts_share_one_hot_prompt_each() -> None:
    trace = load_trace("hot-burst:rate=1,duration=300,every=100,burst_s=5,burst_rate=20")
    bursts: dict[str | None, list[Any]] = defaultdict(list)
    for request in trace.requests:
        bursts[request.session_id].append(request)
    background = bursts.pop(None)
    assert sorted(bursts) == ["hot-0", "hot-1", "hot-2"]
    for requests in bursts.values():
        first = requests[0].arrival_s
        assert all(first <= r.arrival_s < first + 5 for r in requests)
        assert len({r.block_ids[0] for r in requests}) == 1
    assert len({r.block_ids[0] for r in background}) == len(background)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tenants:rate=1", "unknown generator 'tenants'"),
        ("chat:speed=3", "synthetic chat: unknown option 'speed'"),
        ("chat:rate=fast", "synthetic chat: option 'rate' must be a number"),
        ("chat:rate=-1", "synthetic chat: option 'rate': must be positive"),
        ("chat:rate=inf", "option 'rate': must be finite"),
        ("chat:rate=1,rate=2", "option 'rate' given twice"),
        ("chat+", "empty generator"),
        ("chat:block_tokens=16+agent", "disagree on block_tokens"),
        ("chat:duration=0.001", "generates no requests"),
    ],
)
def test_bad_synthetic_specs_are_clear_errors(spec: str, expected: str) -> None:
    with pytest.raises(TraceError) as caught:
        load_trace(spec, "synthetic")
    assert expected in str(caught.value)


def test_synthetic_help_documents_every_generator_and_option() -> None:
    from kvroute.simulator.traces.synthetic import COMMON, KINDS

    for kind, spec in KINDS.items():
        assert kind in SYNTHETIC_HELP
        for key in [*spec.defaults, *COMMON]:
            assert f"{key}=" in SYNTHETIC_HELP, key
