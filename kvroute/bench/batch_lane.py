"""``kvroute bench batch``: a batch job on the capacity a day of online traffic leaves idle.

Emulated replicas (``kvroute replica``, each its own process, the engine model in real time)
behind ``kvroute serve`` with a ``batch:`` section whose "24h" window lasts ``--day`` seconds.
A trace is warped into one day-shaped cycle (``--diurnal``: quiet at the start and the end, a
peak in the middle) and squeezed into the same ``--day``, then replayed live twice, each time on
a fresh fleet (empty caches, a new store): alone, and with a batch job of ``--lines`` requests
submitted through the ``openai`` client as the day starts. It reports the online requests' TTFT
p99 both ways (the target: with the lane <= 1.1x alone), when the job was done against its
window, and the share of the tokens the replicas computed that were the job's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import add_report_args, positive_int
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import (
    Launch,
    kvroute_argv,
    replica_argv,
    serve_argv,
    start_all,
    start_router,
)
from kvroute.bench.harness.host import machine_line, record, utc_stamp
from kvroute.bench.harness.processes import StartError
from kvroute.bench.harness.report import reproduce_command, section_head

MODEL = "bench-model"
TARGET_RATIO = 1.1  # issue 14: online TTFT p99 with the batch lane <= 1.1x online alone


@dataclass(frozen=True)
class Options:
    trace: str
    day_s: float = 240.0
    diurnal: float = 0.8
    replicas: int = 2
    preset: str = "llama-3.1-8b-h100"
    lines: int = 400
    input_words: int = 600
    output_tokens: int = 64
    slots: int = 4
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 64
    max_requests: int | None = None
    output_md: str = "BENCHMARKS.md"
    record: bool = True


@dataclass
class Run:
    online: dict[str, Any]
    batch: dict[str, Any] | None = None


@contextlib.contextmanager
def fleet(options: Options, log_dir: Path, store: Path) -> Iterator[str]:
    """Fresh emulated replicas and a router with the batch lane; yields the router's URL."""
    with contextlib.ExitStack() as stack:
        urls = start_all(
            stack,
            "replica",
            lambda port: replica_argv(port, MODEL, "--preset", options.preset, cli=kvroute_argv()),
            free_ports(options.replicas),
            log_dir,
        )
        config = {
            "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
            "batch": {
                "store": f"sqlite:///{store}",
                "window_s": options.day_s,
                "max_in_flight_per_replica": options.slots,
                "poll_s": 0.2,
            },
        }
        path = log_dir / f"router-{store.stem}.json"  # YAML reads JSON
        path.write_text(json.dumps(config))
        (port,) = free_ports(1)
        serve = Launch(serve_argv(port, (), "--config", str(path)), "/ready")
        base, _ = start_router(stack, "router", serve, port, log_dir)
        yield base


def load_day(options: Options) -> tuple[Any, float]:
    """The trace warped into one day-shaped cycle, and the time scale that plays it in
    ``day_s`` seconds."""
    from kvroute.simulator.traces import load_trace

    trace = load_trace(
        options.trace, None, max_requests=options.max_requests, diurnal=(options.diurnal, None)
    )
    span = trace.duration_s or 1.0
    return trace, options.day_s / span


def job_file(options: Options) -> bytes:
    """The job's lines: completions of ``input_words`` words each, none alike."""
    lines = []
    for k in range(options.lines):
        words = " ".join(f"item{k}w{j}" for j in range(options.input_words))
        body = {"model": MODEL, "prompt": "Summarize: " + words,
                "max_tokens": options.output_tokens, "ignore_eos": True}  # fmt: skip
        lines.append({"custom_id": f"line-{k}", "method": "POST", "url": "/v1/completions",
                      "body": body})  # fmt: skip
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def run_once(options: Options, trace: Any, scale: float, with_job: bool) -> Run:
    import openai

    from kvroute.simulator.traces.live import replay_live_async

    with (
        processes.session() as log_dir,
        fleet(
            options, log_dir, log_dir / ("with.sqlite3" if with_job else "alone.sqlite3")
        ) as base,
    ):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        batch_id = None
        submitted = time.monotonic()
        if with_job:
            upload = await client.files.create(
                file=("job.jsonl", io.BytesIO(job_file(options))), purpose="batch"
            )
            batch = await client.batches.create(
                input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
            )
            batch_id = batch.id
        online = await replay_live_async(
            trace, base, model=MODEL, time_scale=scale, max_prompt_tokens=options.max_prompt_tokens,
            max_output_tokens=options.max_output_tokens, concurrency=256, echo=None,
        )  # fmt: skip
        run = Run(online)
        if batch_id is not None:
            run.batch = await wait_for_job(client, batch_id, submitted, options)
        await client.close()
        return run


async def wait_for_job(
    client: Any, batch_id: str, submitted: float, options: Options
) -> dict[str, Any]:
    """Poll until the job ends (its window ends it at the latest)."""
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "expired", "failed", "cancelled"):
            break
        await asyncio.sleep(0.5)
    took = time.monotonic() - submitted
    counts = batch.request_counts
    done = counts.completed if counts is not None else 0
    return {
        "status": batch.status,
        "lines": options.lines,
        "completed": done,
        "took_s": took,
        "window_s": options.day_s,
        "met_window": batch.status == "completed" and done == options.lines,
    }


def report(options: Options, alone: Run, both: Run, command: str) -> str:
    a, b = alone.online["ttft_p99_s"], both.online["ttft_p99_s"]
    ratio = b / a if a else math.nan
    job = both.batch or {}
    online_tokens = both.online["prompt_tokens_sent"] + both.online["output_tokens_received"]
    job_tokens = job.get("completed", 0) * (options.input_words + 1 + options.output_tokens)
    share = job_tokens / (job_tokens + online_tokens) if job_tokens + online_tokens else 0.0
    met_ttft = ratio <= TARGET_RATIO
    rows = [
        "| run | online requests | failed | TTFT p50 | TTFT p99 | TPOT p99 | batch job |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    for label, run in (("online alone", alone), ("online + batch lane", both)):
        o = run.online
        jd = run.batch
        job_cell = (
            f"{jd['completed']}/{jd['lines']} lines, {jd['status']} after {jd['took_s']:.0f} s "
            f"of its {jd['window_s']:.0f} s window"
            if jd
            else "-"
        )
        rows.append(
            f"| {label} | {o['ok']} | {o['failed']} | {o['ttft_p50_s'] * 1000:.0f} ms | "
            f"{o['ttft_p99_s'] * 1000:.0f} ms | {(o['tpot_p99_s'] or 0) * 1000:.1f} ms | "
            f"{job_cell} |"
        )
    return (
        "\n".join(
            [
                *section_head(
                    f"Batch lane on idle capacity, live (`kvroute bench batch`), {utc_stamp()}",
                    command,
                ),
                f"- machine: {machine_line()}",
                f"- fleet: {options.replicas} emulated replicas (`kvroute replica --preset "
                f"{options.preset}`, each a process, in real time) behind `kvroute serve` with "
                f"`batch: {{window_s: {options.day_s:g}, max_in_flight_per_replica: {options.slots}}}`;"
                " a fresh fleet and store for each run",
                f"- online: {Path(options.trace).name}, {both.online['requests']} requests warped into "
                f"one day-shaped cycle (diurnal amplitude {options.diurnal}) played in "
                f"{options.day_s:g} s; prompts capped at {options.max_prompt_tokens} tokens, answers "
                f"at {options.max_output_tokens}, streamed",
                f"- batch job: {options.lines} completions of {options.input_words} words, "
                f'{options.output_tokens} tokens out, submitted as the day starts, its "24h" '
                f"window the {options.day_s:g} s day",
                "",
                *rows,
                "",
                f"- online TTFT p99 with the lane / alone: {ratio:.2f}x (target <= {TARGET_RATIO}x): "
                f"**{'met' if met_ttft else 'not met'}**",
                f"- the job met its window: **{'yes' if job.get('met_window') else 'no'}**",
                f"- the job's share of the tokens the fleet processed (prompt + output): {share:.0%}",
            ]
        )
        + "\n"
    )


def add_batch_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "batch",
        help="A batch job on the idle capacity of a day of online traffic, live on emulated "
        "replicas: online TTFT p99 with and without it, and the job against its window.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, help="The online trace (any kvroute replay format).")
    p.add_argument("--day", type=float, default=240.0, help="Seconds the day lasts (240).")
    p.add_argument("--diurnal", type=float, default=0.8, help="Day-shape amplitude (0.8).")
    p.add_argument("--replicas", type=positive_int, default=2, help="Emulated replicas (2).")
    p.add_argument("--preset", default="llama-3.1-8b-h100", help="The replicas' latency model.")
    p.add_argument("--lines", type=positive_int, default=400, help="Batch lines (400).")
    p.add_argument(
        "--input-words",
        type=positive_int,
        default=600,
        help="Words in each batch line's prompt (600).",
    )
    p.add_argument(
        "--output-tokens",
        type=positive_int,
        default=64,
        help="Tokens each batch line generates (64).",
    )
    p.add_argument("--slots", type=positive_int, default=4, help="batch.max_in_flight_per_replica")
    p.add_argument("--max-requests", type=positive_int, help="Keep the trace's first N requests.")
    p.add_argument(
        "--max-output-tokens",
        type=positive_int,
        default=64,
        help="The online requests' answers capped at this many tokens (64).",
    )
    add_report_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    from kvroute.simulator.traces import TraceError

    if not (args.day > 0 and 0 <= args.diurnal < 1):
        print("kvroute bench batch: --day must be > 0 and --diurnal in [0, 1)", file=sys.stderr)
        return 2
    options = Options(
        trace=args.trace, day_s=args.day, diurnal=args.diurnal, replicas=args.replicas,
        preset=args.preset, lines=args.lines, input_words=args.input_words,
        output_tokens=args.output_tokens, slots=args.slots, max_requests=args.max_requests,
        max_output_tokens=args.max_output_tokens, output_md=args.output_md,
        record=not args.no_record,
    )  # fmt: skip
    try:
        trace, scale = load_day(options)
        print(f"online: {len(trace.requests)} requests in a {options.day_s:g} s day", flush=True)
        alone = asyncio.run(run_once(options, trace, scale, with_job=False))
        print(f"alone: TTFT p99 {alone.online['ttft_p99_s']:.3f} s", flush=True)
        both = asyncio.run(run_once(options, trace, scale, with_job=True))
    except (StartError, OSError, ValueError, TraceError) as exc:
        print(f"kvroute bench batch: {exc}", file=sys.stderr)
        return 2
    text = report(options, alone, both, reproduce_command(sys.argv[1:], "batch"))
    print(text)
    if options.record:
        record(Path(options.output_md), text)
        print(f"appended to {options.output_md}")
    return 0
