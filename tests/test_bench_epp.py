"""``kvroute bench epp`` end to end on a tiny setting: stubs, ``kvroute epp`` and a real Envoy,
what the user reads (the tables, the targets, the appended section), and nothing left running.
Timings are not asserted: only that the numbers are there and parse."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvroute.bench.stub_upstream import _dechunk
from kvroute.cli import build_parser

TINY = [
    # 2 s windows: each must count requests, and a loaded box can stall for a second.
    "--rounds", "1", "--duration-s", "2", "--warmup-s", "0", "--concurrency", "2",
    "--threads", "1", "--conversations", "2", "--large-concurrency", "2", "--start-kb", "8",
    "--turn-kb", "1", "--tokenizer", "builtin",
]  # fmt: skip


def _rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the table rows whose first cell starts with ``first_cell``."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(first_cell):
            rows.append(cells)
    return rows


def _still_running(marker: str) -> list[str]:
    """Processes whose environment carries ``marker`` (the bench's children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def test_bench_epp_end_to_end(tmp_path: Path) -> None:
    scenario = "all" if shutil.which("wrk") else "large"
    output = tmp_path / "bench.md"
    marker = f"KVROUTE_BENCH_EPP_TEST={uuid.uuid4().hex}"
    name, _, value = marker.partition("=")
    argv = ["bench", "epp", "--scenario", scenario, *TINY, "--output-md", str(output)]
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, name: value},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _still_running(marker)

    out = done.stdout
    section = output.read_text()
    for text in (out, section):
        # The large-prompt table: the picker and the direct ceiling, every number readable.
        (epp,) = _rows(text, "kvroute epp")[-1:]
        (direct,) = _rows(text, "direct")[-1:]
        for row in (epp, direct):
            rps, p50, p99, errors, body_kb = (float(c) for c in row[1:6])
            assert rps > 0 and 0 < p50 <= p99 and errors == 0 and body_kb > 8
        picker_cores = float(epp[7])
        assert picker_cores > 0
        # Its picks per second of its CPU: the rate over the cores (both as rounded here).
        per_cpu_s = float(epp[9])
        assert per_cpu_s == pytest.approx(float(epp[1]) / picker_cores, rel=0.05, abs=1)
        assert direct[9] == "-"
        assert "not judged: --start-kb 8" in text
        if scenario == "all":
            latency = _rows(text, "kvroute epp")[0], _rows(text, "direct")[0]
            for row in latency:
                rps, mean, p50, p99, errors = (float(c) for c in row[1:6])
                assert rps > 0 and mean > 0 and 0 < p50 <= p99 and errors == 0
            (added,) = _rows(text, "added by the picker")
            float(added[3]), float(added[4])  # p50 and p99, signed
            assert "added p50 ≤ 1 ms on 1 KB prompts:" in text
            assert "added p99 ≤ 3 ms on 1 KB prompts:" in text
    # The section appended to the file: its title, the command that reproduces it, versions.
    assert section.startswith("# Benchmarks")
    assert "## Endpoint picker behind Envoy (`kvroute bench epp`)" in section
    assert f"kvroute bench epp --scenario {scenario} --rounds 1" in section
    assert str(output) not in section  # where the report went is no part of the command
    assert "- versions: Envoy 1.40." in section
    assert "**Targets**" in section


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scenario", "fast"], "argument --scenario: choose latency, large or all"),
        (["--rounds", "0"], "argument --rounds: must be at least 1"),
        (["--turn-kb", "-1"], "argument --turn-kb: must be more than 0"),
    ],
)
def test_bad_flags_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "epp", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_stub_reads_chunked_bodies() -> None:
    """Envoy forwards a body the picker streamed back chunked; the stub must read it whole."""
    request = b"POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"
    start = len(request)
    body = b"4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\n\r\nGET /next"
    assert _dechunk(request + body, start) == (b"abcdefg", len(request + body) - len(b"GET /next"))
    with_trailer = b"2\r\nhi\r\n0\r\nx-trailer: 1\r\n\r\n"
    assert _dechunk(with_trailer, 0) == (b"hi", len(with_trailer))
    for cut in range(len(body) - len(b"GET /next")):
        assert _dechunk(request + body[:cut], start) is None
