"""What /proc says of a process, a process tree or group, and the machine (Linux).

Every reader answers for a process that has gone (0, an empty list, None) rather than raise:
a bench samples processes that its faults kill and restart.
"""

from __future__ import annotations

import os
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces): fields 3 on, so
    ``[1]`` is the parent's pid, ``[2]`` the process group, ``[11]`` and ``[12]`` utime, stime."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _cpu_ticks(fields: list[str]) -> int:
    return int(fields[11]) + int(fields[12])


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of one process; 0 once it is gone."""
    fields = stat_fields(pid)
    return _cpu_ticks(fields) / TICKS_PER_S if fields else 0.0


def _all_stats() -> dict[int, list[str]]:
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := stat_fields(entry.name)) is not None:
            found[int(entry.name)] = fields
    return found


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and every living process under it."""
    stats = _all_stats()
    parents = {pid: int(fields[1]) for pid, fields in stats.items()}
    total = 0
    for pid, fields in stats.items():
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += _cpu_ticks(fields)
    return total / TICKS_PER_S


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of the live processes of a process group (a child started by
    ``processes.start`` leads one; the processes it starts inherit it)."""
    stats = _all_stats().values()
    return sum(_cpu_ticks(f) for f in stats if int(f[2]) == pgid) / TICKS_PER_S


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent not idle (all cores), from /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(x) for x in first[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / TICKS_PER_S


def sched_seconds(pid: int) -> tuple[float, float]:
    """Seconds the process ran on a CPU, and seconds it was ready but waited for one."""
    on_cpu_ns, waited_ns, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(on_cpu_ns) / 1e9, int(waited_ns) / 1e9


def rss_bytes(pid: int | str) -> int:
    """Resident set size (VmRSS) of ``pid`` (or "self"); 0 for a process that is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid``; 0 for a process that is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's, since any thread may have forked)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended while we looked
            continue
    return sorted(set(found))


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]
