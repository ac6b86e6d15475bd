"""A sweep's results side by side: one row per cell as a Markdown table, a CSV of every number
``summary.json`` holds, and one plot (hit rate and TTFT p99 against fleet size, a line per
policy and KV capacity, a column of panels per rate)."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from .sweep_grid import Cell

# The cell's own columns, then every scalar of summary.json in its order.
_CELL_COLUMNS = ("cell", "policy", "replicas", "kv_capacity_tokens", "rate_scale")
_REPEATED = {"policy", "replicas"}  # in summary.json too, with the same values


def table_rows(cells: Sequence[Cell], summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per cell: the cell (its KV capacity as the replay resolved it), then the
    summary's numbers and strings (its lists and nested objects stay in summary.json)."""
    rows = []
    for cell, summary in zip(cells, summaries, strict=True):
        row: dict[str, Any] = {
            "cell": cell.name,
            "policy": cell.policy,
            "replicas": cell.replicas,
            "kv_capacity_tokens": summary["kv_capacity_tokens_per_replica"],
            "rate_scale": cell.rate_scale,
        }
        for key, value in summary.items():
            if key not in _REPEATED and (value is None or isinstance(value, str | int | float)):
                row[key] = value
        row["warnings"] = len(summary.get("warnings", []))
        rows.append(row)
    return rows


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(digits: int, scale: float = 1.0) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else f"{v * scale:,.{digits}f}"


# (header, row key, format): the figures a capacity planner compares across cells.
_MARKDOWN: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("cell", "cell", str),
    ("policy", "policy", str),
    ("replicas", "replicas", str),
    ("KV tokens/replica", "kv_capacity_tokens", _num(0)),
    ("rate", "rate_scale", lambda v: f"{v:g}x"),
    ("requests", "requests", _num(0)),
    ("done", "completed", _num(0)),
    ("hit rate", "prefix_hit_rate", _pct),
    ("TTFT p50 s", "ttft_p50_s", _num(3)),
    ("TTFT p99 s", "ttft_p99_s", _num(3)),
    ("TPOT p50 ms", "tpot_p50_s", _num(1, 1000)),
    ("TPOT p99 ms", "tpot_p99_s", _num(1, 1000)),
    ("throughput req/s", "throughput_rps", _num(2)),
    ("goodput req/s", "goodput_rps", _num(2)),
    ("load max/mean", "load_max_over_mean", _num(2)),
    ("warnings", "warnings", str),
    ("wall s", "wall_s", _num(1)),
)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The key figures of every cell; the CSV has the rest."""
    lines = [
        "| " + " | ".join(header for header, _, _ in _MARKDOWN) + " |",
        "|"
        + "|".join("---" if header in ("cell", "policy") else "--:" for header, _, _ in _MARKDOWN)
        + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(key)) for _, key, fmt in _MARKDOWN) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Every row's every column (the union, in first-seen order; blank where a cell lacks one)."""
    columns = list(_CELL_COLUMNS)
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def write_plot(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Hit rate (top) and TTFT p99 (bottom) against replicas; a column per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rates = sorted({row["rate_scale"] for row in rows})
    fig, axes = plt.subplots(
        2, len(rates), figsize=(4.5 * len(rates) + 1.5, 7), squeeze=False, sharex=True
    )
    capacities = {row["kv_capacity_tokens"] for row in rows}
    sizes = sorted({int(row["replicas"]) for row in rows})
    wide = sizes[-1] >= 8 * sizes[0]  # fleet sizes spanning decades: a log axis
    for col, rate in enumerate(rates):
        lines: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            if row["rate_scale"] == rate:
                label = row["policy"]
                if len(capacities) > 1:
                    label += f", {row['kv_capacity_tokens']:,} KV tokens"
                lines.setdefault(label, []).append(row)
        for label, points in lines.items():
            points.sort(key=lambda r: int(r["replicas"]))
            xs = [p["replicas"] for p in points]
            for ax, key in zip(axes[:, col], ("prefix_hit_rate", "ttft_p99_s"), strict=True):
                ys = [math.nan if p.get(key) is None else p[key] for p in points]
                ax.plot(xs, ys, marker="o", label=label)
        axes[0, col].set_title(f"{rate:g}x the trace's rate")
        axes[0, col].set_ylabel("prefix hit rate (tokens)")
        axes[0, col].set_ylim(0, 1)
        axes[1, col].set_ylabel("TTFT p99 (s)")
        axes[1, col].set_xlabel("replicas")
        p99s = [r["ttft_p99_s"] for r in rows if r["rate_scale"] == rate and r.get("ttft_p99_s")]
        if p99s and max(p99s) >= 20 * min(p99s):  # an overloaded fleet beside ones that keep up
            axes[1, col].set_yscale("log")
        for ax in axes[:, col]:
            if wide:
                ax.set_xscale("log")
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out_dir: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """sweep.md, sweep.csv and sweep.png in ``out_dir``; returns their paths."""
    paths = [os.path.join(out_dir, name) for name in ("sweep.md", "sweep.csv", "sweep.png")]
    with open(paths[0], "w") as f:
        f.write(markdown_table(rows))
    write_csv(paths[1], rows)
    write_plot(paths[2], rows)
    return paths
