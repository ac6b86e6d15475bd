"""What a report says of the machine it ran on (CPUs, load, versions), the date, and appending
the report to its Markdown file."""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
from pathlib import Path

from kvroute.bench.harness.report import MD_HEADER, display_path, load_text


def cpu_count() -> int:
    """The CPUs this process may run on (what ``nproc`` says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> str:
    """The load average now, as a report shows it."""
    return load_text(os.getloadavg())


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """``4 CPUs (nproc), <model>, load average before run 0.52 0.61 0.70``: call it before the
    run (a shared machine's load is other people's work)."""
    return f"{cpu_count()} CPUs (nproc), {cpu_model()}, load average before run {load_average()}"


def package_version(dist: str, executable: str | None = None) -> str | None:
    """The installed version of ``dist``: in this environment, else in the venv of ``executable``."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    if executable is None:
        return None
    venv = Path(executable).parent.parent
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for found in importlib.metadata.distributions(name=dist, path=[str(site)]):
            return str(found.version)
    return None


def kvroute_version() -> str:
    """``kvroute 0.1.0``, for a report's versions line."""
    return f"kvroute {package_version('kvroute') or '?'}"


def python_version() -> str:
    return f"Python {platform.python_version()}"


def utc_stamp() -> str:
    """Now, as a section's title dates it: ``2026-12-06 15:35 UTC``."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def record(path: Path, section: str, header: bool = True) -> None:
    """Append ``section`` to the Markdown file after a blank line, the file created with the
    ``# Benchmarks`` header first when it is missing or empty (unless not ``header``)."""
    prefix = "" if not header or (path.exists() and path.stat().st_size) else MD_HEADER
    with path.open("a", encoding="utf-8") as f:
        f.write(prefix + "\n" + section)


def shown_path(path: str) -> str:
    """``path`` as a report names it: the home directory as ``~``."""
    return display_path(path, str(Path.home()))
