"""``kvroute bench h2-attacks``: the endpoint picker's HTTP/2 server under each attack class.

Three processes: one ``kvroute epp`` (its default limits, one instant stub endpoint); in this
process, a well-behaved gRPC client (gRPC's C core) on its ext_proc port, one call after
another: an ext_proc pick (``--probe pick``, the default: a request's headers and body in, the
pick's answer out) or the picker's gRPC health ``Check`` (``--probe health``); and, for each
attack class, an attacker process of its own (a raw HTTP/2 client written for it), started
before the attack's window and stopped after it. First the client's latency alone (the
baseline), then during each attack; the picker's RSS before and after each, and its CPU time
during each (what the attack cost the picker itself, its picks for the other client included:
unlike latency, not the machine's load). The issue's targets: the picker alive and answering
during and after every attack, the well-behaved client's p99 within twice its baseline, memory
growth under a stated bound per class.

The three share the machine: on a small or busy one, the attacker's CPU and everyone else's can
still show in the other client's latency (reported as it is; the CPU column tells the picker's
part), but the attacker no longer runs on that client's event loop.
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


ATTACKS: dict[str, Callable[[int], Coroutine[Any, Any, None]]] = {
    "streams-20k": streams_never_finished,
    "rapid-reset": rapid_reset,
    "continuation-flood": continuation_flood,
    "hpack-bomb": hpack_bomb,
    "ping-flood": ping_flood,
    "settings-flood": settings_flood,
    "slowloris": slowloris,
}


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
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
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
    async with aio.insecure_channel(f"{HOST}:{port}") as channel:
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
class Outcome:
    name: str
    probe: Probe
    rss_before: float
    rss_after: float
    alive: bool
    cpu_s: float = float("nan")  # the picker's, during the attack (the probe's picks included)
    wall_s: float = float("nan")


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


async def attack_window(proc: asyncio.subprocess.Process, port: int, kind: str) -> Probe:
    """Tell the READY attacker to go, and call the picker until it says OVER."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"go\n")
    await proc.stdin.drain()
    over = asyncio.create_task(proc.stdout.readline())
    probe = await probe_until(port, over.done, 1.0, kind)
    await over
    return probe


async def run(
    port: int, pid: int, names: list[str], baseline_s: float, kind: str = "pick"
) -> tuple[Probe, list[Outcome]]:
    cpu, wall = cpu_s(pid), time.perf_counter()
    baseline = await probe_until(port, lambda: True, baseline_s, kind)
    baseline.cpu_s, baseline.wall_s = cpu_s(pid) - cpu, time.perf_counter() - wall
    outcomes = []
    for name in names:
        async with attacker(name, port) as proc:
            before = rss_mb(pid)
            cpu, wall = cpu_s(pid), time.perf_counter()
            probe = await attack_window(proc, port, kind)
            used, took = cpu_s(pid) - cpu, time.perf_counter() - wall
            await asyncio.wait_for(proc.wait(), 30)
        after_probe = await probe_until(port, lambda: True, 0.2, kind)  # answered after it
        alive = after_probe.failures == 0 and bool(after_probe.latencies_ms)
        outcomes.append(Outcome(name, probe, before, rss_mb(pid), alive, used, took))
    return baseline, outcomes


def report(
    baseline: Probe, outcomes: list[Outcome], command: str, kind: str = "pick"
) -> tuple[str, bool]:
    what = "ext_proc pick" if kind == "pick" else "health Check"
    lines = [
        f"baseline: {what} p50 {baseline.p50:.2f} ms, p99 {baseline.p99:.2f} ms "
        f"({len(baseline.latencies_ms)} calls; the picker's CPU {baseline.cpu_s:.2f} s in "
        f"{baseline.wall_s:.1f} s)",
        "",
        "| attack | calls during | failed | p50 ms | p99 ms | p99 / baseline | picker CPU s / wall s | RSS MB before -> after | alive after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for o in outcomes:
        ratio = o.probe.p99 / baseline.p99 if baseline.p99 > 0 else float("nan")
        grown = o.rss_after - o.rss_before
        ok = ok and o.alive and o.probe.failures == 0 and grown <= RSS_BOUND_MB
        lines.append(
            f"| {o.name} | {len(o.probe.latencies_ms)} | {o.probe.failures} | {o.probe.p50:.2f} | "
            f"{o.probe.p99:.2f} | {ratio:.1f}x | {o.cpu_s:.2f} / {o.wall_s:.1f} | "
            f"{o.rss_before:.0f} -> {o.rss_after:.0f} | "
            f"{'yes' if o.alive else 'NO'} |"
        )
    lines += [
        "",
        "Each attack ran in a process of its own, started before its window and stopped after;"
        " the picker and this client in theirs.",
        "",
        f"Reproduce: `{command}`",
    ]
    return "\n".join(lines), ok


def _cmd(args: argparse.Namespace) -> int:
    from kvroute.backends.process import free_ports
    from kvroute.bench import processes
    from kvroute.bench.epp import picker_argv, wait_serving

    names = list(ATTACKS) if args.attacks == "all" else args.attacks.split(",")
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        print(f"kvroute bench h2-attacks: unknown attack(s) {', '.join(unknown)}; choose from "
              f"{', '.join(ATTACKS)} or all", file=sys.stderr)  # fmt: skip
        return 2
    from kvroute.bench.overhead import stub_argv

    *ports, stub_port = free_ports(4)
    # One instant stub endpoint: the picks have a healthy replica to name.
    argv = picker_argv([f"http://{HOST}:{stub_port}"], ports, "builtin", None)
    command = (
        "kvroute bench h2-attacks"
        + (f" --attacks {args.attacks}" if args.attacks != "all" else "")
        + (f" --probe {args.probe}" if args.probe != "pick" else "")
    )
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        stack.enter_context(processes.managed("stub", stub_argv(stub_port, "stub-model"), logs))
        child = stack.enter_context(processes.managed("epp", argv, logs))
        wait_serving(child, ports[1], 60.0)
        baseline, outcomes = asyncio.run(
            run(ports[0], child.popen.pid, names, args.baseline_s, args.probe)
        )
    text, ok = report(baseline, outcomes, command, args.probe)
    print(text)
    return 0 if ok else 1


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
        help=f"comma-separated, from: {', '.join(ATTACKS)} (default: all)",
    )
    p.add_argument(
        "--baseline-s",
        type=_positive_seconds,
        default=3.0,
        help="seconds of calls with no attack (default 3)",
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
