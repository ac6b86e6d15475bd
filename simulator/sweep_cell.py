"""One cell of a sweep: ``kvroute replay`` run in this process into a scratch directory, its
files handed back as bytes. The caller (a Ray task's driver, perhaps on another machine)
writes them where the sweep keeps its results; the trace comes along as bytes too, so a
worker needs no copy of it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
from dataclasses import dataclass

from .cli_replay import UsageError, run_replay


@dataclass(frozen=True)
class TraceFile:
    """A trace's file name and contents (the name matters: formats are told by it)."""

    name: str
    data: bytes


@dataclass(frozen=True)
class CellOutput:
    """What the replay wrote (file name -> bytes), or the one-line error it stopped with."""

    files: dict[str, bytes]
    error: str | None = None


def run_cell(args: argparse.Namespace, trace: TraceFile | None) -> CellOutput:
    """Run the replay ``args`` describes (its ``--out`` replaced by a scratch directory).
    ``trace``: the contents of ``args.trace``; None when it is not a file (a generator spec)."""
    with tempfile.TemporaryDirectory(prefix="kvroute-cell-") as scratch:
        values = vars(args).copy()
        if trace is not None:
            values["trace"] = os.path.join(scratch, trace.name)
            with open(values["trace"], "wb") as f:
                f.write(trace.data)
        out = values["out"] = os.path.join(scratch, "out")
        values["quiet"] = True
        # The replay prints its table for a terminal; the sweep prints one table of all cells.
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                run_replay(argparse.Namespace(**values))
        except UsageError as exc:
            return CellOutput({}, str(exc))
        files = {}
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name), "rb") as f:
                files[name] = f.read()
        return CellOutput(files)
