"""A sweep's grid: its cells (policy x fleet size x KV capacity x rate), their directories,
and what each records of its parameters, so that a sweep run again knows which cells are done.

A cell's directory holds what ``kvroute replay`` writes (``summary.json``, ``report.md``, PNG
plots) and ``cell.json``: the cell and every replay argument it ran with. ``summary.json`` is
written last, so its presence says the cell finished; ``cell.json`` says with what. A cell is
done when both exist and ``cell.json`` equals what the sweep would run now.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

CELL_FILE = "cell.json"
SUMMARY_FILE = "summary.json"

CellStatus = Literal["done", "stale", "todo"]


@dataclass(frozen=True)
class Cell:
    """One replay of the grid."""

    policy: str
    replicas: int
    kv_capacity_tokens: int | None  # None: the preset's (GPU memory less weights)
    rate_scale: float

    @property
    def name(self) -> str:
        """Its directory's name, e.g. ``kv_aware-r64-kvpreset-x10``."""
        kv = "preset" if self.kv_capacity_tokens is None else str(self.kv_capacity_tokens)
        return f"{self.policy}-r{self.replicas}-kv{kv}-x{self.rate_scale:g}"


def grid(
    policies: Iterable[str],
    replicas: Iterable[int],
    capacities: Iterable[int | None],
    rates: Iterable[float],
) -> list[Cell]:
    """Every combination, in the order given (policy slowest), each once."""
    cells = itertools.starmap(Cell, itertools.product(policies, replicas, capacities, rates))
    unique = list(dict.fromkeys(cells))
    names: dict[str, Cell] = {}
    for cell in unique:
        other = names.setdefault(cell.name, cell)
        if other is not cell:  # e.g. rates 1 and 1.0000001, both "x1"
            raise ValueError(f"cells {other} and {cell} would share the directory {cell.name}")
    return unique


def cell_record(cell: Cell, replay: Mapping[str, Any]) -> dict[str, Any]:
    """What ``cell.json`` holds: the cell and its replay arguments, as JSON reads them back."""
    record = {"cell": dataclasses.asdict(cell), "replay": dict(sorted(replay.items()))}
    # A round trip makes tuples lists and objects dicts, as a stored record compares.
    loaded: dict[str, Any] = json.loads(json.dumps(record, default=_plain))
    return loaded


def _plain(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"a replay argument that JSON cannot hold: {value!r}")


def cell_status(out_dir: str, cell: Cell, record: Mapping[str, Any]) -> CellStatus:
    """done: finished with these parameters; stale: finished with others; todo: not finished."""
    path = os.path.join(out_dir, cell.name)
    if not os.path.isfile(os.path.join(path, SUMMARY_FILE)):
        return "todo"
    try:
        with open(os.path.join(path, CELL_FILE)) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return "stale"
    return "done" if stored == record else "stale"


def write_cell(
    out_dir: str, cell: Cell, record: Mapping[str, Any], files: Mapping[str, bytes]
) -> None:
    """Replace the cell's directory with ``files`` (a replay's output) and its ``cell.json``;
    ``summary.json`` last and atomically, so a sweep killed meanwhile leaves the cell undone."""
    path = os.path.join(out_dir, cell.name)
    shutil.rmtree(path, ignore_errors=True)  # a stale run's plots must not outlive it
    os.makedirs(path)
    with open(os.path.join(path, CELL_FILE), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    for name, data in files.items():
        if name != SUMMARY_FILE:
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)
    partial = os.path.join(path, SUMMARY_FILE + ".partial")
    with open(partial, "wb") as f:
        f.write(files[SUMMARY_FILE])
    os.replace(partial, os.path.join(path, SUMMARY_FILE))


def read_summary(out_dir: str, cell: Cell) -> dict[str, Any]:
    with open(os.path.join(out_dir, cell.name, SUMMARY_FILE)) as f:
        summary: dict[str, Any] = json.load(f)
    return summary
