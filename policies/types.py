"""The vocabulary shared by every policy, the live router and the simulator.

Everything here is plain data: no I/O, no asyncio, no wall clock. The router (or the
simulator) owns the ``ReplicaState`` objects, updates them as requests start and finish,
and hands policies a ``FleetView`` to decide on. Policies only read it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .latency import LatencyPrior, ReplicaLatency


@dataclass(slots=True)
class ReplicaState:
    """What the router knows about one replica at this instant."""

    replica_id: str
    healthy: bool = True
    # Taken out of rotation by its circuit breaker (failing or stalled live traffic).
    ejected: bool = False
    # Taken out of rotation by the output-drift canary (its greedy output left the fleet's).
    quarantined: bool = False
    # Kept out of new routing by the fleet's operator: draining before it is stopped or removed
    # (a rollout, DELETE /admin/replicas, the autoscaler), or a replacement awaiting its check.
    draining: bool = False
    # Models the replica serves; None until known (then it is eligible for any model).
    models: frozenset[str] | None = None
    # The router's own accounting, updated at every dispatch and completion.
    in_flight: int = 0
    in_flight_tokens: int = 0
    # Of those, requests still waiting for their first token, and their uncached prompt
    # tokens (with tier loads the policy prices in time, as prefill tokens): the prefill work
    # queued ahead of a new request.
    prefilling: int = 0
    prefill_tokens: int = 0
    # What the replica itself last reported (None until a fresh report exists).
    reported_waiting: int | None = None
    reported_kv_usage: float | None = None
    # Its KV cache in tokens (vLLM's num_gpu_blocks x block_size), None until known.
    kv_capacity_tokens: int | None = None
    # Its latency lines in seconds, learnt online (policies/latency.py); None unless the policy
    # asks for them (``Policy.latency_prior``).
    latency: ReplicaLatency | None = None
    # Its speed as the operator gave it, against the policy's latency prior (0.5: a card half
    # as fast): its lines start from the prior at this speed, before its first answers.
    speed: float = 1.0
    # LoRA adapters it serves (its /v1/models cards with a ``parent``): loaded at start or at
    # runtime, servable without a load. Empty: none, or not known yet.
    lora_adapters: frozenset[str] = frozenset()
    # Adapters its own requests use now (vLLM's ``vllm:lora_requests_info``, running and
    # waiting): they hold its adapter slots. And how many slots it has (``max_lora``; None:
    # not reported, i.e. LoRA off or not scraped yet).
    lora_running: frozenset[str] = frozenset()
    max_loras: int | None = None
    # The router's own requests in flight there per adapter (the ledger's count): an adapter
    # is in use from its dispatch on, whether or not a scrape has seen it yet.
    lora_in_flight: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about a request."""

    prompt_tokens: int
    max_tokens: int
    model: str | None = None
    routing_key: str | None = None
    # Router hashes of the prompt's full KV blocks (empty without a tokenizer).
    block_hashes: Sequence[int] = ()
    # Per replica: prompt tokens it already holds (prefix index match x block size).
    prefix_tokens: Mapping[str, int] | None = None
    # Tokens per block of ``block_hashes`` (0: unknown).
    block_tokens: int = 0
    # How long the client asked its prompt's cache to be kept, in seconds (Anthropic Messages'
    # ``cache_control.ttl``; kvcore/cache_hints.py); None: no hint.
    cache_ttl_s: float | None = None
    # Per replica, of its ``prefix_tokens``: those it would load from a tier below its GPU,
    # as (tier, tokens), fastest tier first (kvcore/kv_tiers.py); replicas absent: all on GPU.
    prefix_tiers: Mapping[str, tuple[tuple[str, int], ...]] | None = None

    @property
    def token_cost(self) -> int:
        """Work this request adds to a replica, in tokens (prompt plus expected output)."""
        return self.prompt_tokens + self.max_tokens


@dataclass(slots=True)
class FleetView:
    """A consistent view of the fleet for one decision.

    ``membership_version`` changes whenever replicas join or leave, so policies that keep
    derived structures (a hash ring) know when to rebuild them without comparing lists.
    """

    replicas: Sequence[ReplicaState]
    membership_version: int = 0
    now: float = 0.0

    def eligible(self, model: str | None) -> list[ReplicaState]:
        """Healthy replicas that serve ``model`` (or whose models are not known yet)."""
        return [
            r
            for r in self.replicas
            if r.healthy
            and not r.ejected
            and not r.quarantined
            and not r.draining
            and (model is None or r.models is None or model in r.models)
        ]

    @staticmethod
    def admits(replica: ReplicaState, model: str | None) -> bool:
        """Whether ``eligible(model)`` would list ``replica``: one replica in O(1), for callers
        that must not scan the fleet (policies/regret.py)."""
        return (
            replica.healthy
            and not replica.ejected
            and not replica.quarantined
            and not replica.draining
            and (model is None or replica.models is None or model in replica.models)
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """Replicas to try, best first, and why the first one was chosen."""

    ranked: tuple[str, ...]
    reason: str

    @property
    def chosen(self) -> str:
        return self.ranked[0]


NO_HEALTHY_REPLICA = Decision(ranked=(), reason="no_healthy_replica")


class Policy(ABC):
    """A routing policy: pure, synchronous, deterministic for a seed."""

    name: ClassVar[str]
    # Whether decisions read ``RouteRequest.prefix_tokens``/``block_hashes``: a policy that
    # does not is spared the router's tokenization (round robin at round robin's price).
    reads_prefixes: ClassVar[bool] = False
    # Set when decisions read ``ReplicaState.latency``: the ledger then gives every replica
    # latency lines that start from this prior and learns them from its first tokens.
    latency_prior: LatencyPrior | None = None

    @abstractmethod
    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        """Rank the healthy replicas for ``request``; empty ranking if none is healthy."""

    def observe_remote(self, request: RouteRequest, replica: ReplicaState, now: float) -> None:
        """Another router sent ``request`` to ``replica`` (shared over a bus): update what the
        policy remembers of its own decisions as if it had made this one. Default: nothing."""
        return  # most policies keep nothing of their decisions

    def queued_load_tokens(self, request: RouteRequest, replica: ReplicaState) -> int:
        """Prefill-token equivalents that ``request`` adds to ``replica``'s queue besides the
        tokens it computes: loading its prefix back from a lower KV tier, where the policy
        prices that in time. The ledger adds them to the replica's queued prefill until the
        first token. Default: nothing."""
        return 0

    def describe(self) -> dict[str, Any]:
        """Parameters, for logs and the admin API."""
        return {"name": self.name}
