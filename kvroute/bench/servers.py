"""``kvroute bench servers``: HTTP servers side by side on kvroute's data path.

Each server serves the same minimal proxy (``kvroute.bench.server_app``: read the JSON body,
pick an upstream round robin, forward with the router's upstream client, relay the answer) in
one process, one after another:

* throughput: wrk at ``--concurrency`` connections against instant stub upstreams, non-streamed
  and streamed: requests/s, p99 and the server's CPU per request (its process tree's CPU time
  over the measured window);
* memory per open stream: ``--streams`` streams held open at once against paced stubs (one event
  every ``--token-interval`` s, ``--tokens`` events), opened over ``--ramp`` s by client processes
  of their own; (the server's peak RSS - its RSS idle after a warm-up) / streams, and every stream
  checked complete ([DONE] after all its events) or counted cut.

The router's own per-stream state (its ledger entry, the text kept for resume) is not here: this
measures what the server adds, to decide which one the data path runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import multiprocessing
import resource
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from pathlib import Path

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import (
    add_report_args,
    add_startup_timeout,
    positive_float,
    positive_int,
)
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import HOST, base_url, start_all, stub_argv
from kvroute.bench.harness.host import (
    kvroute_version,
    machine_line,
    package_version,
    python_version,
    record,
    utc_stamp,
)
from kvroute.bench.harness.procs import children, open_fds, rss_bytes
from kvroute.bench.harness.report import ratio, reproduce_command, section_head
from kvroute.bench.harness.sampling import CpuSampler
from kvroute.bench.loadgen import Load, LoadError, LoadResult, find_wrk, run_load, wrk_version
from kvroute.bench.server_app import SERVERS
from kvroute.router.fd_limit import OVERHEAD_FDS

MODEL = "stub-model"
COMPLETION = b'{"model": "stub-model", "prompt": "Say ok, eight times.", "max_tokens": 8}'
STREAMED = COMPLETION[:-1] + b', "stream": true}'
TARGET_KIB_PER_STREAM = 16.0  # issue 39's target, with 10,000 streams
# Package each server's version comes from, for the report.
DISTRIBUTIONS = {"aiohttp": "aiohttp", "uvicorn": "uvicorn", "granian": "granian"}


@dataclass(frozen=True)
class Options:
    servers: tuple[str, ...] = SERVERS
    concurrency: int = 32
    duration_s: int = 10
    warmup_s: int = 2
    threads: int = 2
    streams: tuple[int, ...] = (2_000, 10_000)
    tokens: int = 60
    token_interval_s: float = 1.0
    ramp_s: float = 20.0
    clients: int = 4
    startup_timeout_s: float = 60.0
    output_md: str = "BENCHMARKS.md"
    record: bool = True


@dataclass(frozen=True)
class Throughput:
    result: LoadResult
    cpu_ms_per_request: float | None


@dataclass(frozen=True)
class Held:
    """One run of ``streams`` streams held open at once."""

    streams: int
    completed: int
    idle_rss: int
    peak_rss: int
    idle_fds: int
    peak_fds: int
    failures: dict[str, int] = field(default_factory=dict)  # why the others were cut

    @property
    def cut(self) -> int:
        return self.streams - self.completed

    @property
    def peak_open(self) -> int:
        """Streams open at once at the peak: two sockets each in the server."""
        return max(0, self.peak_fds - self.idle_fds) // 2

    @property
    def kib_per_stream(self) -> float:
        """The server's growth over the streams open at its peak (not those asked for: a box
        that cannot keep up opens the last before the first end)."""
        return (self.peak_rss - self.idle_rss) / max(1, self.peak_open) / 1024


@dataclass
class ServerRow:
    server: str
    plain: Throughput | None = None
    streamed: Throughput | None = None
    held: list[Held] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ processes


def server_argv(server: str, port: int, upstreams: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-m", "kvroute.bench.server_app", "--server", server]
    argv += ["--host", HOST, "--port", str(port)]
    for url in upstreams:
        argv += ["--upstream", url]
    return argv


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (granian serves from a worker process of its own)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children(p)
    return found


def tree_rss(pid: int) -> int:
    return sum(rss_bytes(p) for p in tree_pids(pid))


def tree_fds(pid: int) -> int:
    return sum(open_fds(p) for p in tree_pids(pid))


def raise_fd_limits(streams: int) -> int:
    """Raise this process's open-file limit (children inherit it) as far as allowed, for the
    server's two sockets a stream; the number of streams the limit leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * streams + OVERHEAD_FDS
    for limits in ((max(wanted, soft), max(wanted, hard)), (hard, hard)):
        with contextlib.suppress(ValueError, OSError):  # raising the hard limit needs root
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            break
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (soft - OVERHEAD_FDS) // 200 * 100  # in hundreds


@contextlib.contextmanager
def running_server(
    server: str, upstreams: list[str], log_dir: Path, timeout_s: float
) -> Iterator[tuple[str, int]]:
    port = free_ports(1)[0]
    url = base_url(port)
    argv = server_argv(server, port, upstreams)
    with processes.managed(server, argv, log_dir, url + "/health", timeout_s) as child:
        yield url, child.pid


# ------------------------------------------------------------------ throughput


def throughput(url: str, pid: int, body: bytes, options: Options, wrk: str | None) -> Throughput:
    target = url + "/v1/completions"
    if options.warmup_s:
        run_load(wrk, Load(target, body, options.concurrency, options.warmup_s, options.threads))
    sampler = CpuSampler(pid)
    with sampler:
        start = time.monotonic()
        result = run_load(
            wrk, Load(target, body, options.concurrency, options.duration_s, options.threads)
        )
        end = time.monotonic()
    cpu = None
    if result.requests_per_s:
        cpu = 1000 * sampler.cpu_between(start, end) / (end - start) / result.requests_per_s
    return Throughput(result, cpu)


# ------------------------------------------------------------------ open streams


STREAM_REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(STREAMED)
) + STREAMED


def stream_complete(data: bytes, tokens: int) -> bool:
    """A whole relayed stream: a 200, every event, then [DONE]."""
    return (
        data.startswith(b"HTTP/1.1 200")
        and data.count(b'"text"') == tokens
        and b"data: [DONE]" in data
    )


async def _hold(
    port: int, count: int, ramp_s: float, tokens: int, timeout_s: float
) -> dict[str, int]:
    async def one(delay: float) -> str:
        await asyncio.sleep(delay)
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(HOST, port)
                writer.write(STREAM_REQUEST)
                data = await reader.read()  # Connection: close: the server ends it
                writer.close()
        except TimeoutError:
            return "timed out"
        except OSError as exc:
            return f"connection error ({type(exc).__name__})"
        return "complete" if stream_complete(data, tokens) else "incomplete"

    outcomes = await asyncio.gather(*(one(ramp_s * i / count) for i in range(count)))
    return dict(Counter(outcomes))


def client_main(
    port: int, count: int, ramp_s: float, tokens: int, timeout_s: float, out: Queue[dict[str, int]]
) -> None:
    import uvloop

    out.put(uvloop.run(_hold(port, count, ramp_s, tokens, timeout_s)))


def hold_streams(url: str, pid: int, streams: int, options: Options) -> Held:
    """Open ``streams`` streams through the server over the ramp; its peak RSS and fds."""
    time.sleep(1.0)  # the warm-up's connections closed, its garbage collected
    idle, idle_fds = tree_rss(pid), tree_fds(pid)
    port = int(url.rsplit(":", 1)[1])
    lasts = options.tokens * options.token_interval_s
    timeout = options.ramp_s + lasts + 60
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    shares = [
        streams // options.clients + (i < streams % options.clients) for i in range(options.clients)
    ]
    procs = [
        ctx.Process(
            target=client_main, args=(port, n, options.ramp_s, options.tokens, timeout, out)
        )
        for n in shares
        if n
    ]
    peak = {"rss": idle, "fds": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            peak["rss"] = max(peak["rss"], tree_rss(pid))
            peak["fds"] = max(peak["fds"], tree_fds(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for proc in procs:
        proc.start()
    outcomes: Counter[str] = Counter()
    for _ in procs:
        outcomes.update(out.get(timeout=timeout + 30))
    for proc in procs:
        proc.join(timeout=10)
    stop.set()
    sampler.join()
    completed = outcomes.pop("complete", 0)
    return Held(streams, completed, idle, peak["rss"], idle_fds, peak["fds"], dict(outcomes))


# ------------------------------------------------------------------ report


def versions_line(wrk: str | None) -> str:
    parts = [kvroute_version()]
    for dist in DISTRIBUTIONS.values():
        parts.append(f"{dist} {package_version(dist) or 'not installed'}")
    parts.append(python_version())
    parts.append(wrk_version(wrk) if wrk else "built-in load generator (aiohttp)")
    return ", ".join(parts)


def throughput_table(rows: list[ServerRow]) -> str:
    base = next((r for r in rows if r.server == "aiohttp" and r.plain), None)
    lines = [
        "| server | req/s | p99 ms | CPU ms/req | req/s vs aiohttp | streamed req/s "
        "| streamed p99 ms | streamed CPU ms/req | streamed vs aiohttp |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        cells = [row.server]
        for t, b in ((row.plain, base and base.plain), (row.streamed, base and base.streamed)):
            if t is None:
                cells += ["-"] * 4
                continue
            cpu = f"{t.cpu_ms_per_request:.3f}" if t.cpu_ms_per_request else "-"
            rps = t.result.requests_per_s
            cells += [
                f"{rps:.0f}",
                f"{t.result.p99_ms:.2f}",
                cpu,
                ratio(rps, b.result.requests_per_s if b else None),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def streams_table(rows: list[ServerRow]) -> str:
    lines = [
        "| server | streams | complete | cut | open at the peak | idle RSS MiB | peak RSS MiB "
        "| KiB per open stream |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        for h in row.held:
            why = ", ".join(f"{kind} {n:,}" for kind, n in sorted(h.failures.items()))
            lines.append(
                f"| {row.server} | {h.streams:,} | {h.completed:,} | {h.cut:,}"
                f"{f' ({why})' if why else ''} | {h.peak_open:,} | {h.idle_rss / 2**20:.1f} "
                f"| {h.peak_rss / 2**20:.1f} | {h.kib_per_stream:.1f} |"
            )
    return "\n".join(lines)


def load_line(options: Options, wrk: str | None) -> str:
    gen = f"wrk, {options.threads} threads" if wrk else "built-in"
    return (
        f"{gen}, {options.concurrency} connections, {options.duration_s} s per server and mode "
        f"after {options.warmup_s} s warmup, POST /v1/completions (max_tokens 8; streamed: 8 "
        f"events and [DONE]) through 2 instant stubs; open streams: {options.tokens} events "
        f"each, one every {options.token_interval_s:g} s from 2 paced stubs, opened over "
        f"{options.ramp_s:g} s by {options.clients} client processes"
    )


def markdown_section(
    date: str, command: str, machine: str, versions: str, load: str, rows: list[ServerRow]
) -> str:
    notes = [f"- {row.server}: {note}" for row in rows for note in row.notes]
    lines = [
        *section_head(f"HTTP servers on the data path, {date}", command),
        f"- machine: {machine}",
        f"- versions: {versions}",
        f"- load: {load}",
        "",
        throughput_table(rows),
        "",
        streams_table(rows),
        "",
        *notes,
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main


def measure_server(
    server: str, ups: list[str], paced: list[str], options: Options, wrk: str | None,
    log_dir: Path, room: int,
) -> ServerRow:  # fmt: skip
    row = ServerRow(server)
    package = server.split("-")[0]  # neither uvicorn nor granian is a dependency of kvroute
    if package != "aiohttp" and importlib.util.find_spec(package) is None:
        row.notes.append(f"skipped: {package} not installed (pip install {package})")
        return row
    try:
        with running_server(server, ups, log_dir, options.startup_timeout_s) as (url, pid):
            row.plain = throughput(url, pid, COMPLETION, options, wrk)
            row.streamed = throughput(url, pid, STREAMED, options, wrk)
        for n in options.streams:
            if n > room:  # two sockets a stream in the server: its descriptors are the cap
                row.notes.append(
                    f"{n:,} streams asked, {room:,} held: the open-file limit (ulimit -Hn) "
                    "leaves room for no more"
                )
                n = room
            with running_server(server, paced, log_dir, options.startup_timeout_s) as (url, pid):
                warm = Load(
                    url + "/v1/completions", COMPLETION, options.concurrency, 2, options.threads
                )
                run_load(wrk, warm)
                row.held.append(hold_streams(url, pid, n, options))
    except (processes.StartError, LoadError, OSError) as exc:
        row.notes.append(f"failed: {exc}")
    return row


def run_servers(options: Options, argv: Sequence[str]) -> int:
    wrk = find_wrk()
    room = raise_fd_limits(max(options.streams))
    date, machine = utc_stamp(), machine_line()
    command = reproduce_command(argv, "servers")
    versions, load = versions_line(wrk), load_line(options, wrk)
    print(f"command: {command}\nload: {load}", flush=True)
    rows = []
    with processes.session() as log_dir, contextlib.ExitStack() as stack:
        instant = start_all(
            stack, "stub", lambda p: stub_argv(p, MODEL), free_ports(2), log_dir,
            options.startup_timeout_s,
        )  # fmt: skip
        pace = ["--paced-tokens", str(options.tokens), "--token-interval"]
        pace.append(str(options.token_interval_s))
        paced = start_all(
            stack, "paced", lambda p: [*stub_argv(p, MODEL), *pace], free_ports(2), log_dir,
            options.startup_timeout_s,
        )  # fmt: skip
        for server in options.servers:
            print(f"{server} ...", flush=True)
            rows.append(measure_server(server, instant, paced, options, wrk, log_dir, room))
    section = markdown_section(date, command, machine, versions, load, rows)
    print(section)
    if options.record:
        record(Path(options.output_md), section)
        print(f"appended to {options.output_md}")
    return 0 if any(row.plain for row in rows) else 1


def _server_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown server(s) {', '.join(unknown) or '(none given)'}; choose from: "
            + ", ".join(SERVERS)
        )
    return names


def _stream_counts(text: str) -> tuple[int, ...]:
    return tuple(positive_int(n.strip()) for n in text.split(",") if n.strip())


def add_servers_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "servers",
        help="HTTP servers side by side on the data path: throughput, CPU, memory per stream.",
        description=(
            "Serve one minimal proxy (read the JSON body, pick an upstream round robin, forward "
            "with the router's upstream client, relay the answer) on each HTTP server in turn: "
            "aiohttp (what kvroute serve runs), uvicorn with httptools (a raw ASGI app), "
            "granian (ASGI and its own RSGI); uvicorn and granian are skipped where not installed. Measures wrk "
            "throughput, p99 and CPU per request, streamed and not, and the memory per open "
            "stream with --streams streams held open at once. Appends the tables to "
            "BENCHMARKS.md."
        ),
    )
    p.add_argument(
        "--servers", type=_server_list, default=SERVERS,
        help=f"Comma list of servers (default {','.join(SERVERS)}).",
    )  # fmt: skip
    p.add_argument("--concurrency", type=positive_int, default=32, help="wrk connections (32).")
    p.add_argument("--duration", type=positive_int, default=10, help="Measured seconds (10).")
    p.add_argument("--warmup", type=positive_int, default=2, help="Warm-up seconds (2).")
    p.add_argument(
        "--streams", type=_stream_counts, default=(2_000, 10_000),
        help="Comma list of open-stream counts to hold, one run each (default 2000,10000).",
    )  # fmt: skip
    p.add_argument("--tokens", type=positive_int, default=60, help="Events per stream (60).")
    p.add_argument(
        "--token-interval", type=positive_float, default=1.0, help="Seconds between events (1)."
    )
    p.add_argument(
        "--ramp", type=positive_float, default=20.0, help="Seconds to open the streams over (20)."
    )
    p.add_argument("--clients", type=positive_int, default=4, help="Client processes (4).")
    add_startup_timeout(p, float)
    add_report_args(p)
    p.set_defaults(func=_cmd_servers)


def _cmd_servers(args: argparse.Namespace) -> int:
    from kvroute.bench.harness.processes import exit_status

    options = Options(
        servers=args.servers,
        concurrency=args.concurrency,
        duration_s=args.duration,
        warmup_s=args.warmup,
        streams=args.streams,
        tokens=args.tokens,
        token_interval_s=args.token_interval,
        ramp_s=args.ramp,
        clients=args.clients,
        startup_timeout_s=args.startup_timeout,
        output_md=args.output_md,
        record=not args.no_record,
    )
    return exit_status("servers", lambda: run_servers(options, sys.argv[1:]), LoadError)
