"""``kvroute bench overhead``'s CPU per request and py-spy profile, run as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvroute.bench.harness.procs import tree_cpu_seconds
from kvroute.bench.harness.sampling import CpuSampler
from kvroute.bench.profiling import frames_table, top_frames

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_tree_cpu_counts_the_children_of_a_process() -> None:
    # A parent that waits while its child burns 0.5 s of CPU and then stays (the tree counts
    # living processes: a child gone is no longer in it, and a poll could miss the moment
    # between its last burnt tick and its exit): the tree's CPU is the child's.
    child = BURN.format(s=0.5) + "time.sleep(60)\n"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])",
        ],
        start_new_session=True,  # its own group, so the child goes with it
    )
    try:
        deadline = time.monotonic() + 60
        while tree_cpu_seconds(parent.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the value under test, with a deadline
        assert 0.5 <= tree_cpu_seconds(parent.pid) < 2.0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_sampler_reads_the_cpu_of_a_window() -> None:
    burner = subprocess.Popen([sys.executable, "-c", BURN.format(s=60)])
    try:
        with CpuSampler(burner.pid, interval_s=0.05) as sampler:
            before, start = tree_cpu_seconds(burner.pid), time.monotonic()
            while len(sampler.samples) < 10 or tree_cpu_seconds(burner.pid) - before < 0.2:
                time.sleep(0.05)  # until the window holds samples and CPU to read
            end, after = time.monotonic(), tree_cpu_seconds(burner.pid)
        busy = sampler.cpu_between(start, end)
        # What /proc says it used between the two moments, give or take the samples just
        # inside the window (at most one interval of a core at each end) and clock ticks.
        assert busy > 0
        assert abs(busy - (after - before)) <= 2 * 0.05 + 0.05
    finally:
        burner.kill()
        burner.wait()


def test_top_frames_rank_self_time_and_cut_paths(tmp_path: Path) -> None:
    raw = tmp_path / "x.raw"
    raw.write_text(
        'process 7:"/usr/bin/python3 -m kvroute.cli serve";main (/usr/lib/python3.11/runpy.py:1);'
        "handle (/x/site-packages/aiohttp/web.py:5);"
        "encode (/src/kvroute/kvcore/tokenizer/hf.py:85) 7\n"
        "main (/usr/lib/python3.11/runpy.py:1);handle (/x/site-packages/aiohttp/web.py:5) 3\n"
        "main (/usr/lib/python3.11/runpy.py:1);other (/opt/tool/mod.py:9) 0\n"
    )
    frames = top_frames(raw)
    assert [f.name for f in frames] == [
        "encode (kvroute/kvcore/tokenizer/hf.py:85)",
        "handle (aiohttp/web.py:5)",
        "other (mod.py:9)",  # no machine's path
    ]
    assert frames[0].self_share == 0.7 and frames[0].total_share == 0.7
    assert frames[1].self_share == 0.3 and frames[1].total_share == 1.0
    assert "main (runpy.py:1)" not in [f.name for f in frames]  # never on top of a stack
    assert "| 70.0% | 70.0% | `encode (kvroute/kvcore/tokenizer/hf.py:85)` |" in frames_table(
        frames
    )


def test_overhead_bench_reports_cpu_per_request_and_where_it_goes(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    profiles = tmp_path / "profiles"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "overhead",
            "--targets",
            "direct,kvroute",
            "--duration",
            "3",
            "--warmup",
            "1",
            "--concurrency",
            "4",
            "--loadgen",
            "builtin",
            "--profile",
            str(profiles),
            "--output-md",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| kvroute |"))
    cpu_ms, per_core = (float(cell) for cell in row.strip("| ").split(" | ")[-2:])
    # The same figure twice: ms per request shown to 2 decimals, requests per core whole
    # (each rounding moves 1000 / per_core by at most 0.005 and 500 / per_core**2).
    assert cpu_ms > 0 and abs(1000 / per_core - cpu_ms) <= 0.0051 + 500 / per_core**2
    direct = next(line for line in text.splitlines() if line.startswith("| direct |"))
    assert direct.endswith("| - | - |")  # no router, no router CPU
    assert "Where kvroute's CPU goes" in text, done.stdout
    assert (profiles / "kvroute.raw").stat().st_size > 0
    assert "kvroute/router/" in text, text  # the router's own frames are among the top ones
    assert "process " not in text and "(/" not in text  # no command lines, no machine paths
