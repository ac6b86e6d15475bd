"""The numbers behind the /status page, built only while someone is looking.

The data path pays for one thing: ``RecentDispatches.append`` (forward.py), an O(1) append to a
bounded deque of the ``Dispatch`` objects the ledger made anyway. Everything else is read here,
at build time, from what the router keeps for its own work or for /metrics: the replicas'
states and breakers, the scraper's last reports, and the Prometheus collector's families. A
build is shared by every viewer for ``StatusFeed.min_interval_s`` (so ten open pages cost one
build a second, not ten), and windowed figures come from samples taken at build time: with
nobody looking, nothing is sampled at all.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from kvroute.backends.handle import ReplicaHandle
from kvroute.health.breaker import BreakerState
from kvroute.health.scrape import ReplicaReport
from kvroute.kvcore.ledger import Dispatch

# Recent routing decisions kept for the page: enough to read, small enough to hold (a Dispatch
# keeps its request's block hashes alive: ~50 long prompts at most).
KEPT_DECISIONS = 50
# Windowed figures cover at most this long ("the last minutes").
WINDOW_S = 300.0
# A window shorter than this is noise (a page just opened after a quiet spell): totals since the
# router started are shown instead, labelled so.
MIN_WINDOW_S = 60.0
# Samples for the window are kept at most this often, whatever the viewers' tick.
SAMPLE_EVERY_S = 10.0
# The reuse decomposition's counter, when the router exports it (kind: available, captured,
# confirmed); read from the collector so the page needs no change when it appears.
REUSE_FAMILY = "kvroute_prefix_reuse_tokens"
REUSE_ORDER = ("available", "captured", "confirmed")
NOT_CHECKED = "not checked yet"
# The regret line ("kv_aware vs round robin over the last hour") has a window of its own, an
# hour, sampled like the others; its counters sit in a row of their own in ``Counters``.
REGRET_WINDOW_S = 3600.0
ROUTING_ROW = "(routing)"
REGRET_CHOICES = ("chosen", "round_robin", "power_of_two")
ESTIMATE_FAMILIES = {
    "kvroute_routing_estimated_ttft_seconds": "choice",
    "kvroute_routing_estimated_decisions": None,
}


class RecentDispatches(deque[Dispatch]):
    """The last ``KEPT_DECISIONS`` dispatches, newest last. The objects are the ledger's own,
    so fields filled in after dispatch (its outcome, confirmed reuse) show when the page reads
    them."""

    def __init__(self, maxlen: int = KEPT_DECISIONS) -> None:
        super().__init__(maxlen=maxlen)


Counters = dict[str, dict[str, float]]  # replica -> what -> cumulative value


@dataclass(slots=True)
class _Sample:
    at: float  # monotonic seconds
    counters: Counters


@dataclass(slots=True)
class _History:
    """Cumulative counters sampled at build time; a window is the difference of two samples."""

    start: _Sample  # all zero at the router's start: "since start"
    samples: deque[_Sample] = field(default_factory=deque)
    window_s: float = WINDOW_S

    def add(self, sample: _Sample) -> None:
        if not self.samples or sample.at - self.samples[-1].at >= SAMPLE_EVERY_S:
            self.samples.append(sample)
        while self.samples and sample.at - self.samples[0].at > self.window_s:
            self.samples.popleft()

    def baseline(self, now: float) -> _Sample:
        """The oldest sample at most ``window_s`` old, if it spans ``MIN_WINDOW_S``; else the
        start (the router is young, or nobody looked for a while)."""
        if now - self.start.at <= self.window_s:
            return self.start
        oldest = self.samples[0] if self.samples else None
        if oldest is not None and now - oldest.at >= MIN_WINDOW_S:
            return oldest
        return self.start


class StatusFeed:
    """Builds the status JSON from the router's live parts (passed as callables: the feed holds
    no copy of any of them)."""

    min_interval_s = 0.5

    def __init__(
        self,
        handles: Callable[[], Mapping[str, ReplicaHandle]],
        reports: Callable[[], Mapping[str, ReplicaReport]],
        metrics: CollectorRegistry,
        recent: RecentDispatches,
        router: Callable[[], dict[str, Any]],
        checks: Callable[[], dict[str, Any]] | None = None,
        tenants: Callable[[], Any] | None = None,
    ) -> None:
        self._checks = checks
        self._tenants = tenants
        self._handles = handles
        self._reports = reports
        self._metrics = metrics
        self._recent = recent
        self._router = router
        self._history = _History(_Sample(time.monotonic(), {}))
        self._hour = _History(self._history.start, window_s=REGRET_WINDOW_S)
        self._built_at = -1.0
        self._built = b""

    def json(self) -> bytes:
        """The status as JSON bytes: built at most once per ``min_interval_s`` for all viewers."""
        now = time.monotonic()
        if now - self._built_at >= self.min_interval_s:
            self._built = msgspec.json.encode(self.build(now))
            self._built_at = now
        return self._built

    def build(self, now: float) -> dict[str, Any]:
        handles = self._handles()
        reports = self._reports()
        counters = self._counters(handles, reports)
        sample = _Sample(now, counters)
        base = self._history.baseline(now)
        self._history.add(sample)
        routing = counters.pop(ROUTING_ROW, {})
        hour = self._hour.baseline(now)
        self._hour.add(_Sample(now, {ROUTING_ROW: routing}))
        regret = regret_summary(
            _difference(routing, hour.counters.get(ROUTING_ROW, {})),
            now - hour.at,
            hour is self._hour.start,
        )

        # Per replica, what happened in the window; the fleet's is their sum.
        window = {
            name: _difference(counters.get(name, {}), base.counters.get(name, {}))
            for name in handles
        }
        totals: dict[str, float] = {}
        for grown in window.values():
            for what, value in grown.items():
                totals[what] = totals.get(what, 0.0) + value
        kinds = sorted(
            {what[6:] for row in counters.values() for what in row if what.startswith("reuse:")},
            key=lambda k: (REUSE_ORDER.index(k) if k in REUSE_ORDER else len(REUSE_ORDER), k),
        )
        replicas = []
        for name, handle in handles.items():
            w = window[name]
            row = _replica_row(handle, reports.get(name), now)
            row["requests"] = int(sum(v for what, v in w.items() if what.startswith("req:")))
            row["hit_rate"] = _ratio(w.get("hits", 0.0), w.get("queries", 0.0))
            row["predicted_hit_rate"] = _ratio(w.get("predicted", 0.0), w.get("routed", 0.0))
            row["reuse"] = {k: int(w.get("reuse:" + k, 0.0)) for k in kinds} if kinds else None
            replicas.append(row)
        reasons = {
            what[4:]: int(v) for what, v in sorted(totals.items()) if what.startswith("req:")
        }
        fleet = {
            "replicas": len(replicas),
            "in_rotation": sum(1 for r in replicas if r["healthy"] and not r["ejected"]),
            "in_flight": sum(r["in_flight"] for r in replicas),
            "waiting": sum(r["waiting"] or 0 for r in replicas),
            "requests": sum(reasons.values()),
            "requests_by_reason": reasons,
            "hit_rate": _ratio(totals.get("hits", 0.0), totals.get("queries", 0.0)),
            "predicted_hit_rate": _ratio(totals.get("predicted", 0.0), totals.get("routed", 0.0)),
            "reuse": {k: int(totals.get("reuse:" + k, 0.0)) for k in kinds} if kinds else None,
        }
        return {
            "time": time.time(),
            "router": self._router(),
            "window": {
                "seconds": round(now - base.at, 1),
                "since_start": base is self._history.start,
            },
            "fleet": fleet,
            "replicas": replicas,
            "decisions": self._decisions(now),
            # The policy's estimate against round robin (policies/regret.py); None without.
            "regret": regret,
            # The router's own checks (parity; drift once built); the page says which are not.
            "checks": {"drift": NOT_CHECKED, "parity": NOT_CHECKED, "alarm": False}
            | (self._checks() if self._checks is not None else {}),
            "tenants": self._tenants() if self._tenants is not None else None,
        }

    def _counters(
        self, handles: Mapping[str, ReplicaHandle], reports: Mapping[str, ReplicaReport]
    ) -> Counters:
        """Every cumulative counter a window is taken of, flat: the collector's families (all
        workers merged, as /metrics) and the replicas' own prefix-cache counters."""
        counters: Counters = {}

        def add(replica: str, what: str, value: float) -> None:
            row = counters.setdefault(replica, {})
            row[what] = row.get(what, 0.0) + value

        for family in self._metrics.collect():
            if family.name == "kvroute_requests":
                for s in family.samples:
                    if s.name.endswith("_total"):
                        add(s.labels["replica"], "req:" + s.labels["reason"], s.value)
            elif family.name in _PER_REPLICA:
                what = _PER_REPLICA[family.name]
                for s in family.samples:
                    if s.name.endswith("_total"):
                        add(s.labels["replica"], what, s.value)
            elif family.name in ESTIMATE_FAMILIES:
                label = ESTIMATE_FAMILIES[family.name]
                for s in family.samples:
                    if s.name.endswith("_total"):
                        add(ROUTING_ROW, "est:" + (s.labels[label] if label else "n"), s.value)
            elif family.name == REUSE_FAMILY:
                for kind in REUSE_ORDER:  # exported: shown, at zero before any request
                    add("", "reuse:" + kind, 0.0)
                for s in family.samples:
                    if s.name.endswith("_total") and "kind" in s.labels:
                        add(s.labels.get("replica", ""), "reuse:" + s.labels["kind"], s.value)
        for name, report in reports.items():
            if report.prefix_hits is not None and report.prefix_queries is not None:
                add(name, "hits", report.prefix_hits)
                add(name, "queries", report.prefix_queries)
        return counters

    def _decisions(self, now: float) -> list[dict[str, Any]]:
        wall = time.time() - now  # monotonic to Unix time
        rows = []
        for d in reversed(self._recent):
            confirmed = getattr(d, "confirmed_tokens", None)
            rows.append(
                {
                    "time": round(wall + d.sent_at, 3),
                    "model": d.request.model,
                    "replica": d.replica,
                    "reason": d.reason,
                    "prompt_tokens": d.request.prompt_tokens,
                    "predicted_tokens": d.cached_tokens,
                    # From the reuse decomposition, once it records the replica's own count.
                    "confirmed_tokens": confirmed if isinstance(confirmed, int) else None,
                    "state": "in flight" if d.open else "done",
                }
            )
        return rows


_PER_REPLICA = {
    "kvroute_routed_prompt_tokens": "routed",
    "kvroute_predicted_prefix_hit_tokens": "predicted",
}


def _replica_row(handle: ReplicaHandle, report: ReplicaReport | None, now: float) -> dict[str, Any]:
    """One replica as a person reads it: a status word (never colour alone) and why."""
    state, breaker = handle.state, handle.breaker
    if not state.healthy:
        status, why = "down", handle.down_reason or "no passing health check yet"
    elif breaker.state is BreakerState.OPEN:
        status, why = "ejected", breaker.last_reason
    elif breaker.state is BreakerState.HALF_OPEN:
        status, why = "half-open", f"on trial after: {breaker.last_reason}"
    else:
        status, why = "up", None
    return {
        "name": handle.name,
        "url": handle.base_url,
        "status": status,
        "why": why,
        "healthy": state.healthy,
        "ejected": state.ejected,
        "breaker": breaker.state.value,
        "breaker_reason": breaker.last_reason or None,
        "down_reason": None if state.healthy else handle.down_reason,
        "ejected_for_s": round(max(0.0, breaker.open_until - now), 1)
        if breaker.state is BreakerState.OPEN
        else 0.0,
        "out_since": handle.out_since,
        "in_flight": state.in_flight,
        "in_flight_tokens": state.in_flight_tokens,
        "waiting": state.reported_waiting,
        "running": report.running if report is not None else None,
        "kv_usage": state.reported_kv_usage,
        "kv_capacity_tokens": state.kv_capacity_tokens,
        "latency": state.latency.describe() if state.latency is not None else None,
        "drift": None,  # not checked yet (see "checks")
        "parity": None,
    }


def regret_summary(
    grown: dict[str, float], seconds: float, since_start: bool
) -> dict[str, Any] | None:
    """The estimated TTFT on the policy's choices against round robin's and power of two's
    over the window, with the line a person reads; None before any decision was estimated."""
    decisions = grown.get("est:n", 0.0)
    if decisions <= 0:
        return None
    means = {c: grown.get("est:" + c, 0.0) / decisions for c in REGRET_CHOICES}
    chosen, rr = means["chosen"], means["round_robin"]
    change = (rr - chosen) / rr if rr > 0 else 0.0
    word = "better" if change >= 0 else "worse"
    # A page first opened after hours without a viewer has no sample an hour old: say so.
    over = "over the last hour"
    if since_start and seconds > REGRET_WINDOW_S:
        over = f"since the router started ({seconds / 3600:.1f} h ago)"
    return {
        "line": f"kv_aware vs round robin {over}: estimated TTFT {chosen:.3f} s vs {rr:.3f} s "
        f"({abs(change):.0%} {word})",
        "window_s": round(seconds, 1),
        "decisions": int(decisions),
        "estimated_ttft_s": {c: round(v, 6) for c, v in means.items()},
    }


def _difference(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters' growth since ``before``; a counter that went back (its replica restarted)
    counts from zero."""
    out = {}
    for what, value in now.items():
        old = before.get(what, 0.0)
        out[what] = value if value < old else value - old
    return out


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def page_html() -> bytes:
    """The page itself: one file, no build step, shipped as package data."""
    return resources.files(__name__.rpartition(".")[0]).joinpath("status_page.html").read_bytes()
