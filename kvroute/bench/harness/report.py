"""The text of a bench's report, pure: no I/O, no clock (``host`` reads the machine).

A report is printed and appended to ``--output-md`` as a section: ``section_head`` (the title,
then the command that reproduces the run in a code block), bullet lines saying what ran where,
the tables, and the verdicts.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Protocol

MD_HEADER = (
    "# Benchmarks\n\n"
    "Results appended by `kvroute bench ...`, newest last. Each section gives the command that "
    "reproduces it. The machines are often small and shared: compare ratios within a section, "
    "not absolute numbers across sections.\n"
)


def reproduce_command(argv: Sequence[str], bench: str, *, report_args: bool = False) -> str:
    """``kvroute bench BENCH ...`` with the arguments after ``bench`` in ``argv``; less where
    its report went (``--output-md``, ``--no-record``: they change no number, and a path names
    a machine) unless ``report_args``."""
    args = list(argv)
    if bench in args:
        args = args[args.index(bench) + 1 :]
    kept: list[str] = []
    skip = False
    for arg in args:
        if report_args:
            kept.append(arg)
        elif skip:
            skip = False
        elif arg == "--output-md":
            skip = True
        elif not arg.startswith("--output-md=") and arg != "--no-record":
            kept.append(arg)
    return shlex.join(["kvroute", "bench", bench, *kept])


def section_head(title: str, command: str) -> list[str]:
    """A Markdown section's first lines: ``## title`` and the command in a code block."""
    return [f"## {title}", "", "```", command, "```", ""]


def load_text(loadavg: Sequence[float]) -> str:
    """``os.getloadavg()`` as a report shows it: ``0.52 0.61 0.70``."""
    return " ".join(f"{x:.2f}" for x in loadavg)


def ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as ``1.23x``; ``-`` without both."""
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def ms(seconds: float | None, missing: str = "n/a", places: int = 0) -> str:
    """Seconds as milliseconds; ``missing`` for None or NaN (nothing measured)."""
    if seconds is None or seconds != seconds:
        return missing
    return f"{seconds * 1000:.{places}f}"


class Failures(Protocol):
    """A load's failed requests: answered with an error status, or lost on the socket."""

    @property
    def errors(self) -> int: ...
    @property
    def non_2xx(self) -> int: ...
    @property
    def socket_errors(self) -> int: ...


def errors_cell(r: Failures) -> str:
    """Failed requests, with how they failed when any did."""
    if not r.errors:
        return "0"
    return f"{r.errors} ({r.non_2xx} http, {r.socket_errors} socket)"


def one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (log tails included), cut to ``limit`` characters."""
    flat = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def first_line(error: BaseException, limit: int = 300) -> str:
    """An error's first line, cut to ``limit`` characters: a table cell or a progress line."""
    return str(error).splitlines()[0][:limit]


def display_path(path: str, home: str) -> str:
    """``path`` with the ``home`` directory as ``~`` (a report names no machine's paths)."""
    return "~" + path[len(home) :] if path.startswith(home + "/") else path
