"""``kvroute bench fairness``: fair admission between tenants at saturation, in one process.

Emulated replicas (the roofline latency model, KV events on) behind a router whose
``limits.max_concurrent_requests`` is the bottleneck, so admission decides who goes next:

1. **Service** (issue 14's fairness target): two tenants of equal weight, both backlogged, one
   with 10x the other's requests in flight (closed loops). Over the saturated window, the
   weighted service each got (input + fairness.output_weight x output tokens, as the router
   charged them from the replicas' usage): its ratio, and Jain's index.
2. **Latency under a flood**: the light tenant alone at a modest open-loop rate, then the same
   rate while the heavy tenant floods: its TTFT p99 in both.
3. **Locality**: the multi-tenant chat workload at saturation (replicas with small KV caches, so
   what stays cached matters), admitted in arrival order (FIFO: one tenant, no locality) and
   fairly (a tenant per chat tenant, locality on): the replicas' own prefix-cache hit rates.

Every figure is measured here, on this machine, against emulated replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import add_report_args, positive_int
from kvroute.bench.chat_load import replica_counters
from kvroute.bench.overhead import machine_line, record, reproduce_command
from kvroute.kvcore.stats import parse_metrics, percentile
from kvroute.kvcore.tokenizer import SimpleTokenizer
from kvroute.router.config import config_from_dict
from kvroute.router.runner import app_runner
from kvroute.router.server import Router
from kvroute.simulator.engine import EngineConfig, latency_preset
from kvroute.simulator.replica.faults import Faults
from kvroute.simulator.replica.server import EmulatedReplica, ReplicaOptions
from kvroute.simulator.workload import filler, multi_tenant_chat

# Issue 14's targets.
TARGET_RATIO = 0.10  # weighted service within 10% of 1:1
TARGET_JAIN = 0.95
TARGET_TTFT = 1.2  # the light tenant's p99 under the flood, against alone
TARGET_HIT_RATE = 0.9  # fair's hit rate against FIFO's
OUTPUT_WEIGHT = 2.0


@dataclass
class Options:
    replicas: int = 2
    slots: int = 4  # limits.max_concurrent_requests: the bottleneck
    light: int = 4  # the light tenant's requests in flight (phase 1)
    heavy_factor: int = 10
    seconds: float = 20.0  # per measured window
    warmup_s: float = 3.0
    prompt_words: int = 150
    max_tokens: int = 16
    preset: str = "llama-3.1-8b-h100"
    seed: int = 0
    output_md: str = "BENCHMARKS.md"
    no_record: bool = False


@dataclass
class Phase:
    ttfts: dict[str, list[float]] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)  # weighted tokens in the window
    light_queue_s: float = 0.0  # the light tenant's mean wait for admission in the window
    errors: int = 0


# -- the fleet, in this process ------------------------------------------------------------


@contextlib.asynccontextmanager
async def fleet(
    options: Options, num_blocks: int, fair: bool = True
) -> AsyncIterator[tuple[str, list[str]]]:
    runners: list[web.AppRunner] = []
    entries, urls = [], []
    try:
        for i in range(options.replicas):
            port, events_port, replay_port = free_ports(3)
            replica = EmulatedReplica(
                ReplicaOptions(
                    served_model_name="tiny",
                    engine=EngineConfig(
                        block_size=16,
                        num_blocks=num_blocks,
                        max_num_seqs=64,
                        latency=latency_preset(options.preset),
                    ),
                    kv_events={
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://*:{events_port}",
                        "replay_endpoint": f"tcp://*:{replay_port}",
                        "topic": "kv-events",
                    },
                    kv_bind_host="127.0.0.1",
                ),
                SimpleTokenizer(),
                Faults(),
            )
            runner = web.AppRunner(replica.build_app(), handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            url = f"http://127.0.0.1:{port}"
            urls.append(url)
            entries.append(
                {
                    "url": url,
                    "name": f"r{i}",
                    "kv_events": f"tcp://127.0.0.1:{events_port}",
                    "kv_replay": f"tcp://127.0.0.1:{replay_port}",
                }
            )
        raw = {
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
        router = Router(config_from_dict(raw))
        runner = app_runner(router)
        await runner.setup()
        port = free_ports(1)[0]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        url = f"http://127.0.0.1:{port}"
        await _wait_ready(url)
        yield url, urls
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def _wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the router at {url} did not become ready")


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
            ttft = await _stream(
                http, url, "/v1/completions", _prompt_body(rng, tenant, options), tenant
            )
            if ttft is None:
                phase.errors += 1
            else:
                phase.ttfts.setdefault(tenant, []).append(ttft)

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
        ttft = await _stream(
            http, url, "/v1/completions", _prompt_body(rng, tenant, options), tenant
        )
        if ttft is None:
            phase.errors += 1
        else:
            phase.ttfts.setdefault(tenant, []).append(ttft)

    while not stop.is_set():
        task = asyncio.create_task(one())
        pending.add(task)
        task.add_done_callback(pending.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
    await asyncio.gather(*pending)


async def _tenant_tokens(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/admin/tenants") as resp:
        body = await resp.json()
    return {
        row["tenant"]: row["tokens"]["input"] + OUTPUT_WEIGHT * row["tokens"]["output"]
        for row in body["tenants"]
    }


async def _queue_wait(http: aiohttp.ClientSession, url: str, tenant: str) -> tuple[float, float]:
    """A tenant's admission wait so far: seconds in all, and requests."""
    async with http.get(url + "/metrics") as resp:
        page = parse_metrics(await resp.text(), only=("kvroute_tenant_queue_seconds",))
    return (
        page.sum("kvroute_tenant_queue_seconds_sum", tenant=tenant),
        page.sum("kvroute_tenant_queue_seconds_count", tenant=tenant),
    )


async def _window(
    http: aiohttp.ClientSession, url: str, options: Options, loads: list[Any], phase: Phase
) -> None:
    """Run ``loads`` (coroutine factories taking ``stop``); measure after the warm-up."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(load(stop)) for load in loads]
    await asyncio.sleep(options.warmup_s)
    for values in phase.ttfts.values():
        values.clear()
    before = await _tenant_tokens(http, url)
    queued_before = await _queue_wait(http, url, "light")
    await asyncio.sleep(options.seconds)
    after = await _tenant_tokens(http, url)
    queued_after = await _queue_wait(http, url, "light")
    count = queued_after[1] - queued_before[1]
    phase.light_queue_s = (queued_after[0] - queued_before[0]) / count if count else 0.0
    stop.set()
    await asyncio.gather(*tasks)
    phase.served = {t: after[t] - before.get(t, 0.0) for t in after if after[t] > before.get(t, 0)}


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
    ttft_alone: float = 0.0
    ttft_flood: float = 0.0
    queue_alone: float = 0.0
    queue_flood: float = 0.0
    light_rate: float = 0.0
    throughput: float = 0.0  # requests/s at saturation
    hit_fifo: float = 0.0
    hit_fair: float = 0.0
    errors: int = 0


async def _service_and_latency(options: Options, outcome: Outcome) -> None:
    rng = random.Random(options.seed)
    heavy_workers = options.light * options.heavy_factor
    async with fleet(options, num_blocks=4096) as (url, _), aiohttp.ClientSession() as http:
        backlogged = Phase()
        await _window(
            http,
            url,
            options,
            [
                lambda stop: _closed_loop(
                    http, url, "heavy", heavy_workers, options, stop, backlogged, rng
                ),
                lambda stop: _closed_loop(
                    http, url, "light", options.light, options, stop, backlogged, rng
                ),
            ],
            backlogged,
        )
        heavy, light = backlogged.served.get("heavy", 0.0), backlogged.served.get("light", 0.0)
        outcome.service = {"heavy": heavy, "light": light}
        outcome.ratio = heavy / light if light else math.inf
        outcome.jain = jain([heavy, light])
        done = sum(len(v) for v in backlogged.ttfts.values())
        outcome.throughput = done / options.seconds
        # The light tenant below its fair share: a fifth of what the fleet serves.
        outcome.light_rate = rate = max(0.5, outcome.throughput / 5)
        alone = Phase()
        await _window(
            http,
            url,
            options,
            [lambda stop: _open_loop(http, url, "light", rate, options, stop, alone, rng)],
            alone,
        )
        flood = Phase()
        await _window(
            http,
            url,
            options,
            [
                lambda stop: _closed_loop(
                    http, url, "heavy", heavy_workers, options, stop, flood, rng
                ),
                lambda stop: _open_loop(http, url, "light", rate, options, stop, flood, rng),
            ],
            flood,
        )
        outcome.ttft_alone = percentile(alone.ttfts.get("light", [0.0]), 0.99)
        outcome.ttft_flood = percentile(flood.ttfts.get("light", [0.0]), 0.99)
        outcome.queue_alone, outcome.queue_flood = alone.light_queue_s, flood.light_queue_s
        outcome.errors += backlogged.errors + alone.errors + flood.errors


async def _chat_hit_rate(options: Options, fair: bool) -> tuple[float, int]:
    """The multi-tenant chat workload through a saturated router: the replicas' hit rate."""
    conversations = multi_tenant_chat(
        tenants=8, conversations_per_tenant=8, turns=4, system_prompt_words=300, seed=options.seed
    )
    errors = 0
    # Small caches: about three tenants' system prompts per replica, so order matters.
    async with (
        fleet(options, num_blocks=256, fair=fair) as (url, urls),
        aiohttp.ClientSession() as http,
    ):
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


async def run(options: Options) -> Outcome:
    outcome = Outcome()
    await _service_and_latency(options, outcome)
    outcome.hit_fifo, e1 = await _chat_hit_rate(options, fair=False)
    outcome.hit_fair, e2 = await _chat_hit_rate(options, fair=True)
    outcome.errors += e1 + e2
    return outcome


# -- the report ----------------------------------------------------------------------------


def _mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(outcome: Outcome, options: Options, command: str) -> str:
    o = outcome
    ratio_ok = abs(o.ratio - 1.0) <= TARGET_RATIO
    ttft_x = o.ttft_flood / o.ttft_alone if o.ttft_alone else math.inf
    hit_x = o.hit_fair / o.hit_fifo if o.hit_fifo else math.inf
    lines = [
        f"## Fair admission between tenants ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        f"{options.replicas} emulated replicas ({options.preset} latency model) in one process "
        f"with the router; limits.max_concurrent_requests {options.slots} (the bottleneck); "
        f"fairness.output_weight {OUTPUT_WEIGHT:g}; prompts of ~{options.prompt_words} words, "
        f"{options.max_tokens} output tokens; {options.seconds:g} s windows after "
        f"{options.warmup_s:g} s warm-up. {machine_line()}.",
        "",
        "| measure | value | target | |",
        "|---|---:|---:|---|",
        f"| weighted service heavy : light (both backlogged, {options.light * options.heavy_factor} "
        f"vs {options.light} in flight) | {o.ratio:.3f} | 1 +- {TARGET_RATIO:.0%} | {_mark(ratio_ok)} |",
        f"| Jain's index | {o.jain:.4f} | >= {TARGET_JAIN} | {_mark(o.jain >= TARGET_JAIN)} |",
        f"| light TTFT p99 alone ({o.light_rate:.1f} req/s open loop) | {o.ttft_alone * 1000:.0f} ms | | |",
        f"| light TTFT p99 under the flood | {o.ttft_flood * 1000:.0f} ms ({ttft_x:.2f}x) "
        f"| <= {TARGET_TTFT}x | {_mark(ttft_x <= TARGET_TTFT)} |",
        f"| prefix hit rate, FIFO admission (multi-tenant chat) | {o.hit_fifo:.3f} | | |",
        f"| prefix hit rate, fair admission with locality | {o.hit_fair:.3f} ({hit_x:.2f}x) "
        f"| >= {TARGET_HIT_RATE}x | {_mark(hit_x >= TARGET_HIT_RATE)} |",
        "",
        f"Saturated throughput {o.throughput:.1f} requests/s; weighted tokens served in the "
        f"window: heavy {o.service.get('heavy', 0):.0f}, light {o.service.get('light', 0):.0f}; "
        f"failed requests: {o.errors}. The light tenant's mean wait for admission: "
        f"{o.queue_alone * 1000:.1f} ms alone, {o.queue_flood * 1000:.1f} ms under the flood "
        "(the rest of its TTFT is the replicas', busier under the flood, and this one process's "
        "event loop, shared by client, router and replicas).",
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
    p.add_argument("--replicas", type=positive_int, default=2)
    p.add_argument(
        "--slots", type=positive_int, default=4, help="limits.max_concurrent_requests (default 4)"
    )
    p.add_argument(
        "--light", type=positive_int, default=4, help="the light tenant's requests in flight"
    )
    p.add_argument("--heavy-factor", type=positive_int, default=10)
    p.add_argument("--seconds", type=float, default=20.0, help="each measured window")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
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
        warmup_s=args.warmup,
        seed=args.seed,
        output_md=args.output_md,
        no_record=args.no_record,
    )
    outcome = asyncio.run(run(options))
    text = report(outcome, options, reproduce_command(sys.argv, "fairness"))
    print(text)
    if not options.no_record:
        record(Path(options.output_md), text)
    return 0
