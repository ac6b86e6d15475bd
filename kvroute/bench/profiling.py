"""What a router process costs per request, and where that CPU goes.

On a small shared machine the load generator competes with the router for the same cores, so
requests/s alone says little about the router. Its own CPU time over the measured window,
divided by the requests it answered, does: ``1000 / cpu_ms`` is how many requests one core
of this machine could route. ``harness.sampling.CpuSampler`` reads it from /proc for the router
and every process under it (``--workers``, the tokenizer pool), so the peers (threads in one
process) and kvroute (processes) are counted alike. ``PySpy`` records where it goes (py-spy, from
``pip install -e '.[bench]'``) and ``top_frames`` summarises the recording for BENCHMARKS.md.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_STDLIB = re.compile(r"^.*/lib/python3\.\d+/")


def prepare_profile(bench: str, directory: str | None) -> bool:
    """For ``--profile DIR``: py-spy is installed and DIR exists (made if missing); False, with
    the reason printed, when py-spy is missing. True without ``--profile``."""
    if not directory:
        return True
    if shutil.which("py-spy") is None:
        print(f"kvroute bench {bench}: --profile needs py-spy (pip install -e '.[bench]')",
              file=sys.stderr)  # fmt: skip
        return False
    os.makedirs(directory, exist_ok=True)
    return True


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
