"""``kvroute bench status``: the paired A/B of an open /status page, and how it is judged."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.bench.loadgen import LoadResult
from kvroute.bench.overhead import TARGETS, Row
from kvroute.bench.profiling import share_on_stack
from kvroute.bench.status_ab import STATUS_MARKERS, Round, summary
from kvroute.cli import main


def row(rps: float, cpu_ms: float, name: str = "kvroute") -> Row:
    r = Row(TARGETS[name])
    r.result = LoadResult(int(rps * 5), 5.0, rps, 1.0, 2.0)
    r.cpu_ms_per_request = cpu_ms
    return r


def test_share_on_stack_counts_samples_with_the_status_code_anywhere_on_the_stack(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "kvroute-status.raw"
    raw.write_text(
        "process 1:kvroute;run (asyncio/base_events.py:1);handle (kvroute/router/proxy.py:9) 97\n"
        "process 1:kvroute;run (asyncio/base_events.py:1);build (kvroute/router/status.py:134) 2\n"
        "process 1:kvroute;handle_status_events (kvroute/router/server.py:366);write (x.py:1) 1\n"
    )
    share, samples = share_on_stack(raw, STATUS_MARKERS)
    assert samples == 100 and share == pytest.approx(0.03)


def test_noisy_rounds_with_a_tiny_measured_share_meet_the_target() -> None:
    """Ratios spread by tens of percent, centred near 1: the page's own 0.1% of the CPU decides,
    and the A/B's interval reaches 0.97."""
    rounds = []
    for k, ratio in enumerate([0.8, 1.2, 0.9, 1.1, 0.95, 1.05]):
        one = Round("without" if k % 2 == 0 else "with", row(4000, 0.25), row(4000 * ratio, 0.25))
        one.status_share, one.samples = 0.001, 400
        rounds.append(one)
    lines, met = summary(rounds)
    assert met, lines
    assert "0.10% of 2,400" in "\n".join(lines)


def test_a_page_that_takes_a_tenth_of_the_cpu_misses_the_target() -> None:
    rounds = []
    for k in range(4):
        one = Round("without" if k % 2 == 0 else "with", row(4000, 0.25), row(3600, 0.28))
        one.status_share, one.samples = 0.10, 400
        rounds.append(one)
    lines, met = summary(rounds)
    assert not met and "not met" in lines[-1]


def test_without_a_profile_the_geometric_means_decide() -> None:
    slower = [Round("without", row(4000, 0.25), row(3000, 0.33)) for _ in range(3)]
    assert not summary(slower)[1]
    even = [Round("without", row(4000, 0.25), row(4000, 0.25)) for _ in range(3)]
    assert summary(even)[1]


def test_one_round_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    """A real router, stubs and load, one short A/B pair: a row per side and a verdict."""
    # 2 s windows: each side must count requests, and a loaded box can stall for a second.
    code = main(["bench", "status", "--rounds", "1", "--duration", "2", "--warmup", "0",
                 "--no-record"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "round 1/1: without first |" in out
    assert "target (>= 0.97x" in out
