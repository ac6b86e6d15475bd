"""PNG plots of replays (matplotlib, Agg backend). The one module here that writes files."""

from __future__ import annotations

import math
import os

from .results import SimResult

_BINS = 60
_MAX_BARS = 64  # replicas per policy drawn as bars in load_per_replica.png; more: an outline
_MAX_WIDTH_IN = 16.0


def write_plots(results: list[SimResult], out_dir: str) -> list[str]:
    """Write the report's plots into ``out_dir``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []

    def save(fig: object, name: str) -> None:
        fig.tight_layout()  # type: ignore[attr-defined]
        fig.savefig(os.path.join(out_dir, name), dpi=110)  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        written.append(name)

    for name, label, values_of in (
        ("ttft_cdf.png", "time to first token (s)", SimResult.ttfts),
        ("tpot_cdf.png", "time per output token (ms)", SimResult.tpots),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in results:
            values = sorted(values_of(r))
            if name == "tpot_cdf.png":
                values = [v * 1000 for v in values]
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, ys, label=r.policy)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        if name == "ttft_cdf.png":
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
        save(fig, name)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        xs, ys = _hit_rate_series(r)
        ax.plot(xs, ys, label=r.policy)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("prefix hit rate (tokens)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, "hit_rate_over_time.png")

    replicas = results[0].replicas
    fig, ax = plt.subplots(figsize=(min(_MAX_WIDTH_IN, max(7.0, 0.25 * replicas)), 4.2))
    width = 0.8 / len(results)
    for k, r in enumerate(results):
        if replicas > _MAX_BARS:
            # One outline per policy: a thousand bars take matplotlib seconds to draw (and
            # to place a legend around), and are too thin to see at any readable width.
            ax.stairs(r.routed_requests, range(r.replicas + 1), label=r.policy)
            continue
        xs = [i + k * width for i in range(r.replicas)]
        ax.bar(xs, r.routed_requests, width=width, label=r.policy)
    ax.set_xlabel("replica")
    ax.set_ylabel("requests routed")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    save(fig, "load_per_replica.png")
    return written


def _hit_rate_series(r: SimResult) -> tuple[list[float], list[float]]:
    if not r.arrival_s:
        return [], []
    t0, t1 = min(r.arrival_s), max(r.arrival_s)
    width = (t1 - t0) / _BINS or 1.0
    hits = [0] * _BINS
    queried = [0] * _BINS
    for a, h, q in zip(r.arrival_s, r.hit_tokens, r.queried_tokens, strict=True):
        b = min(_BINS - 1, int((a - t0) / width))
        hits[b] += h
        queried[b] += q
    xs = [t0 + (b + 0.5) * width for b in range(_BINS)]
    ys = [hits[b] / queried[b] if queried[b] else math.nan for b in range(_BINS)]
    return xs, ys
