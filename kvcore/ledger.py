"""The dispatch ledger: the routing step that every front end shares.

A request's life as the router sees it, in four calls:

* ``route(request, now)``: look the prompt's block hashes up in the prefix index, fill in what
  each replica holds, and ask the policy; a ``Route`` carries the ranking and the reason.
* ``dispatch(route, replica, now)``: the request is sent to ``replica`` (the policy's choice,
  or the next in its ranking on a retry); the prompt is predicted cached there until the
  replica's KV events say so, and it counts as in flight with its uncached prompt as queued
  prefill. The ``Dispatch`` it returns is what the front end hands back below.
* ``first_token(dispatch, now, ok)``: the replica answered. ``ok``: its prefill is done and
  the prompt is cached there (the prediction is renewed); not ok: it refused, nothing was
  cached (the prediction is withdrawn). Either way it is no longer queued prefill.
* ``finish(dispatch, now)``: it left the replica (done, failed or cancelled); one still
  prefilling withdraws its prediction first.

The HTTP router, the endpoint picker and the simulator call these and nothing else: no front
end touches ``in_flight`` counters or predictions. Pure: no I/O, no clock (``now`` is passed
in: monotonic seconds live, virtual seconds in the simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvroute.kvcore.prefix_index import PrefixIndex, PrefixMatch
from kvroute.policies import FleetView, Policy, ReplicaLatency, ReplicaState, RouteRequest
from kvroute.policies.regret import TtftEstimate, estimator_for

# The reason of a dispatch another router made, replayed here (router/ledger_bus.py, the
# simulator's bus): the policy hears of it (``Policy.observe_remote``) instead of deciding it.
REMOTE = "remote"


class SharedLoad(Protocol):
    """Load that other processes add too (the router's worker board): written at every
    change, read back into the fleet's states before each decision."""

    def add(
        self, replica: int, requests: int, tokens: int, prefilling: int, prefill_tokens: int
    ) -> None: ...

    def totals_into(self, states: Sequence[ReplicaState]) -> None: ...


@dataclass(slots=True)
class Route:
    """The policy's decision for one request, with the request as the policy saw it."""

    request: RouteRequest  # prefix_tokens filled in from the index
    ranked: tuple[str, ...]  # best first; empty when no replica may take it
    reason: str
    matches: dict[str, PrefixMatch] | None = None  # the index's, per replica
    block_tokens: int = 0  # tokens per block the prefix tokens were counted in
    # The policy's TTFT estimate on its choice and on round robin's / power of two's
    # (policies/regret.py); None for a policy without one. A front end records it once.
    estimate: TtftEstimate | None = None
    # A decode leg (P/D disaggregation): the prompt's KV arrives from a prefill replica, so the
    # replica it goes to computes none of it (no queued prefill; no prefill latency to learn).
    transferred: bool = False


@dataclass(slots=True)
class Dispatch:
    """One request sent to one replica, tracked until it finishes there."""

    replica: str
    reason: str
    ranked: tuple[str, ...]
    request: RouteRequest
    cached_tokens: int  # prompt tokens the index expects the replica to hold
    cost: int  # prompt + max output tokens: in flight while it runs
    # Uncached prompt tokens, plus a lower tier's load in prefill tokens where the policy prices
    # it in time (Policy.queued_load_tokens): queued prefill until its first token.
    prefill: int
    slot: int  # the replica's position in the fleet when dispatched (the shared board's row)
    state: ReplicaState  # the replica's load, counted down here even if it has left the fleet
    held: int = 0  # leading blocks the replica held by events when routed
    sent_at: float = 0.0  # ``now`` at dispatch
    ahead: int = 0  # the prefill (as ``prefill``) the router had queued there before this one
    answered_at: float = -1.0  # ``now`` at its first token (-1: not yet)
    batch: int = 0  # requests in flight on the replica then: the batch it decodes in
    confirmed_tokens: int | None = None  # prompt tokens the engine reported reusing (its usage)
    transferred: bool = False  # a decode leg: its prompt's KV came from a prefill replica
    adapter: str | None = None  # the LoRA adapter it runs with there (counted in lora_in_flight)
    prefilling: bool = True
    open: bool = True


class DispatchLedger:
    """Decisions, predictions and the router's own load, in one place (see the module doc)."""

    def __init__(
        self,
        policy: Policy,
        fleet: FleetView,
        index: PrefixIndex,
        *,
        prediction_ttl_s: float,
        shared: SharedLoad | None = None,
    ) -> None:
        self.policy = policy
        self.index = index
        self.prediction_ttl_s = prediction_ttl_s
        self._shared = shared
        self.fleet = fleet
        self._slots: dict[str, int] = {}
        self._regret = estimator_for(policy)
        self.members_changed()

    def members_changed(self) -> None:
        """Replicas joined or left ``fleet.replicas`` (discovery): look them up anew.

        Open dispatches keep the state they were counted on, so one finishing on a replica
        that has left counts down its own (detached) state and nobody else's.
        """
        self._slots = {s.replica_id: i for i, s in enumerate(self.fleet.replicas)}
        prior = self.policy.latency_prior
        if prior is not None:
            for state in self.fleet.replicas:
                if state.latency is None:
                    state.latency = ReplicaLatency(prior.at_speed(state.speed))

    @property
    def members(self) -> frozenset[str]:
        """The replicas a dispatch may go to now."""
        return frozenset(self._slots)

    def expire_predictions(self, now: float) -> int:
        """Drop predictions due by ``now``. The index does this itself before each lookup, but
        a live front end calls it on a short timer too: after a quiet spell the first request
        would otherwise pay for every prediction of the last ``prediction_ttl_s`` at once
        (70-100 ms measured at 430 requests/s)."""
        return self.index.expire(now)

    # -- the four calls ---------------------------------------------------------------

    def route(self, request: RouteRequest, now: float, block_tokens: int) -> Route:
        """The policy's ranking for ``request``, prefix matches from the index filled in."""
        hashes = request.block_hashes
        matches = None
        if hashes:
            matches = self.index.match(hashes, now)
            prefix = {rid: m.blocks * block_tokens for rid, m in matches.items()}
            tiers = (
                self._tiers(hashes, matches, prefix, block_tokens) if self.index.tiered else None
            )
            r = request
            request = RouteRequest(
                r.prompt_tokens,
                r.max_tokens,
                r.model,
                r.routing_key,
                hashes,
                prefix,
                block_tokens,
                r.cache_ttl_s,
                tiers,
            )
        fleet = self.fleet
        if self._shared is not None:
            self._shared.totals_into(fleet.replicas)
        fleet.now = now
        decision = self.policy.decide(request, fleet)
        route = Route(request, decision.ranked, decision.reason, matches, block_tokens)
        if self._regret is not None and decision.ranked:
            chosen = fleet.replicas[self._slots[decision.ranked[0]]]
            route.estimate = self._regret.estimate(request, fleet.replicas, chosen)
        return route

    def _tiers(
        self,
        hashes: Sequence[int],
        matches: dict[str, PrefixMatch],
        prefix: dict[str, int],
        block_tokens: int,
    ) -> dict[str, tuple[tuple[str, int], ...]]:
        """Per replica with offload tiers: what of its match it would load from them (and its
        ``prefix`` cut to what vLLM would not compute: the GPU run, then the lower tiers')."""
        tiers: dict[str, tuple[tuple[str, int], ...]] = {}
        for rid, m in matches.items():
            run = self.index.tier_run(rid, hashes, m)
            if run is None:
                continue
            prefix[rid] = run.blocks * block_tokens
            if run.lower:
                tiers[rid] = tuple((tier, n * block_tokens) for tier, n in run.lower)
        return tiers

    def dispatch(
        self, route: Route, replica: str, now: float, reason: str = "", *, predict: bool = True
    ) -> Dispatch:
        """``route``'s request goes to ``replica``: predict its prompt there, count its load.
        With ``predict`` False the caller predicts (:meth:`predict_prompt`) before its next route:
        the endpoint picker does once its answer is on its way."""
        request = route.request
        slot = self._slots[replica]
        prefix = request.prefix_tokens
        cached = min(prefix.get(replica, 0), request.prompt_tokens) if prefix else 0
        computed = 0 if route.transferred else request.prompt_tokens - cached
        if request.prefix_tiers and not route.transferred:  # a load from a lower tier queues
            computed += self.policy.queued_load_tokens(request, self.fleet.replicas[slot])
        d = Dispatch(
            replica,
            reason or route.reason,
            route.ranked,
            request,
            cached,
            request.token_cost,
            max(1, computed),
            slot,
            self.fleet.replicas[slot],
        )
        d.transferred = route.transferred
        d.sent_at = now
        d.ahead = d.state.prefill_tokens
        match = route.matches.get(replica) if route.matches else None
        if match is not None:
            d.held = match.confirmed
        if predict:
            self.predict_prompt(route, d, now)
        if reason == REMOTE:
            # What the policy keeps of its own decisions (kv_aware: the session's claim on its
            # replica), kept for this one too, as if this router had routed it.
            self.policy.observe_remote(request, d.state, now)
        state = d.state
        state.in_flight += 1
        state.in_flight_tokens += d.cost
        model = request.model
        if model is not None and model in state.lora_adapters:
            d.adapter = model
            state.lora_in_flight[model] = state.lora_in_flight.get(model, 0) + 1
        state.prefilling += 1
        state.prefill_tokens += d.prefill
        if self._shared is not None:
            self._shared.add(slot, 1, d.cost, 1, d.prefill)
        return d

    def predict_prompt(self, route: Route, d: Dispatch, now: float) -> None:
        """Until its events arrive, count the prompt as cached where it went, so the next
        request with this prefix follows it. The match says what it holds already: only the
        rest is looked up (a long conversation's next turn: its new blocks)."""
        hashes = d.request.block_hashes
        if not hashes:
            return
        match = route.matches.get(d.replica) if route.matches else None
        self.index.predict(
            d.replica,
            hashes,
            now,
            self.prediction_ttl_s,
            held=d.held,
            known=match.blocks if match is not None else 0,
        )

    def first_token(self, d: Dispatch, now: float, ok: bool = True) -> bool:
        """The replica answered (``ok``) or refused; False if this was counted already."""
        if not d.prefilling:
            return False
        d.prefilling = False
        state = d.state
        state.prefilling -= 1
        state.prefill_tokens -= d.prefill
        if self._shared is not None:
            self._shared.add(d.slot, 0, 0, -1, -d.prefill)
        if ok and state.latency is not None:
            if not d.transferred:
                # The replica's time to first token as the router sees it, with the work it
                # knew was queued there: what the latency line predicts for the next request.
                state.latency.observe_prefill(d.ahead + d.prefill, now - d.sent_at)
            d.answered_at = now
            d.batch = state.in_flight
        hashes = d.request.block_hashes
        if hashes:
            if ok:
                # However long it queued, the prompt is cached there now: keep the prediction
                # until the replica's events confirm it (renewed if dispatch is a while ago).
                ttl = self.prediction_ttl_s
                known = len(hashes)
                self.index.predict(d.replica, hashes, now, ttl, held=d.held, known=known)
            else:
                self.index.unpredict(d.replica, hashes)  # nothing was cached there
        return True

    def finish(self, d: Dispatch, now: float, output_tokens: int = 0) -> None:
        """The request left its replica: done, failed or cancelled (idempotent). A front end that
        knows the ``output_tokens`` generated there passes them: its time per output token
        feeds the replica's decode line (when the policy keeps latency lines)."""
        if not d.open:
            return
        latency = d.state.latency
        if latency is not None and output_tokens > 1 and d.answered_at >= 0:
            latency.observe_decode(d.batch, (now - d.answered_at) / (output_tokens - 1))
        self.first_token(d, now, ok=False)  # a no-op once the replica answered
        d.open = False
        state = d.state
        state.in_flight -= 1
        state.in_flight_tokens -= d.cost
        if d.adapter is not None:
            left = state.lora_in_flight.get(d.adapter, 0) - 1
            if left > 0:
                state.lora_in_flight[d.adapter] = left
            else:
                state.lora_in_flight.pop(d.adapter, None)
        if self._shared is not None:
            self._shared.add(d.slot, -1, -d.cost, 0, 0)
