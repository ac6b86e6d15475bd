"""Model pools at run time: each pool's routing parts, and the directory that finds them.

A pool (``pools:`` in the config, or the one implicit pool of a config without it) is the
replicas serving one model, with what deciding among them needs: its own prefix index fed by
its replicas' KV events, its prompt keys (tokenizer, block size, adapters), its policy, and its
dispatch ledger over a ``FleetView`` of its replicas only, so a request is never routed, retried
or resumed outside its model's pool. The replica registry, probes, scrapes and breakers stay one
for the whole router (replica names are unique across pools); ``RoutingCore`` owns the pools
and keeps their members current.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kvroute.kvcore.fair_queue import Ticket
from kvroute.kvcore.ledger import DispatchLedger, SharedLoad
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import FleetView, Policy, ReplicaState, build_policy

from .admission import Cost, Locality, prefix_cost, prefix_locality
from .config import ReplicaConfig
from .kv_subscriber import KVEventSubscriber, KVEventSubscribers, SubscriberStats
from .ledger_bus import LedgerBus
from .pool_config import PoolSpec
from .prompt_keys import PromptKeys
from .tokenizer_cache_metrics import Counts
from .workers import WorkerLoad


class PoolRouting:
    """One pool's routing parts; its members are set by ``RoutingCore``."""

    def __init__(
        self,
        spec: PoolSpec,
        states: list[ReplicaState],
        *,
        prediction_ttl_s: float,
        shared: SharedLoad | None = None,
        send_tokens: bool = False,
    ) -> None:
        """``send_tokens``: routing.send_tokens, where the router forwards requests itself."""
        self.name = spec.name
        self.model = spec.model  # None: the implicit pool, any model
        self.role = spec.role  # "prefill", "decode" or None (P/D disaggregation)
        self.disaggregate = spec.disaggregate  # a decode pool's rule
        self.index = PrefixIndex()
        self.policy: Policy = build_policy(spec.policy.name, spec.policy_params)
        # Tokens sent once need the prompt's ids whatever the policy reads, once a replica
        # takes them (PromptKeys.tokens_wanted).
        self.send_tokens = send_tokens
        # Some replica of the pool takes token ids now (the health probe says): until one
        # does, requests are not even looked at for the token path.
        self.token_path_live = False
        self.keys = PromptKeys(
            spec.routing, self.index, self.policy.reads_prefixes, self.send_tokens
        )
        self.kv_events = KVEventSubscribers(self.index)
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.fleet = FleetView(states, membership_version=1)
        self.members: frozenset[str] = frozenset(s.replica_id for s in states)
        self.ledger = DispatchLedger(
            self.policy, self.fleet, self.index, prediction_ttl_s=prediction_ttl_s, shared=shared
        )
        # Other routers' dispatches, and this one's for them (routing.ledger_bus; off).
        self.bus: LedgerBus | None = None

    def set_states(self, states: list[ReplicaState]) -> None:
        """Its replicas are now ``states`` (a fleet change): the ledger looks them up anew."""
        if [s.replica_id for s in states] == [s.replica_id for s in self.fleet.replicas]:
            return
        self.fleet.replicas = states
        self.fleet.membership_version += 1
        self.members = frozenset(s.replica_id for s in states)
        self.ledger.members_changed()

    def follow_events(self, name: str, replica: ReplicaConfig) -> None:
        if replica.kv_events:
            self.subscribers[name] = self.kv_events.add(name, replica.kv_events, replica.kv_replay)

    async def forget(self, name: str) -> None:
        """``name`` left the pool: its cache is nobody's now, its events are not heard."""
        self.index.clear_replica(name)
        subscriber = self.subscribers.pop(name, None)
        if subscriber is not None:
            await self.kv_events.remove(subscriber)

    async def close(self) -> None:
        await self.kv_events.close_all()
        self.keys.close()


class OffsetLoad:
    """A pool's view of the workers' load board: its replicas' rows follow the earlier pools'
    (the registry lists replicas pool by pool), so its ledger's slot 0 is row ``first``."""

    def __init__(self, shared: WorkerLoad, first: int) -> None:
        self._shared = shared
        self._first = first

    def add(
        self, replica: int, requests: int, tokens: int, prefilling: int, prefill_tokens: int
    ) -> None:
        self._shared.add(self._first + replica, requests, tokens, prefilling, prefill_tokens)

    def totals_into(self, states: Sequence[ReplicaState]) -> None:
        self._shared.totals_into(states, self._first)


class Pools:
    """The pools in config order: a request's by its model, a replica's by its name."""

    def __init__(self, pools: list[PoolRouting]) -> None:
        self._pools = pools
        self._by_name = {p.name: p for p in pools}
        # A model's requests go to its pool, or to the decode pool of a P/D pair, which sends
        # some through the pair's prefill pool first (``prefill_for``).
        self._by_model = {p.model: p for p in pools if p.model is not None and p.role != "prefill"}
        self._prefill = {
            self._by_model[p.model].name: p
            for p in pools
            if p.role == "prefill" and p.model in self._by_model
        }
        # A config without pools: its one pool takes every model the catalog admits.
        self._any = pools[0] if len(pools) == 1 and pools[0].model is None else None
        self._of: dict[str, PoolRouting] = {}

    def __iter__(self) -> Iterator[PoolRouting]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def sole(self) -> PoolRouting:
        """The one pool of a single-pool router (the endpoint picker's, tests')."""
        if len(self._pools) != 1:
            raise RuntimeError(
                f"this router serves {len(self._pools)} model pools; ask for one by model"
            )
        return self._pools[0]

    def named(self, name: str) -> PoolRouting | None:
        return self._by_name.get(name)

    def for_model(self, model: str | None) -> PoolRouting | None:
        if self._any is not None:
            return self._any
        return self._by_model.get(model) if model is not None else None

    def prefill_for(self, pool: PoolRouting) -> PoolRouting | None:
        """The prefill pool paired with decode pool ``pool`` (None: not a decode pool)."""
        return self._prefill.get(pool.name)

    def of_replica(self, name: str) -> PoolRouting | None:
        return self._of.get(name)

    def owner(self, name: str) -> PoolRouting:
        """The pool of a replica in the fleet (KeyError for one that is not)."""
        return self._of[name]

    def assign(self, name: str, pool: PoolRouting) -> None:
        self._of[name] = pool

    def unassign(self, name: str) -> PoolRouting | None:
        return self._of.pop(name, None)

    def index_entries(self) -> int:
        return sum(p.index.entries for p in self._pools)

    def tokenizer_cache_counts(self) -> list[Counts]:
        """Each pool tokenizer's cache counts (tokenizer_cache_metrics)."""
        return [p.keys.tokenizer.cache_counts() for p in self._pools if p.keys.tokenizer]

    def kv_sources(self) -> dict[tuple[str, str], SubscriberStats]:
        sources: dict[tuple[str, str], SubscriberStats] = {}
        for pool in self._pools:
            sources.update(pool.kv_events.stats_by_source())
        return sources

    def describe_policies(self) -> str:
        """'kv_aware', or with several pools 'chat: kv_aware, code: round_robin'."""
        if len(self._pools) == 1:
            return self._pools[0].policy.name
        return ", ".join(f"{p.name}: {p.policy.name}" for p in self._pools)


def pools_locality(pools: Pools, now: Callable[[], float]) -> Locality:
    """Admission's locality (``admission.prefix_locality``) in the freed replica's pool: its
    index and block size; a replica outside every pool holds nothing."""
    per_pool = {p.name: prefix_locality(p.index, p.keys.block_size, now) for p in pools}

    def on(replica: str) -> Callable[[Ticket], int]:
        pool = pools.of_replica(replica)
        if pool is None:
            return _nothing
        return per_pool[pool.name](replica)

    return on


def pools_cost(pools: Pools, now: Callable[[], float]) -> Cost:
    """Admission's cost by program (``admission.prefix_cost``) over every pool's index."""
    return prefix_cost(lambda: [(p.index, p.keys.block_size()) for p in pools], now)


def _nothing(ticket: Ticket) -> int:
    return 0


class PoolMetrics:
    """kvroute_model_pool (pool, model, policy) and kvroute_replica_pool (replica, pool): info
    gauges of 1 to join per-replica series to their pool (a ``RouterMetrics`` part)."""

    def __init__(self, pools: Pools) -> None:
        self._pools = pools

    def snapshot(self) -> Any:
        return {}  # the same for every worker: nothing to merge

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        pools = GaugeMetricFamily(
            "kvroute_model_pool",
            "1 per model pool: the model it serves ('*': any, a config without pools:) and "
            "its routing policy.",
            labels=["pool", "model", "policy"],
        )
        replicas = GaugeMetricFamily(
            "kvroute_replica_pool",
            "1 per replica: the model pool it belongs to.",
            labels=["replica", "pool"],
        )
        for pool in self._pools:
            pools.add_metric([pool.name, pool.model or "*", pool.policy.name], 1)
            for name in sorted(pool.members):
                replicas.add_metric([name, pool.name], 1)
        yield pools
        yield replicas
