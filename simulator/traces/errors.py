"""The one error every trace loader raises for bad input."""

from __future__ import annotations


class TraceError(ValueError):
    """Bad trace input, as one readable line: where (file, line or key) and why."""
