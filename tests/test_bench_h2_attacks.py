"""``kvroute bench h2-attacks``: a short run against a real ``kvroute epp`` process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_the_picker_survives_the_attacks_and_the_bench_says_so() -> None:
    command = [sys.executable, "-m", "kvroute.cli", "bench", "h2-attacks"]
    command += ["--attacks", "rapid-reset,ping-flood", "--baseline-s", "0.5", "--rounds", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| rapid-reset")]
    rows += [line for line in done.stdout.splitlines() if line.startswith("| ping-flood")]
    assert len(rows) == 2, done.stdout
    # The control, measured the same way with an attacker that sends nothing: always run.
    control = [line for line in done.stdout.splitlines() if line.startswith("| none (control")]
    assert len(control) == 1, done.stdout
    rows += control
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "0", row  # no failed pick during the attack
        assert cells[1].count(" / ") == 1, row  # calls in the baseline windows / during
        assert cells[-1] == "yes", row  # answered after it
    assert "Each attack ran in a process of its own" in done.stdout
    assert "2 rounds, each class in turn" in done.stdout
    assert "The control (no attack): " in done.stdout
    reproduce = (
        "kvroute bench h2-attacks --attacks rapid-reset,ping-flood --rounds 2 --baseline-s 0.5"
    )
    assert f"Reproduce: `{reproduce}`" in done.stdout


def test_an_unknown_attack_is_named() -> None:
    command = [sys.executable, "-m", "kvroute.cli", "bench", "h2-attacks", "--attacks", "nope"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert "unknown attack(s) nope" in done.stderr and "rapid-reset" in done.stderr
    assert "Traceback" not in done.stderr
