"""Counters sampled in a thread while a bench runs, read afterwards for any window.

A measured window is sometimes known only afterwards (the agent workload's opens inside the
load generator; the conversations' is the last ``duration_s`` of the run), so the counters are
kept over time and read for a window by interpolation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvroute.bench.harness.procs import tree_cpu_seconds


class Sampler:
    """``read()`` (counters by name) sampled every ``interval_s`` in a thread, and once on
    entry."""

    def __init__(self, read: Callable[[], dict[str, float]], interval_s: float = 0.2) -> None:
        self.read = read
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (monotonic time, counters)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def sample(self) -> None:
        values = self.read()
        with self._lock:
            self.samples.append((time.monotonic(), values))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def names(self) -> list[str]:
        with self._lock:
            return list(self.samples[0][1]) if self.samples else []

    def series(self, name: str) -> list[tuple[float, float]]:
        with self._lock:
            return [(t, values[name]) for t, values in self.samples]

    def _at(self, name: str, t: float) -> float:
        samples = self.series(name)
        before = [(ts, v) for ts, v in samples if ts <= t]
        after = [(ts, v) for ts, v in samples if ts >= t]
        if not before:
            return after[0][1]
        if not after:
            return before[-1][1]
        (t0, v0), (t1, v1) = before[-1], after[0]
        return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def delta(self, name: str, start: float, end: float) -> float:
        """How much counter ``name`` grew over ``[start, end]``."""
        self.sample()
        return self._at(name, end) - self._at(name, start)

    def cores(self, name: str, start: float, end: float) -> float:
        """Cores CPU counter ``name`` kept busy on average over ``[start, end]`` (1.0: one)."""
        return self.delta(name, start, end) / (end - start) if end > start else 0.0


class CpuSampler(Sampler):
    """The CPU seconds of a process tree (``procs.tree_cpu_seconds``), sampled every
    ``interval_s`` from entry to exit."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        super().__init__(lambda: {"cpu": tree_cpu_seconds(pid)}, interval_s)
        self.pid = pid

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.sample()

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds spent from ``start`` to ``end`` (monotonic), from the samples closest
        inside the window (the error is at most one interval of CPU at each end)."""
        inside = [(t, c) for t, c in self.series("cpu") if start <= t <= end]
        if len(inside) < 2:
            raise ValueError("the window holds fewer than two CPU samples")
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) * (end - start) / (t1 - t0)
