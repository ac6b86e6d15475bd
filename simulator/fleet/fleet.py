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

Several routers (``FleetConfig.routers``, as a gateway scales out its endpoint picker): each
keeps its own index, ``FleetView`` and ledger over its own copy of the policy; request i is
routed by picker i % N. KV events, scrapes and failures reach every picker; first tokens and
finishes reach the one that dispatched, and with ``share="bus"`` the others too, ``bus_lag_s``
later, as a replay of the same ledger calls (``_deliver``).

A disaggregated fleet (``FleetConfig.pd``) is this loop with a prefill and a decode pool, each
its own router, and KV moved between them: ``pd_fleet.PdFleet``, through the hooks below
(``_replica_names``, ``_make_routers``, ``_kv_arrived``, ...).

Deterministic: no wall clock, no unseeded randomness; ties in time resolve by event kind,
then by the order events were created.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import Counter
from collections.abc import Callable

from kvroute.kvcore.autoscale import Autoscaler, ReplicaSignal
from kvroute.kvcore.fair_queue import Ticket
from kvroute.kvcore.ledger import REMOTE, Dispatch, DispatchLedger, Route
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.queue_prefix import held_on, uncached
from kvroute.policies import FleetView, Policy, ReplicaState, RouteRequest
from kvroute.policies.regret import TtftEstimate
from kvroute.simulator.traces.model import next_turns

from .admission import SimAdmission, program_of
from .batch import BatchJob, BatchLane, split_batch
from .bounds import pooled_lru_hits
from .config import FleetConfig
from .exact_engine import ExactEngine
from .fast_engine import FastEngine
from .kv_units import Holdings, IndexOp
from .loss import LossTracker
from .program_starts import ProgramStarts
from .protocol import SimEngine, StepReport
from .regret import ESTIMATED_CHOICES
from .results import NAN, SimResult
from .shared_load import SharedTotals
from .units import SimRequest, UnitTrace

# Event kinds, in the order they run when they fall at the same instant. _KV: a request's KV
# reaches its decode replica (P/D fleets, pd_fleet.py), an arrival there.
(_FAIL, _OPS, _STEP, _SCRAPE, _ARRIVAL, _KV, _KICK, _BUS, _SCALE, _READY, _RESTORE, _BATCH) = range(
    12
)
# A replica's phase under an autoscaler (always SERVING without one).
_OFF, _STARTING, _SERVING, _DRAINING = range(4)
# What a bus message announces: a picker's ledger call, for the others to repeat.
_DISPATCHED, _ANSWERED, _FINISHED = range(3)

Progress = Callable[[int, int, float], None]  # (arrivals routed, total, virtual time)


class _Flight:
    __slots__ = ("delivered", "dispatch", "published", "request", "router")

    def __init__(self, request: SimRequest, router: int) -> None:
        self.request = request
        self.router = router  # the picker that routes it (and routes it again after a failure)
        self.dispatch: Dispatch | None = None
        self.published: _Published | None = None  # its dispatch as the bus carries it
        self.delivered = 0  # tokens generated on replicas that failed since


class _Router:
    """One picker's own view: its index, replica states and ledger (own load, predictions)."""

    __slots__ = ("index", "ledger", "states")

    def __init__(
        self,
        names: list[str],
        policy: Policy,
        prediction_ttl_s: float,
        kv_capacity_tokens: int,
        shared: SharedTotals | None = None,
        speeds: list[float] | None = None,
    ) -> None:
        # Each replica's cache size is known, as a live router reads vLLM's cache_config_info;
        # its speed where the config tells it (``replicas[].speed``).
        told = speeds or [1.0] * len(names)
        self.states = [
            ReplicaState(name, kv_capacity_tokens=kv_capacity_tokens, speed=speed)
            for name, speed in zip(names, told, strict=True)
        ]
        self.index = PrefixIndex()
        view = FleetView(self.states, membership_version=1)
        self.ledger = DispatchLedger(
            policy, view, self.index, prediction_ttl_s=prediction_ttl_s, shared=shared
        )


class _Published:
    """One picker's dispatch on the bus: its route (the request with the prefix it saw, and its
    match of the replica as hints), then each other picker's own copy of the dispatch."""

    __slots__ = ("copies", "origin", "replica", "route")

    def __init__(self, origin: int, route: Route, replica: str) -> None:
        self.origin = origin
        self.route = route
        self.replica = replica
        self.copies: list[tuple[DispatchLedger, Dispatch]] = []


def apply_ops(index: PrefixIndex, name: str, ops: list[IndexOp]) -> None:
    """Replica ``name``'s KV events, applied to one router's prefix index."""
    for op in ops:
        kind = op[0]
        if kind == "stored":
            hashes, parent, tokens, block_size = op[1:5]
            medium = op[5] if len(op) > 5 else "GPU"  # an offload tier's events name theirs
            index.apply_stored(name, hashes, parent, tokens, block_size, medium)  # type: ignore[arg-type]
        elif kind == "removed":
            index.apply_removed(name, op[1], op[2] if len(op) > 2 else "GPU")  # type: ignore[arg-type]
        else:
            index.clear_replica(name)


def make_engine(
    config: FleetConfig, block_tokens: int, holdings: Holdings | None = None, replica: int = 0
) -> SimEngine:
    engine = config.engine_of(replica)
    if config.engine_model == "exact":
        return ExactEngine(engine, block_tokens)
    return FastEngine(engine, block_tokens, holdings)


def simulate(
    trace: UnitTrace,
    policy: Policy,
    config: FleetConfig,
    progress: Progress | None = None,
    batch: tuple[BatchJob, tuple[SimRequest, ...]] | None = None,
) -> SimResult:
    """Replay ``trace`` through ``policy`` on the fleet ``config`` describes; with ``batch``
    (a job and its lines, ``batch.with_batch``), the batch lane runs the job beside it and
    the result's ``batch`` says how it went (its per-request lists hold the trace's only).
    With ``config.pd``, the fleet is disaggregated (pd_fleet.py)."""
    if config.pd is not None:
        if batch is not None:
            raise ValueError("a batch job is not modelled on a P/D fleet")
        from .pd_fleet import PdFleet  # imported here: pd_fleet builds on _Fleet below

        return PdFleet(trace, policy, config).run(progress)
    if config.data_parallel_size > 1 and config.rank_routing == "vllm":
        from .dp_fleet import VllmRankFleet  # imported here: dp_fleet builds on _Fleet below

        return VllmRankFleet(trace, policy, config, batch).run(progress)
    return _Fleet(trace, policy, config, batch).run(progress)


class _Fleet:
    def __init__(
        self,
        trace: UnitTrace,
        policy: Policy,
        config: FleetConfig,
        batch: tuple[BatchJob, tuple[SimRequest, ...]] | None = None,
    ) -> None:
        self.trace = trace
        self.policy = policy
        self.config = config
        n = config.replicas
        self.names = self._replica_names()
        self.number = {name: i for i, name in enumerate(self.names)}
        # share="load": one board of in-flight load for all, as --workers share it.
        self.board = SharedTotals(n) if config.share == "load" and config.routers > 1 else None
        self.routers = self._make_routers(policy)
        self.ledgers = [router.ledger for router in self.routers]
        self.indexes = [router.index for router in self.routers]
        self.bus = config.share == "bus" and config.routers > 1
        self.scrape_every = config.scrape_every_s
        # The loss decomposition (loss.py) needs the fast engine's unit pools (and one pool of
        # replicas: none for a P/D fleet).
        holdings = Holdings() if config.engine_model == "fast" and config.pd is None else None
        self.engines = [make_engine(config, trace.block_tokens, holdings, r) for r in range(n)]
        self.pools = [e.pool for e in self.engines if isinstance(e, FastEngine)]
        self.loss: LossTracker | None = None
        if holdings is not None:
            capacity = config.engine.num_blocks * n
            bs = config.engine.block_size
            bound = [units for _, _, units in pooled_lru_hits(trace, capacity, bs)]
            self.loss = LossTracker(trace.requests, bound, trace.block_tokens, bs, holdings)
        self.ibt = self.engines[0].index_block_tokens
        self.heap: list[tuple[float, int, int, int, object]] = []
        self._order = 0
        self.busy = [False] * n
        self.kicked = [False] * n
        self.version = [0] * n
        self.step_end = [0.0] * n
        self.failed: set[int] = set()
        self.flights: dict[int, _Flight] = {}
        self.online = len(trace.requests)  # request indices from here on are batch lines
        self.lane = BatchLane(*batch) if batch is not None else None
        self._batch_kicked = False
        lines = batch[1] if batch is not None else ()
        reqs = trace.requests + lines
        m = len(reqs)
        self.result = SimResult(
            policy=policy.name,
            replicas=n,
            kv_capacity_tokens=config.kv_capacity_tokens,
            arrival_s=[r.arrival_s for r in trace.requests] + [NAN] * len(lines),
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
            routers=config.routers,
            share=config.share,
        )
        self._holdings = holdings
        self.result.programs = [program_of(r.session_id, r.index) for r in trace.requests]
        self.admission = SimAdmission(config.admission) if config.admission is not None else None
        self.queued: dict[int, _Flight] = {}  # waiting for admission, by request index
        # Closed loop: request index -> the next request of its session, sent its gap after
        # this one's response ends (``held`` ones are not sent at their recorded time).
        self.next_turn: dict[int, int] = next_turns(trace.requests) if config.closed_loop else {}
        self.held = set(self.next_turn.values())
        self.turns_due = 0  # next turns scheduled on the heap, not yet arrived
        # A fixed number of programs at a time (program_starts.py): their first requests too
        # arrive when the fleet's progress says, not at their recorded times.
        self.starts: ProgramStarts | None = None
        if config.programs_in_flight is not None:
            online_programs = self.result.programs[: self.online]
            arrivals = [r.arrival_s for r in trace.requests]
            self.starts = ProgramStarts(
                arrivals, online_programs, self.held, config.programs_in_flight
            )
            self.held |= self.starts.deferred
            self.result.programs_in_flight = config.programs_in_flight
        if config.admission is not None:
            self.result.queue_wait_s = [NAN] * m
            self.result.fairness = config.admission.fairness
            self.result.max_in_flight = config.admission.max_in_flight
        self.phase = [_SERVING] * n
        self.on_since = [0.0] * n  # when each replica was last started (autoscaler)
        self.autoscaler = Autoscaler(config.autoscale) if config.autoscale is not None else None
        if config.autoscale is not None:
            self.result.replica_seconds = 0.0
            first = reqs[0].arrival_s if reqs else 0.0
            self.on_since = [first] * n
            for r in range(config.autoscale.min, n):
                self.phase[r] = _OFF
                for router in self.routers:
                    router.states[r].healthy = False

    def _replica_names(self) -> list[str]:
        return [f"r{i}" for i in range(self.config.replicas)]

    def _make_routers(self, policy: Policy) -> list[_Router]:
        config = self.config
        # Each picker its own policy object, copied before any decision: what N processes
        # started from one config hold (a policy keeps state: its ring, its random stream).
        policies = [policy, *(copy.deepcopy(policy) for _ in range(config.routers - 1))]
        speeds = config.speeds()  # a mixed pool's own replicas only (a DP fleet names ranks)
        return [
            _Router(
                self.names,
                p,
                config.prediction_ttl_s,
                config.kv_capacity_tokens,
                self.board,
                speeds,
            )
            for p in policies
        ]

    # -- the loop ---------------------------------------------------------------------

    def _push(self, t: float, kind: int, replica: int, payload: object = None) -> None:
        self._order += 1
        heapq.heappush(self.heap, (t, kind, self._order, replica, payload))

    def run(self, progress: Progress | None) -> SimResult:
        reqs = self.trace.requests
        total = len(reqs)
        for replica, at in self.config.failures:
            self._push(at, _FAIL, replica)
        dip = self.config.dip
        if dip is not None:
            for replica in dip.replicas(self.config.replicas):
                self._push(dip.start_s, _FAIL, replica)
                self._push(dip.end_s, _RESTORE, replica)
        if self.lane is not None and self._batch_waiting(self.lane.submitted_s):
            self._push(self.lane.submitted_s, _BATCH, -1, True)
        if reqs:
            self._push(reqs[0].arrival_s, _SCRAPE, -1)
            if self.starts is not None:
                self._send(self.starts.initial(reqs[0].arrival_s))
            if self.autoscaler is not None:
                self._push(reqs[0].arrival_s, _SCALE, -1)
        report_every = max(1, total // 200)
        heap = self.heap
        i = 0
        t = 0.0
        while True:
            if i < total and (not heap or (reqs[i].arrival_s, _ARRIVAL) < heap[0][:2]):
                request = reqs[i]
                t = request.arrival_s
                i += 1
                if request.index not in self.held:
                    self._arrive(request, t)
                if progress is not None and (i % report_every == 0 or i == total):
                    progress(i, total, t)
                continue
            if not heap:
                break
            t, kind, _, replica, payload = heapq.heappop(heap)
            if kind == _STEP:
                if payload == self.version[replica] and replica not in self.failed:
                    self._step_done(replica, t)
            elif kind == _KV:
                self._kv_arrived(payload, t)
            elif kind == _KICK:
                self.kicked[replica] = False
                if not self.busy[replica] and replica not in self.failed:
                    self._start(replica, t)
            elif kind == _OPS:
                if replica not in self.failed and self.phase[replica] != _OFF:
                    self._apply_ops(replica, payload)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:  # a session's next turn (closed loop)
                self.turns_due -= 1
                assert isinstance(payload, int)
                self.result.arrival_s[payload] = t
                self._arrive(reqs[payload], t)
            elif kind == _SCRAPE:
                self._scrape()
                if i < total or self.flights or self._batch_waiting(t) or self.turns_due:
                    every = self.scrape_every
                    due = t + every
                    if not self.flights and i < total and not any(self.busy) and not self.turns_due:
                        # An idle fleet changes nothing before the next arrival: skip the
                        # scrapes up to it (they would read what this one read), on the same
                        # clock of sums (fast scrapes over a long idle trace cost minutes).
                        arrival = reqs[i].arrival_s
                        while due <= arrival:
                            due += every
                    self._push(due, _SCRAPE, -1)
            elif kind == _FAIL:
                self._fail(replica, t)
            elif kind == _BUS:
                self._deliver(payload, t)  # type: ignore[arg-type]
            elif kind == _SCALE:
                self._autoscale(t)
                if i < total or self.flights or self.turns_due:
                    assert self.config.autoscale is not None
                    self._push(t + self.config.autoscale.interval_s, _SCALE, -1)
            elif kind == _READY:
                self._ready(replica)
            elif kind == _RESTORE:
                self._restore(replica, t)
            elif kind == _BATCH:
                self._batch(t, periodic=bool(payload))
        if self.autoscaler is not None:
            res = self.result
            end = max([f for f in res.finish_s if not math.isnan(f)], default=t)
            for r, phase in enumerate(self.phase):
                if phase != _OFF:
                    self._count_on(r, end)
        self._finish_stats()
        if self.admission is not None:
            assert self.result.queue_wait_s is not None
            for index, waited in self.admission.waited_s.items():
                self.result.queue_wait_s[index] = waited
        if self.lane is not None:
            self.result.batch = split_batch(self.result, self.online, self.lane)
        return self.result

    # -- the router's side ------------------------------------------------------------

    def _arrive(self, request: SimRequest, t: float) -> None:
        # The gateway spreads requests over the pickers evenly and blindly (round robin).
        flight = _Flight(request, request.index % len(self.routers))
        if not self.config.engine.fits(request.input_tokens + request.output_tokens):
            self.result.rejected[request.index] = True
            self._left(request.index, 0, 0, t)
            return
        admission = self.admission
        if admission is not None and request.index < self.online:
            program = self.result.programs[request.index]  # type: ignore[index]
            hashes = request.route_hashes
            if not admission.arrive(request.index, program, request.input_tokens, t, hashes):
                self.queued[request.index] = flight
                return
        self.flights[request.index] = flight
        self._route(flight, t)

    def _left(
        self, index: int, input_tokens: int, output_tokens: int, t: float, replica: int = -1
    ) -> None:
        """Request ``index`` left the fleet (finished, failed or refused): its session's next turn
        is sent (closed loop), and behind an admission limit its slot goes to the requests the
        fair queue picks."""
        following = self.next_turn.pop(index, None)
        if following is not None:
            gap = self.trace.requests[following].gap_s or 0.0
            self.turns_due += 1
            self._push(t + gap, _ARRIVAL, -1, following)
        if self.starts is not None:
            self._send(self.starts.left(index, t))
        admission = self.admission
        if admission is None or index >= self.online or index not in admission.tickets:
            return
        locality = self._locality(replica, t) if replica >= 0 else None
        cost = self._uncached(t)
        for started in admission.finished(index, input_tokens, output_tokens, t, locality, cost):
            flight = self.queued.pop(started)
            self.flights[started] = flight
            self._route(flight, t)

    def _send(self, arrivals: list[tuple[float, int]]) -> None:
        """Requests that arrive at the given times (their programs just started)."""
        for at, index in arrivals:
            self.turns_due += 1
            self._push(at, _ARRIVAL, -1, index)

    def _locality(self, r: int, t: float) -> Callable[[Ticket], int]:
        """The prompt tokens replica ``r`` holds of a queued request, as the first router's
        prefix index says (router/admission.py's ``prefix_locality``)."""
        index, name, unit = self.indexes[0], self.names[r], self.ibt
        return lambda ticket: held_on(index, name, ticket, t, unit)

    def _uncached(self, t: float) -> Callable[[Ticket], int]:
        """The prompt tokens of a queued request no replica holds, as the first router's prefix
        index says (router/admission.py's ``prefix_cost``)."""
        pools = [(self.indexes[0], self.ibt)]
        return lambda ticket: uncached(pools, ticket, t)

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
        ledger = self.ledgers[flight.router]
        route = ledger.route(route_request, t, self.ibt)
        if not route.ranked:
            del self.flights[request.index]  # no replica left: the request fails
            if self.lane is not None and request.index >= self.online:
                self.lane.lost(request)  # a batch line goes back to its queue
            self._left(request.index, 0, 0, t)
            return
        self.result.reasons[route.reason] += 1
        if route.estimate is not None:
            self._estimated(request.index, route.estimate)
        chosen = route.ranked[0]
        r = self._engine_for(chosen)
        flight.dispatch = ledger.dispatch(route, chosen, t)
        if self.loss is not None and request.index < self.online:
            prefix = route.request.prefix_tokens
            predicted = prefix.get(chosen, 0) // self.ibt if prefix else 0
            self.loss.routed(request, self.pools[r], predicted, route.reason)
        if self.bus:
            flight.published = _Published(flight.router, route, chosen)
            self._publish(_DISPATCHED, flight.published, t)
        self.result.routed_requests[r] += 1
        self.result.routed_tokens[r] += route_request.prompt_tokens
        self._enqueue(r, request, extra, t)

    def _engine_for(self, chosen: str) -> int:
        """The engine serving a request routed to ``chosen`` (dp_fleet.py: a rank of it)."""
        return self.number[chosen]

    def _estimated(self, index: int, estimate: TtftEstimate) -> None:
        """The first decision's estimates (a reroute after a failure is not a fresh choice)."""
        res = self.result
        if res.estimated_ttft_s is None:
            m = len(res.arrival_s)
            res.estimated_ttft_s = {choice: [NAN] * m for choice in ESTIMATED_CHOICES}
        est = res.estimated_ttft_s
        if not math.isnan(est["chosen"][index]):
            return
        est["chosen"][index] = estimate.chosen
        est["round_robin"][index] = estimate.round_robin
        est["power_of_two"][index] = estimate.power_of_two

    def _kv_arrived(self, payload: object, t: float) -> None:
        raise AssertionError("only a P/D fleet moves KV between replicas")

    def _enqueue(self, r: int, request: SimRequest, extra: int, t: float) -> None:
        self._cut_run(r, t)
        self.engines[r].add(request, extra, request.output_tokens - extra)
        self._kick(r, t)

    def _cut_run(self, r: int, t: float) -> None:
        """A request joins replica ``r`` at ``t``: a planned decode run ends at the next step
        boundary, so the request is scheduled when it would be step by step."""
        if self.busy[r]:
            end = self.engines[r].split(t)
            if end != self.step_end[r]:
                self._schedule_step(r, end)

    def _kick(self, r: int, t: float) -> None:
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
        if self.phase[r] == _DRAINING and self._idle(r):
            self._off(r, t)

    # -- the batch lane (simulator/fleet/batch.py) ------------------------------------

    def _batch_waiting(self, t: float) -> bool:
        """Lines wait to start (until the job's window ends: then it has expired)."""
        return self.lane is not None and self.lane.active and t < self.lane.expires_s

    def _kick_batch(self, t: float) -> None:
        """A batch line finished: look for the next at once, as the live runner wakes."""
        if not self._batch_kicked and self._batch_waiting(t):
            self._batch_kicked = True
            self._push(t, _BATCH, -1, False)

    def _batch(self, t: float, periodic: bool) -> None:
        lane = self.lane
        assert lane is not None
        if not periodic:
            self._batch_kicked = False
        # The runner lives in one router (the one holding the job's lease): its view decides.
        states = self.routers[0].states
        serving = [
            states[r].in_flight
            for r in range(len(self.engines))
            if self.phase[r] == _SERVING and r not in self.failed
        ]
        for line in lane.to_start(t, serving):
            self.result.arrival_s[line.index] = t
            flight = _Flight(line, 0)
            self.flights[line.index] = flight
            self._route(flight, t)
        if periodic and self._batch_waiting(t):
            self._push(t + lane.job.poll_s, _BATCH, -1, True)

    # -- the autoscaler (FleetConfig.autoscale) -----------------------------------------

    def _autoscale(self, t: float) -> None:
        assert self.autoscaler is not None
        phase = self.phase
        serving = [r for r, p in enumerate(phase) if p == _SERVING and r not in self.failed]
        signals = [
            ReplicaSignal(
                self.engines[r].num_waiting,
                self.engines[r].kv_usage,
                sum(router.states[r].in_flight for router in self.routers),
            )
            for r in serving
        ]
        starting = phase.count(_STARTING)
        draining = phase.count(_DRAINING)
        change = self.autoscaler.decide(t, signals, starting, draining)
        if change > 0:
            off = [r for r, p in enumerate(phase) if p == _OFF and r not in self.failed]
            for r in off[:change]:
                self._boot(r, t)
        elif change < 0 and serving:
            # The one with the least in flight leaves: the least to wait for.
            r = min(serving, key=lambda k: sum(x.states[k].in_flight for x in self.routers))
            phase[r] = _DRAINING
            self.result.scale_actions.append((t, "down", r))
            for router in self.routers:  # no new requests; those running finish there
                router.states[r].healthy = False
            if self._idle(r):
                self._off(r, t)

    def _boot(self, r: int, t: float) -> None:
        """Start replica ``r`` with an empty cache: it serves ``startup_s`` later."""
        self.phase[r] = _STARTING
        self.on_since[r] = t
        self.result.scale_actions.append((t, "up", r))
        engine = make_engine(self.config, self.trace.block_tokens, self._holdings, r)
        self.engines[r] = engine
        if self.pools and isinstance(engine, FastEngine):
            self.pools[r] = engine.pool
        self._push(t + self.config.startup_s, _READY, r)

    def _ready(self, r: int) -> None:
        if self.phase[r] != _STARTING or r in self.failed:
            return
        self.phase[r] = _SERVING
        for router in self.routers:
            state = router.states[r]
            state.healthy = True
            state.reported_waiting = None
            state.reported_kv_usage = None

    def _idle(self, r: int) -> bool:
        return (
            not self.busy[r]
            and not self.kicked[r]
            and all(router.states[r].in_flight == 0 for router in self.routers)
        )

    def _off(self, r: int, t: float) -> None:
        self.phase[r] = _OFF
        self._count_on(r, t)
        if self.pools:
            self.pools[r].forget()  # its cache leaves the fleet's holdings
        for router in self.routers:
            router.index.clear_replica(self.names[r])
            state = router.states[r]
            state.reported_waiting = None
            state.reported_kv_usage = None

    def _count_on(self, r: int, t: float) -> None:
        res = self.result
        assert res.replica_seconds is not None
        res.replica_seconds += max(0.0, t - self.on_since[r])
        self.on_since[r] = t

    def _take_report(self, r: int, report: StepReport, t: float) -> None:
        res = self.result
        self._count_lookups(report)
        ledgers = self.ledgers
        for index, at in report.first_tokens:
            flight = self.flights[index]
            if math.isnan(res.first_token_s[index]):
                res.first_token_s[index] = at
            assert flight.dispatch is not None
            answered = ledgers[flight.router].first_token(flight.dispatch, at)
            if answered and flight.published is not None:
                self._publish(_ANSWERED, flight.published, at)
        for index, at in report.finished:
            flight = self.flights.pop(index)
            assert flight.dispatch is not None
            self._finish(flight, at, flight.request.output_tokens - flight.delivered)
            res.finish_s[index] = at
            res.replica[index] = r
            request = flight.request
            self._left(index, request.input_tokens, request.output_tokens, at, r)
            if index >= self.online and self.lane is not None:
                self.lane.finish(index)
                self._kick_batch(at)
        self._send_ops(r, report.index_ops, t)

    def _count_lookups(self, report: StepReport) -> None:
        res = self.result
        for index, queried, hit in report.lookups:
            res.queried_tokens[index] += queried
            res.hit_tokens[index] += hit

    def _send_ops(self, r: int, ops: list[IndexOp], t: float) -> None:
        """Replica ``r``'s KV events of a step ending at ``t`` reach the index ``event_lag_s``
        later."""
        if ops:
            lag = self.config.event_lag_s
            if lag > 0:
                self._push(t + lag, _OPS, r, ops)
            else:
                self._apply_ops(r, ops)

    def _finish(self, flight: _Flight, t: float, output_tokens: int = 0) -> None:
        assert flight.dispatch is not None
        self.ledgers[flight.router].finish(flight.dispatch, t, output_tokens)
        if flight.published is not None:
            self._publish(_FINISHED, flight.published, t)

    def _apply_ops(self, r: int, ops: list[IndexOp]) -> None:
        # Every picker subscribes to every replica's KV events.
        for index in self.indexes:
            apply_ops(index, self.names[r], ops)

    def _scrape(self) -> None:
        # Every picker scrapes every replica (at the same instants: a simplification).
        for r, engine in enumerate(self.engines):
            if r not in self.failed and self.phase[r] != _OFF:
                waiting, usage = engine.num_waiting, engine.kv_usage
                for router in self.routers:
                    state = router.states[r]
                    state.reported_waiting = waiting
                    state.reported_kv_usage = usage

    # -- the bus between pickers (share="bus") ------------------------------------------

    def _publish(self, what: int, published: _Published, t: float) -> None:
        lag = self.config.bus_lag_s
        if lag > 0:
            self._push(t + lag, _BUS, -1, (what, published))
        else:
            self._deliver((what, published), t)

    def _deliver(self, message: tuple[int, _Published], t: float) -> None:
        """The other pickers repeat a picker's ledger call on their own ledgers.

        A dispatch is the origin's route dispatched again (the request as the origin saw it, so
        the same cached and prefill tokens are counted; its match of the replica as the
        prediction's hints); first token and finish go to each picker's copy. So a remote
        dispatch changes load and predictions exactly as ``DispatchLedger.dispatch`` /
        ``first_token`` / ``finish`` do, through their public calls; as a ``REMOTE`` dispatch
        it reaches each picker's own policy too (its session claims, as the live bus does).
        Messages keep their order (one lag, ties by creation), so a copy always exists before
        its first token or finish.
        """
        what, published = message
        if what == _DISPATCHED:
            replica, route = published.replica, published.route
            for k, ledger in enumerate(self.ledgers):
                if k != published.origin:
                    published.copies.append((ledger, ledger.dispatch(route, replica, t, REMOTE)))
        elif what == _ANSWERED:
            for ledger, d in published.copies:
                ledger.first_token(d, t)
        else:
            for ledger, d in published.copies:
                ledger.finish(d, t)

    def _restore(self, r: int, t: float) -> None:
        """A replica gone in a capacity dip comes back, its cache empty."""
        if r not in self.failed:
            return
        self.failed.discard(r)
        engine = make_engine(self.config, self.trace.block_tokens, self._holdings, r)
        self.engines[r] = engine
        if self.pools and isinstance(engine, FastEngine):
            self.pools[r] = engine.pool
        self.busy[r] = False
        self.kicked[r] = False
        for router in self.routers:
            state = router.states[r]
            state.healthy = True
            state.reported_waiting = None
            state.reported_kv_usage = None

    def _fail(self, r: int, t: float) -> None:
        if r in self.failed:
            return
        report, left = self.engines[r].fail(t)
        if self.pools:
            self.pools[r].forget()  # its cache leaves the fleet's holdings
        self._take_report(r, report, t)
        self.failed.add(r)
        self.result.failed_replicas.append(r)
        self.busy[r] = False
        self.version[r] += 1
        for router in self.routers:  # every picker sees it go (its health checks)
            state = router.states[r]
            state.healthy = False
            state.reported_waiting = None
            state.reported_kv_usage = None
            router.index.clear_replica(self.names[r])
        for index, generated in left.items():
            flight = self.flights[index]
            self._finish(flight, t)  # withdraws a prediction still prefilling
            flight.delivered += generated
            self.result.reroutes[index] += 1
            self._route(flight, t)

    def _finish_stats(self) -> None:
        res = self.result
        for engine in self.engines:
            res.engine_steps += getattr(engine, "steps", 0)
            res.decode_runs += getattr(engine, "runs", 0)
            res.preemptions += getattr(engine, "num_preemptions", 0)
            for medium, tokens in getattr(engine, "loaded_tokens", {}).items():
                res.loaded_tokens[medium] = res.loaded_tokens.get(medium, 0) + tokens
        if self.loss is not None:
            res.loss = self.loss.breakdown(res.hit_tokens[: self.online])
