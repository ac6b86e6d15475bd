"""The router's configuration: YAML on disk, validated into typed structs on load.

Every problem in a file is found, each naming its key path and the reason (an unknown key with
the closest valid one), and reported together as one ``ConfigError``, so ``kvroute
check-config`` and ``kvroute serve`` can print them all and exit 2 without a traceback.
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import yaml

from kvroute.backends.placement import (
    ParallelLayout,
    PlacementError,
    gpu_list_problems,
    parallel_layout,
    placement_requested,
)
from kvroute.backends.vllm_args import owned_flags_in
from kvroute.health.canary import DEFAULT_PROMPTS
from kvroute.kvcore.autoscale import AutoscaleSettings
from kvroute.kvcore.lora_spread import SpreadSettings
from kvroute.policies import DEFAULT_POLICY, PolicyConfigError, build_policy

from .batch.store import StoreUrlError, check_store_url
from .epp.h2_grpc import H2Limits


class ConfigError(Exception):
    """A configuration that cannot be used: one or more problems, each "key.path: reason".

    ``source`` (the file) prefixes the message; one problem reads as one line, several as a
    count and then one indented line each.
    """

    def __init__(self, *problems: str, source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(self._text())

    def _text(self) -> str:
        prefix = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return prefix + self.problems[0]
        return f"{prefix}{len(self.problems)} problems:" + "".join(
            f"\n  {p}" for p in self.problems
        )


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ListenConfig(_Section):
    host: str = "127.0.0.1"
    port: int = 8000
    # Router processes sharing the port (one event loop per core); they share load and metrics.
    workers: int = 1


class ReplicaConfig(_Section):
    url: str
    # A stable name for metrics and headers; defaults to host:port of the URL.
    name: str | None = None
    # The replica's ZMQ KV-event publisher and replay endpoints (vLLM --kv-events-config).
    kv_events: str | None = None
    kv_replay: str | None = None
    # vLLM's --data-parallel-size: the replica runs this many engine cores, each with its own
    # KV cache; the router routes to each rank (router/dp_ranks.py).
    data_parallel_size: int = 1
    # One rank of a data-parallel replica (set when the replica is expanded into its ranks;
    # in a file: this entry routes to that rank only, with ``kv_events`` as that rank's own).
    data_parallel_rank: int | None = None
    # Its speed against the others' (0.5: an older card, half as fast; 2: twice as fast):
    # where kv_aware's latency lines for it start (cost_unit time or speed, or an SLO) before
    # its own first answers teach them. 1: like the policy's prior.
    speed: float = 1.0


class LaunchConfig(_Section):
    """Replicas kvroute starts and manages itself."""

    engine: str = "emulated"  # emulated | vllm
    count: int = 2
    model: str = "tiny"  # the served model name clients ask for
    # vllm: the model directory (default: the tiny test model, built on first use).
    model_path: str | None = None
    # emulated: HF tokenizer files to tokenize with (default: the built-in tokenizer).
    tokenizer: str | None = None
    block_size: int = 32
    # KV capacity per replica, in blocks; null: 1024, except vLLM on GPUs, which sizes its KV
    # cache from gpu_memory_utilization.
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 64
    preset: str = "llama-3.1-8b-h100"  # emulated: latency model
    # emulated: one latency preset per replica (a mixed pool: count entries), over preset.
    presets: list[str] = msgspec.field(default_factory=list)
    time_scale: float = 1.0  # emulated: >1 runs slower than the modelled hardware
    kv_events: bool = True
    # Where launched replicas publish KV events: "ipc" (default) on Unix sockets in a directory
    # only this user can open, so other users of the host cannot read which prompts' blocks a
    # replica holds; "tcp" on TCP ports (emulated replicas bind them on launch.host; vLLM binds
    # every interface) for subscribers elsewhere.
    kv_events_bind: str = "ipc"
    # Batches each replica keeps for its replay socket (vLLM's --kv-events-config buffer_steps):
    # how far back a router that missed events (a restart, a warm start from a snapshot this
    # many engine steps old) can catch up; null: vLLM's 10,000.
    kv_replay_buffer: int | None = None
    host: str = "127.0.0.1"
    log_dir: str = "kvroute-logs"
    # How long the fleet's replicas may take to become ready when the router starts, and
    # after a crash; one added or replaced while serving gets rollout.readiness_timeout_s.
    startup_timeout_s: float = 300.0
    max_restarts: int = 5
    extra_args: list[str] = msgspec.field(default_factory=list)
    # GPU placement. None of these keys set: no GPUs, replicas inherit kvroute's environment.
    # gpus: the GPUs to share out (nvidia-smi's indices), or "auto" (found through NVML or
    # nvidia-smi); null: auto when any other GPU key is set.
    gpus: list[int] | str | None = None
    # tensor x pipeline x data parallel size; null: derived from them.
    gpus_per_replica: int | None = None
    # vLLM's parallel sizes within one replica; null: 1, except tensor_parallel_size, which is
    # what gpus_per_replica leaves over.
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    # vllm: the share of each GPU's memory vLLM may use; null: vLLM's default.
    gpu_memory_utilization: float | None = None


class PolicyConfig(_Section):
    name: str = DEFAULT_POLICY
    params: dict[str, Any] = msgspec.field(default_factory=dict)


class PoolConfig(_Section):
    """One model pool (``pools:``): the replicas serving one model name, routed among themselves
    with their own prefix index, tokenizer and policy (router/pool_config.py)."""

    name: str  # names its launched replicas ({name}-{engine}-{slot}) and its metrics
    model: str  # the served model name clients ask for; one pool per name
    replicas: list[ReplicaConfig] = msgspec.field(default_factory=list)
    launch: LaunchConfig | None = None
    # As routing.tokenizer and routing.block_size, for this pool's model; null: its launched
    # replicas', else discovered from its replicas.
    tokenizer: str | None = None
    block_size: int | None = None
    policy: PolicyConfig | None = None  # null: the top-level policy:
    # Prefill/decode disaggregation: a "prefill" pool and a "decode" pool serving one model
    # make a pair (router/disaggregation.py); null: an ordinary pool that does both.
    role: str | None = None
    # A role pool's vLLM --kv-transfer-config, passed to its launched replicas; null: NIXL
    # ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, kv_consumer on decode).
    kv_transfer_config: dict[str, Any] | None = None
    # A decode pool's rule for which requests go through a prefill replica first.
    disaggregate: DisaggregateConfig | None = None


class DisaggregateConfig(_Section):
    # conditional: split a request only when at least min_uncached_tokens of its prompt are
    # not cached on its decode replica; always; never (the prefill pool is left idle).
    mode: str = "conditional"
    min_uncached_tokens: int = 512


class SloConfig(_Section):
    # Per-request targets in seconds; kv_aware then prefers any replica predicted to meet both
    # and, among those, the one that keeps the fleet's cache best (null: no target).
    ttft_s: float | None = None
    tpot_s: float | None = None


class TimeoutsConfig(_Section):
    connect_s: float = 5.0
    # A streamed request's response headers, which vLLM sends as soon as it accepts the request
    # (before queueing and prefill). A replica that sends nothing in time is stalled: the request
    # goes to another replica and the stalled one is ejected.
    first_byte_s: float = 15.0
    # A stream's first token (queueing + prefill), or a whole non-streamed answer.
    first_token_s: float = 600.0
    # Longest silence between two chunks of a replica's response.
    idle_s: float = 600.0
    # Whole request, retries and resumed streams included; 0 = no limit.
    total_s: float = 1800.0
    # A client connection that completes no request for this long is closed: idle keep-alive
    # connections and clients that send their headers too slowly.
    client_idle_s: float = 60.0
    # Longest time to receive a request body once its headers are in (slow clients get 408).
    client_body_s: float = 30.0


class RetryConfig(_Section):
    """Trying another replica when one fails before its answer reaches the client."""

    # Replicas tried per request (1 = no retries): connect errors, timeouts, 5xx, 408 and 429.
    max_attempts: int = 3
    # Wait before retry k: a random fraction of min(backoff_max_s, backoff_base_s * 2**(k-1)).
    backoff_base_s: float = 0.025
    backoff_max_s: float = 1.0
    # No new attempt starts later than this after the request arrived.
    budget_s: float = 30.0
    # A stream that breaks after tokens were sent continues on another replica (prompt plus the
    # text already sent), spliced into the same client stream.
    resume_streams: bool = True
    max_resumes: int = 2


class BreakerConfig(_Section):
    """Per-replica circuit breaker: passive outlier detection from live traffic."""

    enabled: bool = True
    consecutive_failures: int = 5
    # Or: at least min_requests outcomes in window_s, failure_rate of them failures.
    failure_rate: float = 0.5
    min_requests: int = 20
    window_s: float = 10.0
    # Ejection time; doubles with each consecutive ejection, up to max_cooldown_s.
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    # Half-open: trial requests at a time, and successes needed to close.
    half_open_requests: int = 1
    close_after_successes: int = 2
    # Where every replica of a model is out of rotation and some of them only by their
    # breakers (their health checks pass), route to those anyway rather than fail every
    # request (Envoy's panic mode): overload trips breakers too.
    panic_routing: bool = True


class LimitsConfig(_Section):
    max_body_bytes: int = 8 * 1024 * 1024
    # Requests handled at once; 0 means no limit. Above it, up to max_queued_requests wait
    # (at most queue_timeout_s) for a slot; beyond that, 429 with Retry-After.
    max_concurrent_requests: int = 0
    max_queued_requests: int = 0
    queue_timeout_s: float = 30.0


class ApiKeyConfig(_Section):
    """A client key with the tenant it belongs to (its budgets, weight and priority)."""

    key: str
    tenant: str | None = None


class AuthConfig(_Section):
    """Bearer keys. A value "env:NAME" is read from the environment variable NAME."""

    # Keys clients must present (Authorization: Bearer KEY, or x-api-key: KEY as Anthropic's
    # clients send it) on /v1/*; empty = open. Each is a
    # string, or {key: ..., tenant: NAME} to name the tenant its requests belong to.
    api_keys: list[str | ApiKeyConfig] = msgspec.field(default_factory=list)
    # Key for /metrics, /admin/* and the /status data; null = /metrics is open, and /admin/*
    # answers loopback clients only, or nobody when api_keys is set.
    admin_api_key: str | None = None


class TenantDefaultsConfig(_Section):
    """What a tenant gets unless ``tenants.by_name`` says otherwise (0: no limit)."""

    weight: float = 1.0  # its share of a saturated fleet, relative to other tenants'
    priority: str = "standard"  # critical, standard or sheddable, unless a request says
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    max_concurrent: int = 0  # its requests in service at once


class TenantConfig(_Section):
    """One named tenant; a key left out takes its value from ``tenants.defaults``."""

    weight: float | None = None
    priority: str | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    max_concurrent: int | None = None


class TenantsConfig(_Section):
    defaults: TenantDefaultsConfig = msgspec.field(default_factory=TenantDefaultsConfig)
    by_name: dict[str, TenantConfig] = msgspec.field(default_factory=dict)
    # Tenant names from headers are the client's to choose: beyond this many distinct ones,
    # unknown names count as "default" (memory stays bounded).
    max_tracked: int = 1000
    # Several routers behind one load balancer enforce one budget per tenant: each shares its
    # charges over this NATS server (router/budget_bus.py). None: each process enforces its
    # own (its share with listen.workers).
    budget_bus: str | None = None
    budget_bus_subject: str = "kvroute.budgets"
    budget_bus_interval_s: float = 0.02


class FairnessConfig(_Section):
    """Who is admitted next when limits.max_concurrent_requests is reached (kvcore/fair_queue)."""

    # An output token costs this many input tokens of service (decode is dearer than prefill).
    output_weight: float = 2.0
    # Locality may admit a request whose prefix the freed replica holds ahead of strict fair
    # order while its tenant is at most this many weighted tokens ahead (0: strict order).
    locality_bound_tokens: float = 4096.0
    # Queued requests looked at per admission for locality.
    locality_scan: int = 32
    # A sheddable request waits at most this long for a slot, then gets 429.
    sheddable_max_wait_s: float = 5.0
    # Slots above limits.max_concurrent_requests for a request that is next in fair order anyway
    # while every slot is taken (a light tenant during a flood): it starts at once instead of
    # waiting for one to free; the next slots to free are not refilled until back under the
    # limit (kvcore/fair_queue.py). 0: it waits.
    reserved_slots: int = 3
    # x-gateway-inference-objective values (InferenceObjective names) -> priority class.
    objectives: dict[str, str] = msgspec.field(default_factory=dict)
    # Order within a tenant: "tenant" (arrival order) or "program": the agent program (a session
    # and its sub-agents, kvcore/agent_identity.py) that has received the least service goes
    # first (least attained service), so short programs are not stuck behind long ones.
    by: str = "tenant"
    # by: program: a request that has waited this long goes first whatever its program's
    # service (long programs are never starved).
    program_max_wait_s: float = 300.0
    # by: program: the order is this x the tokens a program has received, plus the request's own
    # prompt tokens no replica holds (a running program's cached next turn is cheap to serve).
    program_attained_weight: float = 0.05
    # by: program: the share of the waiting requests' wait in the order, beside their service,
    # each normalised over the queue (0: least service alone; llm-d's order is 0.2).
    program_wait_share: float = 0.0
    # by: program: programs whose service is remembered (the least recently served forgotten).
    max_programs: int = 65536
    # Several routers: count what the others served each tenant, over tenants.budget_bus (its
    # NATS link and charge messages; router/budget_bus.py), so a tenant spreading its requests
    # over N routers is not counted a Nth on each (by: program, what each program received
    # too). Needs tenants.budget_bus.
    share_bus: bool = False
    # With share_bus: the most the others' service puts a tenant ahead of the lowest tenant
    # waiting here (weighted tokens): what a router gone silent can distort, at most.
    share_max_lead_tokens: float = 32768.0
    # With share_bus: a request that has waited this long is admitted first (the oldest first),
    # whatever the counters: a tenant served elsewhere is ahead here, and its requests that land
    # here would otherwise wait while the others' backlog lasts. 0: no bound.
    share_max_wait_s: float = 10.0
    # Several routers: admit each tenant up to its part of the fleet's slots (the sum of the
    # routers' limits.max_concurrent_requests, heard over the budget bus), shared by weight over
    # the tenants with demand anywhere, and placed over the routers by each tenant's demand at
    # each (kvcore/fleet_slots.py): a tenant that sends to one router only may get more than
    # that router's limit, one spread over all of them is held to its share. Needs share_bus
    # (and so tenants.budget_bus), limits.max_concurrent_requests and share_max_wait_s > 0.
    # With no other router heard from, admission is this router's alone, as without it.
    share_slots: bool = False
    # With share_slots: a router admits at most this x its limits.max_concurrent_requests (the
    # same on every router): what the others' reports let it take beyond its own limit, bounded,
    # since a report is an interval old and a router's replicas may be its own. 2.5, not 2: a
    # tenant confined to one of 4 routers needs 2x that router's limit for its half of the fleet,
    # and the router keeps a slot for the other tenants' requests there (measured: 0.43 of the
    # service at 2, 0.50 at 2.5; BENCHMARKS.md "Tenants' fair shares over several routers").
    share_slots_max_factor: float = 2.5


class BatchConfig(_Section):
    """The batch lane (/v1/files, /v1/batches): its durable queue and when its lines run."""

    # sqlite:///PATH (one router, or the workers of one) or postgresql://USER@HOST/DB (several
    # routers sharing one queue); null: sqlite in ~/.local/state/kvroute/batches.sqlite3.
    store: str | None = None
    # A replica has spare capacity for batch lines while the router's requests in flight on it
    # are fewer than this (and no online request waits for admission).
    max_in_flight_per_replica: int = 4
    # An online request that has waited this long for admission aborts the newest running
    # batch line (it is re-queued); needs limits.max_concurrent_requests, so requests queue.
    preempt_after_s: float = 0.5
    # A job is paced to finish by this fraction of its window; lines it falls behind by run
    # in the standard class instead of waiting for spare capacity.
    pace_fraction: float = 0.8
    # How long a job's "24h" completion window really lasts (shorter for tests and drills).
    window_s: float = 86400.0
    # A line held by a router that stopped renewing (killed) is run again after this.
    lease_s: float = 15.0
    # How often the runner looks for work, finished jobs, cancellations and expiry.
    poll_s: float = 0.2
    # Tries of a line that fails for want of a replica (5xx, none healthy) before its error
    # is stored; answers the request itself caused (4xx) are stored at once.
    max_attempts: int = 3
    max_lines: int = 50000  # request lines in one input file
    max_file_bytes: int = 200 * 1024 * 1024  # one uploaded file


class ShutdownConfig(_Section):
    # On SIGTERM: stop accepting, let in-flight requests finish this long, then exit.
    drain_timeout_s: float = 30.0


class RolloutConfig(_Section):
    """Replacing and removing replicas while serving: rollouts, DELETE /admin/replicas and the
    autoscaler share these defaults (a rollout request may override them)."""

    # A replica leaving rotation gets this long to finish what it is serving; streams still
    # open then continue on another replica (resumed from the text already sent).
    drain_timeout_s: float = 30.0
    # A replacement or added replica must start, answer its health check (and pass the drift
    # canary, when canary: is on) within this; vLLM loading a large model takes minutes.
    readiness_timeout_s: float = 600.0
    # Replicas a rollout replaces at once.
    max_unavailable: int = 1


class AutoscaleConfig(_Section):
    """Launched replicas added and drained on the replicas' own queue and KV usage
    (kvcore/autoscale.py); needs launch:."""

    min: int = 1
    max: int = 8
    # Mean vllm:num_requests_waiting per serving replica above which replicas are added.
    target_queue_per_replica: float = 2.0
    # Mean KV-cache usage above which one is added; a replica is drained only when the others
    # would stay under kv_low without it.
    kv_high: float = 0.9
    kv_low: float = 0.6
    # How long the fleet must be quiet (no queue anywhere) before one replica is drained.
    scale_down_idle_s: float = 120.0
    interval_s: float = 10.0
    # 0: off. Else scale on the router's own requests in flight per serving replica instead of
    # the replicas' queue (a leading signal, kvcore/autoscale.py); one is drained when the
    # others would stay under in_flight_low of it.
    target_in_flight_per_replica: float = 0.0
    in_flight_low: float = 0.8

    def settings(self) -> AutoscaleSettings:
        return AutoscaleSettings(**msgspec.structs.asdict(self))


class LoraConfig(_Section):
    """LoRA adapters: a hot adapter is loaded on more replicas (kvcore/lora_spread.py)."""

    # Off by default: loading needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the replicas.
    spread: bool = False
    # The adapters the router may load: name -> path on the replicas (vLLM's lora_path).
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    # An adapter in use is hot when every replica serving it has this many requests in flight.
    hot_in_flight: int = 4
    cooldown_s: float = 30.0  # between two loads of one adapter
    min_residency_s: float = 300.0  # an adapter the router loaded stays at least this long
    idle_unload_s: float = 120.0  # ... and is unloaded once unused there this long
    max_replicas: int = 0  # an adapter on at most this many replicas (0: no limit)
    retry_after_s: float = 300.0  # a replica that refused a load is asked again after this
    interval_s: float = 2.0  # one look at the fleet this often

    def settings(self) -> SpreadSettings:
        fields = msgspec.structs.asdict(self)
        del fields["spread"], fields["interval_s"]
        return SpreadSettings(**fields)


class HealthConfig(_Section):
    path: str = "/health"
    interval_s: float = 5.0
    timeout_s: float = 5.0
    # Consecutive failed probes before a replica leaves rotation (a busy replica can miss one).
    unhealthy_after: int = 3


class CanaryConfig(_Section):
    """The output-drift canary (health/canary.py): fixed prompts, greedy, on every replica."""

    # Off unless asked for: it sends its own requests to the replicas (their request counts and
    # cache figures include them), and it assumes every replica serving a model name has the
    # same weights (a fleet mixing, say, quantized and full-precision replicas under one name
    # would see its minority quarantined).
    enabled: bool = False
    # A round every interval_s, and at once when a replica becomes healthy (start, restart).
    interval_s: float = 300.0
    prompts: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_PROMPTS))
    max_tokens: int = 16
    # A flip where either side's top-1 minus top-2 logprob is below this (nats) is a near-tie:
    # reported, not quarantined.
    min_margin: float = 0.5
    seed: int = 0
    timeout_s: float = 30.0
    # Where the fleet's answers are kept across restarts and deploys (null: in memory only).
    fingerprint_file: str | None = None


class RoutingConfig(_Section):
    """How the router sees prompts and caches: tokenizer, KV block size, predictions."""

    # The served model's tokenizer: a HuggingFace tokenizer directory (or tokenizer.json),
    # "builtin" for the emulated replica's built-in tokenizer, or null: the launched replicas'
    # (launch:), else the model directory a local replica reports in /v1/models, else none
    # (text prompts are then routed on load alone).
    tokenizer: str | None = None
    # Prompts longer than this (characters) are tokenized in worker processes, off the event loop.
    tokenize_inline_chars: int = 4096
    tokenizer_processes: int = 1
    # Long conversations' token ids, rendered chat templates and parsed messages kept for their
    # next turn, a third each (MiB; 0: off).
    tokenizer_cache_mb: int = 256
    # The replicas' KV block size in tokens; null: launch.block_size, else read from each
    # replica's vllm:cache_config_info.
    block_size: int | None = None
    # A routed prompt's blocks count as cached on its replica for this long, or until the
    # replica's KV events confirm them (replicas without events rely on this alone).
    prediction_ttl_s: float = 10.0
    # How often each replica's /metrics is read (queue depth, KV usage, prefix cache hits).
    scrape_interval_s: float = 1.0
    # Tokens sent once: a request the router tokenized goes to a replica that serves vLLM's
    # /inference/v1/generate (--enable-scale-out) as its token ids, so the replica does not
    # render and tokenize the conversation again; the answer comes back in the client's API.
    # Only to replicas whose render of a probe conversation equals the router's, and with no
    # reasoning parser; requests the generate path cannot answer exactly (tools, structured
    # output, logprobs, images, stored Responses) still go as text. Measured (docs/agents.md):
    # 3.1x less replica API-server CPU per 220 KB turn, TTFT p50 1.33x lower; so on.
    send_tokens: bool = True
    # Several routers behind one load balancer: share every dispatch (in-flight load,
    # predictions, sessions' claims) over this NATS server, as epp.ledger_bus does for pickers
    # (router/ledger_bus.py; every router on a subject must run the same wire version). null:
    # each router knows its own traffic and the replicas' KV events.
    ledger_bus: str | None = None
    ledger_bus_subject: str = "kvroute.ledger"
    # A header that names the request's session (a gateway's or a client's own), read before
    # every other way of finding it (X-Session-ID, the agents' own headers and fields,
    # prompt_cache_key, user: kvcore/agent_identity.py); null: none.
    session_header: str | None = None


class WarmStartConfig(_Section):
    """Several routers: a starting router loads a running one's prefix index (issue 36)."""

    # Routers (base URLs; a load balancer in front of them will do) asked in turn, at start,
    # for their index snapshot (GET /admin/index-snapshot); empty: start cold.
    peers: list[str] = msgspec.field(default_factory=list)
    # The peers' admin key ("env:NAME" reads it from the environment); null: auth.admin_api_key.
    api_key: str | None = None
    # Each peer's answer, connecting and reading a snapshot of millions of blocks included.
    timeout_s: float = 10.0
    # A NATS server with JetStream (nats-server -js): every router puts its snapshot in an
    # object store there every publish_interval_s, and a starting router that got none from
    # its peers loads the newest from it (null: off). Replay buffers must cover the interval.
    nats_url: str | None = None
    # The object store bucket (one object per model pool), made if missing.
    nats_bucket: str = "kvroute-index"
    publish_interval_s: float = 10.0
    # Snapshots older than this are dropped by NATS (the bucket's ttl) and not loaded.
    max_age_s: float = 300.0


class MetricsConfig(_Section):
    enabled: bool = True


class ParityConfig(_Section):
    """The router checks a sample of requests against the replica that served them: its token
    ids and block keys against the engine's (router/parity.py)."""

    enabled: bool = True
    first_per_replica: int = 3  # the first requests each replica serves are all checked
    sample_every: int = 100  # then one in this many (0: only the first ones)
    events_wait_s: float = 5.0  # how long the KV events may take to store a checked prompt
    blocks_to_alarm: int = 3  # block-key misses in a row on one replica that raise the alarm
    clear_after: int = 50  # checks in a row that agree before a raised alarm clears
    blind_min_requests: int = 20  # blind: requests to a replica per window
    blind_min_hit_tokens: int = 256  # blind: its own hits in that window with none predicted
    blind_interval_s: float = 5.0
    timeout_s: float = 5.0  # the /tokenize call
    max_pending: int = 8  # checks running at once; a sampled request beyond is not checked


class TracingConfig(_Section):
    """OpenTelemetry traces of the request path, sent over OTLP (the 'tracing' extra)."""

    # The OTLP collector; null = tracing off: OpenTelemetry is not even imported. http/protobuf:
    # its base URL (http://collector:4318; /v1/traces is added unless the URL has a path);
    # grpc: http://collector:4317 (https:// for TLS).
    otlp_endpoint: str | None = None
    protocol: str = "http/protobuf"  # http/protobuf | grpc
    service_name: str = "kvroute"
    # Share of the traces the router starts that are recorded; a request that arrives with a
    # W3C traceparent is recorded when its sampled flag says so, whatever this ratio.
    sample_ratio: float = 1.0
    # Finished spans are sent in batches this often.
    export_interval_s: float = 5.0


_H2 = H2Limits()


class EppH2Config(_Section):
    """What one gateway connection may make the picker's HTTP/2 server hold or do; past a
    limit the connection gets GOAWAY (ENHANCE_YOUR_CALM) and is closed, a stream past
    max_concurrent_streams is refused (REFUSED_STREAM). Defaults: router/epp/h2_grpc.py's
    ``H2Limits``; every one is listed in SECURITY.md."""

    # Open streams per connection, advertised in SETTINGS; one more is refused (REFUSED_STREAM).
    max_concurrent_streams: int = _H2.max_concurrent_streams
    # Connections at once; one more gets GOAWAY and is closed.
    max_connections: int = _H2.max_connections
    # A request's header list, decoded, and its block however many CONTINUATION frames carry it.
    max_header_list_bytes: int = _H2.max_header_list_bytes
    # Bytes held for one connection: partial messages, answers the peer's window holds back,
    # unread input, unsent output.
    max_connection_bytes: int = _H2.max_connection_bytes
    # The same, for all connections together.
    max_total_bytes: int = _H2.max_total_bytes
    # Streams a client resets before their answer (or opens past the limit) per second, with a
    # burst of twice max_concurrent_streams: past it, the connection ends (rapid reset).
    max_resets_per_s: float = _H2.max_resets_per_s
    # The client preface and first SETTINGS (and the TLS handshake) must arrive within this.
    handshake_timeout_s: float = _H2.handshake_timeout_s
    # A frame or header block, once started, must be complete within this, and a peer must
    # read what the picker sends within it.
    frame_timeout_s: float = _H2.frame_timeout_s
    # A connection with no open stream and no frame for this long is closed.
    idle_timeout_s: float = _H2.idle_timeout_s

    def limits(self) -> H2Limits:
        return H2Limits(**msgspec.structs.asdict(self))


class EppConfig(_Section):
    """``kvroute epp``: the endpoint picker behind an Envoy-based gateway (ext_proc)."""

    host: str = "127.0.0.1"  # 0.0.0.0 in a pod
    grpc_port: int = 9002  # envoy.service.ext_proc.v3.ExternalProcessor (and gRPC health)
    health_port: int = 9003  # grpc.health.v1 for kubelet probes
    metrics_port: int = 9090  # Prometheus /metrics
    # Gateways connect to the picker over TLS by default; self-signed unless cert/key given.
    tls: bool = False
    cert: str | None = None
    key: str | None = None
    # Endpoints listed in the pick, best first (the gateway retries down the list).
    destinations: int = 4
    # Kubernetes discovery: the InferencePool to watch (else the static replicas).
    pool_name: str | None = None
    pool_namespace: str = "default"
    kubeconfig: str | None = None
    # Several pickers behind one gateway: share every dispatch (load, predictions, sessions'
    # claims) over this NATS server (nats://host:4222) on this subject, so each decides as
    # one would.
    ledger_bus: str | None = None
    ledger_bus_subject: str = "kvroute.ledger"
    # On SIGTERM the picker reports NOT_SERVING, then keeps taking streams this long, so the
    # gateway's health check moves new ones to another picker before it stops listening
    # (the ext_proc stream is not retried elsewhere: one refused is a request failed).
    unready_delay_s: float = 3.0
    # The gRPC server's HTTP/2 limits (streams, connections, headers, memory, timeouts).
    h2: EppH2Config = msgspec.field(default_factory=EppH2Config)


class Config(_Section):
    listen: ListenConfig = msgspec.field(default_factory=ListenConfig)
    # Model names clients may ask for; empty means: whatever the replicas report.
    models: list[str] = msgspec.field(default_factory=list)
    replicas: list[ReplicaConfig] = msgspec.field(default_factory=list)
    # Replicas to start and manage (in addition to any listed under replicas).
    launch: LaunchConfig | None = None
    # Several models behind one router, each its own pool of replicas (listed and/or
    # launched), tokenizer and policy; replaces replicas/launch/models above (empty: one pool).
    pools: list[PoolConfig] = msgspec.field(default_factory=list)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    # Scale the launched replicas with their load (null: a fixed launch.count).
    autoscale: AutoscaleConfig | None = None
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    slo: SloConfig = msgspec.field(default_factory=SloConfig)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    breaker: BreakerConfig = msgspec.field(default_factory=BreakerConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    tenants: TenantsConfig = msgspec.field(default_factory=TenantsConfig)
    fairness: FairnessConfig = msgspec.field(default_factory=FairnessConfig)
    # The batch lane (/v1/files, /v1/batches); null: off (those routes answer 404).
    batch: BatchConfig | None = None
    shutdown: ShutdownConfig = msgspec.field(default_factory=ShutdownConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    canary: CanaryConfig = msgspec.field(default_factory=CanaryConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    parity: ParityConfig = msgspec.field(default_factory=ParityConfig)
    warm_start: WarmStartConfig = msgspec.field(default_factory=WarmStartConfig)
    epp: EppConfig = msgspec.field(default_factory=EppConfig)
    # Add X-Kvroute-Replica, X-Kvroute-Reason, X-Kvroute-Prefix-Hit-Tokens and
    # X-Kvroute-Prefix-Available-Tokens to every routed response.
    decision_headers: bool = True


def load_config(path: str | Path) -> Config:
    """Read, parse and validate a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_describe_yaml_error(exc)}") from None
    if raw is None:
        raw = {}
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(*exc.problems, source=str(path)) from None


def _describe_yaml_error(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own text spans several lines)."""
    problem = getattr(exc, "problem", None) or "cannot parse"
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def config_from_dict(raw: Any) -> Config:
    """Validate a parsed config; every problem found is reported in one ``ConfigError``.

    Keys and types are checked key by key (an unknown key or a wrong type does not hide the
    next one); what passes is then checked for what types alone cannot express, with the keys
    that failed left at their defaults.
    """
    problems: list[str] = []
    usable = _check_struct(raw, Config, "", problems)
    config = None if usable is _BAD else msgspec.convert(usable, Config)
    if config is not None:
        # The replicas that passed keep their place in the file for the problems below.
        keys = [f"replicas[{i}]" for i, _ in passed_items(raw.get("replicas"), ReplicaConfig)]
        problems += _semantic_problems(config, keys)
        # Imported here: pool_config reads this module's structs and checks.
        from .pool_config import pool_problems

        problems += pool_problems(config, passed_items(raw.get("pools"), PoolConfig))
    if problems or config is None:
        raise ConfigError(*sorted(problems, key=_file_order(raw)))
    return config


def passed_items(listed: Any, cls: type[msgspec.Struct]) -> list[tuple[int, Any]]:
    """(position, raw item) of the items of a list in the file that became ``cls`` structs (the
    others' problems are recorded already): the keys later problems name them by."""
    items = listed if isinstance(listed, list) else []
    return [
        (i, item) for i, item in enumerate(items) if _check_struct(item, cls, "", []) is not _BAD
    ]


def _file_order(raw: Any) -> Callable[[str], tuple[int, int]]:
    """Sort key for problems: in the order of their top-level key (and list index) in the file."""
    positions = {key: i for i, key in enumerate(raw)} if isinstance(raw, dict) else {}

    def order(problem: str) -> tuple[int, int]:
        match = re.match(r"([^.\[:]*)(?:\[(\d+)\])?", problem)
        top, index = (match.group(1), match.group(2)) if match else ("", None)
        return positions.get(top, -1), int(index) if index is not None else -1

    return order


class _Bad:
    """A value that failed its check (its problem is already recorded)."""


_BAD = _Bad()


def _check_struct(raw: Any, cls: type[msgspec.Struct], where: str, problems: list[str]) -> Any:
    """``raw`` without unknown keys and badly typed values (each recorded in ``problems``), or
    _BAD when no ``cls`` can be made from it (not a mapping, or a required key unusable)."""
    here = where or "top level"
    if not isinstance(raw, dict):
        problems.append(f"{here}: expected 'object', got '{_json_type(raw)}'")
        return _BAD
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    usable: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(f"{here}: keys must be strings, got {key!r}")
            continue
        path = f"{where}.{key}" if where else key
        if key not in fields:
            problems.append(f"{path}: unknown key{_did_you_mean(key, list(fields))}")
            continue
        checked = _check_value(value, fields[key].type, path, problems)
        if checked is not _BAD:
            usable[key] = checked
    complete = True
    for name, field in fields.items():
        if field.required and name not in usable:
            complete = False
            if name not in raw:
                problems.append(f"{where}.{name}: missing; this key is required")
    return usable if complete else _BAD


def _check_value(value: Any, kind: Any, path: str, problems: list[str]) -> Any:
    """``value`` if it has type ``kind`` (structs checked key by key), else _BAD."""
    if isinstance(kind, types.UnionType) and value is None and type(None) in typing.get_args(kind):
        return None
    if (
        isinstance(kind, types.UnionType)
        and isinstance(value, str)
        and str in typing.get_args(kind)
    ):
        return value  # e.g. an API key given as a plain string rather than {key, tenant}
    if typing.get_origin(kind) is dict and _struct_in(typing.get_args(kind)[1]) is not None:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected 'object', got '{_json_type(value)}'")
            return _BAD
        item = typing.get_args(kind)[1]
        entries = {k: _check_value(v, item, f"{path}.{k}", problems) for k, v in value.items()}
        return {k: v for k, v in entries.items() if v is not _BAD}
    struct = _struct_in(kind)
    if struct is not None:
        return _check_struct(value, struct, path, problems)
    if typing.get_origin(kind) is list and _struct_in(typing.get_args(kind)[0]) is not None:
        if not isinstance(value, list):
            problems.append(f"{path}: expected 'array', got '{_json_type(value)}'")
            return _BAD
        item = typing.get_args(kind)[0]
        items = [_check_value(v, item, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return [v for v in items if v is not _BAD]
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        problems.append(_describe_validation_error(str(exc), path))
        return _BAD
    return value


def _struct_in(kind: Any) -> type[msgspec.Struct] | None:
    """The struct type of ``kind`` (``Struct`` or ``Struct | None``), else None."""
    for option in typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,):
        if isinstance(option, type) and issubclass(option, msgspec.Struct):
            return option
    return None


def _json_type(value: Any) -> str:
    """The YAML value's type in msgspec's words ('object', 'array', 'str', ...)."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "null" if value is None else type(value).__name__


def _did_you_mean(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (valid keys: {', '.join(valid)})"


def _describe_validation_error(message: str, path: str = "") -> str:
    """msgspec says 'Expected `int`, got `str` - at `$[1]`'; say it as 'models[1]: ...'.

    ``path`` is the key msgspec's ``$`` stands for.
    """
    reason, _, where = message.partition(" - at ")
    if where.startswith("`key` in "):
        # A mapping key of the wrong type, e.g. '1: 2' where names are expected.
        key = path + where.removeprefix("`key` in ").strip("`").removeprefix("$")
        return f"{key.lstrip('.') or 'top level'}: keys must be strings"
    reason = reason.replace("`", "'")
    reason = reason[0].lower() + reason[1:] if reason else reason
    key = (path + where.strip("`").removeprefix("$")).lstrip(".")
    return f"{key}: {reason}" if key else f"top level: {reason}"


def _semantic_problems(config: Config, replica_keys: list[str]) -> list[str]:
    """Checks that types alone cannot express; ``replica_keys`` name the replicas' places."""
    problems: list[str] = []

    def check(fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        except ConfigError as exc:
            problems.extend(exc.problems)

    check(_check_port, "listen.port", config.listen.port)
    if not 1 <= config.listen.workers <= 64:
        problems.append(f"listen.workers: must be 1-64, got {config.listen.workers}")
    elif config.listen.port == 0 and config.listen.workers > 1:
        problems.append(
            f"listen.port: 0 (any free port) with listen.workers {config.listen.workers}: each "
            "worker would listen on a port of its own; give the port they share"
        )
    names: set[str] = set()
    for key, replica in zip(replica_keys, config.replicas, strict=True):
        try:
            check_replica_url(replica.url, f"{key}.url")
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue  # no name can be derived from it
        if replica.name is not None and not replica.name.strip():
            problems.append(
                f"{key}.name: must not be empty (leave it out to name the replica by its URL)"
            )
            continue
        name = replica.name or replica_name_from_url(replica.url)
        if name in names:
            problems.append(f"{key}.name: duplicate replica name {name!r}")
        names.add(name)
        problems += replica_problems(replica, key)
    if config.launch is not None:
        problems += launch_problems(config.launch)
        block_size = config.routing.block_size
        if block_size is not None and block_size != config.launch.block_size:
            problems.append(
                f"routing.block_size: {block_size} differs from launch.block_size "
                f"{config.launch.block_size}; the router must cut prompts into the replicas' blocks"
            )
    problems += _autoscale_problems(config)
    for i, model in enumerate(config.models):
        if not model:
            problems.append(f"models[{i}]: must not be empty")
    problems += _routing_problems(config.routing)
    problems += _warm_start_problems(config.warm_start)
    if config.routing.ledger_bus is not None and config.listen.workers > 1:
        # Workers already share load through the host's load board; each would also count
        # its siblings' dispatches again from the bus.
        problems.append(
            f"routing.ledger_bus: not with listen.workers {config.listen.workers}; run one "
            "worker per router process when routers share a bus"
        )
    for section, fields in (
        (
            "timeouts",
            ("connect_s", "first_byte_s", "first_token_s", "idle_s", "client_idle_s"),
        ),
        ("timeouts", ("client_body_s",)),
        ("health", ("interval_s", "timeout_s")),
        ("canary", ("interval_s", "timeout_s")),
        ("routing", ("scrape_interval_s",)),
        ("warm_start", ("timeout_s", "publish_interval_s", "max_age_s")),
        ("retry", ("budget_s", "backoff_max_s")),
        ("breaker", ("window_s", "cooldown_s", "max_cooldown_s")),
        ("limits", ("queue_timeout_s",)),
        ("shutdown", ("drain_timeout_s",)),
        ("rollout", ("drain_timeout_s", "readiness_timeout_s")),
    ):
        for field in fields:
            value = getattr(getattr(config, section), field)
            if not (math.isfinite(value) and value > 0):
                problems.append(f"{section}.{field}: must be a finite number > 0, got {value}")
    for section, field in (("timeouts", "total_s"), ("retry", "backoff_base_s")):
        value = getattr(getattr(config, section), field)
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{section}.{field}: must be a finite number >= 0, got {value}")
    if config.limits.max_body_bytes <= 0:
        problems.append(f"limits.max_body_bytes: must be > 0, got {config.limits.max_body_bytes}")
    for field in ("max_concurrent_requests", "max_queued_requests"):
        if getattr(config.limits, field) < 0:
            problems.append(f"limits.{field}: must be >= 0 (0 means none)")
    problems += _retry_problems(config.retry)
    problems += _epp_problems(config.epp)
    problems += _tracing_problems(config.tracing)
    problems += _breaker_problems(config.breaker)
    problems += _canary_problems(config.canary)
    problems += _lora_problems(config.lora)
    check(_validate_auth, config.auth)
    problems += tenant_problems(config)
    problems += _batch_problems(config.batch)
    if config.health.unhealthy_after < 1:
        problems.append(
            f"health.unhealthy_after: must be >= 1, got {config.health.unhealthy_after}"
        )
    if not config.health.path.startswith("/"):
        problems.append(f"health.path: must start with '/', got {config.health.path!r}")
    problems += _slo_problems(config)
    problems += _parity_problems(config.parity)
    try:
        build_policy(config.policy.name, policy_params(config))
    except PolicyConfigError as exc:
        key = "policy.name" if "unknown policy" in str(exc) else "policy.params"
        problems.append(f"{key}: {exc}")
    return problems


def _autoscale_problems(config: Config) -> list[str]:
    problems = []
    if config.rollout.max_unavailable < 1:
        problems.append(
            f"rollout.max_unavailable: must be >= 1, got {config.rollout.max_unavailable}"
        )
    autoscale = config.autoscale
    if autoscale is None:
        return problems
    problems += autoscale.settings().problems()
    if config.pools:
        return [
            *problems,
            "autoscale: scales the one launched fleet of a config without pools:, "
            "not the fleets of pools",
        ]
    if config.launch is None:
        problems.append("autoscale: scales launched replicas only; add a launch: section")
    elif not autoscale.min <= config.launch.count <= autoscale.max:
        problems.append(
            f"launch.count: {config.launch.count} is outside autoscale min..max "
            f"({autoscale.min}..{autoscale.max})"
        )
    if config.listen.workers > 1:
        problems.append(
            "autoscale: needs listen.workers: 1 (one router process owns the launched replicas)"
        )
    return problems


def _batch_problems(batch: BatchConfig | None) -> list[str]:
    if batch is None:
        return []
    problems = []
    if batch.store is not None:
        try:
            check_store_url(batch.store)
        except StoreUrlError as exc:
            problems.append(f"batch.store: {exc}, got {batch.store!r}")
    for field in ("preempt_after_s", "window_s", "lease_s", "poll_s"):
        value = getattr(batch, field)
        if not (math.isfinite(value) and value > 0):
            problems.append(f"batch.{field}: must be a finite number > 0, got {value}")
    if not 0 < batch.pace_fraction <= 1:
        problems.append(f"batch.pace_fraction: must be in (0, 1], got {batch.pace_fraction}")
    for field in ("max_in_flight_per_replica", "max_attempts", "max_lines", "max_file_bytes"):
        if getattr(batch, field) < 1:
            problems.append(f"batch.{field}: must be >= 1, got {getattr(batch, field)}")
    return problems


def policy_params(config: Config, policy: PolicyConfig | None = None) -> dict[str, Any]:
    """``policy.params`` (or a pool's ``policy``'s) with the ``slo:`` targets as kv_aware's
    ``slo_ttft_s``/``slo_tpot_s`` (a target set in the params themselves wins)."""
    policy = policy or config.policy
    params = dict(policy.params)
    if policy.name == "kv_aware":
        for key, value in (("slo_ttft_s", config.slo.ttft_s), ("slo_tpot_s", config.slo.tpot_s)):
            if value is not None and value > 0:  # a bad one is slo:'s own problem
                params.setdefault(key, value)
    return params


def _parity_problems(parity: ParityConfig) -> list[str]:
    problems = []
    for key in ("first_per_replica", "sample_every", "clear_after", "blind_min_requests"):
        if getattr(parity, key) < 0:
            problems.append(f"parity.{key}: must be >= 0, got {getattr(parity, key)}")
    for key in ("blocks_to_alarm", "max_pending", "blind_min_hit_tokens"):
        if getattr(parity, key) < 1:
            problems.append(f"parity.{key}: must be >= 1, got {getattr(parity, key)}")
    for key in ("events_wait_s", "blind_interval_s", "timeout_s"):
        value = getattr(parity, key)
        if not (math.isfinite(value) and value > 0):
            problems.append(f"parity.{key}: must be a number of seconds > 0, got {value}")
    return problems


def _slo_problems(config: Config) -> list[str]:
    problems = []
    targets = (("ttft_s", config.slo.ttft_s), ("tpot_s", config.slo.tpot_s))
    for key, value in targets:
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"slo.{key}: must be a number of seconds > 0, or null, got {value}")
    if not any(v is not None for _, v in targets):
        return problems
    if not config.pools and config.policy.name != "kv_aware":
        problems.append(
            f"slo: only kv_aware routes against an SLO, and policy.name is {config.policy.name}"
        )
    names = {(p.policy or config.policy).name for p in config.pools}
    if config.pools and "kv_aware" not in names:
        problems.append(
            "slo: only kv_aware routes against an SLO, and no pool's policy is kv_aware "
            f"({', '.join(sorted(names))})"
        )
    return problems


ENGINES = ("emulated", "vllm")
KV_EVENTS_BINDS = ("ipc", "tcp")


def _retry_problems(retry: RetryConfig) -> list[str]:
    problems = []
    if not 1 <= retry.max_attempts <= 10:
        problems.append(f"retry.max_attempts: must be 1-10, got {retry.max_attempts}")
    if not 0 <= retry.max_resumes <= 10:
        problems.append(f"retry.max_resumes: must be 0-10, got {retry.max_resumes}")
    return problems


def _breaker_problems(breaker: BreakerConfig) -> list[str]:
    problems = []
    for field in ("consecutive_failures", "min_requests", "half_open_requests"):
        if getattr(breaker, field) < 1:
            problems.append(f"breaker.{field}: must be >= 1, got {getattr(breaker, field)}")
    if breaker.close_after_successes < 1:
        problems.append(
            f"breaker.close_after_successes: must be >= 1, got {breaker.close_after_successes}"
        )
    if not 0 < breaker.failure_rate <= 1:
        problems.append(f"breaker.failure_rate: must be in (0, 1], got {breaker.failure_rate}")
    if breaker.max_cooldown_s < breaker.cooldown_s:
        problems.append("breaker.max_cooldown_s: must be >= breaker.cooldown_s")
    return problems


def _lora_problems(lora: LoraConfig) -> list[str]:
    problems = lora.settings().problems("lora")
    if not (math.isfinite(lora.interval_s) and lora.interval_s > 0):
        problems.append(f"lora.interval_s: must be a finite number > 0, got {lora.interval_s}")
    if lora.spread and not lora.adapters:
        problems.append(
            "lora.adapters: lora.spread needs the adapters it may load, as name: path on the "
            "replicas (e.g. sql-lora: /adapters/sql)"
        )
    return problems


def _canary_problems(canary: CanaryConfig) -> list[str]:
    problems = []
    if not canary.prompts:
        problems.append("canary.prompts: must list at least one prompt")
    for i, prompt in enumerate(canary.prompts):
        if not prompt.strip():
            problems.append(f"canary.prompts[{i}]: must not be empty")
    if len(set(canary.prompts)) != len(canary.prompts):
        problems.append("canary.prompts: must not repeat a prompt")
    if not 1 <= canary.max_tokens <= 1024:
        problems.append(f"canary.max_tokens: must be 1-1024, got {canary.max_tokens}")
    if not (math.isfinite(canary.min_margin) and canary.min_margin >= 0):
        problems.append(
            f"canary.min_margin: must be a finite number of nats >= 0, got {canary.min_margin}"
        )
    if canary.fingerprint_file is not None and not canary.fingerprint_file.strip():
        problems.append("canary.fingerprint_file: must not be empty (null: in memory only)")
    return problems


def api_key_value(entry: str | ApiKeyConfig) -> str:
    return entry if isinstance(entry, str) else entry.key


def _validate_auth(auth: AuthConfig) -> None:
    problems = []
    keys = [
        (f"auth.api_keys[{i}]" + ("" if isinstance(k, str) else ".key"), api_key_value(k))
        for i, k in enumerate(auth.api_keys)
    ]
    for i, entry in enumerate(auth.api_keys):
        if (
            isinstance(entry, ApiKeyConfig)
            and entry.tenant is not None
            and not entry.tenant.strip()
        ):
            problems.append(f"auth.api_keys[{i}].tenant: must not be empty (leave it out)")
    if auth.admin_api_key is not None:
        keys.append(("auth.admin_api_key", auth.admin_api_key))
    for where, key in keys:
        try:
            resolve_secret(key, where)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(*problems)


PRIORITY_CLASSES = ("critical", "standard", "sheddable")
FAIRNESS_BY = ("tenant", "program")  # kvcore/fair_queue.BY


def tenant_problems(config: Config) -> list[str]:
    """tenants: and fairness: values that types alone cannot rule out."""
    problems = []
    settings: list[tuple[str, TenantDefaultsConfig | TenantConfig]] = [
        ("tenants.defaults", config.tenants.defaults)
    ]
    for name, tenant in config.tenants.by_name.items():
        if not name.strip():
            problems.append("tenants.by_name: a tenant name must not be empty")
        settings.append((f"tenants.by_name.{name}", tenant))
    for where, s in settings:
        if s.weight is not None and not (math.isfinite(s.weight) and s.weight > 0):
            problems.append(f"{where}.weight: must be a finite number > 0, got {s.weight}")
        if s.priority is not None and s.priority not in PRIORITY_CLASSES:
            problems.append(
                f"{where}.priority: must be one of {', '.join(PRIORITY_CLASSES)}, got {s.priority!r}"
            )
        for key in ("input_tokens_per_minute", "output_tokens_per_minute", "max_concurrent"):
            value = getattr(s, key)
            if value is not None and value < 0:
                problems.append(f"{where}.{key}: must be >= 0 (0 means no limit), got {value}")
    if config.tenants.max_tracked < 1:
        problems.append(f"tenants.max_tracked: must be >= 1, got {config.tenants.max_tracked}")
    tenants = config.tenants
    if tenants.budget_bus is not None and not tenants.budget_bus.startswith(("nats://", "tls://")):
        problems.append(f"tenants.budget_bus: expected a nats:// URL, got {tenants.budget_bus!r}")
    if not tenants.budget_bus_subject.strip() or " " in tenants.budget_bus_subject:
        problems.append("tenants.budget_bus_subject: must be a NATS subject without spaces")
    interval = tenants.budget_bus_interval_s
    if not (math.isfinite(interval) and 0 < interval <= 10):
        problems.append(
            f"tenants.budget_bus_interval_s: must be a number of seconds in (0, 10], got {interval}"
        )
    fairness = config.fairness
    if fairness.share_bus and tenants.budget_bus is None:
        problems.append(
            "fairness.share_bus: true needs tenants.budget_bus (the nats:// URL the routers "
            "share their charges on)"
        )
    if fairness.share_slots:
        if not fairness.share_bus:
            problems.append(
                "fairness.share_slots: true needs fairness.share_bus: true (the routers share "
                "their slots and tenants' demand on the same bus as their service)"
            )
        if config.limits.max_concurrent_requests <= 0:
            problems.append(
                "fairness.share_slots: true needs limits.max_concurrent_requests (the slots "
                "this router adds to the fleet's)"
            )
        if not fairness.share_max_wait_s > 0:
            problems.append(
                "fairness.share_slots: true needs fairness.share_max_wait_s > 0 (a tenant whose "
                "part of the fleet's slots rounds to none on a router waits that long at most)"
            )
    factor = fairness.share_slots_max_factor
    if not (math.isfinite(factor) and 1 <= factor <= 16):
        problems.append(
            f"fairness.share_slots_max_factor: must be a number in [1, 16], got {factor}"
        )
    for key in (
        "output_weight",
        "locality_bound_tokens",
        "share_max_lead_tokens",
        "share_max_wait_s",
    ):
        value = getattr(fairness, key)
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"fairness.{key}: must be a finite number >= 0, got {value}")
    if not (math.isfinite(fairness.sheddable_max_wait_s) and fairness.sheddable_max_wait_s > 0):
        problems.append(
            "fairness.sheddable_max_wait_s: must be a number of seconds > 0, "
            f"got {fairness.sheddable_max_wait_s}"
        )
    if fairness.locality_scan < 0:
        problems.append(f"fairness.locality_scan: must be >= 0, got {fairness.locality_scan}")
    if fairness.reserved_slots < 0:
        problems.append(f"fairness.reserved_slots: must be >= 0, got {fairness.reserved_slots}")
    if fairness.by not in FAIRNESS_BY:
        problems.append(
            f"fairness.by: must be one of {', '.join(FAIRNESS_BY)}, got {fairness.by!r}"
        )
    if not (math.isfinite(fairness.program_max_wait_s) and fairness.program_max_wait_s > 0):
        problems.append(
            "fairness.program_max_wait_s: must be a number of seconds > 0, "
            f"got {fairness.program_max_wait_s}"
        )
    if not (
        math.isfinite(fairness.program_attained_weight) and fairness.program_attained_weight >= 0
    ):
        problems.append(
            "fairness.program_attained_weight: must be a finite number >= 0, "
            f"got {fairness.program_attained_weight}"
        )
    if not (math.isfinite(fairness.program_wait_share) and 0 <= fairness.program_wait_share <= 1):
        problems.append(
            "fairness.program_wait_share: must be a number from 0 to 1, "
            f"got {fairness.program_wait_share}"
        )
    if fairness.max_programs < 1:
        problems.append(f"fairness.max_programs: must be >= 1, got {fairness.max_programs}")
    for name, value in fairness.objectives.items():
        if value not in PRIORITY_CLASSES:
            problems.append(
                f"fairness.objectives.{name}: must be one of {', '.join(PRIORITY_CLASSES)}, "
                f"got {value!r}"
            )
    return problems


def _warm_start_problems(warm: WarmStartConfig) -> list[str]:
    problems: list[str] = []
    for i, peer in enumerate(warm.peers):
        try:
            check_replica_url(peer, f"warm_start.peers[{i}]")
        except ConfigError as exc:
            problems += exc.problems
    if warm.nats_url is not None and not warm.nats_url.startswith(("nats://", "tls://")):
        problems.append(f"warm_start.nats_url: expected a nats:// URL, got {warm.nats_url!r}")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", warm.nats_bucket):
        problems.append(
            f"warm_start.nats_bucket: letters, digits, '-' and '_' only, got {warm.nats_bucket!r}"
        )
    if warm.api_key is not None:
        try:
            resolve_secret(warm.api_key, "warm_start.api_key")
        except ConfigError as exc:
            problems += exc.problems
    return problems


def resolve_secret(value: str, key: str) -> str:
    """A key as written, or read from the environment when written as "env:NAME"."""
    if value.startswith("env:"):
        name = value[4:]
        secret = os.environ.get(name, "")
        if not secret:
            raise ConfigError(f"{key}: environment variable {name!r} is not set or empty")
        return secret
    if len(value) < 8:
        raise ConfigError(f"{key}: too short to be a key (at least 8 characters)")
    return value


def tokenizer_problems(key: str, tokenizer: str | None) -> list[str]:
    if tokenizer is None or tokenizer == "builtin":
        return []
    path = Path(tokenizer).expanduser()
    if (path / "tokenizer.json").is_file() or (path.is_file() and path.name.endswith(".json")):
        return []
    return [
        f"{key}: {tokenizer!r} is not a tokenizer.json file or a directory holding one "
        "(use 'builtin' for the emulated replica's tokenizer)"
    ]


def _routing_problems(routing: RoutingConfig) -> list[str]:
    problems = tokenizer_problems("routing.tokenizer", routing.tokenizer)
    if routing.block_size is not None and routing.block_size < 1:
        problems.append(f"routing.block_size: must be >= 1, got {routing.block_size}")
    if routing.tokenize_inline_chars < 0:
        problems.append("routing.tokenize_inline_chars: must be >= 0")
    if not 0 <= routing.tokenizer_processes <= 64:
        problems.append(
            f"routing.tokenizer_processes: must be 0-64, got {routing.tokenizer_processes}"
        )
    if not 0 <= routing.tokenizer_cache_mb <= 1 << 20:
        problems.append(
            f"routing.tokenizer_cache_mb: must be 0-{1 << 20} (MiB), got {routing.tokenizer_cache_mb}"
        )
    if not (math.isfinite(routing.prediction_ttl_s) and routing.prediction_ttl_s >= 0):
        problems.append(
            f"routing.prediction_ttl_s: must be a finite number >= 0, got {routing.prediction_ttl_s}"
        )
    bus = routing.ledger_bus
    if bus is not None and not bus.startswith(("nats://", "tls://")):
        problems.append(f"routing.ledger_bus: expected a nats:// URL, got {bus!r}")
    if not routing.ledger_bus_subject.strip() or " " in routing.ledger_bus_subject:
        problems.append("routing.ledger_bus_subject: must be a NATS subject without spaces")
    return problems


def launch_problems(launch: LaunchConfig) -> list[str]:
    problems = []
    if launch.engine not in ENGINES:
        problems.append(
            f"launch.engine: must be one of {', '.join(ENGINES)}, got {launch.engine!r}"
        )
    for key in ("count", "block_size", "num_gpu_blocks", "max_num_seqs", "kv_replay_buffer"):
        value = getattr(launch, key)
        if value is not None and value < 1:
            problems.append(f"launch.{key}: must be >= 1, got {value}")
    on_gpus = gpus_requested(launch)
    if launch.engine == "vllm" and not on_gpus and launch.block_size % 32:
        problems.append(
            f"launch.block_size: vLLM on CPU needs a multiple of 32, got {launch.block_size}"
        )
    if on_gpus:
        problems += _gpu_problems(launch)
    if launch.engine == "vllm":
        problems += [
            f"launch.extra_args: {flag} is set by kvroute (from the launch keys); use those instead"
            for flag in owned_flags_in(launch.extra_args)
        ]
    for key in ("time_scale", "startup_timeout_s"):
        value = getattr(launch, key)
        if not (math.isfinite(value) and value > 0):
            problems.append(f"launch.{key}: must be a finite number > 0, got {value}")
    if not launch.model:
        problems.append("launch.model: must not be empty")
    problems += _preset_problems(launch)
    if launch.kv_events_bind not in KV_EVENTS_BINDS:
        problems.append(
            f"launch.kv_events_bind: must be one of {', '.join(KV_EVENTS_BINDS)}, "
            f"got {launch.kv_events_bind!r}"
        )
    return problems


def _preset_problems(launch: LaunchConfig) -> list[str]:
    """``presets``: one latency preset per replica, for emulated ones only. The names
    themselves are the emulator's to check (``kvroute replica --preset``, which says which
    exist): the router does not import the simulator."""
    problems = []
    if launch.presets and len(launch.presets) != launch.count:
        problems.append(
            f"launch.presets: one preset per replica, {launch.count} (launch.count), got "
            f"{len(launch.presets)}"
        )
    if launch.presets and launch.engine != "emulated":
        problems.append(
            "launch.presets: only emulated replicas have a latency preset (a real vLLM "
            "replica is as fast as its GPUs); leave it out"
        )
    return problems


def gpus_requested(launch: LaunchConfig) -> bool:
    return placement_requested(
        launch.gpus,
        launch.gpus_per_replica,
        launch.tensor_parallel_size,
        launch.pipeline_parallel_size,
        launch.data_parallel_size,
        launch.gpu_memory_utilization,
    )


def launch_layout(launch: LaunchConfig) -> ParallelLayout:
    """One replica's parallel sizes; raises ``PlacementError`` when the keys disagree."""
    return parallel_layout(
        gpus_per_replica=launch.gpus_per_replica,
        tensor=launch.tensor_parallel_size,
        pipeline=launch.pipeline_parallel_size,
        data=launch.data_parallel_size,
    )


def _gpu_problems(launch: LaunchConfig) -> list[str]:
    """What can be told wrong with the GPU keys without a GPU (counting them comes at launch)."""
    problems = []
    utilization = launch.gpu_memory_utilization
    if utilization is not None and not (math.isfinite(utilization) and 0 < utilization <= 1):
        problems.append(
            f"launch.gpu_memory_utilization: must be a share of each GPU's memory, above 0 "
            f"and at most 1, got {utilization}"
        )
    try:
        layout = launch_layout(launch)
    except PlacementError as exc:
        return problems + exc.problems
    if launch.gpus is not None and launch.count >= 1:
        problems += gpu_list_problems(launch.gpus, launch.count, layout)
    vllm_events = launch.engine == "vllm" and launch.kv_events
    if layout.data > 1 and vllm_events and launch.kv_events_bind == "ipc":
        # vLLM offsets each rank's endpoint (ZmqEventPublisher.offset_endpoint_port): tcp
        # ports by the rank; an ipc:// endpoint raises ValueError for ranks above 0.
        problems.append(
            f"launch.data_parallel_size: {layout.data} with launch.kv_events on needs "
            "launch.kv_events_bind: tcp: vLLM publishes rank k's events on the configured "
            "port + k and refuses ipc:// endpoints for ranks above 0"
        )
    return problems


def _epp_problems(epp: EppConfig) -> list[str]:
    problems = []
    for field in ("grpc_port", "health_port", "metrics_port"):
        port = getattr(epp, field)
        if not 0 <= port <= 65535:
            problems.append(f"epp.{field}: must be a port number 0-65535, got {port}")
    ports = [p for p in (epp.grpc_port, epp.health_port, epp.metrics_port) if p]
    if len(set(ports)) != len(ports):
        problems.append("epp: grpc_port, health_port and metrics_port must differ")
    if epp.destinations < 1:
        problems.append(f"epp.destinations: must be >= 1, got {epp.destinations}")
    if not (math.isfinite(epp.unready_delay_s) and 0 <= epp.unready_delay_s <= 300):
        problems.append(
            f"epp.unready_delay_s: must be a number of seconds in [0, 300], got {epp.unready_delay_s}"
        )
    if (epp.cert is None) != (epp.key is None):
        problems.append("epp.cert, epp.key: give both (or neither, for a self-signed one)")
    if epp.cert is not None and not epp.tls:
        problems.append("epp.cert: set epp.tls: true to serve it")
    if epp.ledger_bus is not None and not epp.ledger_bus.startswith(("nats://", "tls://")):
        problems.append(f"epp.ledger_bus: expected a nats:// URL, got {epp.ledger_bus!r}")
    if not epp.ledger_bus_subject.strip() or " " in epp.ledger_bus_subject:
        problems.append("epp.ledger_bus_subject: must be a NATS subject without spaces")
    if epp.pool_name is not None and not epp.pool_name.strip():
        problems.append("epp.pool_name: must not be empty")
    problems += epp.h2.limits().problems("epp.h2.")
    return problems


TRACING_PROTOCOLS = ("http/protobuf", "grpc")
# The OpenTelemetry span exporter module for each protocol (the 'tracing' extra).
OTLP_EXPORTERS = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}


def _tracing_problems(tracing: TracingConfig) -> list[str]:
    problems = []
    if tracing.protocol not in TRACING_PROTOCOLS:
        problems.append(
            f"tracing.protocol: must be one of {', '.join(TRACING_PROTOCOLS)}, "
            f"got {tracing.protocol!r}"
        )
    if not tracing.service_name.strip():
        problems.append("tracing.service_name: must not be empty")
    if not (math.isfinite(tracing.sample_ratio) and 0 <= tracing.sample_ratio <= 1):
        problems.append(f"tracing.sample_ratio: must be in [0, 1], got {tracing.sample_ratio}")
    interval = tracing.export_interval_s
    if not (math.isfinite(interval) and interval > 0):
        problems.append(f"tracing.export_interval_s: must be a finite number > 0, got {interval}")
    endpoint = tracing.otlp_endpoint
    if endpoint is None:
        return problems
    try:
        parts = urlsplit(endpoint)
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError as exc:
        return [*problems, f"tracing.otlp_endpoint: {endpoint!r} is not a valid URL ({exc})"]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        problems.append(
            f"tracing.otlp_endpoint: {endpoint!r} is not an http(s) URL with a host "
            "(e.g. http://otel-collector:4318)"
        )
    elif tracing.protocol in OTLP_EXPORTERS:
        problem = _exporter_import_problem(OTLP_EXPORTERS[tracing.protocol])
        if problem is not None:
            problems.append(f"tracing.otlp_endpoint: {problem}")
    return problems


def _exporter_import_problem(module: str) -> str | None:
    """Why the OTLP exporter cannot be used, or None. Only asked when tracing is on: the router
    runs without OpenTelemetry installed otherwise."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        hint = "install the 'tracing' extra: pip install 'kvroute[tracing]'"
        if "opentelemetry.proto" in str(exc):
            # xds-protos (the endpoint picker's Envoy protos) ships an old copy of
            # opentelemetry-proto's modules; installed after it, it breaks the exporters.
            hint = (
                "another package (xds-protos) overwrote opentelemetry-proto's modules: "
                "pip install --force-reinstall --no-deps opentelemetry-proto==VERSION "
                "(the version installed)"
            )
        return f"tracing is on but OpenTelemetry's exporter cannot be imported ({exc}); {hint}"
    return None


def _check_port(key: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: must be a port number 0-65535, got {port}")


MAX_SPEED = 1000.0  # beyond it, a typo (a speed is a ratio of cards, not tokens per second)


def check_replica_url(url: str, key: str) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{key}: {url!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: {url!r} is not an http(s) URL with a host")
    if port == 0:
        raise ConfigError(f"{key}: {url!r} has port 0, which no replica can listen on")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{key}: {url!r} must be a base URL like http://host:port")


def replica_problems(replica: ReplicaConfig, key: str) -> list[str]:
    """What is wrong with a replica's data-parallel keys and its speed."""
    speed = replica.speed
    if not (math.isfinite(speed) and 0 < speed <= MAX_SPEED):
        return [
            f"{key}.speed: must be a number above 0 and at most {MAX_SPEED:g} (its speed "
            f"against the others': 0.5 for a card half as fast), got {speed}"
        ]
    size, rank = replica.data_parallel_size, replica.data_parallel_rank
    if not 1 <= size <= 1024:
        return [
            f"{key}.data_parallel_size: must be 1-1024 (vLLM's --data-parallel-size), got {size}"
        ]
    if rank is not None and (rank < 0 or (size > 1 and rank >= size)):
        top = f" below data_parallel_size {size}" if size > 1 else ""
        return [f"{key}.data_parallel_rank: must be a rank 0 or above{top}, got {rank}"]
    return []


def replica_name_from_url(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def replica_base_url(url: str) -> str:
    return url.rstrip("/")
