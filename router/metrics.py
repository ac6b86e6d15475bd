"""Prometheus metrics, all named kvroute_*.

The hot path only bumps plain Python numbers (no locks, no label lookups in
prometheus_client); a collector turns them into Prometheus families at scrape time. This
is safe because the router runs on one event loop thread. Per-replica gauges are read from
the live ``ReplicaState`` at scrape time.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvroute.health.scrape import ReplicaReport
from kvroute.kvcore.reuse import Reuse
from kvroute.policies import ReplicaState
from kvroute.policies.regret import TtftEstimate

from .kv_subscriber import SubscriberStats

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# What a routing decision's estimated TTFT is compared with (policies/regret.py).
REGRET_BASELINES = ("round_robin", "power_of_two")
# Event-loop lag: finer around the 50 ms a stream's next chunk may wait at most.
LOOP_LAG_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Counts per bucket, bumped on the hot path; Prometheus buckets at scrape time."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


Snapshot = dict[str, Any]


class MetricsPart(Protocol):
    """Metrics kept by another part (tenants, ...): its counters as plain data for the other
    workers, and its families from its own and the peers' data at scrape time."""

    def snapshot(self) -> Any: ...

    def families(self, peers: list[Any]) -> Iterable[Metric]: ...


class RouterMetrics:
    def __init__(
        self,
        replicas: Callable[[], Iterable[ReplicaState]],
        peers: Callable[[], list[Snapshot]] = list,
        kv_sources: Callable[[], Mapping[tuple[str, str], SubscriberStats]] = dict,
        index_entries: Callable[[], int] = lambda: 0,
        replica_reports: Callable[[], Mapping[str, ReplicaReport]] = dict,
        breaker_states: Callable[[], Mapping[str, str]] = dict,
        admission: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self._replicas = replicas
        self.breaker_states = breaker_states
        self.admission = admission
        self.replica_reports = replica_reports
        self.kv_sources = kv_sources
        self.index_entries = index_entries
        # Other worker processes' snapshots, merged in at scrape time.
        self._peers = peers
        # (replica, status, reason) -> count
        self.requests: dict[tuple[str, int, str], int] = {}
        # (status, code) -> count
        self.rejected: dict[tuple[int, str], int] = {}
        # (replica, kind) -> count
        self.upstream_errors: dict[tuple[str, str], int] = {}
        # (kind,) -> count: "retry" (before the first byte) or "resume" (a broken stream)
        self.retries: dict[tuple[str], int] = {}
        # (outcome,) -> count: resumed, failed, impossible, completed
        self.resumes: dict[tuple[str], int] = {}
        # (api,) -> count: client requests by the API they came in on (ParsedRequest.api)
        self.api_requests: dict[tuple[str], int] = {}
        # (replica, kind) -> count
        self.ejections: dict[tuple[str, str], int] = {}
        # (replica,) -> requests routed to it while ejected, nothing else in rotation (panic)
        self.panic_routed: dict[tuple[str], int] = {}
        # (replica, result) -> count: the drift canary's checks (one per prompt and replica).
        self.canary_checks: dict[tuple[str, str], int] = {}
        self.time_to_first_byte: dict[str, Histogram] = {}
        self.duration: dict[str, Histogram] = {}
        # replica -> prompt tokens routed there, and of those, tokens the index said it held.
        self.prompt_tokens: dict[str, int] = {}
        self.predicted_hit_tokens: dict[str, int] = {}
        # Prefix reuse decomposed (kvcore/reuse.py), by the replica that served the request:
        # (replica, kind) -> tokens, (replica, cause) -> tokens lost, (replica,) -> requests
        # whose reuse the engine did not report.
        self.reuse: dict[tuple[str, str], int] = {}
        self.reuse_lost: dict[tuple[str, str], int] = {}
        self.reuse_unconfirmed: dict[tuple[str], int] = {}
        # The policy's TTFT estimates (policies/regret.py), summed: ("ttft", choice) -> seconds,
        # ("decisions", "") -> decisions estimated, ("worse", baseline) -> of them, where the
        # choice looked slower than the baseline's.
        self.regret: dict[tuple[str, str], float] = {}
        # How late the event loop ran a timer (router/loop_lag.py): this worker's own.
        self.loop_lag = Histogram(LOOP_LAG_BUCKETS)
        self.parts: dict[str, MetricsPart] = {}  # name -> part (see MetricsPart)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def observe_request(
        self, replica: str, status: int, reason: str, ttfb_s: float, duration_s: float
    ) -> None:
        key = (replica, status, reason)
        self.requests[key] = self.requests.get(key, 0) + 1
        ttfb = self.time_to_first_byte.get(replica)
        if ttfb is None:
            ttfb = self.time_to_first_byte[replica] = Histogram()
            self.duration[replica] = Histogram()
        ttfb.observe(ttfb_s)
        self.duration[replica].observe(duration_s)

    def observe_routed(self, replica: str, prompt_tokens: int, predicted_hit_tokens: int) -> None:
        self.prompt_tokens[replica] = self.prompt_tokens.get(replica, 0) + prompt_tokens
        hits = self.predicted_hit_tokens
        hits[replica] = hits.get(replica, 0) + predicted_hit_tokens

    def observe_reuse(self, replica: str, reuse: Reuse | None) -> None:
        """A request answered by ``replica``: its prefix reuse, decomposed (None: the router
        did not look the prompt up in the index, so there is nothing to decompose)."""
        if reuse is None:
            return
        counts, lost = self.reuse, self.reuse_lost
        for key, tokens in (
            ((replica, "available"), reuse.available),
            ((replica, "captured"), reuse.captured),
        ):
            counts[key] = counts.get(key, 0) + tokens
        for key, tokens in (
            ((replica, "workload"), reuse.lost_workload),
            ((replica, "routing"), reuse.lost_routing),
        ):
            lost[key] = lost.get(key, 0) + tokens
        index_loss = reuse.lost_index
        if reuse.confirmed is None or index_loss is None:
            unconfirmed = self.reuse_unconfirmed
            unconfirmed[(replica,)] = unconfirmed.get((replica,), 0) + 1
            return
        key = (replica, "confirmed")
        counts[key] = counts.get(key, 0) + reuse.confirmed
        key = (replica, "index")
        lost[key] = lost.get(key, 0) + index_loss

    def observe_estimate(self, e: TtftEstimate) -> None:
        """One routing decision's estimated TTFT on its choice and the baselines'."""
        r = self.regret
        for key, value in (
            (("ttft", "chosen"), e.chosen),
            (("ttft", "round_robin"), e.round_robin),
            (("ttft", "power_of_two"), e.power_of_two),
            (("decisions", ""), 1.0),
            (("worse", "round_robin"), 1.0 if e.chosen > e.round_robin else 0.0),
            (("worse", "power_of_two"), 1.0 if e.chosen > e.power_of_two else 0.0),
        ):
            r[key] = r.get(key, 0.0) + value

    def observe_api(self, api: str) -> None:
        self.api_requests[(api,)] = self.api_requests.get((api,), 0) + 1

    def observe_rejected(self, status: int, code: str) -> None:
        key = (status, code)
        self.rejected[key] = self.rejected.get(key, 0) + 1

    def observe_upstream_error(self, replica: str, kind: str) -> None:
        key = (replica, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def observe_retry(self, kind: str) -> None:
        self.retries[(kind,)] = self.retries.get((kind,), 0) + 1

    def observe_resume(self, outcome: str) -> None:
        self.resumes[(outcome,)] = self.resumes.get((outcome,), 0) + 1

    def observe_panic_routed(self, replica: str) -> None:
        self.panic_routed[(replica,)] = self.panic_routed.get((replica,), 0) + 1

    def observe_ejection(self, replica: str, kind: str) -> None:
        key = (replica, kind)
        self.ejections[key] = self.ejections.get(key, 0) + 1

    def observe_canary(self, replica: str, result: str) -> None:
        key = (replica, result)
        self.canary_checks[key] = self.canary_checks.get(key, 0) + 1

    def replicas(self) -> Iterable[ReplicaState]:
        return self._replicas()

    def snapshot(self) -> Snapshot:
        """Counters and histograms as plain data, for the other workers to merge."""
        return {
            "requests": [[*k, v] for k, v in self.requests.items()],
            "rejected": [[*k, v] for k, v in self.rejected.items()],
            "upstream_errors": [[*k, v] for k, v in self.upstream_errors.items()],
            "retries": [[*k, v] for k, v in self.retries.items()],
            "resumes": [[*k, v] for k, v in self.resumes.items()],
            "api_requests": [[*k, v] for k, v in self.api_requests.items()],
            "ejections": [[*k, v] for k, v in self.ejections.items()],
            "panic_routed": [[*k, v] for k, v in self.panic_routed.items()],
            "canary_checks": [[*k, v] for k, v in self.canary_checks.items()],
            "prompt_tokens": [[k, v] for k, v in self.prompt_tokens.items()],
            "predicted_hit_tokens": [[k, v] for k, v in self.predicted_hit_tokens.items()],
            "reuse": [[*k, v] for k, v in self.reuse.items()],
            "reuse_lost": [[*k, v] for k, v in self.reuse_lost.items()],
            "reuse_unconfirmed": [[*k, v] for k, v in self.reuse_unconfirmed.items()],
            "regret": [[*k, v] for k, v in self.regret.items()],
            "ttfb": {r: [h.counts, h.total] for r, h in self.time_to_first_byte.items()},
            "duration": {r: [h.counts, h.total] for r, h in self.duration.items()},
            "parts": {name: part.snapshot() for name, part in self.parts.items()},
        }

    def part_families(self) -> Iterable[Metric]:
        peers = [peer.get("parts", {}) for peer in self._peers()]
        for name, part in self.parts.items():
            yield from part.families([p[name] for p in peers if name in p])

    def merged(self) -> Snapshot:
        """This worker's snapshot plus every peer's: what /metrics reports."""
        requests = dict(self.requests)
        rejected = dict(self.rejected)
        upstream_errors = dict(self.upstream_errors)
        retries: dict[Any, int] = dict(self.retries)
        resumes: dict[Any, int] = dict(self.resumes)
        api_requests: dict[Any, int] = dict(self.api_requests)
        ejections: dict[Any, int] = dict(self.ejections)
        panic_routed: dict[Any, int] = dict(self.panic_routed)
        canary_checks: dict[Any, int] = dict(self.canary_checks)
        prompt_tokens: dict[Any, int] = {(k,): v for k, v in self.prompt_tokens.items()}
        predicted: dict[Any, int] = {(k,): v for k, v in self.predicted_hit_tokens.items()}
        reuse: dict[Any, int] = dict(self.reuse)
        reuse_lost: dict[Any, int] = dict(self.reuse_lost)
        reuse_unconfirmed: dict[Any, int] = dict(self.reuse_unconfirmed)
        regret: dict[Any, float] = dict(self.regret)
        ttfb = {
            r: Histogram(counts=list(h.counts), total=h.total)
            for r, h in self.time_to_first_byte.items()
        }
        duration = {
            r: Histogram(counts=list(h.counts), total=h.total) for r, h in self.duration.items()
        }
        for peer in self._peers():
            for target, rows in (
                (requests, peer["requests"]),
                (rejected, peer["rejected"]),
                (upstream_errors, peer["upstream_errors"]),
                (retries, peer.get("retries", [])),
                (resumes, peer.get("resumes", [])),
                (api_requests, peer.get("api_requests", [])),
                (ejections, peer.get("ejections", [])),
                (panic_routed, peer.get("panic_routed", [])),
                (canary_checks, peer.get("canary_checks", [])),
                (prompt_tokens, peer["prompt_tokens"]),
                (predicted, peer["predicted_hit_tokens"]),
                (reuse, peer.get("reuse", [])),
                (reuse_lost, peer.get("reuse_lost", [])),
                (reuse_unconfirmed, peer.get("reuse_unconfirmed", [])),
                (regret, peer.get("regret", [])),
            ):
                for *key, count in rows:
                    k = tuple(key)
                    target[k] = target.get(k, 0) + count
            for target_h, histograms in ((ttfb, peer["ttfb"]), (duration, peer["duration"])):
                for replica, (counts, total) in histograms.items():
                    h = target_h.setdefault(replica, Histogram())
                    h.counts = [a + b for a, b in zip(h.counts, counts, strict=True)]
                    h.total += total
        return {
            "requests": requests,
            "rejected": rejected,
            "upstream_errors": upstream_errors,
            "retries": retries,
            "resumes": resumes,
            "api_requests": api_requests,
            "ejections": ejections,
            "panic_routed": panic_routed,
            "canary_checks": canary_checks,
            "prompt_tokens": {k[0]: v for k, v in prompt_tokens.items()},
            "predicted_hit_tokens": {k[0]: v for k, v in predicted.items()},
            "reuse": reuse,
            "reuse_lost": reuse_lost,
            "reuse_unconfirmed": reuse_unconfirmed,
            "regret": regret,
            "ttfb": ttfb,
            "duration": duration,
        }


class _Collector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterable[Metric]:
        m = self._m
        yield from m.part_families()
        merged = m.merged()
        requests = CounterMetricFamily(
            "kvroute_requests",
            "Requests answered by a replica, by replica, HTTP status and routing reason.",
            labels=["replica", "status", "reason"],
        )
        for (replica, status, reason), count in merged["requests"].items():
            requests.add_metric([replica, str(status), reason], count)
        yield requests

        rejected = CounterMetricFamily(
            "kvroute_rejected_requests",
            "Requests answered by the router itself without reaching a replica, by status and code.",
            labels=["status", "code"],
        )
        for (status, code), count in merged["rejected"].items():
            rejected.add_metric([str(status), code], count)
        yield rejected

        errors = CounterMetricFamily(
            "kvroute_upstream_errors",
            "Failures talking to a replica, by kind (connect, timeout, protocol, broken_stream).",
            labels=["replica", "kind"],
        )
        for (replica, kind), count in merged["upstream_errors"].items():
            errors.add_metric([replica, kind], count)
        yield errors
        yield from _reliability_families(m, merged)

        for name, doc, histograms in (
            (
                "kvroute_time_to_first_byte_seconds",
                "From dispatch to the first byte of the replica's response body.",
                merged["ttfb"],
            ),
            (
                "kvroute_request_duration_seconds",
                "From dispatch to the last byte relayed to the client.",
                merged["duration"],
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=["replica"])
            for replica, histogram in histograms.items():
                family.add_metric([replica], histogram.buckets(), histogram.total)
            yield family
        lag = HistogramMetricFamily(
            "kvroute_event_loop_lag_seconds",
            "How late this worker's event loop ran a timer due every 100 ms: how long any "
            "stream may have waited for the loop.",
        )
        lag.add_metric([], m.loop_lag.buckets(), m.loop_lag.total)
        yield lag

        in_flight = GaugeMetricFamily(
            "kvroute_in_flight_requests",
            "Requests the router has in flight per replica.",
            labels=["replica"],
        )
        in_flight_tokens = GaugeMetricFamily(
            "kvroute_in_flight_tokens",
            "Estimated tokens (prompt plus max output) in flight per replica.",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily(
            "kvroute_replica_healthy", "1 when the replica is taking traffic.", labels=["replica"]
        )
        for replica in m.replicas():
            in_flight.add_metric([replica.replica_id], replica.in_flight)
            in_flight_tokens.add_metric([replica.replica_id], replica.in_flight_tokens)
            healthy.add_metric([replica.replica_id], 1.0 if replica.healthy else 0.0)
        yield in_flight
        yield in_flight_tokens
        yield healthy
        yield from _prefix_hit_families(m, merged)
        yield from _reuse_families(merged)
        yield from _regret_families(merged)
        yield from _kv_event_families(m)


def _reliability_families(
    m: RouterMetrics, merged: Snapshot
) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    retries = CounterMetricFamily(
        "kvroute_retries",
        "Extra attempts: 'retry' (another replica before the first byte reached the client) "
        "or 'resume' (continuing a broken stream).",
        labels=["kind"],
    )
    for (kind,), count in merged["retries"].items():
        retries.add_metric([kind], count)
    yield retries
    apis = CounterMetricFamily(
        "kvroute_api_requests",
        "Client requests by the API they came in on: completions, chat, messages (Anthropic "
        "Messages), count_tokens (its token counting) or responses (OpenAI Responses).",
        labels=["api"],
    )
    for (api,), count in merged["api_requests"].items():
        apis.add_metric([api], count)
    yield apis

    resumes = CounterMetricFamily(
        "kvroute_stream_resumes",
        "Streams that broke after tokens were sent, by outcome (resumed, failed: no replica "
        "could continue it, impossible: the request cannot be continued, completed).",
        labels=["outcome"],
    )
    for (outcome,), count in merged["resumes"].items():
        resumes.add_metric([outcome], count)
    yield resumes
    ejections = CounterMetricFamily(
        "kvroute_replica_ejections",
        "Times a replica's circuit breaker opened, by the failure that opened it.",
        labels=["replica", "kind"],
    )
    for (replica, kind), count in merged["ejections"].items():
        ejections.add_metric([replica, kind], count)
    yield ejections
    panic = CounterMetricFamily(
        "kvroute_panic_routed_requests",
        "Requests routed to a replica its circuit breaker had ejected, because no replica of "
        "the model was in rotation (panic routing, breaker.panic_routing).",
        labels=["replica"],
    )
    for (replica,), count in merged["panic_routed"].items():
        panic.add_metric([replica], count)
    yield panic
    state = GaugeMetricFamily(
        "kvroute_replica_breaker_state",
        "1 for the state each replica's circuit breaker is in (this worker's view).",
        labels=["replica", "state"],
    )
    for replica, current in m.breaker_states().items():
        for name in ("closed", "open", "half_open"):
            state.add_metric([replica, name], 1.0 if name == current else 0.0)
    yield state
    checks = CounterMetricFamily(
        "kvroute_canary_checks",
        "Output-drift canary checks (one per replica and prompt), by result: agree, near_tie "
        "(differs where the top-2 logprobs were nearly tied), disagree (differs, no reference "
        "to judge by), drift (confidently differs from the fleet) or error (no answer).",
        labels=["replica", "result"],
    )
    for (replica, result), count in merged["canary_checks"].items():
        checks.add_metric([replica, result], count)
    yield checks
    quarantined = GaugeMetricFamily(
        "kvroute_replica_quarantined",
        "1 while the output-drift canary keeps the replica out of rotation (this worker's view).",
        labels=["replica"],
    )
    for replica in m.replicas():
        quarantined.add_metric([replica.replica_id], 1.0 if replica.quarantined else 0.0)
    yield quarantined
    active, queued = m.admission()
    admitted = GaugeMetricFamily(
        "kvroute_active_requests", "Client requests being handled (this worker)."
    )
    admitted.add_metric([], active)
    yield admitted
    waiting = GaugeMetricFamily(
        "kvroute_queued_requests", "Client requests waiting for a slot (this worker)."
    )
    waiting.add_metric([], queued)
    yield waiting


def _prefix_hit_families(
    m: RouterMetrics, merged: Snapshot
) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    """Predicted prefix hits next to the replicas' reported ones: is the index right?"""
    routed = CounterMetricFamily(
        "kvroute_routed_prompt_tokens",
        "Prompt tokens routed to each replica (exact when the router has the tokenizer).",
        labels=["replica"],
    )
    predicted = CounterMetricFamily(
        "kvroute_predicted_prefix_hit_tokens",
        "Of those, tokens the prefix index predicted the replica already held.",
        labels=["replica"],
    )
    for replica, tokens in merged["prompt_tokens"].items():
        routed.add_metric([replica], tokens)
    for replica, tokens in merged["predicted_hit_tokens"].items():
        predicted.add_metric([replica], tokens)
    yield routed
    yield predicted
    queries = GaugeMetricFamily(
        "kvroute_replica_prefix_cache_queries_tokens",
        "The replica's own vllm:prefix_cache_queries counter at the last scrape.",
        labels=["replica"],
    )
    hits = GaugeMetricFamily(
        "kvroute_replica_prefix_cache_hits_tokens",
        "The replica's own vllm:prefix_cache_hits counter at the last scrape.",
        labels=["replica"],
    )
    waiting = GaugeMetricFamily(
        "kvroute_replica_waiting_requests",
        "The replica's own vllm:num_requests_waiting at the last scrape.",
        labels=["replica"],
    )
    kv_usage = GaugeMetricFamily(
        "kvroute_replica_kv_cache_usage",
        "The replica's own vllm:kv_cache_usage_perc (0-1) at the last scrape.",
        labels=["replica"],
    )
    for replica, report in m.replica_reports().items():
        for family, value in (
            (queries, report.prefix_queries),
            (hits, report.prefix_hits),
            (waiting, report.waiting),
            (kv_usage, report.kv_usage),
        ):
            if value is not None:
                family.add_metric([replica], float(value))
    yield queries
    yield hits
    yield waiting
    yield kv_usage


def _reuse_families(merged: Snapshot) -> Iterable[CounterMetricFamily]:
    """Prefix reuse decomposed per request (kvcore/reuse.py), by the replica that served it."""
    tokens = CounterMetricFamily(
        "kvroute_prefix_reuse_tokens",
        "Prompt tokens of prefix reuse, by the replica that served the request and kind: "
        "available (the longest cached prefix the index knew on any eligible replica when it "
        "was routed), captured (what the index expected the chosen replica to hold), confirmed "
        "(what the engine reported reusing: usage.prompt_tokens_details.cached_tokens; only "
        "requests whose response said, see kvroute_prefix_reuse_unconfirmed_requests). "
        "Available and captured count at most the full blocks before the prompt's last token.",
        labels=["replica", "kind"],
    )
    for (replica, kind), count in merged["reuse"].items():
        tokens.add_metric([replica, kind], count)
    yield tokens
    lost = CounterMetricFamily(
        "kvroute_prefix_reuse_lost_tokens",
        "Prompt tokens not reused, by cause: workload (prompt - available: no replica had "
        "them), routing (available - captured: a replica had them, the request went elsewhere), "
        "index (captured - confirmed, at least 0: expected cached but not reused, a wrong "
        "prediction or an eviction; only requests whose response reported cached_tokens).",
        labels=["replica", "cause"],
    )
    for (replica, cause), count in merged["reuse_lost"].items():
        lost.add_metric([replica, cause], count)
    yield lost
    unconfirmed = CounterMetricFamily(
        "kvroute_prefix_reuse_unconfirmed_requests",
        "Decomposed requests whose response did not report cached_tokens (a stream without "
        "stream_options.include_usage, vLLM without --enable-prompt-tokens-details, a broken "
        "stream): counted in available and captured, not in confirmed nor index loss.",
        labels=["replica"],
    )
    for (replica,), count in merged["reuse_unconfirmed"].items():
        unconfirmed.add_metric([replica], count)
    yield unconfirmed


def _regret_families(merged: Snapshot) -> Iterable[CounterMetricFamily]:
    """Regret against round robin (policies/regret.py) as monotonic sums, not a histogram of
    regret: regret is negative when the choice looks better, and a histogram's ``_sum`` that
    goes down reads as a counter reset to rate(). Sums of estimated TTFT per choice divide into
    any window's mean (and ratio) instead."""
    regret = merged["regret"]
    ttft = CounterMetricFamily(
        "kvroute_routing_estimated_ttft_seconds",
        "Sum over routing decisions of the policy's estimated TTFT for the request, by choice: "
        "chosen (the replica it picked), round_robin (the next replica in a round-robin "
        "rotation), power_of_two (the less loaded of two drawn from the request's hash). Divide "
        "by kvroute_routing_estimated_decisions_total for the mean; chosen minus a baseline is "
        "the regret (negative: the choice looked better). kv_aware only; an estimate against "
        "the fleet as it stood, not a replay.",
        labels=["choice"],
    )
    decisions = CounterMetricFamily(
        "kvroute_routing_estimated_decisions",
        "Routing decisions whose TTFT was estimated (see kvroute_routing_estimated_ttft_seconds).",
    )
    worse = CounterMetricFamily(
        "kvroute_routing_estimated_worse_decisions",
        "Of those, decisions whose choice had a higher estimated TTFT than the baseline's.",
        labels=["baseline"],
    )
    # Every series from the start (at 0 until a decision is estimated): a dashboard's ratio
    # reads "no data" for a policy without estimates, not a missing metric.
    decisions.add_metric([], regret.get(("decisions", ""), 0.0))
    for choice in ("chosen", *REGRET_BASELINES):
        ttft.add_metric([choice], regret.get(("ttft", choice), 0.0))
    for baseline in REGRET_BASELINES:
        worse.add_metric([baseline], regret.get(("worse", baseline), 0.0))
    yield ttft
    yield decisions
    yield worse


def _kv_event_families(m: RouterMetrics) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    """The KV-event subscribers and the prefix index they feed (this worker's own view)."""
    counters = {
        "batches": "KV event batches applied (live and replayed).",
        "events": "KV events applied.",
        "gaps": "Sequence gaps seen on the live stream.",
        "replayed_batches": "Batches recovered through the replay socket.",
        "resyncs": "Times a replica's index entries were dropped (restart or unrecoverable gap).",
        "malformed": "Malformed frames or payloads skipped.",
        "replay_timeouts": "Replays abandoned for a publisher too slow to answer (2 s per "
        "message, 60 s in all); the replica's entries are resynced.",
        "replay_overflows": "Replays abandoned for sending more than 100,000 messages; the "
        "replica's entries are resynced.",
        "sink_errors": "KV events the prefix index failed to apply (a bug in kvroute: logged "
        "with its traceback, the event skipped, the stream goes on).",
    }
    families = {
        name: CounterMetricFamily(f"kvroute_kv_event_{name}", doc, labels=["replica", "endpoint"])
        for name, doc in counters.items()
    }
    connected = GaugeMetricFamily(
        "kvroute_kv_event_connected", "1 while the subscriber is connected to the replica's publisher.",
        labels=["replica", "endpoint"],
    )  # fmt: skip
    for (replica, endpoint), stats in m.kv_sources().items():
        for name, family in families.items():
            family.add_metric([replica, endpoint], getattr(stats, name))
        connected.add_metric([replica, endpoint], 1.0 if stats.connected else 0.0)
    yield from families.values()
    yield connected
    entries = GaugeMetricFamily(
        "kvroute_prefix_index_entries", "(block, replica) pairs in the prefix index."
    )
    entries.add_metric([], m.index_entries())
    yield entries
