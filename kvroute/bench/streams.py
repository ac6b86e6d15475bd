"""``kvroute bench streams``: thousands of concurrent streams through one router process.

Emulated replicas stream tokens at a steady pace, one ``kvroute serve`` process sits in front of
them, and several client processes (each its own event loop and aiohttp session, none in the
router's process) open ``--streams`` streaming completions of ``--tokens`` tokens each, spread
over a short ramp, and hold them open until the last token. Measured:

* the router's memory per open stream: (RSS with the most streams open - RSS idle after a
  warm-up) / streams open, from /proc/<pid>/status, and its open descriptors;
* its event-loop lag over the run: the difference of two scrapes of its
  ``kvroute_event_loop_lag_seconds`` histogram (router/loop_lag.py);
* every stream complete (all tokens, finish_reason, usage and [DONE]) or cut, and TTFT.

The replicas are configured so the streams are really open at once: ``--max-num-seqs`` is the
whole stream count (an uneven split still never queues) and the KV cache holds twice a fair
share of full-length streams; their own /metrics (running, waiting, preemptions) are sampled to
show it. Each replica's engine steps are paced by the latency model of a 70B model on 8 H100s
(whose step time moves least with context), time-scaled so a token comes about every
``--token-interval-ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import (
    add_report_args,
    add_startup_timeout,
    non_negative_float,
    positive_float,
    positive_int,
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
from kvroute.bench.harness.host import (
    kvroute_version,
    machine_line,
    python_version,
    record,
    utc_stamp,
)
from kvroute.bench.harness.metrics import scrape
from kvroute.bench.harness.procs import open_fds, rss_bytes, sched_seconds
from kvroute.bench.harness.report import ms, reproduce_command, section_head
from kvroute.kvcore.stats import MetricsPage, percentile
from kvroute.router.fd_limit import OVERHEAD_FDS, raise_fd_limit
from kvroute.simulator.engine import latency_preset

MODEL = "stream-model"
PRESET = "llama-3.1-70b-8xh100"
BLOCK_SIZE = 16
PROMPT_TOKENS = 24  # at most, for sizing; the prompts are a handful of words
LAG_METRIC = "kvroute_event_loop_lag_seconds"
STALL_S = 0.05  # the "no event-loop stall over 50 ms"
TARGET_KB_PER_STREAM = 20.0
TARGET_LAG_P99_S = 0.05
SAMPLE_S = 0.25
REPLICA_SAMPLE_S = 2.0
TAIL_BYTES = 4096  # the end of each stream, kept to check how it ended


@dataclass(frozen=True)
class Options:
    streams: int = 5000
    tokens: int = 1000
    replicas: int = 4
    clients: int = 4
    token_interval_ms: float = 250.0
    ramp_s: float | None = None  # None: streams / 500 per second
    startup_timeout_s: float = 60.0
    output_md: str = "BENCHMARKS.md"
    record: bool = True

    @property
    def ramp(self) -> float:
        return self.streams / 500 if self.ramp_s is None else self.ramp_s


# ------------------------------------------------------------------ the replicas


def replica_time_scale(options: Options) -> float:
    """The time scale that makes a replica's step (one token for each of its streams) take
    about ``token_interval_ms`` halfway through the streams."""
    batch = math.ceil(options.streams / options.replicas)
    context = PROMPT_TOKENS + options.tokens // 2
    step_s = latency_preset(PRESET).step_time(batch, batch * context, batch * context)
    return options.token_interval_ms / 1000 / step_s


def replica_flags(options: Options) -> list[str]:
    fair_share = math.ceil(options.streams / options.replicas)
    per_stream_blocks = math.ceil((PROMPT_TOKENS + options.tokens) / BLOCK_SIZE) + 1
    return [
        "--preset", PRESET,
        "--time-scale", f"{replica_time_scale(options):.4g}",
        "--block-size", str(BLOCK_SIZE),
        # Every stream may run at once on any replica: none waits in its queue.
        "--max-num-seqs", str(options.streams),
        "--max-num-batched-tokens", str(options.streams + 4096),
        "--num-gpu-blocks-override", str(2 * fair_share * per_stream_blocks),
        "--max-model-len", str(PROMPT_TOKENS + options.tokens + 64),
    ]  # fmt: skip


# ---------------------------------------------------------------------- clients


def request_body(index: int, tokens: int) -> bytes:
    return msgspec.json.encode(
        {
            "model": MODEL,
            "prompt": f"Stream {index}: tell a long story.",
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


@dataclass(slots=True)
class StreamResult:
    ttft_s: float  # NaN when no byte of the answer came
    problem: str | None  # None: complete (every token, finish_reason, usage, [DONE])


def check_stream(status: int, events: int, tail: bytes, tokens: int) -> str | None:
    """Why a stream is not complete, or None. ``events``: SSE events seen; ``tail``: its end."""
    if status != 200:
        return f"HTTP {status}"
    last = [e for e in tail.split(b"\n\n") if e.strip()][-3:]
    if len(last) < 3 or last[-1].strip() != b"data: [DONE]":
        return "cut: no [DONE]"
    try:
        final, end = (msgspec.json.decode(e.removeprefix(b"data: ")) for e in last[:2])
    except msgspec.DecodeError:
        return "cut: unreadable end"
    for event in (end, final):  # the router ends a stream it cannot finish with an error event
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            return f"cut: {event['error'].get('message', 'error event')}"
    usage = (end.get("usage") if isinstance(end, dict) else None) or {}
    choices = final.get("choices") if isinstance(final, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return "cut: no last token"
    if usage.get("completion_tokens") != tokens or events - 2 != tokens:
        return f"cut: {events - 2} of {tokens} tokens"
    if choices[0].get("finish_reason") != "length":
        return "cut: no finish_reason"
    return None


async def one_stream(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    tokens: int,
    start_at: float,
    counters: Any,
    slot: int,
) -> StreamResult:
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    sent = time.monotonic()
    ttft = math.nan
    try:
        async with session.post(url, data=request_body(index, tokens)) as resp:
            events, tail = 0, b""
            async for data in resp.content.iter_any():
                if ttft != ttft:  # NaN: the first bytes of the answer
                    ttft = time.monotonic() - sent
                    counters[slot] += 1
                # An event ends with a blank line; JSON never holds a raw newline.
                events += (tail[-1:] + data).count(b"\n\n")
                tail = (tail + data)[-TAIL_BYTES:]
            return StreamResult(ttft, check_stream(resp.status, events, tail, tokens))
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(ttft, f"failed: {type(exc).__name__}: {exc}")
    finally:
        if ttft == ttft:  # it opened: it counts as closed now (open = opened - closed)
            counters[slot + 1] += 1


async def run_client(
    base_url: str, indices: list[int], options: Options, t0: float, counters: Any, slot: int
) -> list[StreamResult]:
    url = base_url + "/v1/completions"
    ramp = options.ramp
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(
            *(
                one_stream(
                    session,
                    url,
                    i,
                    options.tokens,
                    t0 + ramp * i / options.streams,
                    counters,
                    slot,
                )
                for i in indices
            )
        )


Rows = list[tuple[float, str | None]]  # (ttft_s, problem) per stream, across processes


@dataclass(frozen=True)
class ClientLinks:
    """What a client process shares with the bench: start line, live counts, results."""

    ready: Barrier
    start: Event
    t0: Any  # a shared double: the monotonic time the first stream starts
    counters: Any  # shared int64s: streams opened and closed, two per client
    results: Queue[tuple[int, Rows]]


def client_main(
    base_url: str, indices: list[int], options: Options, links: ClientLinks, slot: int
) -> None:
    """One client process: wait for the start, run its streams, send back what each did."""
    import uvloop

    links.ready.wait()
    links.start.wait()
    out = uvloop.run(run_client(base_url, indices, options, links.t0.value, links.counters, slot))
    links.results.put((slot, [(r.ttft_s, r.problem) for r in out]))


# ---------------------------------------------------------------- the router


@dataclass(frozen=True)
class LagSummary:
    ticks: int
    p50_le_s: float  # upper bound of the bucket holding the median
    p99_le_s: float
    max_le_s: float  # upper bound of the highest bucket with a tick
    stalls: int  # ticks later than STALL_S
    mean_s: float


def lag_buckets(page: MetricsPage) -> dict[float, float]:
    return {float(labels["le"]): value for labels, value in page.series(LAG_METRIC + "_bucket")}


def lag_summary(before: MetricsPage, after: MetricsPage) -> LagSummary:
    """The lag histogram's growth between two scrapes, read as bucket upper bounds."""
    b0, b1 = lag_buckets(before), lag_buckets(after)
    cumulative = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)
    total = cumulative[-1][1] if cumulative else 0.0

    def quantile(q: float) -> float:
        for le, count in cumulative:
            if count >= q * total:
                return le
        return math.inf

    previous, highest = 0.0, 0.0
    for le, count in cumulative:
        if count > previous:
            highest = le
        previous = count
    at_stall = dict(cumulative).get(STALL_S, total)
    total_s = after.sum(LAG_METRIC + "_sum") - before.sum(LAG_METRIC + "_sum")
    return LagSummary(
        ticks=int(total),
        p50_le_s=quantile(0.5),
        p99_le_s=quantile(0.99),
        max_le_s=highest,
        stalls=int(total - at_stall),
        mean_s=total_s / total if total else math.nan,
    )


# ---------------------------------------------------------------------- running


@dataclass
class Samples:
    """What the monitor saw while the streams ran."""

    peak_open: int = 0
    plateau_rss: int = 0  # the largest RSS while the most streams were open
    plateau_fds: int = 0
    max_rss: int = 0
    replicas_running: int = 0  # the most the replicas reported running at once (summed)
    open_at: float | None = None  # seconds after the start when the peak was first reached


@dataclass
class Outcome:
    results: list[StreamResult]
    idle_rss: int
    samples: Samples
    lag: LagSummary
    wall_s: float
    router_cpu_s: float
    router_waited_s: float  # ready to run but waiting for a CPU another process had
    preemptions: int
    notes: list[str] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return sum(1 for r in self.results if r.problem is None)

    @property
    def cut(self) -> int:
        return len(self.results) - self.completed

    @property
    def kb_per_stream(self) -> float:
        s = self.samples
        return (s.plateau_rss - self.idle_rss) / 1024 / s.peak_open if s.peak_open else math.nan

    def ttft_ms(self, q: float) -> float:
        values = [r.ttft_s * 1000 for r in self.results if r.ttft_s == r.ttft_s]
        return percentile(values, q, method="nearest_rank")


def warm_up(base_url: str, options: Options) -> None:
    """A few short streams first: what the router allocates once is not per-stream memory."""
    warm = Options(streams=4 * options.replicas, tokens=4, ramp_s=0.0)
    counters = [0, 0]
    results = asyncio.run(run_client(base_url, list(range(warm.streams)), warm, 0.0, counters, 0))
    failed = [r.problem for r in results if r.problem]
    if failed:
        raise processes.StartError(f"warm-up streams failed: {failed[0]}")


def replicas_running(urls: list[str]) -> int:
    """Requests the replicas say they are running now, summed (vLLM's gauge)."""
    running = 0
    for url in urls:
        with contextlib.suppress(OSError, ValueError):
            running += int(scrape(url + "/metrics").sum("vllm:num_requests_running"))
    return running


def monitor(
    pid: int,
    replicas: list[str],
    links: ClientLinks,
    workers: Sequence[multiprocessing.process.BaseProcess],
    deadline: float,
) -> tuple[Samples, dict[int, Rows]]:
    """Sample the router and the replicas until every client process has reported."""
    samples = Samples()
    got: dict[int, Rows] = {}
    next_replica_sample = 0.0
    t0 = links.t0.value
    while len(got) < len(workers) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            slot, rows = links.results.get(timeout=SAMPLE_S)
            got[slot] = rows
        counts = links.counters[:]
        open_now = sum(counts[0::2]) - sum(counts[1::2])
        rss = rss_bytes(pid)
        samples.max_rss = max(samples.max_rss, rss)
        if open_now > samples.peak_open:
            samples.peak_open, samples.plateau_rss = open_now, rss
            samples.plateau_fds = open_fds(pid)
            samples.open_at = time.monotonic() - t0
        elif open_now == samples.peak_open and open_now and rss > samples.plateau_rss:
            samples.plateau_rss = rss
            samples.plateau_fds = max(samples.plateau_fds, open_fds(pid))
        if time.monotonic() >= next_replica_sample and open_now:
            samples.replicas_running = max(samples.replicas_running, replicas_running(replicas))
            next_replica_sample = time.monotonic() + REPLICA_SAMPLE_S
        if not any(w.is_alive() for w in workers) and links.results.empty():
            break
    return samples, got


def run_load(router_url: str, router_pid: int, replicas: list[str], options: Options) -> Outcome:
    ctx = multiprocessing.get_context("spawn")
    clients = min(options.clients, options.streams)
    links = ClientLinks(
        ready=ctx.Barrier(clients + 1),
        start=ctx.Event(),
        t0=ctx.Value("d", 0.0, lock=False),
        counters=ctx.Array("q", 2 * clients, lock=False),
        results=ctx.Queue(),
    )
    shares = [list(range(c, options.streams, clients)) for c in range(clients)]
    workers = [
        ctx.Process(
            target=client_main,
            args=(router_url, shares[c], options, links, 2 * c),
            name=f"kvroute-bench-client-{c}",
            daemon=True,
        )
        for c in range(clients)
    ]
    idle_rss = rss_bytes(router_pid)
    before = scrape(router_url + "/metrics")
    cpu_before = sched_seconds(router_pid)
    for w in workers:
        w.start()
    try:
        try:
            links.ready.wait(timeout=options.startup_timeout_s)
        except threading.BrokenBarrierError:
            raise processes.StartError(
                f"the client processes were not all up after {options.startup_timeout_s:g} s"
            ) from None
        # Streams start on a shared clock, a moment after every client is up.
        links.t0.value = time.monotonic() + 0.5
        links.start.set()
        expected_s = options.ramp + options.tokens * options.token_interval_ms / 1000
        deadline = links.t0.value + 10 * expected_s + 120
        samples, got = monitor(router_pid, replicas, links, workers, deadline)
        wall_s = time.monotonic() - links.t0.value
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.terminate()
    cpu_after = sched_seconds(router_pid)
    lag = lag_summary(before, scrape(router_url + "/metrics"))
    outcome = Outcome(
        [],
        idle_rss,
        samples,
        lag,
        wall_s,
        cpu_after[0] - cpu_before[0],
        cpu_after[1] - cpu_before[1],
        replica_preemptions(replicas),
    )
    for c in range(clients):
        rows = got.get(2 * c)
        if rows is None:
            outcome.notes.append(f"client {c} reported nothing (timed out or crashed)")
            rows = [(math.nan, "failed: client process lost")] * len(shares[c])
        outcome.results += [StreamResult(ttft, problem) for ttft, problem in rows]
    return outcome


def replica_preemptions(urls: list[str]) -> int:
    total = 0
    for url in urls:
        with contextlib.suppress(OSError, ValueError):
            total += int(scrape(url + "/metrics").sum("vllm:num_preemptions"))
    return total


@contextlib.contextmanager
def running_fleet(options: Options, log_dir: Path) -> Iterator[tuple[str, int, list[str]]]:
    """The replicas and the router in front of them: (router URL, router pid, replica URLs)."""
    cli, timeout_s = kvroute_cli(), options.startup_timeout_s
    with contextlib.ExitStack() as stack:
        port, *ports = free_ports(options.replicas + 1)
        flags = replica_flags(options)

        def replica(port: int) -> list[str]:
            return replica_argv(port, MODEL, *flags, cli=cli)

        urls = start_all(stack, "replica", replica, ports, log_dir, timeout_s)
        serve = Launch(serve_argv(port, urls, cli=cli), "/ready")
        router_url, router = start_router(stack, "router", serve, port, log_dir, timeout_s)
        yield router_url, router.pid, urls


# ---------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def format_table(options: Options, o: Outcome) -> str:
    s, lag = o.samples, o.lag
    mib = 1024 * 1024
    all_open = s.peak_open == options.streams
    rows = [
        ("streams complete (every token, finish_reason, usage, [DONE])",
         f"{o.completed} / {len(o.results)}", "all"),
        ("streams cut or failed", str(o.cut), f"0: {verdict(o.cut == 0)}"),
        ("streams open at once (peak)", f"{s.peak_open}"
         + (f", reached {s.open_at:.1f} s after the start" if s.open_at is not None else ""),
         f"{options.streams}: {verdict(all_open)}"),
        ("replicas: most streams running at once (summed), preemptions",
         f"{s.replicas_running}, {o.preemptions}", f"{options.streams}, 0"),
        ("router RSS idle / with the streams open",
         f"{o.idle_rss / mib:.1f} / {s.plateau_rss / mib:.1f} MiB", ""),
        ("router memory per open stream", f"{o.kb_per_stream:.1f} KiB",
         f"<= {TARGET_KB_PER_STREAM:g} KB: {verdict(o.kb_per_stream * 1.024 <= TARGET_KB_PER_STREAM)}"),
        ("router open descriptors with the streams open", str(s.plateau_fds), ""),
        ("event-loop lag p50 / p99 / max (bucket bounds)",
         f"<= {ms(lag.p50_le_s, '-')} / <= {ms(lag.p99_le_s, '-')} / <= {ms(lag.max_le_s, '-')} ms",
         f"p99 <= {ms(TARGET_LAG_P99_S, '-')} ms: {verdict(lag.p99_le_s <= TARGET_LAG_P99_S)}"),
        (f"loop ticks later than {ms(STALL_S, '-')} ms", f"{lag.stalls} of {lag.ticks}", "0"),
        ("TTFT p50 / p99", f"{o.ttft_ms(0.5):.0f} / {o.ttft_ms(0.99):.0f} ms", ""),
        ("router CPU over the run", f"{o.router_cpu_s:.1f} s ({o.router_cpu_s / o.wall_s:.0%} "
         "of one core)", ""),
        ("router ready to run but waiting for a CPU (schedstat)", f"{o.router_waited_s:.1f} s",
         ""),
        ("wall time from the first stream to the last", f"{o.wall_s:.0f} s", ""),
    ]  # fmt: skip
    lines = ["| measure | value | target |", "|---|--:|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def load_line(options: Options) -> str:
    return (
        f"{options.streams} streaming POST /v1/completions (max_tokens {options.tokens}, "
        f"include_usage) from {min(options.clients, options.streams)} client processes "
        f"(aiohttp), started evenly over {options.ramp:g} s; one `kvroute serve` process "
        f"(default policy) in front of {options.replicas} emulated replicas (`kvroute "
        f"replica --preset {PRESET} --time-scale {replica_time_scale(options):.3g}`: a token "
        f"about every {options.token_interval_ms:g} ms per stream; --max-num-seqs "
        f"{options.streams}, KV for twice a fair share of full streams, so no stream waits)"
    )


def problems(o: Outcome) -> list[str]:
    """The first few reasons streams were cut, with counts."""
    counts: dict[str, int] = {}
    for r in o.results:
        if r.problem:
            counts[r.problem] = counts.get(r.problem, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    return [f"{n} streams: {why}" for why, n in top]


def versions_line() -> str:
    return f"{kvroute_version()}, aiohttp {aiohttp.__version__}, {python_version()}"


def markdown_section(
    date: str, command: str, machine: str, options: Options, o: Outcome, notes: list[str]
) -> str:
    lines = [
        *section_head(f"Thousands of streams in one router process, {date}", command),
        f"- machine: {machine}",
        f"- versions: {versions_line()}",
        f"- load: {load_line(options)}",
        "",
        format_table(options, o),
        "",
        *(f"- {n}" for n in notes),
    ]
    return "\n".join(lines) + "\n"


def run_notes(o: Outcome) -> list[str]:
    notes = [
        "memory per stream: (router RSS with the most streams open - RSS after a warm-up) / "
        "streams open; RSS from /proc/<pid>/status, sampled every "
        f"{SAMPLE_S:g} s, the largest while the most streams were open",
        "loop lag: the router's own kvroute_event_loop_lag_seconds (a timer due every 100 ms) "
        "over the run; percentiles are the upper bounds of the histogram buckets they fall in",
        "the replicas and clients share the machine's cores with the router",
    ]
    notes += o.notes
    notes += problems(o)
    return notes


def run_streams(options: Options, argv: Sequence[str]) -> int:
    # Every stream holds a socket in a client, two in the router, one in a replica.
    raise_fd_limit(2 * options.streams + OVERHEAD_FDS)
    date = utc_stamp()
    command = reproduce_command(argv, "streams")
    machine = machine_line()
    print(f"command: {command}\nload: {load_line(options)}", flush=True)
    with (
        processes.session() as log_dir,
        running_fleet(options, log_dir) as (router_url, router_pid, replicas),
    ):
        warm_up(router_url, options)
        print(f"{options.streams} streams ...", flush=True)
        outcome = run_load(router_url, router_pid, replicas, options)
    notes = run_notes(outcome)
    print()
    print(format_table(options, outcome))
    for note in notes:
        print(f"note: {note}")
    if options.record:
        path = Path(options.output_md)
        record(path, markdown_section(date, command, machine, options, outcome, notes))
        print(f"\nappended to {path}")
    return 0 if outcome.cut == 0 else 1


# ------------------------------------------------------------------------- CLI


def add_streams_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "streams",
        help="Thousands of concurrent streams through one router process: memory, loop lag.",
        description=(
            "Start emulated replicas and one `kvroute serve` in front of them, then open "
            "--streams concurrent streaming completions of --tokens tokens each from "
            "--clients client processes and hold them to the end. Reports the router's memory "
            "per open stream (RSS with the streams open minus idle), its open descriptors, its "
            "event-loop lag (its kvroute_event_loop_lag_seconds), TTFT, and every stream "
            "complete or cut; appends the table and the command to BENCHMARKS.md. Exits 1 if "
            "any stream was cut. Targets (issue 17): 5,000 streams at <= 20 KB of router "
            "memory each and loop lag p99 <= 50 ms."
        ),
    )
    p.add_argument(
        "--streams", type=positive_int, default=5000, help="Concurrent streams (default 5000)."
    )
    p.add_argument(
        "--tokens", type=positive_int, default=1000, help="Output tokens per stream (default 1000)."
    )
    p.add_argument(
        "--replicas", type=positive_int, default=4, help="Emulated replicas (default 4)."
    )
    p.add_argument(
        "--clients",
        type=positive_int,
        default=4,
        help="Client processes opening the streams, each with its own event loop (default 4).",
    )
    p.add_argument(
        "--token-interval-ms",
        type=positive_float,
        default=250.0,
        help="About how often each stream gets a token, in ms (default 250): it paces the "
        "replicas so the streams stay open together.",
    )
    p.add_argument(
        "--ramp-s",
        type=non_negative_float,
        help="Seconds over which the streams start, evenly (default: 500 streams a second).",
    )
    add_startup_timeout(p)
    add_report_args(p)
    p.set_defaults(func=_cmd_streams)


def _cmd_streams(args: argparse.Namespace) -> int:
    options = Options(
        streams=args.streams,
        tokens=args.tokens,
        replicas=args.replicas,
        clients=args.clients,
        token_interval_ms=args.token_interval_ms,
        ramp_s=args.ramp_s,
        startup_timeout_s=args.startup_timeout,
        output_md=args.output_md,
        record=not args.no_record,
    )
    return processes.exit_status("streams", lambda: run_streams(options, sys.argv[1:]))
