"""The routing core every live front end shares: the HTTP router and the endpoint picker.

It holds what a decision needs and keeps it current: the replica registry with its probes and
metric scrapes, the model catalog, and per model pool (router/pools.py; one for a config
without ``pools:``) the prefix index fed by its replicas' KV events, the prompt keys
(tokenizer, block size, adapters), the policy and the dispatch ledger. A front end finds the
request's pool (``pools.for_model``) and calls its ``ledger.route`` / ``dispatch`` /
``first_token`` / ``finish`` and nothing else of it for the request path; it may change the
fleet (``set_replicas``) when discovery says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from kvroute.health.canary import CanaryRunner, CanarySettings
from kvroute.health.probe import ActiveProber
from kvroute.health.scrape import MetricsScraper
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.token_path import PROBE_MESSAGES, ReplicaTokenPath
from kvroute.kvcore.tokenizer import ChatTemplateError
from kvroute.policies import FleetView, Policy, ReplicaState

from .config import Config, ReplicaConfig, replica_name_from_url
from .dp_ranks import expand_ranks, replica_of
from .kv_subscriber import KVEventSubscribers
from .lora_spread import LoraSpreader
from .pipeline import ModelCatalog
from .pool_config import pool_specs
from .pools import OffsetLoad, PoolRouting, Pools
from .prompt_keys import PromptKeys
from .prompt_tokenizer import PromptTokenizer
from .registry import RegistryHooks, ReplicaRegistry
from .warm_start import SnapshotPublisher, warm_start
from .workers import WorkerLoad

log = logging.getLogger(__name__)


class RoutingCore:
    def __init__(
        self,
        config: Config,
        hooks: RegistryHooks,
        shared: WorkerLoad | None = None,
        *,
        forwards: bool = True,
    ) -> None:
        """``forwards``: this router sends requests to the replicas itself (kvroute serve);
        the endpoint picker only picks (the gateway forwards the client's body), so tokens
        sent once (routing.send_tokens) are nothing to it."""
        self.config = config
        routing = config.routing
        specs = pool_specs(config)
        replicas = [r for spec in specs for r in spec.replicas]
        # One registry for every pool's replicas, pool by pool (the workers' load board's rows).
        self.registry = ReplicaRegistry(config, hooks, replicas)
        self.fleet: FleetView = self.registry.fleet
        # The fleet as configured now, by name: what ``add_replica``/``remove_replica`` change.
        self.members: dict[str, ReplicaConfig] = dict(
            zip(self.registry.handles, replicas, strict=True)
        )
        states = [h.state for h in self.registry.handles.values()]
        pools, first = [], 0
        for spec in specs:
            count = len(spec.replicas)
            # Which replica holds which prefix blocks (the replicas' own KV events, plus
            # predictions for requests just routed), the keys and the ledger: per pool.
            pool = PoolRouting(
                spec,
                states[first : first + count],
                prediction_ttl_s=routing.prediction_ttl_s,
                shared=OffsetLoad(shared, first) if shared is not None and first else shared,
                send_tokens=forwards and spec.routing.send_tokens,
            )
            pools.append(pool)
            first += count
        self.pools = Pools(pools)
        members = iter(self.members.items())
        for pool, spec in zip(pools, specs, strict=True):
            for _ in spec.replicas:
                name, replica = next(members)
                self.pools.assign(name, pool)
                pool.follow_events(name, replica)
        self.prober = ActiveProber(
            lambda: list(self.registry.handles.values()),
            path=config.health.path,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
            unhealthy_after=config.health.unhealthy_after,
            on_change=self._probed,
            check_generate=any(pool.send_tokens for pool in pools),
            renders_alike=self._renders_alike,
            wants_token_path=self._wants_token_path,
        )
        self.scraper = MetricsScraper(
            lambda: list(self.registry.handles.values()),
            interval_s=routing.scrape_interval_s,
            timeout_s=config.health.timeout_s,
            on_block_size=self._scraped_block_size,
        )
        # With pools, clients ask for the pools' models, and for no other.
        self.catalog = ModelCatalog(config.models or [p.model for p in config.pools])
        # The output-drift canary (canary: in the config), None when off.
        self.canary = _canary(config, self) if config.canary.enabled else None
        # Hot LoRA adapters loaded on more replicas (lora.spread), None when off.
        self.lora_spreader = _lora_spreader(config, self) if config.lora.spread else None
        self._expiry: asyncio.Task[None] | None = None
        # Puts the index in NATS for routers that start later (warm_start.nats_url).
        self.snapshot_publisher: SnapshotPublisher | None = None

    # The single pool's parts, for the endpoint picker (one InferencePool, one pool) and
    # tests; with several pools they raise: a request's pool is ``pools.for_model``.

    @property
    def index(self) -> PrefixIndex:
        return self.pools.sole.index

    @property
    def keys(self) -> PromptKeys:
        return self.pools.sole.keys

    @property
    def policy(self) -> Policy:
        return self.pools.sole.policy

    @property
    def ledger(self) -> DispatchLedger:
        return self.pools.sole.ledger

    @property
    def kv_events(self) -> KVEventSubscribers:
        return self.pools.sole.kv_events

    @property
    def tokenizer(self) -> PromptTokenizer | None:
        return self.keys.tokenizer

    def block_size(self) -> int:
        return self.keys.block_size()

    async def start(self) -> None:
        # A warm start loads the index before any KV event is followed, and after the first
        # probes and scrapes have told this router its model, tokenizer and block size.
        settings = self.config.warm_start
        warm = bool(settings.peers or settings.nats_url)
        for pool in self.pools:
            pool.keys.start()
            if not warm:
                pool.kv_events.start_all()
        await self.prober.probe_all()
        self.prober.start()
        await self.scraper.scrape_all()
        self.scraper.start()
        if warm:
            await warm_start(list(self.pools), settings, self.config.auth.admin_api_key)
            for pool in self.pools:
                pool.kv_events.start_all()
        if settings.nats_url is not None:
            self.snapshot_publisher = SnapshotPublisher(list(self.pools), settings)
            self.snapshot_publisher.start()
        if self.canary is not None:
            self.canary.start()
        if self.lora_spreader is not None:
            self.lora_spreader.start()
        self._expiry = asyncio.create_task(self._expire_predictions(), name="kvroute-expiry")

    async def _expire_predictions(self) -> None:
        """Predictions leave as they come due, in small batches, not all on one request."""
        every_s = max(0.05, min(0.5, self.config.routing.prediction_ttl_s / 8))
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for pool in self.pools:
                pool.ledger.expire_predictions(now)

    async def close(self) -> None:
        if self.snapshot_publisher is not None:
            await self.snapshot_publisher.close()
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.prober.close()
        await self.scraper.close()
        if self.canary is not None:
            await self.canary.close()
        if self.lora_spreader is not None:
            await self.lora_spreader.close()
        for pool in self.pools:
            await pool.close()

    # -- membership ---------------------------------------------------------------------

    async def set_replicas(
        self, replicas: Sequence[ReplicaConfig], *, ready: bool, pool: str | None = None
    ) -> None:
        """Discovery changed the fleet: follow the new replicas' events, forget the gone ones'.

        ``replicas`` are now all of ``pool``'s (the only pool when None); other pools keep
        theirs. ``ready``: the new replicas are known to be ready (Kubernetes readiness) and
        take traffic at once; otherwise they join on their first passing probe.
        """
        target = self._pool(pool)
        by_name = {r.name or replica_name_from_url(r.url): r for r in expand_ranks(replicas)}
        others = {n: r for n, r in self.members.items() if self.pools.of_replica(n) is not target}
        clash = sorted(by_name.keys() & others.keys())
        if clash:
            raise ValueError(f"replica {clash[0]} is in another pool already")
        self.members = {**others, **by_name}
        added, removed = self.registry.replace(list(self.members.values()), ready=ready)
        if not added and not removed:
            return
        # Before anything awaits: no decision may see a replica the registry has dropped.
        left = [(handle, self.pools.unassign(handle.name)) for handle in removed]
        for handle in added:
            self.pools.assign(handle.name, target)
        self._regroup()
        for handle, owner in left:
            self.scraper.forget(handle.name)
            self.prober.forget(handle.name)
            if self.lora_spreader is not None:
                self.lora_spreader.forget(handle.name)
            if owner is not None:
                await owner.forget(handle.name)  # its cache is nobody's now
        for handle in added:
            replica = by_name.get(handle.name)
            if replica is not None:
                target.follow_events(handle.name, replica)
        log.info(
            "fleet changed: +%s -%s (%d replicas)",
            ",".join(h.name for h in added) or "none",
            ",".join(h.name for h in removed) or "none",
            len(self.registry),
        )
        self._probed()

    def _pool(self, name: str | None) -> PoolRouting:
        if name is None:
            return self.pools.sole
        pool = self.pools.named(name)
        if pool is None:
            raise ValueError(f"no model pool named {name!r}")
        return pool

    def _regroup(self) -> None:
        """Each pool's ledger sees its replicas as the registry now lists them."""
        grouped: dict[str, list[ReplicaState]] = {p.name: [] for p in self.pools}
        for name, handle in self.registry.handles.items():
            owner = self.pools.of_replica(name)
            if owner is not None:
                grouped[owner.name].append(handle.state)
        for pool in self.pools:
            pool.set_states(grouped[pool.name])

    async def add_replica(
        self, replica: ReplicaConfig, *, ready: bool, pool: str | None = None
    ) -> None:
        """One more replica in ``pool`` (the only one when None): the admin API, a rollout,
        the autoscaler; ``ready`` as in set_replicas."""
        target = self._pool(pool)
        mine = [r for n, r in self.members.items() if self.pools.of_replica(n) is target]
        await self.set_replicas([*mine, replica], ready=ready, pool=target.name)

    async def remove_replica(self, name: str) -> None:
        """``name`` leaves the fleet: its handle, index entries, probes and KV events (a
        data-parallel replica's: every rank's)."""
        gone = {n for n in self.members if n == name or replica_of(n) == name}
        owner = next((self.pools.of_replica(n) for n in gone), None)
        if owner is None:
            return
        mine = [
            r
            for n, r in self.members.items()
            if n not in gone and self.pools.of_replica(n) is owner
        ]
        await self.set_replicas(mine, ready=False, pool=owner.name)

    def follows_events(self, name: str) -> bool:
        """Whether the index hears ``name``'s KV events."""
        pool = self.pools.of_replica(name)
        return pool is not None and name in pool.subscribers

    def clear_cached(self, name: str) -> None:
        """Nothing prefers ``name`` for its cache any more (a drain starts)."""
        pool = self.pools.of_replica(name)
        if pool is not None:
            pool.index.clear_replica(name)

    def _scraped_block_size(self, name: str, block_size: int) -> None:
        pool = self.pools.of_replica(name)
        if pool is not None:
            pool.keys.on_scraped_block_size(name, block_size)

    def _probed(self) -> None:
        """A probe changed something: who is in rotation, the tokenizers, adapters, models."""
        self.registry.probed()
        roots, adapters = self.prober.model_roots, self.prober.lora_adapters
        for pool in self.pools:
            # Only the pool's own replicas say what its model's tokenizer and adapters are.
            names = [s.replica_id for s in pool.fleet.replicas]
            pool.keys.discover(roots[n] for n in names if n in roots)
            pool.keys.lora_adapters = frozenset().union(
                *(adapters.get(n, frozenset()) for n in names)
            )
            if pool.send_tokens:
                paths = self.prober.token_paths
                live = any(p is not None for n in names for p in paths.get(n, {}).values())
                pool.token_path_live = live
                pool.keys.tokens_wanted(live)
        known: set[str] = set()
        for state in self.fleet.replicas:
            known.update(state.models or ())
        self.catalog.update(known)
        if self.canary is not None:
            self.canary.replicas_changed()

    def _wants_token_path(self, model: str) -> bool:
        pool = self.pools.for_model(model)
        return pool is not None and pool.send_tokens and pool.keys.tokenizer is not None

    def _renders_alike(self, model: str, replica_ids: list[int]) -> bool | None:
        """Whether the router's tokenizer for ``model`` gives the replica's ids for the probe's
        conversation (kvcore/token_path.PROBE_MESSAGES), rendered as a chat request; None
        while it has none (one discovered from the replicas comes after their first probe)."""
        pool = self.pools.for_model(model)
        tokenizer = pool.keys.tokenizer if pool is not None else None
        if tokenizer is None:
            return None
        messages = [dict(m) for m in PROBE_MESSAGES]
        try:
            text = tokenizer.render_chat(messages, {}, incremental=False)
        except ChatTemplateError:
            return False
        return tokenizer.tokenizer.encode(text, add_special_tokens=False) == replica_ids

    def token_path(self, replica: str, model: str) -> ReplicaTokenPath | None:
        """Where ``replica`` takes ``model``'s requests as token ids (routing.send_tokens):
        its context length and sampling defaults; None: send it text."""
        return self.prober.token_paths.get(replica, {}).get(model)

    def scrape_ages(self, now: float | None = None) -> dict[str, float]:
        """Seconds since each replica's metrics were last scraped successfully."""
        now = time.monotonic() if now is None else now
        return {name: now - at for name, at in self.scraper.scraped_at.items()}


def _lora_spreader(config: Config, core: RoutingCore) -> LoraSpreader:
    def base_url(name: str) -> str | None:
        handle = core.registry.handles.get(name)
        return handle.base_url if handle is not None else None

    return LoraSpreader(
        config.lora.settings(),
        lambda: [pool.fleet.replicas for pool in core.pools],
        base_url,
        core.prober.probe_all,
        interval_s=config.lora.interval_s,
        timeout_s=max(config.health.timeout_s, 30.0),
    )


def _canary(config: Config, core: RoutingCore) -> CanaryRunner:
    c = config.canary
    settings = CanarySettings(
        interval_s=c.interval_s,
        prompts=tuple(c.prompts),
        max_tokens=c.max_tokens,
        min_margin=c.min_margin,
        seed=c.seed,
        timeout_s=c.timeout_s,
        fingerprint_file=c.fingerprint_file,
    )
    return CanaryRunner(
        lambda: list(core.registry.handles.values()),
        settings,
        adapters=lambda name: core.prober.lora_adapters.get(name, frozenset()),
        on_change=core.registry.probed,
    )
