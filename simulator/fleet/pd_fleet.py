"""A disaggregated (P/D) fleet: a prefill pool, a decode pool, and KV moved between them.

``FleetConfig.pd`` (``PdSetup``) makes replicas ``p0..`` the prefill pool and ``d0..`` the
decode pool, one engine preset for both. The router keeps a ledger and a prefix index per pool,
each over its own replicas and fed only their KV events, with its own copy of the fleet's
policy. Per request, as the live router does it, with the shared rule of ``kvcore/pd.py``:

1. the decode pool's policy picks a decode replica; the prompt tokens the index says that
   replica holds are ``cached_on_decode``, and ``decide`` splits the request or not;
2. not split: it runs on the decode replica as in an aggregated fleet (prefill and decode);
3. split: the prefill pool's policy picks a prefill replica, which prefills the whole prompt
   and samples one token (the prompt stays cached there, as usual);
4. the KV of the prompt tokens the decode replica does not hold when that prefill ends moves
   over the link (``transfer_s``, the preset's KV bytes per token, the link per replica);
5. it then joins the decode replica's queue with its prompt computed
   (``FastEngine.add_prefilled``): one step for its last prompt token samples the client's
   first token, then it decodes the rest.

So a split request's TTFT is its prefill (queue and compute) + the transfer + its queue and
first step on the decode replica; its TPOT is the decode replica's.

The decode pool's ledger counts a split request from the decision on (in flight there, its
prompt arriving rather than queued as prefill: ``_arriving``), so a burst of split requests
spreads over the decode pool by load as it would unsplit. Not modelled: transfers sharing a
link (each has the whole link), the decode replica holding blocks while the KV streams in
(they are taken when it lands), the prefill replica holding its blocks until the decode side
has read them (they are freed, cached, when it samples its token), and failures, autoscaling,
dips, batch jobs and several routers (``FleetConfig`` refuses them).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from kvroute.kvcore.ledger import Dispatch, DispatchLedger, Route
from kvroute.kvcore.pd import SPLIT, decide, transfer_s
from kvroute.policies import Policy, RouteRequest

from .config import FleetConfig
from .fast_engine import FastEngine
from .fleet import _KV, _Fleet, _Flight, _Router, apply_ops
from .kv_units import IndexOp
from .pd_outcome import PdOutcome
from .pd_setup import PdSetup
from .protocol import StepReport
from .units import SimRequest, UnitTrace

# The fleet's routers: the decode pool's ledger first (a flight's ``router`` is 0, so the
# aggregated fleet's handling of first tokens and finishes serves decode replicas unchanged).
_DECODE, _PREFILL = 0, 1


class _PdFlight(_Flight):
    __slots__ = ("decode_replica", "prefill")

    def __init__(self, request: SimRequest) -> None:
        super().__init__(request, _DECODE)
        self.decode_replica = -1
        self.prefill: Dispatch | None = None  # its prefill leg, when split


def _arriving(route: Route, replica: str) -> Route:
    """``route`` with its whole prompt counted as held by ``replica``: a split request's KV
    arrives there by transfer, so it queues no prefill there (and is predicted cached)."""
    request = route.request
    prefix = dict(request.prefix_tokens or {})
    prefix[replica] = request.prompt_tokens
    return replace(route, request=replace(request, prefix_tokens=prefix))


class PdFleet(_Fleet):
    def __init__(self, trace: UnitTrace, policy: Policy, config: FleetConfig) -> None:
        assert config.pd is not None
        self.setup: PdSetup = config.pd
        super().__init__(trace, policy, config)
        self.decode_engines: dict[int, FastEngine] = {}
        for r in range(self.setup.prefill, config.replicas):
            engine = self.engines[r]
            assert isinstance(engine, FastEngine)  # FleetConfig allows P/D on the fast one
            self.decode_engines[r] = engine
        latency = config.engine.latency
        self.kv_bytes_per_token = latency.kv_bytes_per_token
        self.link = self.setup.link_bytes_per_s(latency.num_gpus)
        self.outcome = PdOutcome.empty(self.setup, self.link, len(trace.requests))
        self.result.pd = self.outcome

    def _replica_names(self) -> list[str]:
        p = self.setup.prefill
        return [f"p{i}" for i in range(p)] + [f"d{i}" for i in range(self.setup.decode)]

    def _make_routers(self, policy: Policy) -> list[_Router]:
        config, p = self.config, self.setup.prefill
        ttl, kv = config.prediction_ttl_s, config.kv_capacity_tokens
        decode = _Router(self.names[p:], policy, ttl, kv)
        prefill = _Router(self.names[:p], copy.deepcopy(policy), ttl, kv)
        return [decode, prefill]

    def _ledger(self, pool: int) -> DispatchLedger:
        return self.routers[pool].ledger

    # -- routing ------------------------------------------------------------------------

    def _arrive(self, request: SimRequest, t: float) -> None:
        if not self.config.engine.fits(request.input_tokens + request.output_tokens):
            self.result.rejected[request.index] = True
            return
        flight = _PdFlight(request)
        self.flights[request.index] = flight
        self._route(flight, t)

    def _route(self, flight: _Flight, t: float) -> None:
        assert isinstance(flight, _PdFlight)
        request = flight.request
        decode = self._ledger(_DECODE)
        route = decode.route(self._route_request(request, request.output_tokens), t, self.ibt)
        if not route.ranked:  # no decode replica may take it (cannot happen without failures)
            del self.flights[request.index]
            return
        self.result.reasons[route.reason] += 1
        chosen = route.ranked[0]
        prefix = route.request.prefix_tokens
        cached = prefix.get(chosen, 0) if prefix else 0
        decision = decide(self.setup.rule, request.input_tokens, cached, self.setup.prefill > 0)
        self.outcome.decision[request.index] = decision
        self.outcome.decisions[decision] += 1
        r = self.number[chosen]
        flight.decode_replica = r
        self._count_routed(r, request)
        if decision != SPLIT:
            flight.dispatch = decode.dispatch(route, chosen, t)
            self._enqueue(r, request, 0, t)
            return
        flight.dispatch = decode.dispatch(_arriving(route, chosen), chosen, t)
        prefill = self._ledger(_PREFILL)
        p_route = prefill.route(self._route_request(request, 1), t, self.ibt)
        self.result.reasons[f"prefill {p_route.reason}"] += 1
        p = self.number[p_route.ranked[0]]
        flight.prefill = prefill.dispatch(p_route, p_route.ranked[0], t)
        self.outcome.prefill_replica[request.index] = p
        self._count_routed(p, request)
        self._cut_run(p, t)
        self.engines[p].add(request, 0, 1)  # the prompt, and the one token that ends it
        self._kick(p, t)

    def _route_request(self, request: SimRequest, max_tokens: int) -> RouteRequest:
        return RouteRequest(
            request.input_tokens, max_tokens, None, request.session_id, request.route_hashes
        )

    def _count_routed(self, r: int, request: SimRequest) -> None:
        self.result.routed_requests[r] += 1
        self.result.routed_tokens[r] += request.input_tokens

    # -- the prefill leg, the transfer, the decode leg ----------------------------------

    def _take_report(self, r: int, report: StepReport, t: float) -> None:
        if r >= self.setup.prefill:  # a decode replica: as in an aggregated fleet
            super()._take_report(r, report, t)
            return
        self._count_lookups(report)
        ledger = self._ledger(_PREFILL)
        for index, at in report.first_tokens:
            flight = self._flight(index)
            assert flight.prefill is not None
            ledger.first_token(flight.prefill, at)
        for index, at in report.finished:
            flight = self._flight(index)
            assert flight.prefill is not None
            ledger.finish(flight.prefill, at, 1)
            self._transfer(flight, at)
        self._send_ops(r, report.index_ops, t)

    def _flight(self, index: int) -> _PdFlight:
        flight = self.flights[index]
        assert isinstance(flight, _PdFlight)
        return flight

    def _transfer(self, flight: _PdFlight, t: float) -> None:
        """The prefill ended at ``t``: the KV the decode replica lacks moves over the link."""
        request, d = flight.request, flight.decode_replica
        held = self.decode_engines[d].cached_prompt_tokens(request)
        tokens = request.input_tokens - held
        seconds = transfer_s(tokens, self.kv_bytes_per_token, self.link)
        out, i = self.outcome, request.index
        out.prefill_done_s[i] = t
        out.transfer_tokens[i] = tokens
        out.transfer_s[i] = seconds
        self._push(t + seconds, _KV, d, flight)

    def _kv_arrived(self, payload: object, t: float) -> None:
        assert isinstance(payload, _PdFlight)
        d = payload.decode_replica
        self._cut_run(d, t)
        self.decode_engines[d].add_prefilled(payload.request)
        self._kick(d, t)

    # -- what each pool's router learns -------------------------------------------------

    def _apply_ops(self, r: int, ops: list[IndexOp]) -> None:
        pool = _PREFILL if r < self.setup.prefill else _DECODE
        apply_ops(self.routers[pool].index, self.names[r], ops)

    def _scrape(self) -> None:
        for router in self.routers:
            for state in router.states:
                engine = self.engines[self.number[state.replica_id]]
                state.reported_waiting = engine.num_waiting
                state.reported_kv_usage = engine.kv_usage
