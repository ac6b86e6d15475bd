"""What a router process costs per request, and where that CPU goes.

On a small shared machine the load generator competes with the router for the same cores, so
requests/s alone says little about the router. Its own CPU time over the measured window,
divided by the requests it answered, does: ``1000 / cpu_ms`` is how many requests one core
of this machine could route. ``CpuSampler`` reads it from /proc for the router and every
process under it (``--workers``, the tokenizer pool), so the peers (threads in one process)
and kvroute (processes) are counted alike. ``PySpy`` records where it goes (py-spy, from
``pip install -e '.[bench]'``) and ``top_frames`` summarises the recording for BENCHMARKS.md.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_STDLIB = re.compile(r"^.*/lib/python3\.\d+/")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: fields start after the last ")".
    return text[text.rindex(")") + 2 :].split()


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and every living process under it."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])  # ppid
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime
    total = 0.0
    for pid, seconds in cpu.items():
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += seconds
    return total


class CpuSampler:
    """Samples a process tree's CPU seconds in a thread, so the CPU spent between any two
    moments of the run can be read afterwards (the agent workload's measured window opens
    inside the load generator)."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (monotonic time, CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), tree_cpu_seconds(self.pid)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds spent from ``start`` to ``end`` (monotonic), from the samples closest
        inside the window (the error is at most one interval of CPU at each end)."""
        inside = [(t, c) for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:
            raise ValueError("the window holds fewer than two CPU samples")
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) * (end - start) / (t1 - t0)


class PySpy:
    """``py-spy record`` of a process (and its children) into a raw collapsed-stack file."""

    def __init__(self, pid: int, duration_s: float, out: Path) -> None:
        exe = shutil.which("py-spy")
        if exe is None:
            raise FileNotFoundError("py-spy not found on PATH (pip install -e '.[bench]')")
        self.out = out
        argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s)))]
        argv += ["--format", "raw", "--output", str(out), "--subprocesses", "--nonblocking"]
        self._proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    def wait(self, timeout_s: float) -> str | None:
        """Wait for the recording; None when it is there, else why not."""
        try:
            _, err = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return "py-spy did not finish in time"
        if self._proc.returncode != 0 or not self.out.exists():
            return f"py-spy failed: {err.strip()[-300:]}"
        return None


@dataclass(frozen=True)
class Frame:
    name: str  # "function (file:line)", paths cut to the package
    self_share: float  # of all samples, where the frame was running
    total_share: float  # of all samples, where the frame was on the stack


def top_frames(raw: Path, count: int = 12) -> list[Frame]:
    """The frames that take the most samples (by self time), with their inclusive share."""
    own: collections.Counter[str] = collections.Counter()
    on_stack: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        samples = int(n)
        # --subprocesses roots each stack at "process PID:<command line>": not a frame.
        frames = [_short(f) for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            on_stack[frame] += samples
    if not total:
        return []
    return [Frame(name, n / total, on_stack[name] / total) for name, n in own.most_common(count)]


def share_on_stack(raw: Path, markers: tuple[str, ...]) -> tuple[float, int]:
    """Of a recording's samples, the share with a frame naming any of ``markers`` on the
    stack (a function or a file), and the number of samples."""
    hit = total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        if any(marker in stack for marker in markers):
            hit += int(n)
    return (hit / total if total else 0.0), total


def _short(frame: str) -> str:
    """``fn (/long/path/site-packages/pkg/mod.py:12)`` as ``fn (pkg/mod.py:12)``; kvroute's
    own files as ``kvroute/...`` wherever the checkout is (py-spy gives paths as imported)."""
    name, _, where = frame.partition(" (")
    for marker, keep in (("site-packages/", 0), ("/kvroute/", len("kvroute/"))):
        at = where.rfind(marker)
        if at >= 0:
            where = where[at + len(marker) - keep :]
            break
    else:
        where = _STDLIB.sub("", where)
        if where.startswith("/"):  # elsewhere on this machine: the file's name is enough
            where = where.rsplit("/", 1)[-1]
    return f"{name} ({where}" if where else name


def frames_table(frames: list[Frame]) -> str:
    lines = ["| self | on stack | frame |", "|--:|--:|---|"]
    lines += [
        f"| {f.self_share:.1%} | {f.total_share:.1%} | `{f.name.replace('|', '/')}` |"
        for f in frames
    ]
    return "\n".join(lines)
