"""``kvroute bench budgets``: a tenant's token budget over several routers.

One tenant with an output-token budget sends requests, ``--concurrency`` at a time, spread
round robin over N ``kvroute serve`` routers in front of the same emulated replicas, for
``--duration`` seconds from a full budget. Three cases, each on routers started for it:

* one router (the reference: what a budget grants under this load);
* N routers sharing their budget charges over NATS (``tenants.budget_bus``);
* N routers that do not (each enforces the whole budget on its own).

Reported: the output tokens the tenant was served, against what the budget allows over the
run (a full minute's bucket plus its refill) and against one router. ``nats-server`` on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import add_report_args, add_startup_timeout, positive_float
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import (
    Launch,
    kvroute_cli,
    replica_argv,
    serve_argv,
    start_all,
    start_router,
)
from kvroute.bench.harness.host import machine_line, record
from kvroute.bench.harness.nats import nats_server
from kvroute.bench.harness.report import reproduce_command

MODEL = "tiny"
TENANT = "acme"
MAX_TOKENS = 8


@dataclass
class Options:
    routers: int = 4
    replicas: int = 2
    output_per_minute: int = 6000
    duration_s: float = 20.0
    concurrency: int = 16
    startup_timeout_s: float = 60.0
    output_md: str = "BENCHMARKS.md"
    no_record: bool = False


@dataclass(frozen=True)
class Case:
    name: str  # "one router", "bus", "no bus"
    routers: int
    bus: bool


@dataclass
class Served:
    case: Case
    output_tokens: int
    answered: int
    refused: int
    elapsed_s: float

    def allowed(self, per_minute: int) -> float:
        """What the budget grants over the run: a full minute's bucket plus its refill."""
        return per_minute * (1 + self.elapsed_s / 60)


def cases(options: Options) -> list[Case]:
    return [
        Case("one router", 1, False),
        Case(f"{options.routers} routers, budget bus", options.routers, True),
        Case(f"{options.routers} routers, no bus", options.routers, False),
    ]


@contextlib.contextmanager
def fleet(options: Options, case: Case, log_dir: Path) -> Iterator[list[str]]:
    cli, timeout_s = kvroute_cli(), options.startup_timeout_s
    with contextlib.ExitStack() as stack:
        bus = stack.enter_context(nats_server(log_dir)) if case.bus else None
        replica_ports = free_ports(options.replicas)
        flags = ["--preset", "llama-3.1-8b-h100", "--max-num-seqs", "256"]
        urls = start_all(
            stack,
            "replica",
            lambda p: replica_argv(p, MODEL, *flags, cli=cli),
            replica_ports,
            log_dir,
            timeout_s,
        )
        tenants: dict[str, Any] = {
            "by_name": {TENANT: {"output_tokens_per_minute": options.output_per_minute}}
        }
        if bus is not None:
            tenants["budget_bus"] = bus
        body = {"replicas": [{"url": u} for u in urls], "tenants": tenants}
        config = log_dir / f"router-{case.routers}-{case.bus}.yaml"
        config.write_text(json.dumps(body))
        routers = []
        for k, port in enumerate(free_ports(case.routers)):
            serve = Launch(serve_argv(port, (), "--config", str(config), cli=cli), "/ready")
            url, _ = start_router(stack, f"router-{k}", serve, port, log_dir, timeout_s)
            routers.append(url)
        yield routers


async def drive(routers: list[str], options: Options, case: Case) -> Served:
    body = {"model": MODEL, "prompt": "Say ok.", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    headers = {"X-Tenant-Id": TENANT}
    served = Served(case, 0, 0, 0, 0.0)
    started = time.monotonic()
    deadline = started + options.duration_s

    async def sender(http: aiohttp.ClientSession, url: str) -> None:
        while time.monotonic() < deadline:
            async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
                data = await resp.read()
                if resp.status == 200:
                    served.answered += 1
                    served.output_tokens += json.loads(data)["usage"]["completion_tokens"]
                elif resp.status == 429:
                    served.refused += 1
                    # As a well-behaved client does: wait before retrying, a little.
                    await asyncio.sleep(0.05)
                else:
                    raise processes.StartError(f"{url} answered HTTP {resp.status}: {data[:200]!r}")

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        urls = [routers[i % len(routers)] for i in range(options.concurrency)]
        await asyncio.gather(*(sender(http, url) for url in urls))
    served.elapsed_s = time.monotonic() - started
    return served


def measure(options: Options, echo: Any = print) -> list[Served]:
    results = []
    with processes.session("kvroute-bench-budgets-") as logs:
        for case in cases(options):
            with fleet(options, case, logs) as routers:
                served = asyncio.run(drive(routers, options, case))
            results.append(served)
            if echo:
                echo(
                    f"{case.name}: {served.output_tokens:,} output tokens in "
                    f"{served.answered:,} answers, {served.refused:,} refused (429)"
                )
    return results


def report(results: list[Served], options: Options, command: str) -> str:
    one = results[0]
    per_minute = options.output_per_minute
    lines = [
        f"## A tenant's budget over several routers ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        f"One tenant, output budget {per_minute:,} tokens per minute, {options.concurrency} "
        f"requests at a time of {MAX_TOKENS} output tokens each, spread round robin over the "
        f"routers, for {options.duration_s:g} s from a full budget; `kvroute serve` routers in "
        f"front of {options.replicas} emulated replicas (llama-3.1-8b-h100 latency model). "
        f"Allowed = the budget's full bucket plus its refill over the run. {machine_line()}.",
        "",
        "| case | output tokens served | allowed | served / allowed | vs one router | "
        "answered | refused (429) |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        allowed = r.allowed(per_minute)
        lines.append(
            f"| {r.case.name} | {r.output_tokens:,} | {allowed:,.0f} | "
            f"{r.output_tokens / allowed:.3f}x | {r.output_tokens / one.output_tokens:.2f}x | "
            f"{r.answered:,} | {r.refused:,} |"
        )
    lines.append("")
    return "\n".join(lines)


def add_budgets_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "budgets",
        help="A tenant's token budget over several kvroute serve routers: with the budget "
        "bus, without it, and one router.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--routers", type=int, default=4, help="Routers (default 4).")
    p.add_argument(
        "--output-per-minute",
        type=int,
        default=6000,
        metavar="TOKENS",
        help="The tenant's output_tokens_per_minute (default 6000).",
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        default=20.0,
        metavar="S",
        help="Seconds of load per case (default 20).",
    )
    p.add_argument(
        "--concurrency", type=int, default=16, help="Requests at a time, over all routers."
    )
    add_startup_timeout(p)
    add_report_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    for name, value, least in (
        ("--routers", args.routers, 2),
        ("--output-per-minute", args.output_per_minute, 1),
        ("--concurrency", args.concurrency, 1),
    ):
        if value < least:
            print(f"kvroute bench budgets: {name} must be at least {least}", file=sys.stderr)
            return 2
    options = Options(
        routers=args.routers,
        output_per_minute=args.output_per_minute,
        duration_s=args.duration,
        concurrency=args.concurrency,
        startup_timeout_s=args.startup_timeout,
        output_md=args.output_md,
        no_record=args.no_record,
    )
    try:
        results = measure(options, echo=lambda line: print(line, flush=True))
    except processes.StartError as exc:
        print(f"kvroute bench budgets: {exc}", file=sys.stderr)
        return 1
    text = report(results, options, reproduce_command(sys.argv, "budgets"))
    print(text)
    if not options.no_record:
        record(Path(options.output_md), text)
    return 0
