"""The discrete-event fleet: a trace's requests through a router's policy onto N engine models.

Virtual time only. At each arrival the simulated router calls the live router's own dispatch
ledger (``kvcore.ledger``): the prompt's block hashes looked up in the same ``PrefixIndex``,
the same policy object deciding over a ``FleetView`` of ``ReplicaState`` s, a prediction for
the chosen replica, the request counted in flight and its uncached prompt as queued prefill.
Engines report first tokens (``first_token``: prefill done, prediction renewed), finishes
(``finish``: out of flight) and KV events,
which reach the index ``event_lag_s`` later; every ``scrape_interval_s`` the replicas' queue
depth and KV usage are read, as the router scrapes ``/metrics``. A failed replica's unfinished
requests go back through the policy at once and resume elsewhere from the tokens already
generated (prompt + output so far as the new prompt).

Deterministic: no wall clock, no unseeded randomness; ties in time resolve by event kind,
then by the order events were created.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable

from kvroute.kvcore.ledger import Dispatch, DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import FleetView, Policy, ReplicaState, RouteRequest

from .config import FleetConfig
from .exact_engine import ExactEngine
from .fast_engine import FastEngine
from .kv_units import IndexOp
from .protocol import SimEngine, StepReport
from .results import NAN, SimResult
from .units import SimRequest, UnitTrace

# Event kinds, in the order they run when they fall at the same instant.
_FAIL, _OPS, _STEP, _SCRAPE, _ARRIVAL, _KICK = range(6)

Progress = Callable[[int, int, float], None]  # (arrivals routed, total, virtual time)


class _Flight:
    __slots__ = ("delivered", "dispatch", "request")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.dispatch: Dispatch | None = None
        self.delivered = 0  # tokens generated on replicas that failed since


def make_engine(config: FleetConfig, block_tokens: int) -> SimEngine:
    if config.engine_model == "exact":
        return ExactEngine(config.engine, block_tokens)
    return FastEngine(config.engine, block_tokens)


def simulate(
    trace: UnitTrace,
    policy: Policy,
    config: FleetConfig,
    progress: Progress | None = None,
) -> SimResult:
    """Replay ``trace`` through ``policy`` on the fleet ``config`` describes."""
    return _Fleet(trace, policy, config).run(progress)


class _Fleet:
    def __init__(self, trace: UnitTrace, policy: Policy, config: FleetConfig) -> None:
        self.trace = trace
        self.policy = policy
        self.config = config
        n = config.replicas
        self.names = [f"r{i}" for i in range(n)]
        self.number = {name: i for i, name in enumerate(self.names)}
        self.states = [ReplicaState(name) for name in self.names]
        self.view = FleetView(self.states, membership_version=1)
        self.engines = [make_engine(config, trace.block_tokens) for _ in range(n)]
        self.index = PrefixIndex()
        self.ledger = DispatchLedger(
            policy, self.view, self.index, prediction_ttl_s=config.prediction_ttl_s
        )
        self.ibt = self.engines[0].index_block_tokens
        self.heap: list[tuple[float, int, int, int, object]] = []
        self._order = 0
        self.busy = [False] * n
        self.kicked = [False] * n
        self.version = [0] * n
        self.step_end = [0.0] * n
        self.failed: set[int] = set()
        self.flights: dict[int, _Flight] = {}
        reqs = trace.requests
        m = len(reqs)
        self.result = SimResult(
            policy=policy.name,
            replicas=n,
            kv_capacity_tokens=config.kv_capacity_tokens,
            arrival_s=[r.arrival_s for r in reqs],
            input_tokens=[r.input_tokens for r in reqs],
            output_tokens=[r.output_tokens for r in reqs],
            first_token_s=[NAN] * m,
            finish_s=[NAN] * m,
            replica=[-1] * m,
            queried_tokens=[0] * m,
            hit_tokens=[0] * m,
            reroutes=[0] * m,
            rejected=[False] * m,
            routed_requests=[0] * n,
            routed_tokens=[0] * n,
            failed_replicas=[],
            reasons=Counter(),
        )
        bs = config.engine.block_size
        self._max_blocks = config.engine.num_blocks
        self._block_size = bs

    # -- the loop ---------------------------------------------------------------------

    def _push(self, t: float, kind: int, replica: int, payload: object = None) -> None:
        self._order += 1
        heapq.heappush(self.heap, (t, kind, self._order, replica, payload))

    def run(self, progress: Progress | None) -> SimResult:
        reqs = self.trace.requests
        total = len(reqs)
        for replica, at in self.config.failures:
            self._push(at, _FAIL, replica)
        if reqs:
            self._push(reqs[0].arrival_s, _SCRAPE, -1)
        every = max(1, total // 200)
        heap = self.heap
        i = 0
        t = 0.0
        while True:
            if i < total and (not heap or (reqs[i].arrival_s, _ARRIVAL) < heap[0][:2]):
                request = reqs[i]
                t = request.arrival_s
                i += 1
                self._arrive(request, t)
                if progress is not None and (i % every == 0 or i == total):
                    progress(i, total, t)
                continue
            if not heap:
                break
            t, kind, _, replica, payload = heapq.heappop(heap)
            if kind == _STEP:
                if payload == self.version[replica] and replica not in self.failed:
                    self._step_done(replica, t)
            elif kind == _KICK:
                self.kicked[replica] = False
                if not self.busy[replica] and replica not in self.failed:
                    self._start(replica, t)
            elif kind == _OPS:
                if replica not in self.failed:
                    self._apply_ops(replica, payload)  # type: ignore[arg-type]
            elif kind == _SCRAPE:
                self._scrape()
                if i < total or self.flights:
                    self._push(t + self.config.scrape_interval_s, _SCRAPE, -1)
            elif kind == _FAIL:
                self._fail(replica, t)
        self._finish_stats()
        return self.result

    # -- the router's side ------------------------------------------------------------

    def _arrive(self, request: SimRequest, t: float) -> None:
        flight = _Flight(request)
        blocks = -(-(request.input_tokens + request.output_tokens - 1) // self._block_size)
        if blocks > self._max_blocks:
            self.result.rejected[request.index] = True
            return
        self.flights[request.index] = flight
        self._route(flight, t)

    def _route(self, flight: _Flight, t: float) -> None:
        request = flight.request
        extra = flight.delivered
        route_request = RouteRequest(
            request.input_tokens + extra,
            request.output_tokens - extra,
            None,
            request.session_id,
            self.engines[0].route_hashes(request),
        )
        ledger = self.ledger
        route = ledger.route(route_request, t, self.ibt)
        if not route.ranked:
            del self.flights[request.index]  # no replica left: the request fails
            return
        self.result.reasons[route.reason] += 1
        chosen = route.ranked[0]
        r = self.number[chosen]
        flight.dispatch = ledger.dispatch(route, chosen, t)
        self.result.routed_requests[r] += 1
        self.result.routed_tokens[r] += route_request.prompt_tokens
        self._enqueue(r, request, extra, t)

    def _enqueue(self, r: int, request: SimRequest, extra: int, t: float) -> None:
        engine = self.engines[r]
        if self.busy[r]:
            end = engine.split(t)
            if end != self.step_end[r]:
                self._schedule_step(r, end)
        engine.add(request, extra, request.output_tokens - extra)
        if not self.busy[r] and not self.kicked[r]:
            # Start after every arrival of this instant, so a burst shares the first step.
            self.kicked[r] = True
            self._push(t, _KICK, r)

    def _schedule_step(self, r: int, end: float) -> None:
        self.version[r] += 1
        self.step_end[r] = end
        self._push(end, _STEP, r, self.version[r])

    def _start(self, r: int, t: float) -> None:
        end = self.engines[r].start(t)
        if end is None:
            self.busy[r] = False
            return
        self.busy[r] = True
        self._schedule_step(r, end)

    def _step_done(self, r: int, t: float) -> None:
        self.busy[r] = False
        self._take_report(r, self.engines[r].complete(), t)
        self._start(r, t)

    def _take_report(self, r: int, report: StepReport, t: float) -> None:
        res = self.result
        for index, queried, hit in report.lookups:
            res.queried_tokens[index] += queried
            res.hit_tokens[index] += hit
        ledger = self.ledger
        for index, at in report.first_tokens:
            flight = self.flights[index]
            if math.isnan(res.first_token_s[index]):
                res.first_token_s[index] = at
            assert flight.dispatch is not None
            ledger.first_token(flight.dispatch, at)
        for index, at in report.finished:
            flight = self.flights.pop(index)
            assert flight.dispatch is not None
            ledger.finish(flight.dispatch, at)
            res.finish_s[index] = at
            res.replica[index] = r
        if report.index_ops:
            lag = self.config.event_lag_s
            if lag > 0:
                self._push(t + lag, _OPS, r, report.index_ops)
            else:
                self._apply_ops(r, report.index_ops)

    def _apply_ops(self, r: int, ops: list[IndexOp]) -> None:
        name = self.names[r]
        index = self.index
        for op in ops:
            kind = op[0]
            if kind == "stored":
                _, hashes, parent, tokens, block_size = op
                index.apply_stored(name, hashes, parent, tokens, block_size)  # type: ignore[arg-type]
            elif kind == "removed":
                index.apply_removed(name, op[1])  # type: ignore[arg-type]
            else:
                index.clear_replica(name)

    def _scrape(self) -> None:
        for r, (state, engine) in enumerate(zip(self.states, self.engines, strict=True)):
            if r not in self.failed:
                state.reported_waiting = engine.num_waiting
                state.reported_kv_usage = engine.kv_usage

    def _fail(self, r: int, t: float) -> None:
        if r in self.failed:
            return
        report, left = self.engines[r].fail(t)
        self._take_report(r, report, t)
        self.failed.add(r)
        self.result.failed_replicas.append(r)
        self.busy[r] = False
        self.version[r] += 1
        state = self.states[r]
        state.healthy = False
        state.reported_waiting = None
        state.reported_kv_usage = None
        self.index.clear_replica(self.names[r])
        for index, generated in left.items():
            flight = self.flights[index]
            assert flight.dispatch is not None
            self.ledger.finish(flight.dispatch, t)  # withdraws a prediction still prefilling
            flight.delivered += generated
            self.result.reroutes[index] += 1
            self._route(flight, t)

    def _finish_stats(self) -> None:
        res = self.result
        for engine in self.engines:
            res.engine_steps += getattr(engine, "steps", 0)
            res.decode_runs += getattr(engine, "runs", 0)
            res.preemptions += getattr(engine, "num_preemptions", 0)
