"""``kvroute bench streams``: run end to end at a small size, as a user would, and its helpers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvroute.bench.streams import check_stream, lag_summary
from kvroute.kvcore.stats import parse_metrics

KVROUTE = [sys.executable, "-m", "kvroute.cli"]


def table_value(markdown: str, measure: str) -> str:
    """The value column of the results table's row that starts with ``measure``."""
    match = re.search(r"^\| " + re.escape(measure) + r"[^|]* \| ([^|]+) \|", markdown, re.M)
    assert match, f"no row {measure!r} in:\n{markdown}"
    return match.group(1).strip()


def test_small_run_completes_every_stream_and_records_memory_and_lag(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    args = [
        "bench", "streams", "--streams", "200", "--tokens", "20", "--replicas", "2",
        "--clients", "2", "--token-interval-ms", "100", "--output-md", str(out),
    ]  # fmt: skip
    run = subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    md = out.read_text()
    # The command that reproduces it, without machine paths, then the table.
    assert "kvroute bench streams --streams 200 --tokens 20 --replicas 2" in md
    assert str(tmp_path) not in md
    assert table_value(md, "streams complete") == "200 / 200"
    assert table_value(md, "streams cut or failed") == "0"
    assert table_value(md, "streams open at once").startswith("200")
    assert float(table_value(md, "router memory per open stream").split()[0]) > 0
    idle, busy = re.findall(r"[\d.]+", table_value(md, "router RSS idle"))
    assert 0 < float(idle) < float(busy)
    assert int(table_value(md, "router open descriptors")) >= 2 * 200
    # The router's own lag histogram was read: three ordered bucket bounds, ticks counted.
    lag = [float(v) for v in re.findall(r"[\d.]+|inf", table_value(md, "event-loop lag"))]
    assert len(lag) == 3 and lag == sorted(lag)
    _, ticks = map(int, re.findall(r"\d+", table_value(md, "loop ticks later than 50 ms")))
    assert ticks > 0
    assert "200 / 200" in run.stdout  # the same table printed


@pytest.mark.parametrize(
    ("flag", "value"), [("--streams", "0"), ("--tokens", "-3"), ("--token-interval-ms", "0")]
)
def test_bad_values_are_usage_errors(flag: str, value: str) -> None:
    run = subprocess.run(
        [*KVROUTE, "bench", "streams", flag, value], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert f"argument {flag}" in run.stderr


def sse(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def ending(tokens_sent: int, usage_tokens: int, finish: str | None = "length") -> tuple[int, bytes]:
    choice = {"index": 0, "text": "x", "finish_reason": finish}
    tail = sse({"choices": [choice]}) + sse(
        {"choices": [], "usage": {"completion_tokens": usage_tokens}}
    )
    return tokens_sent + 2, tail + b"data: [DONE]\n\n"


def test_a_stream_is_complete_only_with_every_token_and_its_end() -> None:
    assert check_stream(200, *ending(20, 20), tokens=20) is None
    assert check_stream(200, *ending(19, 19), tokens=20) == "cut: 19 of 20 tokens"
    assert check_stream(200, *ending(20, 20, finish=None), tokens=20) == "cut: no finish_reason"
    events, tail = ending(20, 20)
    assert check_stream(200, events - 1, tail.removesuffix(b"data: [DONE]\n\n"), 20) == (
        "cut: no [DONE]"
    )
    broken = sse({"error": {"message": "The replica failed mid-stream"}}) + b"data: [DONE]\n\n"
    assert check_stream(200, 8, sse({"choices": []}) + broken, 20) == (
        "cut: The replica failed mid-stream"
    )
    assert check_stream(503, 0, b"", 20) == "HTTP 503"


def lag_page(counts: list[int], total_s: float) -> str:
    bounds = ["0.001", "0.05", "0.1", "+Inf"]
    lines = ["# TYPE kvroute_event_loop_lag_seconds histogram"]
    lines += [
        f'kvroute_event_loop_lag_seconds_bucket{{le="{le}"}} {n}'
        for le, n in zip(bounds, counts, strict=True)
    ]
    lines += [
        f"kvroute_event_loop_lag_seconds_count {counts[-1]}",
        f"kvroute_event_loop_lag_seconds_sum {total_s}",
    ]
    return "\n".join(lines) + "\n"


def test_lag_is_read_from_the_growth_of_the_histogram_between_scrapes() -> None:
    before = parse_metrics(lag_page([10, 10, 10, 10], 0.002))  # startup ticks: not counted
    after = parse_metrics(lag_page([107, 109, 110, 110], 0.302))
    lag = lag_summary(before, after)
    assert (lag.ticks, lag.stalls) == (100, 1)
    assert (lag.p50_le_s, lag.p99_le_s, lag.max_le_s) == (0.001, 0.05, 0.1)
    assert lag.mean_s == pytest.approx(0.003)
