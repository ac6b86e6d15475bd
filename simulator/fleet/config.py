"""How a simulated fleet is built: replicas, their engine, and the router's timings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvroute.kvcore.autoscale import AutoscaleSettings
from kvroute.simulator.engine.config import EngineConfig, OffloadTier
from kvroute.simulator.engine.latency import LatencyModel

from .admission import AdmissionSpec
from .batch import CapacityDip
from .pd_setup import PdSetup

ENGINE_MODELS = ("fast", "exact")
# What several routers (endpoint pickers behind one gateway) share beyond the KV events that
# every one of them subscribes to (see FleetConfig.share).
SHARE_MODES = ("none", "scrape", "bus", "load")
RANK_ROUTINGS = ("router", "vllm")

# GPU memory per device, for the default KV capacity of a preset (name fragment -> bytes).
_GPU_MEMORY = {"h100": 80e9, "h200": 141e9, "a100": 80e9}
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
TINY_CPU_KV_TOKENS = 64 * 32  # what the real-vLLM tests give the tiny model (64 blocks of 32)


def default_kv_capacity_tokens(latency: LatencyModel) -> int:
    """KV tokens one replica holds: vLLM's share of GPU memory, less the weights.

    Activation memory is ignored (a few GiB on these models): a slight overestimate.
    """
    memory = next((m for frag, m in _GPU_MEMORY.items() if frag in latency.name), None)
    if memory is None:
        return TINY_CPU_KV_TOKENS
    free = memory * latency.num_gpus * GPU_MEMORY_UTILIZATION - latency.weight_bytes
    return max(1, int(free // latency.kv_bytes_per_token))


@dataclass(frozen=True)
class FleetConfig:
    """A fleet of identical replicas behind one simulated router, or several.

    ``routers`` > 1: that many pickers behind a load balancer (request i goes to picker
    i % routers), each with its own prefix index, load accounting and predictions, all fed
    every replica's KV events. ``share`` says what else they learn of each other's traffic:
    ``none``, the replicas' queue depth scraped every ``scrape_interval_s``; ``scrape``, the
    same scraped every ``share_scrape_interval_s`` instead; ``bus``, every dispatch, first
    token and finish (load and predictions) published to the others ``bus_lag_s`` later;
    ``load``, in-flight load summed over the routers at once, predictions each its own (the
    workers of ``kvroute serve --workers N``, simulator/fleet/shared_load.py).

    ``pd``: a disaggregated fleet of ``pd.prefill`` + ``pd.decode`` = ``replicas`` replicas
    (simulator/fleet/pd_fleet.py).
    """

    replicas: int
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_model: str = "fast"  # "fast" (unit-granular, decode runs) or "exact" (simulator.engine)
    event_lag_s: float = 0.01  # KV events reach the router's index this long after their step
    scrape_interval_s: float = 1.0  # how often replicas' queue depth and KV usage are read
    prediction_ttl_s: float = 10.0  # the router's routing.prediction_ttl_s
    failures: tuple[tuple[int, float], ...] = ()  # (replica index, time in s): removed then
    routers: int = 1  # pickers in front of the fleet, each with its own ledger and index
    share: str = "none"  # what the pickers share: one of SHARE_MODES
    share_scrape_interval_s: float = 0.05  # share="scrape": the Gateway API picker's interval
    bus_lag_s: float = 0.001  # share="bus": publish to delivery (pub/sub on a LAN)
    # An autoscaler (kvcore/autoscale.py) over ``replicas`` = its max: ``autoscale.min`` serve
    # from the start, the rest are off until it starts them (``startup_s`` later they serve).
    autoscale: AutoscaleSettings | None = None
    startup_s: float = 60.0  # a started replica loads its model this long before it serves
    # Part of the fleet gone for a while (its requests resume elsewhere), back with empty caches.
    dip: CapacityDip | None = None
    pd: PdSetup | None = None
    # The router's admission limit and fair queue in front of the fleet (admission.py).
    admission: AdmissionSpec | None = None
    # Agents wait for their answers: a request with a recorded gap (TraceRequest.gap_s) is sent
    # that long after its session's previous response ends, not at its recorded time.
    closed_loop: bool = False
    # With closed_loop: this many agent programs at a time, each replaced by the next when it
    # ends (program_starts.py), instead of the sessions' recorded start times. None: recorded.
    programs_in_flight: int | None = None
    # A mixed pool: replica i steps at ``replica_latency[i]`` instead of ``engine.latency``
    # (one per replica, or () for all alike). KV capacity and batching stay ``engine``'s.
    replica_latency: tuple[LatencyModel, ...] = ()
    # Tell the router each replica's speed (``replicas[].speed``): its prefill pace against
    # ``engine``'s, so its latency lines start there rather than at the fleet's prior.
    tell_speeds: bool = False
    # Data-parallel replicas (dp_fleet.py): ``replicas`` engines (ranks) in all, this many to a
    # replica. ``rank_routing`` "router": the router picks the rank (each rank its own endpoint,
    # as kvroute routes DP replicas: the same as single-rank replicas); "vllm": the router picks
    # the replica only, without KV events (what DP got before ranks), vLLM's balancer the rank.
    data_parallel_size: int = 1
    rank_routing: str = "router"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_latency and len(self.replica_latency) != self.replicas:
            raise ValueError(
                f"replica_latency: one latency model per replica ({self.replicas}), got "
                f"{len(self.replica_latency)}"
            )
        if self.replica_latency and self.pd is not None:
            raise ValueError("a mixed pool (replica_latency) is not modelled with P/D")
        self._check_ranks()
        if self.replica_latency and self.data_parallel_size > 1:
            raise ValueError("a mixed pool (replica_latency) is not modelled with DP ranks")
        if isinstance(self.routers, bool) or not isinstance(self.routers, int):
            raise ValueError(f"routers must be an integer >= 1, got {self.routers!r}")
        if self.routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.routers}")
        if self.share not in SHARE_MODES:
            raise ValueError(f"share must be one of {', '.join(SHARE_MODES)}, got {self.share!r}")
        if self.engine_model not in ENGINE_MODELS:
            raise ValueError(
                f"engine model must be one of {', '.join(ENGINE_MODELS)}, got {self.engine_model!r}"
            )
        for label, value in (
            ("event_lag_s", self.event_lag_s),
            ("scrape_interval_s", self.scrape_interval_s),
            ("prediction_ttl_s", self.prediction_ttl_s),
            ("share_scrape_interval_s", self.share_scrape_interval_s),
            ("bus_lag_s", self.bus_lag_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be a finite number >= 0, got {value}")
        if self.scrape_interval_s == 0:
            raise ValueError("scrape_interval_s must be > 0")
        if self.programs_in_flight is not None:
            if self.programs_in_flight < 1:
                raise ValueError(f"programs in flight must be >= 1, got {self.programs_in_flight}")
            if not self.closed_loop:
                raise ValueError("programs in flight: a closed loop's (closed_loop) only")
        if self.autoscale is not None:
            problems = self.autoscale.problems()
            if self.autoscale.max != self.replicas:
                problems.append(
                    f"autoscale.max: the fleet's replicas ({self.replicas}) are its max, got "
                    f"{self.autoscale.max}"
                )
            if not (math.isfinite(self.startup_s) and self.startup_s >= 0):
                problems.append(f"startup_s: must be a number >= 0, got {self.startup_s}")
            if problems:
                raise ValueError("; ".join(problems))
        if self.share_scrape_interval_s == 0:
            raise ValueError("share_scrape_interval_s must be > 0")
        if self.dip is not None:
            problems = self.dip.problems()
            if self.autoscale is not None:
                problems.append("dip: not modelled with an autoscaler (it would replace them)")
            if problems:
                raise ValueError("; ".join(problems))
        if self.pd is not None:
            self._check_pd(self.pd)
        for replica, at in self.failures:
            if not 0 <= replica < self.replicas:
                raise ValueError(
                    f"cannot fail replica {replica}: replicas are numbered 0..{self.replicas - 1}"
                )
            if not (math.isfinite(at) and at >= 0):
                raise ValueError(f"failure time must be a finite number >= 0, got {at}")

    def _check_ranks(self) -> None:
        size = self.data_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {size!r}")
        if self.replicas % size:
            raise ValueError(
                f"replicas ({self.replicas}, ranks in all) must be a multiple of "
                f"data_parallel_size {size}"
            )
        if self.rank_routing not in RANK_ROUTINGS:
            raise ValueError(
                f"rank_routing must be one of {', '.join(RANK_ROUTINGS)}, got {self.rank_routing!r}"
            )
        if size > 1 and self.rank_routing == "vllm":
            unmodelled = [
                name
                for name, on in (
                    ("failures", bool(self.failures)),
                    ("a capacity dip", self.dip is not None),
                    ("an autoscaler", self.autoscale is not None),
                    ("P/D", self.pd is not None),
                    ("several routers", self.routers > 1),
                )
                if on
            ]
            if unmodelled:
                raise ValueError(f"rank_routing vllm is not modelled with {', '.join(unmodelled)}")

    def _check_pd(self, pd: PdSetup) -> None:
        problems = pd.problems()
        if pd.replicas != self.replicas:
            problems.append(
                f"replicas: a P/D fleet has prefill + decode = {pd.replicas}, got {self.replicas}"
            )
        # What the P/D fleet does not model (yet): each would need its own rules for two pools.
        for what, present in (
            ("the exact engine model (the fast one moves KV)", self.engine_model != "fast"),
            ("several routers", self.routers != 1),
            ("an autoscaler", self.autoscale is not None),
            ("a capacity dip", self.dip is not None),
            ("replica failures", bool(self.failures)),
            ("an admission limit", self.admission is not None),
            ("closed-loop sessions", self.closed_loop),
        ):
            if present:
                problems.append(f"{what}: not modelled with P/D disaggregation")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def scrape_every_s(self) -> float:
        """How often the routers read the replicas' queue depth and KV usage."""
        return self.share_scrape_interval_s if self.share == "scrape" else self.scrape_interval_s

    def engine_of(self, replica: int) -> EngineConfig:
        """Replica ``replica``'s engine: ``engine`` at its own latency in a mixed pool."""
        if not self.replica_latency:
            return self.engine
        return replace(self.engine, latency=self.replica_latency[replica])

    def speeds(self) -> list[float] | None:
        """Each replica's speed as told the router (None unless ``tell_speeds`` in a mixed pool:
        the router is told nothing): ``engine``'s seconds per prefill token over its own, as an
        operator would state its card."""
        if not (self.tell_speeds and self.replica_latency):
            return None
        base = self.engine.latency.latency_prior()["prefill_s_per_token"]
        return [base / m.latency_prior()["prefill_s_per_token"] for m in self.replica_latency]

    @property
    def mixed(self) -> bool:
        return len({m.name for m in self.replica_latency}) > 1

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.num_blocks * self.engine.block_size


def engine_config(
    latency: LatencyModel,
    kv_capacity_tokens: int | None = None,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
    offload: tuple[OffloadTier, ...] = (),
) -> EngineConfig:
    """One replica's engine: vLLM's defaults for online serving on a large GPU, unless given."""
    tokens = (
        kv_capacity_tokens
        if kv_capacity_tokens is not None
        else (default_kv_capacity_tokens(latency))
    )
    num_blocks = max(1, tokens // block_size)
    return EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=num_blocks * block_size,
        latency=latency,
        seed=seed,
        offload=offload,
    )
