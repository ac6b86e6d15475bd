"""``load_trace``: any supported trace, by format name or detected from the file."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import TraceError
from .model import Trace
from .mooncake import load_mooncake
from .synthetic import generate, is_synthetic_spec
from .transform import apply_transform, validate_transform

FORMATS = ("mooncake", "azure", "claude-code", "synthetic")

_ARCHIVE_SUFFIXES = (".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar", ".json")


def load_trace(
    path: str,
    fmt: str | None = None,
    *,
    time_scale: float = 1.0,
    rate_scale: float = 1.0,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
    seed: int = 0,
    diurnal: tuple[float, float | None] | None = None,
    repeat: int = 1,
) -> Trace:
    """Load ``path`` (a synthetic spec for ``fmt="synthetic"``) and window, cap and scale it.

    ``fmt`` is one of FORMATS, optionally with format options after a colon, e.g.
    ``"azure:apps=16,followup=0.5"`` or ``"claude-code:session_rate=0.02"``; None detects the
    format from the file (a path that does not exist but names a generator is a synthetic spec).
    See ``transform`` for the exact meaning of the window, the cap and the two scales.
    Raises TraceError (one line: where and why) for bad input of any kind.
    """
    validate_transform(
        time_scale=time_scale, rate_scale=rate_scale, window_s=window_s, max_requests=max_requests
    )
    name, options = _split_format(fmt) if fmt is not None else (detect_format(path), "")
    with _collector_paused():
        trace = _load(path, name, options, seed, window_s, max_requests)
    return apply_transform(
        trace,
        time_scale=time_scale,
        rate_scale=rate_scale,
        window_s=window_s,
        max_requests=max_requests,
        diurnal=diurnal,
        repeat=repeat,
    )


def _load(
    path: str,
    name: str,
    options: str,
    seed: int,
    window_s: tuple[float, float] | None,
    max_requests: int | None,
) -> Trace:
    if name == "synthetic":
        trace = generate(path, seed)
    elif name == "mooncake":
        trace = load_mooncake(path, options)
    elif name == "azure":
        from .azure import load_azure

        trace = load_azure(path, options, seed=seed, window_s=window_s, max_requests=max_requests)
    else:
        from .claude_code import load_claude_code

        trace = load_claude_code(
            path, options, seed=seed, window_s=window_s, max_requests=max_requests
        )
    return trace


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Loading builds millions of acyclic tuples; the cycle collector would rescan them all
    many times over (measured: about a third of a Claude Code load)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _split_format(fmt: str) -> tuple[str, str]:
    name, _, options = fmt.partition(":")
    name = name.strip().lower()
    if name not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    if options and name == "synthetic":
        raise TraceError("synthetic takes its options in the spec, not the format")
    return name, options


def detect_format(path: str) -> str:
    """The format of ``path`` from its name, else from its first bytes."""
    if not os.path.exists(path):
        if is_synthetic_spec(path):
            return "synthetic"
        raise TraceError(f"{path}: no such file")
    if os.path.isdir(path):
        return "claude-code"
    lower = path.lower()
    if lower.endswith(".jsonl"):
        return "mooncake"
    if lower.endswith(".csv"):
        return "azure"
    if lower.endswith(_ARCHIVE_SUFFIXES):
        return "claude-code"
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError as error:
        raise TraceError(f"{path}: cannot read ({error.strerror or error})") from None
    if head.lstrip().startswith(b"{") and b'"hash_ids"' in head and b'"timestamp"' in head:
        return "mooncake"
    if head.upper().startswith(b"TIMESTAMP,"):
        return "azure"
    raise TraceError(f"{path}: cannot tell the trace format; pass --format ({', '.join(FORMATS)})")
