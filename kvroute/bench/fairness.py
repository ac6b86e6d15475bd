"""``kvroute bench fairness``: fair admission between tenants at saturation.

Emulated replicas (``kvroute replica``: the roofline latency model, KV events on) behind a
router (``kvroute serve``) whose ``limits.max_concurrent_requests`` is the bottleneck, so
admission decides who goes next. Each replica, the router and the flooding tenant's load
generator run in a process of their own; the light tenant's client and the measuring run in
this one. So the light tenant's latency is the router's and the replicas', not that of a load
generator sharing their event loop (until 2026-12 all of it ran in one process, one loop).

1. **Service** (issue 14's fairness target): two tenants of equal weight, both backlogged, one
   with 10x the other's requests in flight (closed loops). Over the saturated window, the
   weighted service each got (input + fairness.output_weight x output tokens, as the router
   charged them from the replicas' usage): its ratio, and Jain's index.
2. **Latency under a flood**: the light tenant alone at a modest open-loop rate (a fifth of
   what the fleet serves), then the same rate while the heavy tenant floods, in turns
   (``--rounds``), pooled: its TTFT p50 and p99 both ways, and where the time goes (its wait
   for admission, from the router's kvroute_tenant_queue_seconds; the router's dispatch to the
   first byte, and the replicas' own TTFT; the router's event-loop lag).
3. **Locality**: the multi-tenant chat workload at saturation (replicas with small KV caches, so
   what stays cached matters), admitted in arrival order (FIFO: one tenant, no locality) and
   fairly (a tenant per chat tenant, locality on): the replicas' own prefix-cache hit rates.

With ``--routers N`` (2 or more) it measures tenants' shares over N routers instead
(kvroute/bench/fairness_routers.py): one tenant spreading its requests over all of them, one
sending to one, with ``fairness.share_bus`` off and on and with ``fairness.share_slots``, against
one router.

Every figure is measured here, on this machine, against emulated replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import add_report_args, positive_int
from kvroute.bench.chat_load import replica_counters
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import (
    HOST,
    Launch,
    kvroute_cli,
    replica_argv,
    serve_argv,
    start_all,
    start_router,
)
from kvroute.bench.harness.host import machine_line, record
from kvroute.bench.harness.metrics import metrics_page
from kvroute.bench.harness.report import reproduce_command
from kvroute.bench.streams import lag_summary
from kvroute.kvcore.fair_queue import FairnessParams
from kvroute.kvcore.stats import MetricsPage, percentile
from kvroute.simulator.workload import filler, multi_tenant_chat

# Issue 14's targets.
TARGET_RATIO = 0.10  # weighted service within 10% of 1:1
TARGET_JAIN = 0.95
TARGET_TTFT = 1.2  # the light tenant's p99 under the flood, against alone
TARGET_HIT_RATE = 0.9  # fair's hit rate against FIFO's
OUTPUT_WEIGHT = 2.0

RESERVED_SLOTS = FairnessParams().reserved_slots  # what the router runs with (the default)


@dataclass
class Options:
    replicas: int = 2
    slots: int = 4  # limits.max_concurrent_requests: the bottleneck
    light: int = 4  # the light tenant's requests in flight (phase 1)
    heavy_factor: int = 10
    seconds: float = 20.0  # per measured window
    rounds: int = 3  # windows alone and under the flood, in turns
    warmup_s: float = 3.0
    prompt_words: int = 150
    max_tokens: int = 16
    preset: str = "llama-3.1-8b-h100"
    seed: int = 0
    startup_timeout_s: float = 60.0
    output_md: str = "BENCHMARKS.md"
    no_record: bool = False
    share_slots_max_factor: float = 2.5  # --routers: fairness.share_slots_max_factor (the default)


@dataclass
class Phase:
    """What one kind of window measured; several windows of a kind pool here (``add``)."""

    ttfts: dict[str, list[float]] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)  # weighted tokens, per tenant
    completed: float = 0.0  # requests the router answered, all tenants
    grown: dict[str, float] = field(default_factory=dict)  # metric sums' and counts' growth
    lag_p99_le_s: float = 0.0  # the router's event-loop lag p99 (a bucket bound), worst window
    errors: int = 0

    def record(self, tenant: str, ttft: float | None) -> None:
        """One request's TTFT, or an error when it failed (None)."""
        if ttft is None:
            self.errors += 1
        else:
            self.ttfts.setdefault(tenant, []).append(ttft)

    def add(self, other: Phase) -> None:
        for tenant, values in other.ttfts.items():
            self.ttfts.setdefault(tenant, []).extend(values)
        for tenant, tokens in other.served.items():
            self.served[tenant] = self.served.get(tenant, 0.0) + tokens
        for name, value in other.grown.items():
            self.grown[name] = self.grown.get(name, 0.0) + value
        self.completed += other.completed
        self.lag_p99_le_s = max(self.lag_p99_le_s, other.lag_p99_le_s)
        self.errors += other.errors

    def mean(self, name: str) -> float:
        count = self.grown.get(name + "_count", 0.0)
        return self.grown.get(name + "_sum", 0.0) / count if count else 0.0

    @property
    def light_waited(self) -> float:
        """The share of the light tenant's requests that waited over 1 ms for admission."""
        count = self.grown.get("queue_count", 0.0)
        return 1.0 - self.grown.get("queue_at_once", 0.0) / count if count else 0.0


# -- the fleet: each replica and the router a process of its own ---------------------------


def replica_flags(
    events_port: int, replay_port: int, num_blocks: int, options: Options
) -> list[str]:
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv-events",
    }
    return [
        "--preset", options.preset,
        "--block-size", "16",
        "--num-gpu-blocks-override", str(num_blocks),
        "--max-num-seqs", "64",
        "--kv-events-config", json.dumps(events),
    ]  # fmt: skip


def router_config(entries: list[dict[str, str]], options: Options, fair: bool) -> dict[str, Any]:
    return {
        "replicas": entries,
        "routing": {"tokenizer": "builtin", "block_size": 16},
        "limits": {
            "max_concurrent_requests": options.slots,
            "max_queued_requests": 10_000,
            "queue_timeout_s": 300.0,
        },
        "fairness": {
            "output_weight": OUTPUT_WEIGHT,
            "locality_bound_tokens": 4096.0 if fair else 0.0,
        },
        "health": {"interval_s": 0.5},
    }


@contextlib.contextmanager
def fleet(
    options: Options, num_blocks: int, log_dir: Path, fair: bool = True
) -> Iterator[tuple[str, list[str]]]:
    """The replicas and the router in front of them: (router URL, replica URLs)."""
    cli, timeout_s = kvroute_cli(), options.startup_timeout_s
    with contextlib.ExitStack() as stack:
        port, *ports = free_ports(1 + 3 * options.replicas)
        # Each replica's HTTP port -> its KV events and replay ports.
        kv = {ports[k]: (ports[k + 1], ports[k + 2]) for k in range(0, len(ports), 3)}

        def replica(p: int) -> list[str]:
            flags = replica_flags(*kv[p], num_blocks, options)
            return replica_argv(p, "tiny", *flags, cli=cli)

        urls = start_all(stack, "replica", replica, list(kv), log_dir, timeout_s)
        entries = [
            {
                "url": url,
                "name": f"r{i}",
                "kv_events": f"tcp://{HOST}:{events}",
                "kv_replay": f"tcp://{HOST}:{replay}",
            }
            for i, (url, (events, replay)) in enumerate(zip(urls, kv.values(), strict=True))
        ]
        config = log_dir / f"router-{'fair' if fair else 'fifo'}.yaml"
        config.write_text(json.dumps(router_config(entries, options, fair)))  # JSON is YAML
        serve = Launch(serve_argv(port, (), "--config", str(config), cli=cli), "/ready")
        router_url, _ = start_router(stack, "router", serve, port, log_dir, timeout_s)
        yield router_url, urls


# -- the load ------------------------------------------------------------------------------


async def _stream(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], tenant: str
) -> float | None:
    """One streamed request; its TTFT (None if it failed)."""
    started = time.perf_counter()
    ttft = None
    async with http.post(url + path, json=body, headers={"X-Tenant-Id": tenant}) as resp:
        if resp.status != 200:
            await resp.read()
            return None
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
    return ttft


def _prompt_body(rng: random.Random, tenant: str, options: Options) -> dict[str, Any]:
    # A fresh prompt every time (a unique head): no cache hits to blur the service counts.
    head = f"{tenant} {rng.getrandbits(64):x} "
    return {
        "model": "tiny",
        "prompt": head + filler(rng, options.prompt_words * 6),
        "max_tokens": options.max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def _closed_loop(
    http: aiohttp.ClientSession,
    url: str,
    tenant: str,
    workers: int,
    options: Options,
    stop: asyncio.Event,
    phase: Phase,
    rng: random.Random,
) -> None:
    async def worker() -> None:
        while not stop.is_set():
            body = _prompt_body(rng, tenant, options)
            phase.record(tenant, await _stream(http, url, "/v1/completions", body, tenant))

    await asyncio.gather(*(worker() for _ in range(workers)))


async def _open_loop(
    http: aiohttp.ClientSession,
    url: str,
    tenant: str,
    rate: float,
    options: Options,
    stop: asyncio.Event,
    phase: Phase,
    rng: random.Random,
) -> None:
    pending: set[asyncio.Task[None]] = set()

    async def one() -> None:
        body = _prompt_body(rng, tenant, options)
        phase.record(tenant, await _stream(http, url, "/v1/completions", body, tenant))

    while not stop.is_set():
        task = asyncio.create_task(one())
        pending.add(task)
        task.add_done_callback(pending.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
    await asyncio.gather(*pending)


class Flood:
    """The flooding tenant's closed loops, in a process of their own: started, and ready,
    before a window opens (so the warm-up is the flood's, not Python's start-up); ``run``
    floods from the window's start until its stop."""

    def __init__(self, url: str, tenant: str, workers: int, options: Options, seed: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready, self._go, self._halt = ctx.Event(), ctx.Event(), ctx.Event()
        self._errors: Synchronized[int] = ctx.Value("i", 0)
        self._child = ctx.Process(
            target=_flood_main,
            args=(url, tenant, workers, options, seed, self._ready, self._go, self._halt),
            kwargs={"errors": self._errors},
            name=f"kvroute-bench-{tenant}",
            daemon=True,
        )

    def __enter__(self) -> Flood:
        self._child.start()
        if not self._ready.wait(60.0):
            self._child.kill()
            raise RuntimeError("the flood's load generator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._go.set()
        self._child.join(60.0)
        if self._child.is_alive():
            self._child.kill()
            self._child.join()

    async def run(self, stop: asyncio.Event, phase: Phase) -> None:
        self._go.set()
        await stop.wait()
        self._halt.set()
        await asyncio.to_thread(self._child.join, 60.0)
        phase.errors += self._errors.value


def _flood_main(
    url: str,
    tenant: str,
    workers: int,
    options: Options,
    seed: int,
    ready: Event,
    go: Event,
    halt: Event,
    errors: Synchronized[int],
) -> None:
    uvloop.run(_flood(url, tenant, workers, options, seed, ready, go, halt, errors))


async def _flood(
    url: str,
    tenant: str,
    workers: int,
    options: Options,
    seed: int,
    ready: Event,
    go: Event,
    halt: Event,
    errors: Synchronized[int],
) -> None:
    phase, stop = Phase(), asyncio.Event()
    async with aiohttp.ClientSession() as http:
        ready.set()
        await asyncio.to_thread(go.wait)
        halted = asyncio.ensure_future(asyncio.to_thread(halt.wait))
        halted.add_done_callback(lambda _: stop.set())
        await _closed_loop(http, url, tenant, workers, options, stop, phase, random.Random(seed))
    errors.value = phase.errors


# -- what the router and the replicas say --------------------------------------------------


async def _tenant_rows(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with http.get(url + "/admin/tenants") as resp:
        body = await resp.json()
    return {row["tenant"]: row for row in body["tenants"]}


def _weighted(row: dict[str, Any]) -> float:
    return float(row["tokens"]["input"] + OUTPUT_WEIGHT * row["tokens"]["output"])


@dataclass
class _Readings:
    tenants: dict[str, dict[str, Any]]
    router: MetricsPage
    replicas: list[MetricsPage]


async def _read(http: aiohttp.ClientSession, url: str, replicas: Sequence[str]) -> _Readings:
    return _Readings(
        await _tenant_rows(http, url),
        await metrics_page(http, url),
        [await metrics_page(http, r) for r in replicas],
    )


QUEUE = "kvroute_tenant_queue_seconds"
ROUTER_TTFB = "kvroute_time_to_first_byte_seconds"
REPLICA_TTFT = "vllm:time_to_first_token_seconds"


def _measure(before: _Readings, after: _Readings, phase: Phase) -> None:
    """What happened between two readings: service, the light tenant's wait for admission,
    the router's dispatch-to-first-byte, the replicas' TTFT and the router's event-loop lag."""
    empty: dict[str, Any] = {"tokens": {"input": 0, "output": 0}, "requests": {}}
    was = {t: before.tenants.get(t, empty) for t in after.tenants}
    served = {t: _weighted(row) - _weighted(was[t]) for t, row in after.tenants.items()}
    phase.served = {t: v for t, v in served.items() if v > 0}
    phase.completed = sum(
        row["requests"].get("ok", 0) - was[t]["requests"].get("ok", 0)
        for t, row in after.tenants.items()
    )

    def grew(a: MetricsPage, b: MetricsPage, name: str, **labels: str) -> float:
        return b.sum(name, **labels) - a.sum(name, **labels)

    b, a = before.router, after.router
    pairs = list(zip(before.replicas, after.replicas, strict=True))
    for part in ("sum", "count"):
        phase.grown[f"queue_{part}"] = grew(b, a, f"{QUEUE}_{part}", tenant="light")
        phase.grown[f"ttfb_{part}"] = grew(b, a, f"{ROUTER_TTFB}_{part}")
        phase.grown[f"replica_{part}"] = sum(grew(x, y, f"{REPLICA_TTFT}_{part}") for x, y in pairs)
    phase.grown["queue_at_once"] = grew(b, a, QUEUE + "_bucket", tenant="light", le="0.001")
    phase.lag_p99_le_s = lag_summary(b, a).p99_le_s


async def _window(
    http: aiohttp.ClientSession,
    url: str,
    replicas: Sequence[str],
    options: Options,
    loads: list[Any],
) -> Phase:
    """Run ``loads`` (factories taking ``stop`` and the window's Phase to record into) and
    measure after the warm-up."""
    stop, phase = asyncio.Event(), Phase()
    tasks = [asyncio.create_task(load(stop, phase)) for load in loads]
    await asyncio.sleep(options.warmup_s)
    for values in phase.ttfts.values():
        values.clear()
    before = await _read(http, url, replicas)
    await asyncio.sleep(options.seconds)
    after = await _read(http, url, replicas)
    stop.set()
    await asyncio.gather(*tasks)
    _measure(before, after, phase)
    return phase


# -- the phases ----------------------------------------------------------------------------


def jain(values: Sequence[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


@dataclass
class Outcome:
    ratio: float = 0.0
    jain: float = 0.0
    service: dict[str, float] = field(default_factory=dict)
    alone: Phase = field(default_factory=Phase)
    flood: Phase = field(default_factory=Phase)
    light_rate: float = 0.0
    throughput: float = 0.0  # requests/s at saturation
    hit_fifo: float = 0.0
    hit_fair: float = 0.0
    errors: int = 0

    def ttft(self, phase: Phase, q: float) -> float:
        return percentile(phase.ttfts.get("light", [0.0]), q)


async def _service_and_latency(
    options: Options, url: str, replicas: Sequence[str], outcome: Outcome
) -> None:
    rng = random.Random(options.seed)
    heavy_workers = options.light * options.heavy_factor

    def flood_of(flood: Flood) -> Any:
        return lambda stop, phase: flood.run(stop, phase)

    def light_closed(stop: asyncio.Event, phase: Phase) -> Any:
        return _closed_loop(http, url, "light", options.light, options, stop, phase, rng)

    def light_open(rate: float) -> Any:
        return lambda stop, phase: _open_loop(http, url, "light", rate, options, stop, phase, rng)

    async with aiohttp.ClientSession() as http:
        with Flood(url, "heavy", heavy_workers, options, options.seed) as flood:
            backlogged = await _window(
                http, url, replicas, options, [flood_of(flood), light_closed]
            )
        heavy, light = backlogged.served.get("heavy", 0.0), backlogged.served.get("light", 0.0)
        outcome.service = {"heavy": heavy, "light": light}
        outcome.ratio = heavy / light if light else math.inf
        outcome.jain = jain([heavy, light])
        outcome.throughput = backlogged.completed / options.seconds
        outcome.errors += backlogged.errors
        # The light tenant below its fair share: a fifth of what the fleet serves.
        outcome.light_rate = rate = max(0.5, outcome.throughput / 5)
        # Alone and under the flood in turns, pooled: what drifts on a shared machine drifts
        # for both.
        for i in range(options.rounds):
            outcome.alone.add(await _window(http, url, replicas, options, [light_open(rate)]))
            with Flood(url, "heavy", heavy_workers, options, options.seed + 1 + i) as flood:
                loads = [flood_of(flood), light_open(rate)]
                outcome.flood.add(await _window(http, url, replicas, options, loads))
        outcome.errors += outcome.alone.errors + outcome.flood.errors


async def _chat_hit_rate(
    options: Options, url: str, urls: Sequence[str], fair: bool
) -> tuple[float, int]:
    """The multi-tenant chat workload through a saturated router: the replicas' hit rate."""
    conversations = multi_tenant_chat(
        tenants=8, conversations_per_tenant=8, turns=4, system_prompt_words=300, seed=options.seed
    )
    errors = 0
    async with aiohttp.ClientSession() as http:
        before = await replica_counters(http, urls)
        queue = list(conversations)
        lock = asyncio.Lock()

        async def worker() -> None:
            nonlocal errors
            while True:
                async with lock:
                    if not queue:
                        return
                    conversation = queue.pop(0)
                tenant = f"tenant-{conversation.tenant}" if fair else "default"
                messages: list[dict[str, str]] = [
                    {"role": "system", "content": conversation.system_prompt}
                ]
                for turn in conversation.user_turns:
                    messages.append({"role": "user", "content": turn})
                    body = {
                        "model": "tiny",
                        "messages": messages,
                        "max_tokens": options.max_tokens,
                        "stream": True,
                        "ignore_eos": True,
                    }
                    if await _stream(http, url, "/v1/chat/completions", body, tenant) is None:
                        errors += 1
                    messages.append({"role": "assistant", "content": "noted."})

        await asyncio.gather(*(worker() for _ in range(options.slots * 6)))
        after = await replica_counters(http, urls)
    queries = sum(after[u].queries - before[u].queries for u in urls)
    hits = sum(after[u].hits - before[u].hits for u in urls)
    return (hits / queries if queries else 0.0), errors


def run(options: Options) -> Outcome:
    """Every phase, each fleet started for it and stopped after (small KV caches for the
    locality phases, so what stays cached matters)."""
    outcome = Outcome()
    with processes.session("kvroute-bench-fairness-") as logs:
        with fleet(options, 4096, logs) as (url, urls):
            uvloop.run(_service_and_latency(options, url, urls, outcome))
        for fair in (False, True):
            with fleet(options, 256, logs, fair=fair) as (url, urls):
                hit_rate, errors = uvloop.run(_chat_hit_rate(options, url, urls, fair))
            outcome.errors += errors
            if fair:
                outcome.hit_fair = hit_rate
            else:
                outcome.hit_fifo = hit_rate
    return outcome


# -- the report ----------------------------------------------------------------------------


def _mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _decomposition_row(name: str, o: Outcome, phase: Phase) -> str:
    ttfts = phase.ttfts.get("light", [])
    mean = sum(ttfts) / len(ttfts) if ttfts else 0.0
    queue, ttfb = phase.mean("queue"), phase.mean("ttfb")
    return (
        f"| {name} | {len(ttfts)} | {_ms(o.ttft(phase, 0.5))} | {_ms(o.ttft(phase, 0.99))} "
        f"| {_ms(mean)} | {_ms(queue)} ({phase.light_waited:.0%} waited) "
        f"| {_ms(ttfb)} ({_ms(phase.mean('replica'))}) | {_ms(mean - queue - ttfb)} "
        f"| <= {phase.lag_p99_le_s * 1000:g} |"
    )


def report(outcome: Outcome, options: Options, command: str) -> str:
    o = outcome
    ratio_ok = abs(o.ratio - 1.0) <= TARGET_RATIO
    alone, flood = o.ttft(o.alone, 0.99), o.ttft(o.flood, 0.99)
    ttft_x = flood / alone if alone else math.inf
    hit_x = o.hit_fair / o.hit_fifo if o.hit_fifo else math.inf
    lines = [
        f"## Fair admission between tenants ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        f"{options.replicas} emulated replicas (`kvroute replica`, {options.preset} latency "
        f"model), the router (`kvroute serve`) and the flooding tenant's load generator each "
        f"a process of its own; the light tenant's client in another. "
        f"limits.max_concurrent_requests {options.slots} (the bottleneck), "
        f"{RESERVED_SLOTS} reserved slots (the default); fairness.output_weight "
        f"{OUTPUT_WEIGHT:g}; prompts of ~{options.prompt_words} words, {options.max_tokens} "
        f"output tokens; {options.seconds:g} s windows after {options.warmup_s:g} s warm-up, "
        f"{options.rounds} alone and {options.rounds} under the flood in turns, pooled. "
        f"{machine_line()}.",
        "",
        "| measure | value | target | |",
        "|---|---:|---:|---|",
        f"| weighted service heavy : light (both backlogged, {options.light * options.heavy_factor} "
        f"vs {options.light} in flight) | {o.ratio:.3f} | 1 +- {TARGET_RATIO:.0%} | {_mark(ratio_ok)} |",
        f"| Jain's index | {o.jain:.4f} | >= {TARGET_JAIN} | {_mark(o.jain >= TARGET_JAIN)} |",
        f"| light TTFT p99 alone ({o.light_rate:.1f} req/s open loop) | {alone * 1000:.0f} ms | | |",
        f"| light TTFT p99 under the flood | {flood * 1000:.0f} ms ({ttft_x:.2f}x) "
        f"| <= {TARGET_TTFT}x | {_mark(ttft_x <= TARGET_TTFT)} |",
        f"| prefix hit rate, FIFO admission (multi-tenant chat) | {o.hit_fifo:.3f} | | |",
        f"| prefix hit rate, fair admission with locality | {o.hit_fair:.3f} ({hit_x:.2f}x) "
        f"| >= {TARGET_HIT_RATE}x | {_mark(hit_x >= TARGET_HIT_RATE)} |",
        "",
        "Where the light tenant's time goes, in ms: its mean TTFT is its wait for admission "
        "(the router's kvroute_tenant_queue_seconds; the share of its requests that waited "
        "over 1 ms), plus the router's dispatch to the replica's first byte (its "
        "kvroute_time_to_first_byte_seconds, of which the replicas' own TTFT, both over every "
        "tenant's requests), plus the rest (the client, the router before dispatch, the relay). "
        "Router loop lag: its kvroute_event_loop_lag_seconds p99 (a bucket bound), the worst "
        "window's.",
        "",
        "| light tenant | requests | TTFT p50 | TTFT p99 | TTFT mean | = admission wait "
        "| + dispatch to first byte (replicas' TTFT) | + the rest | router loop lag p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        _decomposition_row("alone", o, o.alone),
        _decomposition_row("under the flood", o, o.flood),
        "",
        f"Saturated throughput {o.throughput:.1f} requests/s; weighted tokens served in the "
        f"window: heavy {o.service.get('heavy', 0):.0f}, light {o.service.get('light', 0):.0f}; "
        f"failed requests: {o.errors}.",
        "",
    ]
    return "\n".join(lines)


def add_fairness_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fairness",
        help="Fair admission between tenants at saturation: service ratio, TTFT, locality.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=positive_int, default=2, help="emulated replicas (default 2)")
    p.add_argument(
        "--slots", type=positive_int, default=4, help="limits.max_concurrent_requests (default 4)"
    )
    p.add_argument(
        "--light", type=positive_int, default=4, help="the light tenant's requests in flight"
    )
    p.add_argument(
        "--heavy-factor",
        type=positive_int,
        default=10,
        help="the heavy tenant's requests in flight, as a multiple of the light one's (default 10)",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="each measured window")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="windows of the light tenant alone and under the flood, in turns (default 3)",
    )
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    p.add_argument(
        "--routers",
        type=positive_int,
        default=1,
        help="2 or more: tenants' shares over this many routers, fairness.share_bus off and on "
        "(and with share_slots), "
        "against one router (kvroute/bench/fairness_routers.py; --slots per router)",
    )
    p.add_argument(
        "--share-slots-max-factor",
        type=float,
        default=Options.share_slots_max_factor,
        help="with --routers: fairness.share_slots_max_factor of the share_slots case "
        f"(default {Options.share_slots_max_factor:g}, the config's)",
    )
    add_report_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if not (args.seconds > 0 and args.warmup >= 0):
        print("kvroute bench fairness: --seconds must be > 0 and --warmup >= 0", file=sys.stderr)
        return 2
    options = Options(
        replicas=args.replicas,
        slots=args.slots,
        light=args.light,
        heavy_factor=args.heavy_factor,
        seconds=args.seconds,
        rounds=args.rounds,
        warmup_s=args.warmup,
        seed=args.seed,
        output_md=args.output_md,
        no_record=args.no_record,
        share_slots_max_factor=args.share_slots_max_factor,
    )
    if args.routers > 1:
        from kvroute.bench import fairness_routers

        try:
            results = fairness_routers.run(options, args.routers, echo=print)
        except processes.StartError as exc:
            print(f"kvroute bench fairness: {exc}", file=sys.stderr)
            return 1
        command = reproduce_command(sys.argv, "fairness")
        text = fairness_routers.report(results, options, args.routers, command)
    else:
        text = report(run(options), options, reproduce_command(sys.argv, "fairness"))
    print(text)
    if not options.no_record:
        record(Path(options.output_md), text)
    return 0
