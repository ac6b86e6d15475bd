"""``kvroute bench soak``: hours of mixed traffic with faults; do the router's resources stay flat?

One ``kvroute serve`` launches and supervises emulated replicas (KV events on, small caches
that fill and evict) and routes with kv_aware. The soak drives mixed traffic through it
(``soak_traffic``), kills replicas on a schedule (``soak_kills``: the serve process restarts
them), hangs up streams and sends bad input, and samples the router's RSS, open fds, prefix
index entries and in-flight gauges (``soak_measure``). After the warm-up, a window at the start
and one at the end must be within 5% of each other; once the traffic stops, the in-flight
counters must return to 0. A bench rather than a drill scenario: a drill is one fault and what
clients lost, this is a long run, many faults and a resource report for BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvroute.backends.process import free_ports
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import Launch, kvroute_cli, start_router
from kvroute.bench.harness.host import (
    kvroute_version,
    machine_line,
    python_version,
    record,
    utc_stamp,
)
from kvroute.bench.harness.metrics import metrics_page, metrics_text
from kvroute.bench.harness.processes import StartError
from kvroute.bench.harness.report import reproduce_command
from kvroute.bench.soak_kills import Kill, Replica, kill, replicas
from kvroute.bench.soak_measure import Sample, gauges, idle, take_sample
from kvroute.bench.soak_procs import RouterTree
from kvroute.bench.soak_report import SoakResult, markdown_section, text_report
from kvroute.bench.soak_traffic import (
    LIVE_CONVERSATIONS,
    TENANTS,
    Conversations,
    Tally,
    bad_inputs,
    hang_up,
    normal_plan,
    send_bad,
)
from kvroute.simulator.loadgen import run_open_loop

MODEL = "tiny"
BLOCK_SIZE = 32
# Small, so the oversized-body fault costs little to send.
MAX_BODY_BYTES = 256 * 1024
READY_TIMEOUT_S = 60.0
# In-flight counters must be back at 0 this soon after the last answer.
IDLE_TIMEOUT_S = 30.0
POLL_S = 0.05
# /metrics and /admin answers; generous, the machines soaks run on are often busy.
ADMIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SoakOptions:
    duration_s: float
    warmup_s: float
    rate: float
    sample_interval_s: float
    replicas: int
    blocks: int
    kill_every_s: float  # 0: no kills
    hang_up_every_s: float  # 0: no hang-ups
    bad_input_every_s: float  # 0: no bad input
    seed: int
    startup_timeout_s: float
    output_md: str
    record: bool


def cycle_samples(kill_every_s: float, replicas: int, sample_interval_s: float) -> int:
    """Samples in a kill cycle (every replica killed once): the period of the index's sawtooth."""
    return math.ceil(kill_every_s * replicas / sample_interval_s)


def measured_samples(duration_s: float, warmup_s: float, sample_interval_s: float) -> int:
    """Samples taken from the end of the warm-up to the end of the traffic."""
    return int((duration_s - warmup_s) / sample_interval_s) + 1


def soak_config(options: SoakOptions, port: int, log_dir: Path) -> dict[str, Any]:
    """The router config: replicas launched by serve, drill-like timeouts so a killed replica
    leaves rotation within a second or two."""
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "launch": {
            "engine": "emulated",
            "count": options.replicas,
            "model": MODEL,
            "block_size": BLOCK_SIZE,
            "num_gpu_blocks": options.blocks,
            "max_num_seqs": 64,
            "kv_events": True,
            "log_dir": str(log_dir),
            "max_restarts": 1_000_000,  # every kill is restarted, however long the soak
        },
        "policy": {"name": "kv_aware"},
        "limits": {"max_body_bytes": MAX_BODY_BYTES},
        "timeouts": {"first_byte_s": 1.0, "first_token_s": 60.0, "idle_s": 10.0},
        "health": {"interval_s": 1.0, "timeout_s": 1.0, "unhealthy_after": 2},
        "breaker": {"consecutive_failures": 3, "cooldown_s": 2.0},
    }


def header_lines(options: SoakOptions) -> list[str]:
    o = options
    faults = [
        f"a replica killed every {o.kill_every_s:g} s" if o.kill_every_s else "no kills",
        f"a client hanging up a stream every {o.hang_up_every_s:g} s"
        if o.hang_up_every_s
        else "no hang-ups",
        f"bad input every {o.bad_input_every_s:g} s" if o.bad_input_every_s else "no bad input",
    ]
    return [
        f"machine: {machine_line()}",
        f"versions: {kvroute_version()}, {python_version()}",
        f"fleet: {o.replicas} emulated replicas ({o.blocks} KV blocks of {BLOCK_SIZE} tokens "
        "each, KV events on) launched and supervised by one `kvroute serve`, policy kv_aware",
        f"load: {o.rate:g} req/s for {o.duration_s:g} s, chat and completions, streamed and not "
        f"({LIVE_CONVERSATIONS} multi-turn conversations of {TENANTS} tenants at a time); "
        f"warm-up {o.warmup_s:g} s; a sample every {o.sample_interval_s:g} s",
        "faults: " + ", ".join(faults),
    ]


def run_soak(options: SoakOptions, argv: list[str]) -> int:
    command = reproduce_command(argv, "soak")
    header = header_lines(options)
    print(f"command: {command}", *header, sep="\n", flush=True)
    with processes.session("kvroute-soak-") as tmp, contextlib.ExitStack() as stack:
        port = free_ports(1)[0]
        config = tmp / "soak.yaml"
        config.write_text(yaml.safe_dump(soak_config(options, port, tmp / "replicas")))
        serve = Launch([*kvroute_cli(), "serve", "--config", str(config)], "/ready")
        url, router = start_router(stack, "router", serve, port, tmp, options.startup_timeout_s)
        result = asyncio.run(_drive(options, url, RouterTree(router.pid)))
    result.judge()
    print()
    print(text_report(header, result), flush=True)
    if options.record:
        title = f"Soak: {options.duration_s:g} s of mixed traffic with faults, {utc_stamp()}"
        path = Path(options.output_md)
        record(path, markdown_section(title, command, header, result))
        print(f"\nappended to {path}")
    return 1 if result.failures() else 0


async def _drive(options: SoakOptions, url: str, tree: RouterTree) -> SoakResult:
    tally = Tally()
    samples: list[Sample] = []
    admin_timeout = aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=admin_timeout) as admin:
        fleet = await _wait_all_healthy(admin, url, options.replicas)
        before = await _counters(admin, url)
        started = time.monotonic()
        sampler = asyncio.create_task(_sample(admin, url, tree, started, options, samples))
        kills = asyncio.create_task(_kills(admin, url, tree, fleet, started, options))
        # Like a client: no total limit, but a long silence is an error.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            misbehaving = asyncio.create_task(_misbehave(http, url, started, options, tally))
            plan = normal_plan(url, MODEL, options.rate, options.duration_s, options.seed, tally)
            await run_open_loop(http, plan, started=started, on_done=tally.on_normal)
            hang_ups = await misbehaving
        stopped = time.monotonic()
        print(f"traffic done after {stopped - started:.0f} s; waiting for idle", flush=True)
        idle_after_s, idle_gauges = await _wait_idle(admin, url, stopped)
        killed = await kills
        missed = await sampler
        after = await _counters(admin, url)
    counters = {k: after[k] - before[k] for k in after}
    return SoakResult(
        samples,
        tally,
        killed,
        hang_ups,
        idle_after_s,
        idle_gauges,
        counters,
        options.warmup_s,
        cycle_samples(options.kill_every_s, options.replicas, options.sample_interval_s),
        missed_samples=missed,
        # Each replica caches at most ``blocks`` blocks, so an index that tracks them truly
        # holds at most replicas x blocks entries, however long it takes to fill.
        ceilings={"index_entries": float(options.replicas * options.blocks)},
    )


async def _counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    page = await metrics_page(http, url)
    return {
        "retries": page.sum("kvroute_retries_total", kind="retry"),
        "resumed": page.sum("kvroute_stream_resumes_total", outcome="resumed"),
        "resyncs": page.sum("kvroute_kv_event_resyncs_total"),
    }


async def _wait_all_healthy(http: aiohttp.ClientSession, url: str, count: int) -> list[Replica]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = await replicas(http, url)
        if len(rows) == count and all(r["healthy"] and not r["ejected"] for r in rows):
            return [Replica(str(r["name"]), str(r["url"])) for r in rows]
        await asyncio.sleep(POLL_S)
    raise StartError(f"not every replica became healthy within {READY_TIMEOUT_S:g} s: {rows}")


async def _every(
    started: float,
    period_s: float,
    until_s: float,
    action: Callable[[int, float], Coroutine[Any, Any, Any]],
) -> list[Any]:
    """Start ``action(k, t)`` at t = (k + 1/2) * period_s into the run, while t < until_s (each
    on time, whatever the earlier ones are doing); their results once all are done."""
    tasks: list[asyncio.Task[Any]] = []
    k = 0
    while period_s > 0 and (at := (k + 0.5) * period_s) < until_s:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        tasks.append(asyncio.create_task(action(k, at)))
        k += 1
    return list(await asyncio.gather(*tasks))


async def _kills(
    http: aiohttp.ClientSession,
    url: str,
    tree: RouterTree,
    fleet: list[Replica],
    started: float,
    options: SoakOptions,
) -> list[Kill]:
    async def one(k: int, at: float) -> Kill:
        replica = fleet[k % len(fleet)]
        print(f"t={at:.0f}s: killing {replica.name}", flush=True)
        return await kill(http, url, tree, replica, at)

    return await _every(started, options.kill_every_s, options.duration_s, one)


async def _misbehave(
    http: aiohttp.ClientSession, url: str, started: float, options: SoakOptions, tally: Tally
) -> int:
    """Hang-ups and bad input on their schedules; how many hang-ups were started."""
    prompts = Conversations(random.Random(options.seed + 1))
    bad = bad_inputs(MODEL, MAX_BODY_BYTES)

    async def hang(k: int, at: float) -> None:
        await hang_up(http, url, MODEL, prompts.tenant_prompt(), tally)

    async def send(k: int, at: float) -> None:
        await send_bad(http, url, bad[k % len(bad)], tally)

    hung: list[Any]
    hung, _ = await asyncio.gather(
        _every(started, options.hang_up_every_s, options.duration_s, hang),
        _every(started, options.bad_input_every_s, options.duration_s, send),
    )
    return len(hung)


async def _sample(
    http: aiohttp.ClientSession,
    url: str,
    tree: RouterTree,
    started: float,
    options: SoakOptions,
    samples: list[Sample],
) -> int:
    """A sample every interval from t=0 to the end of the traffic, progress every tenth; how
    many were missed (the router did not answer /metrics in time: a busy machine, not a leak)."""
    count = int(options.duration_s / options.sample_interval_s) + 1
    missed = 0
    for k in range(count):
        await asyncio.sleep(max(0.0, started + k * options.sample_interval_s - time.monotonic()))
        try:
            text = await metrics_text(http, url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            missed += 1
            print(f"t={time.monotonic() - started:.0f}s: no sample: {exc!r}", flush=True)
            continue
        sample = take_sample(time.monotonic() - started, tree, text)
        samples.append(sample)
        if k % max(1, count // 10) == 0:
            print(
                f"t={sample.t:.0f}s: RSS {sample.rss_bytes / 2**20:.1f} MiB, "
                f"{sample.open_fds:.0f} fds, {sample.index_entries:.0f} index entries, "
                f"{sample.in_flight_requests:.0f} in flight",
                flush=True,
            )
    return missed


async def _wait_idle(
    http: aiohttp.ClientSession, url: str, stopped: float
) -> tuple[float | None, dict[str, float]]:
    """Seconds from the end of the traffic until every in-flight gauge reads 0 (None if they
    did not within IDLE_TIMEOUT_S), and the gauges as last read."""
    last: dict[str, float] = {}
    while time.monotonic() < stopped + IDLE_TIMEOUT_S:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            last = gauges(await metrics_page(http, url))
        if last and idle(last):
            return time.monotonic() - stopped, last
        await asyncio.sleep(POLL_S)
    return None, last
