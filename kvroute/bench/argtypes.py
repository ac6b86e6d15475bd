"""argparse value types shared by the ``kvroute bench`` subcommands: a bad value is a usage error."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_report_args(p: argparse.ArgumentParser) -> None:
    """Where a bench's results go: appended to --output-md, or nowhere with --no-record
    (neither is part of the command a report quotes: see overhead.reproduce_command)."""
    p.add_argument(
        "--output-md",
        metavar="PATH",
        default="BENCHMARKS.md",
        help="Markdown file to append the results to (default BENCHMARKS.md here).",
    )
    p.add_argument("--no-record", action="store_true", help="Print only; write no file.")


def add_startup_timeout(
    p: argparse.ArgumentParser, kind: Callable[[str], float] | None = None
) -> None:
    """--startup-timeout: how long each process a bench starts may take to become ready."""
    p.add_argument(
        "--startup-timeout",
        type=kind or positive_float,
        default=60.0,
        help="Seconds each process may take to become ready (default 60).",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value
