"""Data-parallel replicas whose rank vLLM picks: the router sees replicas, not ranks.

``FleetConfig.replicas`` engines, ``data_parallel_size`` to a replica. The router's policy
decides over the replicas (``r0``, ``r1``, ...) with no KV events, on its own predictions (what a
data-parallel fleet got before the router routed ranks: ``kv_events: false``); the rank is then
vLLM's pick (``simulator/engine/dp_balance.py``: fewest requests in flight, waiting weighed up
on a nearly full cache, ties rotating), which knows nothing of cached prefixes. Scrapes report a
replica's queue as its ranks' sum and its KV usage as their mean, as vLLM's metrics do summed
over engines. With ``rank_routing`` "router" no subclass is needed: each rank is an endpoint of
its own, so the fleet is ``replicas`` single-rank replicas.
"""

from __future__ import annotations

from kvroute.policies import Policy
from kvroute.simulator.engine.dp_balance import DPBalancer, RankLoad

from .batch import BatchJob
from .config import FleetConfig
from .fleet import _Fleet
from .kv_units import IndexOp
from .protocol import StepReport
from .units import SimRequest, UnitTrace


class VllmRankFleet(_Fleet):
    def __init__(
        self,
        trace: UnitTrace,
        policy: Policy,
        config: FleetConfig,
        batch: tuple[BatchJob, tuple[SimRequest, ...]] | None = None,
    ) -> None:
        if batch is not None:
            raise ValueError("rank_routing vllm is not modelled with a batch job")
        self.ranks = config.data_parallel_size
        self.balancers = [DPBalancer() for _ in range(config.replicas // self.ranks)]
        self.in_flight = [0] * config.replicas  # per engine, as vLLM's client counts them
        super().__init__(trace, policy, config, batch)
        for router in self.routers:  # a replica's cache is its ranks' together
            for state in router.states:
                state.kv_capacity_tokens = config.kv_capacity_tokens * self.ranks

    def _replica_names(self) -> list[str]:
        return [f"r{i}" for i in range(self.config.replicas // self.ranks)]

    def _engine_for(self, chosen: str) -> int:
        first = self.number[chosen] * self.ranks
        loads = []
        for e in range(first, first + self.ranks):
            waiting = self.engines[e].num_waiting
            loads.append(
                RankLoad(waiting, max(0, self.in_flight[e] - waiting), self.engines[e].kv_usage)
            )
        return first + self.balancers[self.number[chosen]].pick(loads)

    def _enqueue(self, r: int, request: SimRequest, extra: int, t: float) -> None:
        self.in_flight[r] += 1
        super()._enqueue(r, request, extra, t)

    def _take_report(self, r: int, report: StepReport, t: float) -> None:
        self.in_flight[r] -= len(report.finished)
        super()._take_report(r, report, t)

    def _apply_ops(self, r: int, ops: list[IndexOp]) -> None:
        """No KV events reach the router: it routes on its predictions alone."""

    def _scrape(self) -> None:
        for i in range(len(self.names)):
            engines = self.engines[i * self.ranks : (i + 1) * self.ranks]
            waiting = sum(e.num_waiting for e in engines)
            usage = sum(e.kv_usage for e in engines) / len(engines)
            for router in self.routers:
                router.states[i].reported_waiting = waiting
                router.states[i].reported_kv_usage = usage
