"""What a P/D fleet's run did per request: split or not, where it prefilled, the KV it moved."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvroute.kvcore.pd import SPLIT
from kvroute.kvcore.stats import percentile

from .pd_setup import PdSetup

NAN = float("nan")


@dataclass
class PdOutcome:
    """Per request (trace index), filled in by the P/D fleet (pd_fleet.py)."""

    setup: PdSetup
    link_bytes_per_s: float
    decision: list[str]  # kvcore.pd's answer: SPLIT, or why not ("" until routed)
    prefill_replica: list[int]  # the prefill replica of a split request (-1: none)
    prefill_done_s: list[float]  # when its prefill replica sampled its token (NaN: not split)
    transfer_tokens: list[int]  # prompt tokens whose KV moved (those the decode replica lacked)
    transfer_s: list[float]  # how long the move took (NaN: not split)
    decisions: Counter[str] = field(default_factory=Counter)

    @classmethod
    def empty(cls, setup: PdSetup, link_bytes_per_s: float, requests: int) -> PdOutcome:
        return cls(
            setup,
            link_bytes_per_s,
            [""] * requests,
            [-1] * requests,
            [NAN] * requests,
            [0] * requests,
            [NAN] * requests,
        )

    @property
    def split_share(self) -> float:
        routed = sum(self.decisions.values())
        return self.decisions[SPLIT] / routed if routed else NAN

    def decode_replicas(self) -> range:
        """The fleet's replica numbers of the decode pool (the prefill pool comes first)."""
        return range(self.setup.prefill, self.setup.replicas)

    def as_dict(
        self, arrival_s: list[float], first_token_s: list[float], finish_s: list[float]
    ) -> dict[str, Any]:
        """summary.json's ``pd``: the setup, the decisions, the transfers, TTFT by path."""
        done = [i for i, f in enumerate(finish_s) if not math.isnan(f)]
        split = [i for i in done if self.decision[i] == SPLIT]
        local = [i for i in done if self.decision[i] != SPLIT]

        def ttft(which: list[int], q: float) -> float | None:
            return _num(percentile([first_token_s[i] - arrival_s[i] for i in which], q))

        rule = self.setup.rule
        moved = [self.transfer_tokens[i] for i in split]
        return {
            "prefill_replicas": self.setup.prefill,
            "decode_replicas": self.setup.decode,
            "mode": rule.mode,
            "min_uncached_tokens": rule.min_uncached_tokens,
            "link": self.setup.link,
            "link_bytes_per_s": self.link_bytes_per_s,
            "split_share": _num(self.split_share),
            "decisions": dict(sorted(self.decisions.items())),
            "transfer_tokens_mean": _num(sum(moved) / len(moved) if moved else NAN),
            "transfer_s_p50": _num(percentile([self.transfer_s[i] for i in split], 0.5)),
            "transfer_s_p99": _num(percentile([self.transfer_s[i] for i in split], 0.99)),
            # Arrival to the prefill replica's token: its queue and compute.
            "prefill_s_p50": _num(
                percentile([self.prefill_done_s[i] - arrival_s[i] for i in split], 0.5)
            ),
            "ttft_split_p50_s": ttft(split, 0.5),
            "ttft_split_p99_s": ttft(split, 0.99),
            "ttft_local_p50_s": ttft(local, 0.5),
            "ttft_local_p99_s": ttft(local, 0.99),
        }


def format_pd(summary: dict[str, Any]) -> str | None:
    """One line for the terminal: how the run split its requests and what moving KV cost."""
    pd = summary.get("pd")
    if not pd:
        return None
    decisions = pd["decisions"]
    routed = sum(decisions.values()) or 1
    why_not = ", ".join(
        f"{name} {count / routed:.0%}" for name, count in decisions.items() if name != SPLIT
    )
    line = (
        f"P/D ({summary['policy']}): {pd['prefill_replicas']} prefill + "
        f"{pd['decode_replicas']} decode, {pd['mode']}: {_pct(pd['split_share'])} split"
        + (f" (not split: {why_not})" if why_not else "")
    )
    if pd["transfer_s_p50"] is not None:
        line += (
            f"; KV moved {pd['transfer_tokens_mean']:,.0f} tokens per split request, "
            f"transfer p50 {pd['transfer_s_p50'] * 1000:.1f} ms, p99 "
            f"{pd['transfer_s_p99'] * 1000:.1f} ms; TTFT p50/p99 split "
            f"{_s(pd['ttft_split_p50_s'])}/{_s(pd['ttft_split_p99_s'])}"
        )
    if pd["ttft_local_p50_s"] is not None:
        line += (
            f", prefilled on the decode replica {_s(pd['ttft_local_p50_s'])}/"
            f"{_s(pd['ttft_local_p99_s'])}"
        )
    return line


def _num(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 6)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"
