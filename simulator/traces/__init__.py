"""Trace loaders, synthetic generators and the live replayer.

``load_trace(path, fmt)`` reads Mooncake JSONL, Azure 2023 CSV, Claude Code (kv-cache-tester)
session archives or a synthetic spec into a ``Trace``; docs/traces.md describes the formats and
the models that fill in what a format lacks (Azure prefixes, Claude Code session starts).
"""

from .errors import TraceError
from .loader import FORMATS, detect_format, load_trace
from .model import Trace, TraceRequest
from .synthetic import SYNTHETIC_HELP

__all__ = [
    "FORMATS",
    "SYNTHETIC_HELP",
    "Trace",
    "TraceError",
    "TraceRequest",
    "detect_format",
    "load_trace",
]
