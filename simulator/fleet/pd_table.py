"""``kvroute plan --pd``'s table: aggregated and disaggregated fleets side by side (pure text)."""

from __future__ import annotations

import math
from typing import Any

# The fleets compared, in the table's order: the aggregated one, then the P/D modes.
PD_FLEETS = ("aggregated", "always", "conditional")
_LABELS = {
    "aggregated": "aggregated",
    "always": "disaggregated",
    "conditional": "conditional",
}


def format_pd_plan(title: list[str], rows: list[dict[str, Any]]) -> str:
    """``title`` lines, then one row per fleet: its size (``P+D`` for a P/D fleet), GPUs,
    TTFT and TPOT p50/p99, goodput per GPU and the share of requests split. A fleet that met
    no SLO shows the largest one simulated, marked ``(miss)``."""
    lines = [
        *title,
        f"{'fleet':<15}{'replicas':>12}{'GPUs':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'goodput/GPU':>13}{'split':>7}",
    ]
    missed = False
    for row in rows:
        size = (
            f"{row['prefill']}+{row['decode']}"
            if row["prefill"] is not None
            else str(row["replicas"])
        )
        if not row["ok"]:
            size += " (miss)"
            missed = True
        lines.append(
            f"{_LABELS[row['fleet']]:<15}{size:>12}{row['gpus']:>7}"
            f"{_s(row['ttft_p50_s']):>10}{_s(row['ttft_p99_s']):>10}"
            f"{_ms(row['tpot_p50_s']):>10}{_ms(row['tpot_p99_s']):>10}"
            f"{_rate(row['goodput_per_gpu']):>13}{_pct(row['split_share']):>7}"
        )
    lines.append(
        "goodput/GPU: requests per second meeting both SLO targets (first arrival to last "
        "finish), per GPU; split: requests prefilled on a prefill replica"
    )
    if missed:
        lines.append("(miss): no fleet of that kind met the SLO; the row shows the largest tried")
    return "\n".join(lines)


def _s(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.3f}s"


def _ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.1f}ms"


def _rate(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.4f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.0%}"
