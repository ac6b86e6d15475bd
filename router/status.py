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
from kvroute.policies import FleetView

from .dp_ranks import replica_of

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
        *,
        agents: Callable[[], dict[str, Any]] | None = None,
        fleet_fields: Callable[[str], dict[str, Any]] | None = None,
        parity: Callable[[], dict[str, Any] | None] | None = None,
        rollout: Callable[[], dict[str, Any] | None] | None = None,
        canary_enabled: bool = False,
        kv_tiers: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        # Per replica: blocks per KV tier and the capacity its events showed (pools.kv_tiers).
        self._kv_tiers = kv_tiers
        self._checks = checks
        # A replica's rollout phase and pool (fleet_admin.FleetControl.row_fields).
        self._fleet_fields = fleet_fields
        # The parity checker's snapshot (router/parity.py), None when it is off.
        self._parity = parity
        self._rollout = rollout
        self._canary_enabled = canary_enabled
        self._tenants = tenants
        self._agents = agents
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
        parity = self._parity() if self._parity is not None else None
        tiers = self._kv_tiers() if self._kv_tiers is not None else {}
        replicas = []
        for name, handle in handles.items():
            w = window[name]
            fields = self._fleet_fields(name) if self._fleet_fields is not None else {}
            row = _replica_row(handle, reports.get(name), now, fields, parity)
            row["requests"] = int(sum(v for what, v in w.items() if what.startswith("req:")))
            row["hit_rate"] = _ratio(w.get("hits", 0.0), w.get("queries", 0.0))
            row["predicted_hit_rate"] = _ratio(w.get("predicted", 0.0), w.get("routed", 0.0))
            row["reuse"] = {k: int(w.get("reuse:" + k, 0.0)) for k in kinds} if kinds else None
            row["kv_tiers"] = tiers.get(name)
            replicas.append(row)
        reasons = {
            what[4:]: int(v) for what, v in sorted(totals.items()) if what.startswith("req:")
        }
        fleet = {
            "replicas": len(replicas),
            # Only replicas that take new requests now (FleetView.admits: healthy, breaker
            # closed or on trial, not quarantined, not draining).
            "in_rotation": sum(1 for r in replicas if r["in_rotation"]),
            "out": {
                status: sum(1 for r in replicas if r["status"] == status)
                for status in STATUS_WORDS
                if any(r["status"] == status for r in replicas)
            },
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
            # The router's own checks (drift canary, parity); the page says which are not.
            "checks": self._fleet_checks(handles),
            "rollout": self._rollout() if self._rollout is not None else None,
            "tenants": self._tenants() if self._tenants is not None else None,
            # How requests' sessions were found, and the programs admission orders (sessions.py).
            "agents": self._agents() if self._agents is not None else None,
        }

    def _fleet_checks(self, handles: Mapping[str, ReplicaHandle]) -> dict[str, Any]:
        checks: dict[str, Any] = {"drift": NOT_CHECKED, "parity": NOT_CHECKED, "alarm": False}
        if not self._canary_enabled:
            checks["drift"] = "off (canary.enabled: false)"
        else:
            checked = [h for h in handles.values() if h.drift.checked_at is not None]
            quarantined = sorted(h.name for h in handles.values() if h.drift.quarantined)
            if quarantined:
                checks["drift"] = "QUARANTINED: " + ", ".join(quarantined)
                checks["alarm"] = True
            elif checked:
                agree = sum(1 for h in checked if h.drift.last_result == "agree")
                checks["drift"] = f"ok ({agree} of {len(checked)} replicas agree)"
        if self._checks is not None:
            given = self._checks()
            if given.get("alarm"):
                checks["alarm"] = True
            checks["parity"] = given.get("parity", checks["parity"])
        return checks

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


# Status words, most serious first: a replica's status is the first that applies. "up" and
# "parity alarm" take new requests; "half-open" takes trial requests.
STATUS_WORDS = (
    "down",
    "quarantined",
    "draining",
    "starting",
    "ejected",
    "half-open",
    "parity alarm",
    "up",
)


def _replica_row(
    handle: ReplicaHandle,
    report: ReplicaReport | None,
    now: float,
    fleet_fields: Mapping[str, Any] | None = None,
    parity: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One replica as a person reads it: a status word (never colour alone), every reason it
    is out of rotation or suspect (``reasons``, most serious first), and its checks' last
    results."""
    state, breaker, drift = handle.state, handle.breaker, handle.drift
    phase = (fleet_fields or {}).get("phase", "serving")
    finding = (parity or {}).get("finding") or {}
    alarmed = bool((parity or {}).get("alarm")) and finding.get("replica") == handle.name
    reasons: list[dict[str, str]] = []
    if not state.healthy:
        reasons.append(
            {"status": "down", "why": handle.down_reason or "no passing health check yet"}
        )
    if drift.quarantined:
        where = drift.quarantine
        detail = "quarantined for output drift by the canary"
        if where is not None:
            detail += (
                f": on {where.prompt!r} its token {where.position} differs from the"
                f" {where.reference}'s"
            )
        reasons.append({"status": "quarantined", "why": detail})
    if state.draining or phase == "draining":
        reasons.append({"status": "draining", "why": "draining: takes no new requests"})
    if phase == "starting":
        reasons.append({"status": "starting", "why": "starting: not yet checked in"})
    if breaker.state is BreakerState.OPEN:
        reasons.append({"status": "ejected", "why": f"breaker open: {breaker.last_reason}"})
    elif breaker.state is BreakerState.HALF_OPEN:
        reasons.append(
            {"status": "half-open", "why": f"breaker on trial after: {breaker.last_reason}"}
        )
    if handle.panic and reasons:
        reasons[-1]["why"] += (
            "; taking traffic anyway: no other replica of its model is in rotation"
        )
    if alarmed:
        reasons.append({"status": "parity alarm", "why": f"parity alarm: {finding.get('detail')}"})
    status = reasons[0]["status"] if reasons else "up"
    return {
        "name": handle.name,
        "url": handle.base_url,
        "replica": replica_of(handle.name),
        "data_parallel_rank": handle.data_parallel_rank,
        "status": status,
        "why": "; ".join(r["why"] for r in reasons) or None,
        "reasons": reasons,
        # Takes new requests now: the one rule the policies use (FleetView.admits).
        "in_rotation": FleetView.admits(state, None),
        "healthy": state.healthy,
        "ejected": state.ejected or handle.panic,
        "panic": handle.panic,
        "quarantined": drift.quarantined,
        "draining": state.draining,
        "phase": phase,
        "pool": (fleet_fields or {}).get("pool"),
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
        # Its speed against the others' as configured (replicas[].speed): where its
        # latency lines started.
        "speed": state.speed,
        "latency": state.latency.describe() if state.latency is not None else None,
        # The drift canary's last result on this replica; None before its first round.
        "drift": _drift_row(handle),
        # The parity check's last result on this replica; None before its first check.
        "parity": _parity_row(handle.name, parity, alarmed),
    }


def _drift_row(handle: ReplicaHandle) -> dict[str, Any] | None:
    drift = handle.drift
    if drift.checked_at is None and not drift.quarantined:
        return None
    divergence = drift.quarantine or drift.last_divergence
    return {
        "result": drift.last_result,
        "checked_at": drift.checked_at,
        "quarantined": drift.quarantined,
        "quarantined_at": drift.quarantined_at,
        "position": divergence.position if divergence is not None else None,
        "reference": divergence.reference if divergence is not None else None,
        "error": drift.last_error,
    }


def _parity_row(
    name: str, parity: Mapping[str, Any] | None, alarmed: bool
) -> dict[str, Any] | None:
    last = (parity or {}).get("last", {}).get(name)
    if last is None and not alarmed:
        return None
    return {
        "check": last["check"] if last else None,
        "result": last["result"] if last else None,
        "detail": last["detail"] if last else None,
        "alarm": alarmed,
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
