"""The routing core every live front end shares: the HTTP router and the endpoint picker.

It holds what a decision needs and keeps it current: the prefix index fed by the replicas' KV
events, the prompt keys (tokenizer, block size, adapters), the replica registry with its
probes and metric scrapes, the model catalog, the policy and the dispatch ledger. A front end
calls ``ledger.route`` / ``dispatch`` / ``first_token`` / ``finish`` and nothing else of it for
the request path; it may change the fleet (``set_replicas``) when discovery says so.
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
from kvroute.policies import FleetView, Policy, build_policy

from .config import Config, ReplicaConfig, policy_params, replica_name_from_url
from .kv_subscriber import KVEventSubscriber, KVEventSubscribers
from .pipeline import ModelCatalog
from .prompt_keys import PromptKeys
from .prompt_tokenizer import PromptTokenizer
from .registry import RegistryHooks, ReplicaRegistry
from .workers import WorkerLoad

log = logging.getLogger(__name__)


class RoutingCore:
    def __init__(
        self, config: Config, hooks: RegistryHooks, shared: WorkerLoad | None = None
    ) -> None:
        self.config = config
        routing = config.routing
        # Which replica holds which prefix blocks: the replicas' own KV events, plus
        # predictions for requests just routed (all a replica without events has).
        self.index = PrefixIndex()
        self.policy: Policy = build_policy(config.policy.name, policy_params(config))
        self.keys = PromptKeys(routing, self.index, self.policy.reads_prefixes)
        self.kv_events = KVEventSubscribers(self.index)
        self._subscribers: dict[str, KVEventSubscriber] = {}
        self.registry = ReplicaRegistry(config, hooks)
        self.fleet: FleetView = self.registry.fleet
        # The fleet as configured now, by name: what ``add_replica``/``remove_replica`` change.
        self.members: dict[str, ReplicaConfig] = dict(
            zip(self.registry.handles, config.replicas, strict=True)
        )
        for name, replica in zip(self.registry.handles, config.replicas, strict=True):
            self._follow_events(name, replica)
        self.ledger = DispatchLedger(
            self.policy,
            self.fleet,
            self.index,
            prediction_ttl_s=routing.prediction_ttl_s,
            shared=shared,
        )
        self.prober = ActiveProber(
            lambda: list(self.registry.handles.values()),
            path=config.health.path,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
            unhealthy_after=config.health.unhealthy_after,
            on_change=self._probed,
        )
        self.scraper = MetricsScraper(
            lambda: list(self.registry.handles.values()),
            interval_s=routing.scrape_interval_s,
            timeout_s=config.health.timeout_s,
            on_block_size=self.keys.on_scraped_block_size,
        )
        self.catalog = ModelCatalog(config.models)
        # The output-drift canary (canary: in the config), None when off.
        self.canary = _canary(config, self) if config.canary.enabled else None
        self._expiry: asyncio.Task[None] | None = None

    @property
    def tokenizer(self) -> PromptTokenizer | None:
        return self.keys.tokenizer

    def block_size(self) -> int:
        return self.keys.block_size()

    async def start(self) -> None:
        self.kv_events.start_all()
        self.keys.start()
        await self.prober.probe_all()
        self.prober.start()
        await self.scraper.scrape_all()
        self.scraper.start()
        if self.canary is not None:
            self.canary.start()
        self._expiry = asyncio.create_task(self._expire_predictions(), name="kvroute-expiry")

    async def _expire_predictions(self) -> None:
        """Predictions leave as they come due, in small batches, not all on one request."""
        every_s = max(0.05, min(0.5, self.config.routing.prediction_ttl_s / 8))
        while True:
            await asyncio.sleep(every_s)
            self.ledger.expire_predictions(time.monotonic())

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.prober.close()
        await self.scraper.close()
        if self.canary is not None:
            await self.canary.close()
        await self.kv_events.close_all()
        self.keys.close()

    # -- membership ---------------------------------------------------------------------

    async def set_replicas(self, replicas: Sequence[ReplicaConfig], *, ready: bool) -> None:
        """Discovery changed the fleet: follow the new replicas' events, forget the gone ones'.

        ``ready``: the new replicas are known to be ready (Kubernetes readiness) and take
        traffic at once; otherwise they join on their first passing probe.
        """
        by_name = {r.name or replica_name_from_url(r.url): r for r in replicas}
        self.members = dict(by_name)
        added, removed = self.registry.replace(replicas, ready=ready)
        if not added and not removed:
            return
        self.ledger.members_changed()
        for handle in removed:
            self.index.clear_replica(handle.name)  # its cache is nobody's now
            self.scraper.forget(handle.name)
            self.prober.forget(handle.name)
            subscriber = self._subscribers.pop(handle.name, None)
            if subscriber is not None:
                await self.kv_events.remove(subscriber)
        for handle in added:
            replica = by_name.get(handle.name)
            if replica is not None:
                self._follow_events(handle.name, replica)
        log.info(
            "fleet changed: +%s -%s (%d replicas)",
            ",".join(h.name for h in added) or "none",
            ",".join(h.name for h in removed) or "none",
            len(self.registry),
        )
        self._probed()

    async def add_replica(self, replica: ReplicaConfig, *, ready: bool) -> None:
        """One more replica (admin API, rollout, autoscaler); ``ready`` as in set_replicas."""
        await self.set_replicas([*self.members.values(), replica], ready=ready)

    async def remove_replica(self, name: str) -> None:
        """``name`` leaves the fleet: its handle, index entries, probes and KV events."""
        await self.set_replicas([r for n, r in self.members.items() if n != name], ready=False)

    def follows_events(self, name: str) -> bool:
        """Whether the index hears ``name``'s KV events."""
        return name in self._subscribers

    def _follow_events(self, name: str, replica: ReplicaConfig) -> None:
        if replica.kv_events:
            self._subscribers[name] = self.kv_events.add(name, replica.kv_events, replica.kv_replay)

    def _probed(self) -> None:
        """A probe changed something: who is in rotation, the tokenizer, adapters, models."""
        self.registry.probed()
        self.keys.discover(self.prober.model_roots.values())
        self.keys.lora_adapters = frozenset().union(*self.prober.lora_adapters.values())
        known: set[str] = set()
        for state in self.fleet.replicas:
            known.update(state.models or ())
        self.catalog.update(known)
        if self.canary is not None:
            self.canary.replicas_changed()

    def scrape_ages(self, now: float | None = None) -> dict[str, float]:
        """Seconds since each replica's metrics were last scraped successfully."""
        now = time.monotonic() if now is None else now
        return {name: now - at for name, at in self.scraper.scraped_at.items()}


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
