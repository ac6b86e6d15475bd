"""``kvroute bench epp``: the endpoint picker behind a real Envoy, against the issue's targets.

One run starts N instant-answer stub upstreams, ``kvroute epp`` as its own process, and one
Envoy (``kvroute.gateway``) with two listeners over the same pods: the picker's (ext_proc,
``FULL_DUPLEX_STREAMED`` bodies, ``override_host``) and a direct one that routes round robin.
Same Envoy, same pods, same client: what the picker listener adds over the direct one is the
picker's cost (the ext_proc stream, the body echoed back, parse, tokenize, route).

* ``latency``: wrk at a fixed concurrency POSTs 1 KB completions prompts (each one distinct, so
  no tokenizer cache or prefix match makes the picker's work lighter than a real request's),
  in rounds alternating direct and picker so that the machine's noise hits both. The added
  latency is picker minus direct within a round; the report gives medians over rounds.
* ``large``: agent conversations (220 KB of chat history, +2 KB a turn, tokenized by the picker
  with a real HuggingFace tokenizer) at a concurrency meant to saturate the picker: picks/s,
  the picker's CPU over the measured window (was it the bottleneck?), and the same workload
  through the direct listener, the ceiling set by everything but the picker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvroute.bench import overhead
from kvroute.bench.argtypes import (
    add_report_args,
    add_startup_timeout,
    non_negative_int,
    positive_float,
    positive_int,
)
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import HOST, kvroute_argv, running_stubs
from kvroute.bench.harness.host import (
    cpu_count,
    kvroute_version,
    machine_line,
    python_version,
    record,
    shown_path,
    utc_stamp,
)
from kvroute.bench.harness.metrics import scrape
from kvroute.bench.harness.procs import group_cpu_s, machine_busy_s, process_cpu_s
from kvroute.bench.harness.report import errors_cell, one_line, reproduce_command, section_head
from kvroute.bench.harness.sampling import Sampler
from kvroute.bench.loadgen import LoadError, find_wrk, parse_wrk, wrk_output, wrk_version

if TYPE_CHECKING:
    from kvroute.gateway import EnvoyProcess

SCENARIOS = ("latency", "large")
# The targets.
ADDED_P50_MS = 1.0
ADDED_P99_MS = 3.0
LARGE_PICKS_PER_S = 400.0
TARGET_START_KB = 220  # the large-prompt target's conversation size
PROMPT_CHARS = 1000  # the latency target's "1 KB prompts"
MAX_TOKENS = 8
SATURATED_CORES = 0.9  # a Python process at about one core: it is the bottleneck
READY_SERVICE = "readiness"  # kvroute epp's gRPC health: SERVING once its endpoints are probed
_POLL_S = 0.1


@dataclass(frozen=True)
class Options:
    scenarios: tuple[str, ...] = SCENARIOS
    rounds: int = 3
    concurrency: int = 8
    duration_s: int = 10
    warmup_s: int = 2
    upstreams: int = 2
    threads: int = 2
    large_concurrency: int = 32
    conversations: int = 32
    start_kb: int = 220
    turn_kb: float = 2.0
    tokenizer: str | None = None  # default: overhead.agent_tokenizer's (the tiny model's)
    policy: str | None = None  # default: kvroute's
    envoy_workers: int = 1
    model: str = "stub-model"
    startup_timeout_s: float = 60.0
    output: str = "BENCHMARKS.md"
    record: bool = True

    def overhead_options(self) -> overhead.Options:
        """The same settings as ``kvroute bench overhead`` reads them (stubs, tokenizer)."""
        return overhead.Options(
            upstreams=self.upstreams,
            model=self.model,
            startup_timeout_s=self.startup_timeout_s,
            tokenizer=self.tokenizer,
        )


# ------------------------------------------------------------------ CPU accounting


def cpu_sampler(gateway: Gateway) -> Sampler:
    """Cores busy: "picker" (its process group), "picker main", "envoy", "client", "machine"."""
    pid = gateway.picker.pid
    envoy = gateway.envoy.process
    envoy_pid = envoy.pid if envoy is not None else 0
    me = os.getpid()

    def cpu() -> dict[str, float]:
        return {
            "picker": group_cpu_s(pid),
            "picker main": process_cpu_s(pid),
            "envoy": process_cpu_s(envoy_pid),
            "client": process_cpu_s(me),  # the large scenario's load generator
            "machine": machine_busy_s(),
        }

    return Sampler(cpu)


def decision_sampler(gateway: Gateway) -> Sampler:
    """The picker's "decision_s" and "decisions" totals from its /metrics, once a second only:
    a scrape costs the picker some CPU (so only while a window is known only afterwards)."""
    last = {"decision_s": 0.0, "decisions": 0.0}

    def decisions() -> dict[str, float]:
        read = decision_counters(gateway.metrics_url)
        if read is not None:  # a failed scrape keeps the last totals: no false drop and jump
            last["decision_s"], last["decisions"] = read
        return dict(last)

    return Sampler(decisions, 1.0)


# ------------------------------------------------------------------ the gateway


@dataclass
class Gateway:
    direct_url: str  # Envoy straight to the pods, round robin
    epp_url: str  # Envoy asking kvroute epp
    metrics_url: str  # the picker's /metrics
    picker: processes.Child
    envoy: EnvoyProcess


def picker_argv(
    upstreams: Sequence[str], ports: Sequence[int], tokenizer: str, policy: str | None
) -> list[str]:
    grpc_port, health_port, metrics_port = ports
    argv = [*kvroute_argv(), "epp"]
    for url in upstreams:
        argv += ["--endpoint", url.removeprefix("http://")]
    argv += [
        "--host", HOST,
        "--grpc-port", str(grpc_port),
        "--health-port", str(health_port),
        "--metrics-port", str(metrics_port),
        "--tokenizer", tokenizer,
    ]  # fmt: skip
    if policy:
        argv += ["--policy", policy]
    return argv


def wait_serving(child: processes.Child, port: int, timeout_s: float) -> None:
    """Poll the picker's gRPC health (``readiness``) until SERVING, or raise StartError."""
    import grpc
    from grpc_health.v1 import health_pb2

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        while time.monotonic() < deadline:
            code = child.popen.poll()
            if code is not None:
                raise processes.StartError(
                    f"kvroute epp exited with status {code}:\n{child.log_tail()}"
                )
            request = health_pb2.HealthCheckRequest(service=READY_SERVICE)
            try:
                reply = check(request, timeout=1.0)
            except grpc.RpcError as exc:
                last = str(exc.code())
            else:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            time.sleep(_POLL_S)
    raise processes.StartError(
        f"kvroute epp not {READY_SERVICE} on gRPC health port {port} after {timeout_s:g} s "
        f"({last}):\n{child.log_tail()}"
    )


@contextlib.contextmanager
def running_gateway(options: Options, log_dir: Path) -> Iterator[Gateway]:
    """Stubs, ``kvroute epp`` and Envoy, each ready; all stopped on the way out."""
    from kvroute.backends.process import free_ports
    from kvroute.gateway import EnvoyProcess, GatewaySpec

    tokenizer = overhead.agent_tokenizer(options.overhead_options())
    with (
        running_stubs(
            options.upstreams, options.model, log_dir, options.startup_timeout_s
        ) as upstreams,
        contextlib.ExitStack() as stack,
    ):
        grpc_port, health_port, metrics_port, listen, admin, direct = free_ports(6)
        argv = picker_argv(
            upstreams, (grpc_port, health_port, metrics_port), tokenizer, options.policy
        )
        picker = stack.enter_context(processes.managed("epp", argv, log_dir))
        wait_serving(picker, health_port, options.startup_timeout_s)
        pods = [(HOST, int(url.rsplit(":", 1)[1])) for url in upstreams]
        spec = GatewaySpec(
            pods=pods,
            pickers=[(HOST, grpc_port)],
            listen_port=listen,
            admin_port=admin,
            direct_port=direct,
        )
        envoy = EnvoyProcess(spec, log_dir, concurrency=options.envoy_workers)
        stack.callback(envoy.stop)  # before start: a start that fails half-way is cleaned too
        try:
            envoy.start(options.startup_timeout_s)
        except (RuntimeError, TimeoutError) as exc:  # say which process did not start
            raise processes.StartError(f"Envoy did not start: {exc}") from exc
        try:
            envoy.wait_for_pickers(1, options.startup_timeout_s)
        except TimeoutError as exc:
            raise processes.StartError(f"Envoy did not see the picker healthy: {exc}") from None
        gateway = Gateway(
            direct_url=f"http://{HOST}:{direct}",
            epp_url=f"http://{HOST}:{listen}",
            metrics_url=f"http://{HOST}:{metrics_port}/metrics",
            picker=picker,
            envoy=envoy,
        )
        smoke_check(gateway, options)
        yield gateway


def smoke_check(gateway: Gateway, options: Options) -> None:
    """One completion and one chat through each listener: fail now, not after minutes of 5xx."""
    completion = json.dumps(
        {"model": options.model, "prompt": "Say ok.", "max_tokens": MAX_TOKENS}
    ).encode()
    chat = json.dumps(
        {
            "model": options.model,
            "messages": [{"role": "user", "content": "Say ok."}],
            "max_tokens": MAX_TOKENS,
        }
    ).encode()
    for base in (gateway.direct_url, gateway.epp_url):
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            problem = overhead.smoke_check(base + path, body)
            if problem:
                raise processes.StartError(
                    f"POST {base}{path} failed: {problem}\nkvroute epp log:\n"
                    f"{gateway.picker.log_tail(1500)}\nEnvoy log:\n{gateway.envoy.log_tail(1500)}"
                )


def decision_counters(metrics_url: str) -> tuple[float, float] | None:
    """The picker's own ``kvroute_epp_decision_seconds`` (sum, count): parse, tokenize, route."""
    try:
        page = scrape(metrics_url, only=("kvroute_epp_decision_seconds_",), timeout=5)
    except (OSError, ValueError):
        return None
    return (
        page.sum("kvroute_epp_decision_seconds_sum"),
        page.sum("kvroute_epp_decision_seconds_count"),
    )


def mean_decision_ms(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    if before is None or after is None:
        return None
    count = after[1] - before[1]
    return (after[0] - before[0]) / count * 1e3 if count > 0 else None


# ------------------------------------------------------------------ latency scenario


@dataclass(frozen=True)
class Latency:
    """One wrk run: throughput and the latency distribution (from wrk's own histogram)."""

    requests: int
    requests_per_s: float
    mean_ms: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    picker_cores: float | None = None  # the picker's CPU while it ran (picker listener only)
    decision_ms: float | None = None  # the picker's mean decision time (picker listener only)

    @property
    def errors(self) -> int:
        return self.non_2xx + self.socket_errors


@dataclass
class LatencyRound:
    direct: Latency
    epp: Latency

    @property
    def added_p50_ms(self) -> float:
        return self.epp.p50_ms - self.direct.p50_ms

    @property
    def added_p99_ms(self) -> float:
        return self.epp.p99_ms - self.direct.p99_ms

    @property
    def added_mean_ms(self) -> float:
        return self.epp.mean_ms - self.direct.mean_ms


def lua_string(text: str) -> str:
    """``text`` as a Lua long-bracket literal whose brackets it does not contain."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    return f"[{eq}[{text}]{eq}]"


def latency_script(model: str, prompt_chars: int = PROMPT_CHARS) -> str:
    """A wrk script: POST /v1/completions with a ``prompt_chars`` prompt that starts with a
    per-thread request number (each prompt distinct from its first token), and print wrk's
    latency histogram's mean and percentiles in microseconds when done."""
    marker = "\x00"
    text = prompt_text(prompt_chars)
    template = json.dumps({"model": model, "max_tokens": MAX_TOKENS, "prompt": marker + text})
    head, tail = template.split(json.dumps(marker)[1:-1])
    return "\n".join(
        [
            "local threads = 0",
            "function setup(thread)",
            "  thread:set('tid', threads)",
            "  threads = threads + 1",
            "end",
            f"local head = {lua_string(head)}",
            f"local tail = {lua_string(tail)}",
            "local n = 0",
            "local headers = {['Content-Type'] = 'application/json'}",
            "function request()",
            "  n = n + 1",
            "  local body = head .. 'Request ' .. tid .. '-' .. n .. ': ' .. tail",
            "  return wrk.format('POST', nil, headers, body)",
            "end",
            "function done(summary, latency, requests)",
            "  io.write(string.format('kvroute-latency-us mean=%.1f p50=%.1f p99=%.1f\\n',",
            "    latency.mean, latency:percentile(50), latency:percentile(99)))",
            "end",
            "",
        ]
    )


def prompt_text(chars: int) -> str:
    """``chars`` characters of common words, the same every run."""
    from kvroute.simulator.workload import filler

    return filler(random.Random(0), chars)[:chars]


_RE_LATENCY = re.compile(r"^kvroute-latency-us mean=([\d.]+) p50=([\d.]+) p99=([\d.]+)$", re.M)


def parse_latency(output: str) -> Latency:
    """wrk's summary (requests, errors) and the script's exact mean and percentiles."""
    load = parse_wrk(output)
    exact = _RE_LATENCY.search(output)
    if exact is None:
        raise LoadError(f"no latency line from the wrk script:\n{output.strip()}")
    mean, p50, p99 = (float(g) / 1e3 for g in exact.groups())
    return Latency(
        load.requests, load.requests_per_s, mean, p50, p99, load.non_2xx, load.socket_errors
    )


def run_wrk(wrk: str, url: str, script: str, options: Options, duration_s: int) -> Latency:
    url += "/v1/completions"
    prefix = "kvroute-bench-epp-"
    c, threads = options.concurrency, options.threads
    return parse_latency(wrk_output(wrk, url, script, threads, c, duration_s, prefix))


def run_latency(gateway: Gateway, options: Options, wrk: str, cpu: Sampler) -> list[LatencyRound]:
    script = latency_script(options.model)

    def warm(url: str) -> None:
        # Before every run, both listeners alike: the picker sat idle through the direct run,
        # and the first requests after a lull pay for catching up (its predictions' expiry).
        if options.warmup_s:
            run_wrk(wrk, url, script, options, options.warmup_s)

    rounds = []
    for i in range(options.rounds):
        warm(gateway.direct_url)
        direct = run_wrk(wrk, gateway.direct_url, script, options, options.duration_s)
        warm(gateway.epp_url)
        before = decision_counters(gateway.metrics_url)
        started = time.monotonic()
        epp = run_wrk(wrk, gateway.epp_url, script, options, options.duration_s)
        ended = time.monotonic()
        after = decision_counters(gateway.metrics_url)
        epp = dataclasses.replace(
            epp,
            picker_cores=cpu.cores("picker", started, ended),
            decision_ms=mean_decision_ms(before, after),
        )
        done = LatencyRound(direct, epp)
        rounds.append(done)
        print(
            f"  latency round {i + 1}/{options.rounds}: direct p50 {direct.p50_ms:.2f} ms "
            f"p99 {direct.p99_ms:.2f} ms, epp p50 {epp.p50_ms:.2f} ms p99 {epp.p99_ms:.2f} ms "
            f"(added {done.added_p50_ms:+.2f} / {done.added_p99_ms:+.2f} ms)",
            flush=True,
        )
    return rounds


def median_of(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_latency(results: Sequence[Latency]) -> Latency:
    """Each column's median over the rounds (errors summed)."""
    return Latency(
        requests=sum(r.requests for r in results),
        requests_per_s=statistics.median(r.requests_per_s for r in results),
        mean_ms=statistics.median(r.mean_ms for r in results),
        p50_ms=statistics.median(r.p50_ms for r in results),
        p99_ms=statistics.median(r.p99_ms for r in results),
        non_2xx=sum(r.non_2xx for r in results),
        socket_errors=sum(r.socket_errors for r in results),
        picker_cores=median_of([r.picker_cores for r in results]),
        decision_ms=median_of([r.decision_ms for r in results]),
    )


# ------------------------------------------------------------------ large-prompt scenario


@dataclass(frozen=True)
class Large:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    mean_body_kb: float
    first_turn_ms: float
    cores: dict[str, float]  # probe -> cores busy over the measured window
    decision_ms: float | None = None  # the picker's mean over the measured window

    @property
    def errors(self) -> int:
        return self.non_2xx + self.socket_errors

    @property
    def picks_per_cpu_s(self) -> float | None:
        """Requests per second of the picker's CPU (its whole process group): what one picker
        process does with a core to itself, when the machine could not give it one."""
        cores = self.cores.get("picker", 0.0)
        return self.requests_per_s / cores if cores > 0 else None


def run_large(gateway: Gateway, options: Options, url: str, cpu: Sampler) -> Large:
    from kvroute.bench.loadgen import Conversations, run_conversations

    spec = Conversations(
        url + "/v1/chat/completions",
        options.model,
        options.conversations,
        options.large_concurrency,
        options.start_kb * 1000,
        int(options.turn_kb * 1000),
    )
    with decision_sampler(gateway) as decisions:
        done = run_conversations(spec, options.warmup_s, options.duration_s)
        # The measured window was the run's last duration_s (only the requests in flight when
        # it closed were answered after it: a fraction of a second at most).
        ended = time.monotonic()
    started = ended - options.duration_s
    count = decisions.delta("decisions", started, ended)
    decision_ms = decisions.delta("decision_s", started, ended) / count * 1e3 if count else None
    r = done.load
    return Large(
        requests_per_s=r.requests_per_s,
        p50_ms=r.p50_ms,
        p99_ms=r.p99_ms,
        non_2xx=r.non_2xx,
        socket_errors=r.socket_errors,
        mean_body_kb=done.mean_body_bytes / 1000,
        first_turn_ms=done.first_turn_ms,
        cores={name: cpu.cores(name, started, ended) for name in cpu.names()},
        decision_ms=decision_ms if url == gateway.epp_url else None,
    )


# ------------------------------------------------------------------ report


@dataclass
class Results:
    latency: list[LatencyRound] = field(default_factory=list)
    large_epp: Large | None = None
    large_direct: Large | None = None
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Context:
    date: str
    command: str
    machine: str
    versions: str
    setup: str
    loads: list[str]


def envoy_version() -> str:
    from kvroute.gateway import envoy_binary

    try:
        out = subprocess.run(
            [envoy_binary(), "--version"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "Envoy ?"
    found = re.search(r"version: \S*?/(\d+\.\d+\.\d+)/", out.stdout)
    return f"Envoy {found.group(1)}" if found else "Envoy ?"


def versions_line(wrk: str | None) -> str:
    parts = [
        envoy_version(),
        kvroute_version(),
        python_version(),
    ]
    if wrk:
        parts.append(wrk_version(wrk))
    return ", ".join(parts)


def setup_line(options: Options, tokenizer: str) -> str:
    from kvroute.policies import DEFAULT_POLICY

    policy = options.policy or f"{DEFAULT_POLICY} (default)"
    workers = "worker thread" if options.envoy_workers == 1 else "worker threads"
    return (
        f"{options.upstreams} instant-answer stub upstreams; kvroute epp as its own process "
        f"(policy {policy}, --tokenizer {shown_path(tokenizer)}); one Envoy "
        f"({options.envoy_workers} {workers}) with two listeners over the same pods: the "
        "picker's (ext_proc, FULL_DUPLEX_STREAMED bodies, override_host) and a direct one "
        "(round robin)"
    )


def load_lines(options: Options, wrk: str | None) -> list[str]:
    lines = []
    if "latency" in options.scenarios:
        threads = min(options.threads, options.concurrency)
        lines.append(
            f"latency: wrk ({threads} threads, latencies from its histogram, 3 significant "
            f"digits), {options.concurrency} connections, {options.rounds} rounds of "
            f"{options.duration_s} s per listener alternating direct then picker, each after "
            f"{options.warmup_s} s of unmeasured load through the same listener; POST "
            f"/v1/completions, {PROMPT_CHARS}-character prompts each distinct from the first "
            f"token, max_tokens {MAX_TOKENS}, not streamed"
        )
    if "large" in options.scenarios:
        lines.append(
            f"large: built-in client (aiohttp, this process), {options.large_concurrency} "
            f"connections, {options.conversations} chat conversations from {options.start_kb} KB "
            f"of history, each request adding {options.turn_kb:g} KB, max_tokens {MAX_TOKENS}; "
            f"{options.duration_s} s per listener (picker, then direct) after each "
            f"conversation's first turn and {options.warmup_s} s warmup; CPU from /proc over the "
            "measured window, in cores (1.00 = one core busy)"
        )
    return lines


def _cell(value: float | None, places: int = 2) -> str:
    return "-" if value is None else f"{value:.{places}f}"


def latency_table(rounds: Sequence[LatencyRound]) -> str:
    direct = median_latency([r.direct for r in rounds])
    epp = median_latency([r.epp for r in rounds])
    lines = [
        "| listener | req/s | mean ms | p50 ms | p99 ms | errors | picker CPU (cores) "
        "| picker decision ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, r in (("direct (Envoy round robin)", direct), ("kvroute epp (Envoy ext_proc)", epp)):
        lines.append(
            f"| {name} | {r.requests_per_s:.0f} | {r.mean_ms:.2f} | {r.p50_ms:.2f} "
            f"| {r.p99_ms:.2f} | {errors_cell(r)} | {_cell(r.picker_cores)} | {_cell(r.decision_ms)} |"
        )
    lines.append(
        f"| added by the picker (median of rounds) | - "
        f"| {statistics.median(r.added_mean_ms for r in rounds):+.2f} "
        f"| {statistics.median(r.added_p50_ms for r in rounds):+.2f} "
        f"| {statistics.median(r.added_p99_ms for r in rounds):+.2f} | - | - | - |"
    )
    return "\n".join(lines)


def rounds_line(rounds: Sequence[LatencyRound]) -> str:
    parts = [f"{i}: {r.added_p50_ms:+.2f} / {r.added_p99_ms:+.2f}" for i, r in enumerate(rounds, 1)]
    return "added p50 / p99 ms by round: " + ", ".join(parts)


def large_table(epp: Large | None, direct: Large | None, cpus: int) -> str:
    lines = [
        "| listener | req/s | p50 ms | p99 ms | errors | mean body KB | first turn ms "
        "| picker CPU (cores) | picker main process | picks per picker CPU-second | Envoy CPU "
        "| client CPU | machine busy | picker decision ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, r in (("kvroute epp (Envoy ext_proc)", epp), ("direct (Envoy round robin)", direct)):
        if r is None:
            lines.append(f"| {name} | - | - | - | failed (see notes) |" + " - |" * 10)
            continue
        c = r.cores
        lines.append(
            f"| {name} | {r.requests_per_s:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {errors_cell(r)} "
            f"| {r.mean_body_kb:.0f} | {r.first_turn_ms:.0f} | {c['picker']:.2f} "
            f"| {c['picker main']:.2f} | {_cell(r.picks_per_cpu_s if r is epp else None, 0)} "
            f"| {c['envoy']:.2f} | {c['client']:.2f} "
            f"| {c['machine']:.2f} of {cpus} | {_cell(r.decision_ms)} |"
        )
    return "\n".join(lines)


def verdict(met: bool) -> str:
    return "**met**" if met else "**not met**"


def target_lines(results: Results, options: Options) -> list[str]:
    lines = []
    if results.latency:
        rounds = results.latency
        p50 = statistics.median(r.added_p50_ms for r in rounds)
        p99 = statistics.median(r.added_p99_ms for r in rounds)
        errors = sum(r.direct.errors + r.epp.errors for r in rounds)
        if errors:
            lines.append(f"added latency: not judged, {errors} requests failed")
        else:
            lines.append(
                f"added p50 ≤ {ADDED_P50_MS:g} ms on 1 KB prompts: {p50:.2f} ms, "
                f"{verdict(p50 <= ADDED_P50_MS)}"
            )
            lines.append(
                f"added p99 ≤ {ADDED_P99_MS:g} ms on 1 KB prompts: {p99:.2f} ms, "
                f"{verdict(p99 <= ADDED_P99_MS)}"
            )
    large = results.large_epp
    if large is not None:
        rate = large.requests_per_s
        cores = large.cores["picker main"]
        where = (
            "the picker's main process was the bottleneck"
            if cores >= SATURATED_CORES
            else "the picker's main process had CPU to spare: something else limited it"
        )
        capacity = large.picks_per_cpu_s
        what = (
            f"≥ {LARGE_PICKS_PER_S:.0f} picks/s per picker process with {TARGET_START_KB} KB "
            f"chat prompts: {rate:.0f} picks/s (picker main process {cores:.2f} cores: {where})"
        )
        if capacity is not None and cores < SATURATED_CORES:
            # Envoy, the pods and the client took the rest of the machine: one picker process
            # with a core of its own is judged by what each second of its CPU picked.
            rate = capacity
            what += f"; {capacity:.0f} picks per second of the picker's CPU, judged"
        if options.start_kb != TARGET_START_KB:
            lines.append(f"{what}, not judged: --start-kb {options.start_kb}")
        elif large.errors:
            lines.append(f"{what}, not judged: {large.errors} requests failed")
        else:
            lines.append(f"{what}, {verdict(rate >= LARGE_PICKS_PER_S)}")
    return lines


def note_lines(results: Results, options: Options) -> list[str]:
    notes = list(results.failures)
    if results.latency:
        epp = median_latency([r.epp for r in results.latency])
        if (epp.picker_cores or 0) >= SATURATED_CORES:
            notes.append(
                f"latency: the picker was saturated at {options.concurrency} connections "
                f"({epp.picker_cores:.2f} cores, {epp.requests_per_s:.0f} req/s): with a "
                "closed loop, its added latency is mostly requests queued behind its CPU "
                f"(about {options.concurrency} / {epp.requests_per_s:.0f} req/s), not its cost "
                "per request; --concurrency 1 --threads 1 measures that"
            )
        notes.append(
            "picker decision ms: the picker's own kvroute_epp_decision_seconds (parse, "
            "tokenize, route), a part of what it adds; the rest is the ext_proc exchange "
            "(the gRPC stream, the body echoed back to Envoy) and waiting for its CPU"
        )
    if results.large_epp is not None or results.large_direct is not None:
        notes.append(
            "large: picker CPU counts kvroute epp's whole process group (its tokenizer worker "
            "processes too); its main process is one Python event loop (plus gRPC's polling "
            f"thread), so {SATURATED_CORES:.2f} cores or more there means the picker is saturated"
        )
        notes.append(
            "large: each conversation grows by a turn per answer, so the faster listener's "
            "requests are larger by the end of its run (mean body KB)"
        )
    return notes


def report(context: Context, results: Results, options: Options, markdown: bool) -> str:
    cpus = cpu_count()
    bullet = "- " if markdown else ""
    lines = []
    if markdown:
        title = f"Endpoint picker behind Envoy (`kvroute bench epp`), {context.date}"
        lines += section_head(title, context.command)
    else:
        lines += [f"date: {context.date}", f"command: {context.command}"]
    lines += [
        f"{bullet}machine: {context.machine}",
        f"{bullet}versions: {context.versions}",
        f"{bullet}setup: {context.setup}",
        *(f"{bullet}load, {line}" for line in context.loads),
    ]
    if results.latency:
        title = "Added latency (1 KB completions; medians over rounds)"
        lines += [
            "",
            f"### {title}" if markdown else f"{title}:",
            "",
            latency_table(results.latency),
            "",
            rounds_line(results.latency),
        ]
    if results.large_epp is not None or results.large_direct is not None:
        title = f"Large prompts ({options.start_kb} KB chat conversations, +{options.turn_kb:g} KB a turn)"
        lines += [
            "",
            f"### {title}" if markdown else f"{title}:",
            "",
            large_table(results.large_epp, results.large_direct, cpus),
        ]
    targets = target_lines(results, options)
    lines += ["", "Targets:" if not markdown else "**Targets**", ""]
    lines += [f"- {t}" for t in targets] or ["- none measured"]
    notes = note_lines(results, options)
    if notes:
        lines += ["", "Notes:" if not markdown else "**Notes**", ""]
        lines += [f"- {n}" for n in notes]
    return "\n".join(line for line in _drop_blank_runs(lines)) + "\n"


def _drop_blank_runs(lines: list[str]) -> Iterator[str]:
    blank = False
    for line in lines:
        if not line and blank:
            continue
        blank = not line
        yield line


# ------------------------------------------------------------------ main


def run_epp_bench(options: Options, argv: Sequence[str]) -> int:
    wrk = None
    if "latency" in options.scenarios:
        wrk = find_wrk()
        if wrk is None:
            raise LoadError(
                "the latency scenario needs wrk (Debian/Ubuntu: apt-get install wrk); "
                "or run --scenario large"
            )
    context_tokenizer = overhead.agent_tokenizer(options.overhead_options())
    context = Context(
        date=utc_stamp(),
        command=reproduce_command(argv, "epp"),
        machine=machine_line(),
        versions=versions_line(wrk),
        setup=setup_line(options, context_tokenizer),
        loads=load_lines(options, wrk),
    )
    print(f"command: {context.command}", flush=True)
    results = Results()
    with (
        processes.session("kvroute-bench-epp-") as log_dir,
        running_gateway(options, log_dir) as gateway,
    ):
        print("gateway ready: stubs, kvroute epp and Envoy", flush=True)
        with cpu_sampler(gateway) as cpu:
            if "latency" in options.scenarios:
                assert wrk is not None
                print(f"latency: {options.rounds} rounds, direct then picker", flush=True)
                try:
                    results.latency = run_latency(gateway, options, wrk, cpu)
                except LoadError as exc:
                    results.failures.append(f"latency: {one_line(str(exc))}")
            if "large" in options.scenarios:
                for label, url in (("picker", gateway.epp_url), ("direct", gateway.direct_url)):
                    print(f"large: through the {label} listener ...", end=" ", flush=True)
                    try:
                        large = run_large(gateway, options, url, cpu)
                    except (LoadError, OSError) as exc:
                        results.failures.append(f"large, {label}: {one_line(str(exc))}")
                        print("failed", flush=True)
                        continue
                    print(f"{large.requests_per_s:.0f} req/s", flush=True)
                    if label == "picker":
                        results.large_epp = large
                    else:
                        results.large_direct = large
    print()
    print(report(context, results, options, markdown=False), end="")
    if options.record:
        path = Path(options.output)
        record(path, report(context, results, options, markdown=True))
        print(f"\nappended to {path}")
    measured = results.latency or results.large_epp is not None
    return 0 if measured else 1


# ------------------------------------------------------------------ command line


def _scenarios(text: str) -> tuple[str, ...]:
    if text == "all":
        return SCENARIOS
    if text not in SCENARIOS:
        raise argparse.ArgumentTypeError(f"choose latency, large or all (got {text!r})")
    return (text,)


def add_epp_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvroute.policies import POLICIES

    p = sub.add_parser(
        "epp",
        help="The endpoint picker behind Envoy vs Envoy straight to the pods (issue targets).",
        description=(
            "Start N instant-answer stub upstreams, 'kvroute epp' as its own process and one "
            "Envoy with two listeners over the same pods: the picker's (ext_proc) and a direct "
            "one (round robin). 'latency': wrk sends 1 KB completions prompts at a fixed "
            "concurrency, alternating direct and picker for --rounds rounds, and reports the "
            "latency the picker adds at p50 and p99 (target: at most 1 ms and 3 ms). 'large': "
            "agent chat conversations (220 KB of history, +2 KB a turn) tokenized by the "
            "picker, at a concurrency that saturates it, report picks/s (target: 400 per picker "
            "process) with the picker's CPU, its picks per second of that CPU (what judges the "
            "target when the machine cannot give the picker a core of its own), and the direct "
            "listener's req/s as the ceiling. "
            "Prints the tables and appends them, the machine, versions, the command and "
            "whether the targets were met to --output-md."
        ),
    )
    p.add_argument(
        "--scenario",
        dest="scenarios",
        type=_scenarios,
        default=SCENARIOS,
        metavar="{latency,large,all}",
        help="What to measure: latency (added latency on 1 KB prompts), large (picks/s on "
        "220 KB chat prompts) or all (default).",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="latency: rounds, each one run through the direct listener then one through the "
        "picker; the report gives medians over rounds (default 3).",
    )
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=8,
        help="latency: wrk's open connections, each sending its next request when the last "
        "is answered (default 8).",
    )
    p.add_argument(
        "--duration-s",
        type=positive_int,
        default=10,
        help="Measured seconds of each run: per listener per round (latency), per listener "
        "(large) (default 10).",
    )
    p.add_argument(
        "--warmup-s",
        type=non_negative_int,
        default=2,
        help="Unmeasured seconds of the same load through a listener before each measured run "
        "(default 2).",
    )
    p.add_argument(
        "--upstreams", type=positive_int, default=2, help="Stub upstreams (pods) (default 2)."
    )
    p.add_argument(
        "--threads", type=positive_int, default=2, help="latency: wrk threads (default 2)."
    )
    p.add_argument(
        "--large-concurrency",
        type=positive_int,
        default=32,
        help="large: open connections, enough to keep the picker busy (default 32).",
    )
    p.add_argument(
        "--conversations",
        type=positive_int,
        default=32,
        help="large: chat conversations, spread over the connections (default 32).",
    )
    p.add_argument(
        "--start-kb",
        type=positive_int,
        default=TARGET_START_KB,
        help=f"large: history each conversation starts with, in KB (default {TARGET_START_KB}; "
        "the target is judged only at 220).",
    )
    p.add_argument(
        "--turn-kb",
        type=positive_float,
        default=2.0,
        help="large: KB each request adds to its conversation (default 2).",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="The tokenizer the picker routes with, a HuggingFace tokenizer directory or "
        "'builtin' (default: the tiny test model's, as 'kvroute bench overhead --workload "
        "agent').",
    )
    p.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        help="The picker's routing policy (default: kvroute's default).",
    )
    p.add_argument(
        "--envoy-workers",
        type=positive_int,
        default=1,
        help="Envoy's worker threads (--concurrency) (default 1).",
    )
    p.add_argument(
        "--model", default="stub-model", help="Model name the stubs serve and requests ask for."
    )
    add_startup_timeout(p)
    add_report_args(p)
    p.set_defaults(func=_cmd_epp_bench)


def _cmd_epp_bench(args: argparse.Namespace) -> int:
    options = Options(
        scenarios=args.scenarios,
        rounds=args.rounds,
        concurrency=args.concurrency,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        upstreams=args.upstreams,
        threads=args.threads,
        large_concurrency=args.large_concurrency,
        conversations=args.conversations,
        start_kb=args.start_kb,
        turn_kb=args.turn_kb,
        tokenizer=args.tokenizer,
        policy=args.policy,
        envoy_workers=args.envoy_workers,
        model=args.model,
        startup_timeout_s=args.startup_timeout,
        output=args.output_md,
        record=not args.no_record,
    )
    return processes.exit_status("epp", lambda: run_epp_bench(options, sys.argv[1:]), LoadError)
