"""``kvroute bench fairness --routers N``: tenants' fair shares over several routers.

N ``kvroute serve`` routers in front of the same emulated replicas, each with
``limits.max_concurrent_requests`` ``--slots`` (the fleet's capacity split over the routers, so
admission decides who goes next). Two tenants of equal weight, both backlogged (closed loops):
``spread`` sends over all N routers round robin (behind a load balancer), ``local`` to the first
router only. Four cases, each on a fleet started for it, side by side in one run:

* one router with N x ``--slots`` (the reference: what fair admission gives the two);
* N routers on a budget bus without ``fairness.share_bus`` (each counts what it served only);
* N routers on the same bus with ``fairness.share_bus`` (each counts what the others served);
* the same with ``fairness.share_slots`` too (each admits each tenant up to its part of the
  fleet's slots: the local tenant may take more than the first router's own limit).

Reported per case and tenant: its share of the weighted tokens served (input +
fairness.output_weight x output, the routers' /admin/tenants summed), and its TTFT p50 and p99
(this client's, both tenants on one event loop). ``nats-server`` on PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from kvroute.backends.process import free_ports
from kvroute.bench.fairness import (
    OUTPUT_WEIGHT,
    Options,
    _prompt_body,
    _stream,
    _tenant_rows,
    _weighted,
    jain,
)
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import (
    Launch,
    kvroute_cli,
    replica_argv,
    serve_argv,
    start_all,
    start_router,
)
from kvroute.bench.harness.host import machine_line
from kvroute.bench.harness.nats import nats_server
from kvroute.kvcore.stats import percentile
from kvroute.router.config import FairnessConfig

SPREAD, LOCAL = "spread", "local"
TENANTS = (SPREAD, LOCAL)
SHARED = "spread via the first router"  # the spread tenant's requests that meet the local one
# What the routers run with: the defaults.
LEAD, WAIT = FairnessConfig().share_max_lead_tokens, FairnessConfig().share_max_wait_s


@dataclass(frozen=True)
class Case:
    name: str
    routers: int
    share: bool | None  # None: no bus at all (one router)
    slots: bool = False  # fairness.share_slots


@dataclass
class Result:
    case: Case
    served: dict[str, float] = field(default_factory=dict)  # weighted tokens, per tenant
    ttfts: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0

    def share(self, tenant: str) -> float:
        total = sum(self.served.values())
        return self.served.get(tenant, 0.0) / total if total else 0.0

    def ttft(self, tenant: str, q: float) -> float:
        return percentile(self.ttfts.get(tenant) or [0.0], q)


def cases(routers: int) -> list[Case]:
    return [
        Case("one router (reference)", 1, None),
        Case(f"{routers} routers, shares not shared", routers, False),
        Case(f"{routers} routers, fairness.share_bus", routers, True),
        Case(f"{routers} routers, fairness.share_bus + share_slots", routers, True, True),
    ]


@contextlib.contextmanager
def fleet(options: Options, routers: int, case: Case, log_dir: Path) -> Iterator[list[str]]:
    """The replicas and ``case.routers`` routers in front of them: the routers' URLs."""
    cli, timeout_s = kvroute_cli(), options.startup_timeout_s
    with contextlib.ExitStack() as stack:
        bus = stack.enter_context(nats_server(log_dir)) if case.share is not None else None
        flags = ["--preset", options.preset, "--max-num-seqs", "256"]
        urls = start_all(
            stack,
            "replica",
            lambda p: replica_argv(p, "tiny", *flags, cli=cli),
            free_ports(options.replicas),
            log_dir,
            timeout_s,
        )
        # The fleet's capacity is the same in every case: one router gets all of it.
        slots = options.slots * (routers if case.routers == 1 else 1)
        config: dict[str, Any] = {
            "replicas": [{"url": u} for u in urls],
            "limits": {
                "max_concurrent_requests": slots,
                "max_queued_requests": 10_000,
                "queue_timeout_s": 300.0,
            },
            "fairness": {
                "output_weight": OUTPUT_WEIGHT,
                "share_bus": bool(case.share),
                "share_slots": case.slots,
                "share_slots_max_factor": options.share_slots_max_factor,
            },
            "health": {"interval_s": 0.5},
        }
        if bus is not None:
            config["tenants"] = {"budget_bus": bus}
        path = log_dir / f"router-{case.routers}-{case.share}-{case.slots}.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        out = []
        for k, port in enumerate(free_ports(case.routers)):
            serve = Launch(serve_argv(port, (), "--config", str(path), cli=cli), "/ready")
            url, _ = start_router(stack, f"router-{k}", serve, port, log_dir, timeout_s)
            out.append(url)
        yield out


async def _served(http: aiohttp.ClientSession, routers: list[str]) -> dict[str, float]:
    """Weighted tokens each tenant was served, summed over the routers."""
    total: dict[str, float] = {}
    for url in routers:
        for tenant, row in (await _tenant_rows(http, url)).items():
            total[tenant] = total.get(tenant, 0.0) + _weighted(row)
    return total


async def drive(options: Options, routers: list[str], case: Case, workers: int) -> Result:
    """Both tenants backlogged, ``workers`` requests each in flight: spread over every router
    (round robin by worker), local to the first. Measured after the warm-up."""
    result, stop = Result(case), asyncio.Event()
    rng = random.Random(options.seed)
    measuring = False

    async def worker(http: aiohttp.ClientSession, tenant: str, url: str) -> None:
        while not stop.is_set():
            body = _prompt_body(rng, tenant, options)
            ttft = await _stream(http, url, "/v1/completions", body, tenant)
            if ttft is None:
                result.errors += 1
            elif measuring:
                result.ttfts.setdefault(tenant, []).append(ttft)
                if tenant == SPREAD and url == routers[0]:
                    result.ttfts.setdefault(SHARED, []).append(ttft)

    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        tasks = [
            asyncio.create_task(worker(http, SPREAD, routers[i % len(routers)]))
            for i in range(workers)
        ]
        tasks += [asyncio.create_task(worker(http, LOCAL, routers[0])) for _ in range(workers)]
        await asyncio.sleep(options.warmup_s)
        before = await _served(http, routers)
        measuring = True
        await asyncio.sleep(options.seconds)
        after = await _served(http, routers)
        stop.set()
        # Requests still waiting (a spread one starved on the first router) finish now and
        # count their wait: the TTFT says what starving costs.
        await asyncio.gather(*tasks)
    result.served = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in TENANTS}
    return result


def run(options: Options, routers: int, echo: Any = print) -> list[Result]:
    results = []
    workers = 2 * options.slots * routers  # each tenant's in flight: backlogged on every router
    with processes.session("kvroute-bench-fairness-routers-") as logs:
        for case in cases(routers):
            with fleet(options, routers, case, logs) as urls:
                result = uvloop.run(drive(options, urls, case, workers))
            results.append(result)
            if echo:
                echo(
                    f"{case.name}: spread {result.share(SPREAD):.3f}, local "
                    f"{result.share(LOCAL):.3f} of the weighted tokens; {result.errors} failed"
                )
    return results


def report(results: list[Result], options: Options, routers: int, command: str) -> str:
    ref = results[0]
    workers = 2 * options.slots * routers
    factor = options.share_slots_max_factor
    lines = [
        f"## Tenants' fair shares over several routers ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        f"Two tenants of equal weight, both backlogged ({workers} requests each in flight, "
        f"closed loops): `spread` round robin over all the routers, `local` to the first only. "
        f"{options.replicas} emulated replicas (`kvroute replica`, {options.preset} latency "
        f"model), each router (`kvroute serve`) a process of its own with "
        f"limits.max_concurrent_requests {options.slots} (one router: {options.slots * routers}: "
        f"the same fleet capacity), so admission decides who goes next; the routers on one NATS "
        f"server (tenants.budget_bus; no budgets set), fairness.share_bus off or on "
        f"(share_max_lead_tokens {LEAD:g}, share_max_wait_s {WAIT:g}), and with "
        f"fairness.share_slots (share_slots_max_factor {factor:g}: the first router admits at "
        f"most {factor:g} x its limit). Prompts of ~{options.prompt_words} words, "
        f"{options.max_tokens} output tokens; a {options.seconds:g} s window after "
        f"{options.warmup_s:g} s warm-up. Share: of the weighted tokens served in the window "
        f"(input + {OUTPUT_WEIGHT:g} x output, the routers' /admin/tenants summed). TTFT: the "
        f"client's (both tenants on one event loop), requests finished after the window "
        f"included; the spread tenant's requests sent to the first router (where the local "
        f"one competes) apart. Weighted tokens/s moves with the box's load, the shares do not. "
        f"{machine_line()}.",
        "",
        "| case | spread share | local share | local share vs one router | Jain's index "
        "| weighted tokens/s | spread TTFT p50 / p99 | local TTFT p50 / p99 "
        "| spread via the first router: requests, TTFT p50 / max | failed |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        spread, local = r.served.get(SPREAD, 0.0), r.served.get(LOCAL, 0.0)
        vs = r.share(LOCAL) / ref.share(LOCAL) if ref.share(LOCAL) else 0.0
        first = r.ttfts.get(SHARED, [])
        lines.append(
            f"| {r.case.name} | {r.share(SPREAD):.3f} | {r.share(LOCAL):.3f} | {vs:.2f}x "
            f"| {jain([spread, local]):.3f} | {(spread + local) / options.seconds:,.0f} "
            f"| {r.ttft(SPREAD, 0.5) * 1000:.0f} / {r.ttft(SPREAD, 0.99) * 1000:.0f} ms "
            f"| {r.ttft(LOCAL, 0.5) * 1000:.0f} / {r.ttft(LOCAL, 0.99) * 1000:.0f} ms "
            f"| {len(first)}, {percentile(first or [0.0], 0.5) * 1000:.0f} / "
            f"{max(first, default=0.0) * 1000:.0f} ms | {r.errors} |"
        )
    lines.append("")
    return "\n".join(lines)
