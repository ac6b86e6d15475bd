"""``kvroute bench send-tokens``: the conversations, the request bodies, the table and the
command line (no vLLM here; the bench itself runs against a real replica)."""

from __future__ import annotations

import math

import pytest

from kvroute.bench.send_tokens import (
    Sample,
    build_session,
    build_sessions,
    cache_check,
    chat_body,
    chat_chars,
    format_table,
    generate_body,
    options_from_args,
    reproduce_command,
    summarise,
)
from kvroute.cli import build_parser


def test_a_session_starts_with_its_history_and_grows_by_a_turn_each_turn() -> None:
    session = build_session(0, start_chars=20_000, turn_chars=2_000, turns=4)
    assert session.history[0]["role"] == "system"
    assert chat_chars(session.history) >= 20_000
    assert len(session.turns) == 4
    sizes = [chat_chars(session.messages(t)) for t in range(4)]
    first = session.messages(0)
    assert first[: len(session.history)] == list(session.history)
    assert first[-1] == {"role": "user", "content": session.turns[0][0]}
    for t in range(1, 4):
        now, before = session.messages(t), session.messages(t - 1)
        # The previous turn's prompt, then its reply, then this turn's user message.
        assert now[: len(before)] == before
        assert now[len(before)] == {"role": "assistant", "content": session.turns[t - 1][1]}
        assert now[-1]["role"] == "user"
        assert 1_900 <= sizes[t] - sizes[t - 1] <= 2_100 + 40
    with pytest.raises(IndexError):
        session.messages(4)


def test_sessions_are_deterministic_and_differ_from_one_another() -> None:
    a = build_sessions(2, 5_000, 1_000, 3)
    b = build_sessions(2, 5_000, 1_000, 3)
    assert a == b
    assert a[0].history[0] != a[1].history[0]
    roles = [m["role"] for m in a[0].messages(2)]
    assert roles[0] == "system"
    assert all(r != roles[i + 1] for i, r in enumerate(roles[1:-1], start=1))  # alternating


def test_the_two_bodies_carry_the_same_prompt_and_their_own_cache_salt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = chat_body("m", messages, 4, "text")
    assert body["messages"] == messages and body["max_tokens"] == 4
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "text" and body["temperature"] == 0.0
    rendered = {
        "request_id": "chatcmpl-abc",
        "token_ids": [1, 5, 9],
        "sampling_params": {"max_tokens": 4, "temperature": 0.0},
        "model": "m",
        "stream": False,
        "cache_salt": "tokens",
        "features": None,
        "output_mode": "tokens",
    }
    gen = generate_body(rendered, "tokens")
    assert "request_id" not in gen and "features" not in gen  # a fresh id; nulls left out
    assert gen["token_ids"] == [1, 5, 9] and gen["sampling_params"] == rendered["sampling_params"]
    assert gen["stream"] is True and gen["stream_options"] == {"include_usage": True}
    assert gen["cache_salt"] == "tokens"
    assert rendered["request_id"] == "chatcmpl-abc"  # the render's answer is left as it was


def sample(path: str, turn: int, api: float, ttft: float, cached: int | None = 96) -> Sample:
    return Sample(
        path=path, session=0, turn=turn, api_cpu_ms=api, engine_cpu_ms=100.0,
        ttft_ms=ttft, latency_ms=ttft + 20, prompt_tokens=128, cached_tokens=cached,
        body_bytes=2_000,
    )  # fmt: skip


def test_the_table_gives_each_way_and_the_ratio() -> None:
    samples = [
        sample("text", 1, 40.0, 300.0),
        sample("tokens", 1, 10.0, 150.0),
        sample("text", 2, 60.0, 500.0),
        sample("tokens", 2, 10.0, 250.0),
    ]
    by = summarise(samples)
    assert by["text"].mean("api_cpu_ms") == 50.0
    assert by["tokens"].p("ttft_ms", 0.5) == 150.0
    table = format_table(samples)
    lines = table.splitlines()
    assert lines[0].startswith("| way | turns | API-server CPU ms p50 | API-server CPU ms mean")
    assert lines[2] == "| text | 2 | 40.0 | 50.0 | 100.0 | 300.0 | 500.0 | 320.0 | 2.0 |"
    assert lines[3] == "| tokens | 2 | 10.0 | 10.0 | 100.0 | 150.0 | 250.0 | 170.0 | 2.0 |"
    assert lines[4] == (
        "| text / tokens | | 4.00x | 5.00x | 1.00x | 2.00x | 2.00x | 1.88x | 1.00x |"
    )
    assert len({line.count("|") for line in lines}) == 1  # every row has every column


def test_a_way_without_samples_shows_nan_and_no_ratio() -> None:
    table = format_table([sample("text", 1, 40.0, 300.0)])
    assert "| tokens | 0 | nan |" in table
    assert table.splitlines()[-1].count("n/a") == 7
    assert math.isnan(summarise([])["text"].mean("ttft_ms"))


def test_the_cache_check_compares_each_turn_both_ways() -> None:
    same = [sample("text", 1, 1, 1), sample("tokens", 1, 1, 1)]
    assert cache_check(same).startswith("1 of 1 turns with the same prompt tokens both ways, 1 ")
    assert "75.0% / 75.0%" in cache_check(same)
    differ = [sample("text", 1, 1, 1, cached=96), sample("tokens", 1, 1, 1, cached=0)]
    assert ", 0 with the same cached tokens" in cache_check(differ)
    assert cache_check([sample("text", 1, 1, 1)]) == "no turn was measured both ways"


def test_the_command_leaves_out_where_the_results_go() -> None:
    argv = ["--turns", "5", "--record", "--output-md", "x.md", "--sessions=3", "--output-md=y"]
    assert reproduce_command(argv) == "kvroute bench send-tokens --turns 5 --sessions=3"


def test_the_flags_parse_and_bad_values_are_usage_errors() -> None:
    args = build_parser().parse_args(["bench", "send-tokens"])
    options = options_from_args(args)
    assert (options.sessions, options.turns, options.start_kb, options.turn_kb) == (2, 9, 220, 2.0)
    assert options.max_tokens == 4 and not options.record
    assert options.output_md == "BENCHMARKS.md"
    args = build_parser().parse_args(
        ["bench", "send-tokens", "--sessions", "1", "--turns", "3", "--start-kb", "50",
         "--turn-kb", "1.5", "--max-tokens", "1", "--settle", "0", "--record",
         "--output-md", "out.md", "--log-dir", "logs"]
    )  # fmt: skip
    options = options_from_args(args)
    assert (options.sessions, options.turns, options.start_kb, options.turn_kb) == (1, 3, 50, 1.5)
    assert (options.max_tokens, options.settle_s, options.record) == (1, 0.0, True)
    assert (options.output_md, options.log_dir) == ("out.md", "logs")
    for bad in (["--sessions", "0"], ["--turn-kb", "-1"], ["--settle", "-0.5"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "send-tokens", *bad])


def test_one_turn_is_refused_it_would_all_be_warm_up(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "send-tokens", "--turns", "1"])
    assert args.func(args) == 2
    assert "--turns must be 2 or more" in capsys.readouterr().err
