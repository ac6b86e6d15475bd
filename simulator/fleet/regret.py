"""The regret estimate against its counterfactual: the same trace replayed with the baseline.

At every decision the router estimates the request's TTFT on its choice and on the replicas
round robin and power of two would have picked (policies/regret.py); the live router exports
the sums (``kvroute_routing_estimated_ttft_seconds``). The simulator can do what the live
router cannot: replay the trace with the baseline policy itself. Here the two meet: the mean
estimated regret per request against the measured difference of mean TTFT between the two
runs, over the requests both finished. The estimate freezes the fleet at each decision (the
baseline's own earlier choices would have left other caches and queues), so its size may be
off; its sign is what an operator reads, and what ``kvroute replay`` checks.

Pure: SimResults in, numbers and lines out.
"""

from __future__ import annotations

import math
from typing import Any

from .results import SimResult

ESTIMATED_CHOICES = ("chosen", "round_robin", "power_of_two")
BASELINES = ("round_robin", "power_of_two")  # each is the estimate's key and the policy's name


def estimate_summary(result: SimResult) -> dict[str, Any] | None:
    """Mean estimated TTFT per choice and mean regret per baseline, over the decisions made
    (None: the policy makes no estimate)."""
    est = result.estimated_ttft_s
    if est is None:
        return None
    rows = [i for i, v in enumerate(est["chosen"]) if not math.isnan(v)]
    if not rows:
        return None
    means = {c: _mean([est[c][i] for i in rows]) for c in ESTIMATED_CHOICES}
    return {
        "decisions": len(rows),
        "estimated_ttft_mean_s": means,
        "regret_mean_s": {b: means["chosen"] - means[b] for b in BASELINES},
        "worse_share": {
            b: sum(1 for i in rows if est["chosen"][i] > est[b][i]) / len(rows) for b in BASELINES
        },
    }


def counterfactual(result: SimResult, others: list[SimResult]) -> dict[str, dict[str, Any]]:
    """Per baseline run among ``others`` (by policy name): the mean estimated regret of
    ``result``'s decisions next to the measured difference of mean TTFT, both over the
    requests both runs finished."""
    est = result.estimated_ttft_s
    out: dict[str, dict[str, Any]] = {}
    if est is None:
        return out
    for base in others:
        if base.policy not in BASELINES or base.requests != result.requests:
            continue
        rows = [
            i
            for i in range(result.requests)
            if not math.isnan(est["chosen"][i])
            and not math.isnan(result.finish_s[i])
            and not math.isnan(base.finish_s[i])
        ]
        if not rows:
            continue
        estimated = _mean([est["chosen"][i] - est[base.policy][i] for i in rows])
        mine = _mean([result.first_token_s[i] - result.arrival_s[i] for i in rows])
        theirs = _mean([base.first_token_s[i] - base.arrival_s[i] for i in rows])
        measured = mine - theirs
        out[base.policy] = {
            "requests": len(rows),
            "estimated_regret_mean_s": estimated,
            "measured_ttft_mean_s": mine,
            "baseline_ttft_mean_s": theirs,
            "measured_difference_s": measured,
            "signs_agree": _sign(estimated) == _sign(measured),
        }
    return out


def comparison_lines(policy: str, compared: dict[str, dict[str, Any]]) -> list[str]:
    """One sentence per baseline, for the CLI and report.md."""
    lines = []
    for base, c in compared.items():
        lines.append(
            f"{policy} vs {base}: estimated regret {_signed(c['estimated_regret_mean_s'])} per "
            f"request (TTFT on its choice less on {base}'s, the fleet as it stood), measured "
            f"{_signed(c['measured_difference_s'])} (mean TTFT {c['measured_ttft_mean_s']:.3f} s "
            f"vs {c['baseline_ttft_mean_s']:.3f} s in the {base} run, {c['requests']:,} requests): "
            + ("signs agree" if c["signs_agree"] else "signs DISAGREE")
        )
    return lines


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _signed(seconds: float) -> str:
    return f"{seconds:+.3f} s"
