"""``kvroute bench status``: what an open /status page costs the data path, as a paired A/B.

One kvroute process (its default policy, the tiny model's tokenizer) in front of instant-answer
stub upstreams takes the same closed-loop load in alternating windows: without a /status page
open, then with ``--viewers`` pages streaming the status document (or the other way round; the
order alternates every round, ABBA, so a drift of the machine over the run falls on both sides
alike). Comparing windows of one process, a few seconds apart, removes what makes two runs of
``kvroute bench overhead`` differ by 20-30% on a small shared machine: a different process,
started at a different moment. Each round gives a ratio (req/s with / without, and the router's
CPU per request without / with); the summary is their geometric mean and median.

On a small shared machine those ratios still move by tens of percent from one window to the
next. ``--profile DIR`` measures the page's cost directly as well: py-spy samples the router in
every window with the page open, and the share of samples with the status page's code on the
stack (building the document, streaming it) is the share of the router's CPU it took.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.argtypes import add_report_args, positive_int
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import running_stubs
from kvroute.bench.harness.host import machine_line, record, utc_stamp
from kvroute.bench.harness.report import reproduce_command, section_head
from kvroute.bench.loadgen import LoadError
from kvroute.bench.overhead import (
    TARGETS,
    Options,
    Row,
    Target,
    choose_loadgen,
    load_line,
    measure,
    running_target,
    versions_line,
)
from kvroute.bench.profiling import prepare_profile, share_on_stack

TARGET_RATIO = 0.97  # issue 15: the page open costs the data path nothing measurable


# Frames of the status page's work in the router: the feed (router/status.py) and its handler.
STATUS_MARKERS = ("router/status.py", "handle_status_events", "_status_json")


@dataclass
class Round:
    first: str  # "without" or "with": which window ran first
    without: Row
    with_page: Row
    status_share: float | None = None  # of the router's samples with the page open (--profile)
    samples: int = 0

    @property
    def throughput_ratio(self) -> float | None:
        a, b = self.without.result, self.with_page.result
        if a is None or b is None or not a.requests_per_s:
            return None
        return b.requests_per_s / a.requests_per_s

    @property
    def cpu_ratio(self) -> float | None:
        """CPU per request without / with: below 1 when the open page costs CPU."""
        a, b = self.without.cpu_ms_per_request, self.with_page.cpu_ms_per_request
        if a is None or not b:
            return None
        return a / b


def geo_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def run_rounds(options: Options, rounds: int, viewers: int) -> tuple[list[Round], list[str]]:
    wrk = choose_loadgen(options)
    plain = TARGETS["kvroute"]
    viewed = Target("kvroute-status", "kvroute", None, status_viewers=viewers)
    done: list[Round] = []
    notes: list[str] = []
    with (
        processes.session() as log_dir,
        running_stubs(options.upstreams, options.model, log_dir, options.startup_timeout_s) as ups,
        running_target(plain, ups, options, log_dir, Row(plain)) as (base, pid),
    ):
        for k in range(rounds):
            order = ("without", "with") if k % 2 == 0 else ("with", "without")
            rows = {"without": Row(plain), "with": Row(viewed)}
            for side in order:
                measure(base, options, wrk, rows[side], pid)
            one = Round(order[0], rows["without"], rows["with"])
            if options.profile_dir:
                raw = Path(options.profile_dir) / f"{viewed.name}.raw"
                if raw.exists():
                    one.status_share, one.samples = share_on_stack(raw, STATUS_MARKERS)
                    raw.unlink()
            done.append(one)
            cells = round_cells(one)
            print(
                f"round {k + 1}/{rounds}: {cells[0]} first | " + " | ".join(cells[1:]), flush=True
            )
            notes += [n for row in rows.values() for n in row.notes if "documents" not in n]
    return done, notes


def round_cells(one: Round) -> list[str]:
    """One round as table cells: which side ran first, req/s each side, their ratio, CPU per
    request each side, its ratio, and the status code's share of samples."""

    def rps(row: Row) -> str:
        return f"{row.result.requests_per_s:,.0f}" if row.result else "-"

    def cpu(row: Row) -> str:
        v = row.cpu_ms_per_request
        return f"{v:.3f}" if v is not None else "-"

    tr, cr = one.throughput_ratio, one.cpu_ratio
    if tr is None or cr is None:
        return [one.first, "no result", "", "", "", "", ""]
    share = "-" if one.status_share is None else f"{one.status_share:.2%} of {one.samples}"
    return [
        one.first, rps(one.without), rps(one.with_page), f"{tr:.3f}",
        f"{cpu(one.without)} / {cpu(one.with_page)}", f"{cr:.3f}", share,
    ]  # fmt: skip


def interval(values: list[float]) -> tuple[float, float]:
    """The geometric mean's 95% interval (normal approximation over the log ratios)."""
    logs = [math.log(v) for v in values]
    if len(logs) < 2:
        return values[0], values[0]
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean - half), math.exp(mean + half)


def summary(rounds: list[Round]) -> tuple[list[str], bool]:
    """What the rounds say, and whether the target is met.

    Met when the page's measured share of the router's CPU (--profile) leaves at least
    ``TARGET_RATIO`` of it to the data path and the paired A/B does not contradict that (its
    95% interval reaches ``TARGET_RATIO``); without --profile, on the A/B's geometric means."""
    throughput = [r.throughput_ratio for r in rounds if r.throughput_ratio]
    cpu = [r.cpu_ratio for r in rounds if r.cpu_ratio]
    if not throughput:
        return ["no round was measured"], False
    low, high = interval(throughput)
    lines = [
        f"req/s with the page open / without: geometric mean {geo_mean(throughput):.3f} "
        f"(95% interval {low:.3f}-{high:.3f}), median {statistics.median(throughput):.3f}, "
        f"range {min(throughput):.3f}-{max(throughput):.3f} over {len(throughput)} rounds"
    ]
    if cpu:
        lines.append(
            f"router CPU per request without / with: geometric mean {geo_mean(cpu):.3f}, "
            f"median {statistics.median(cpu):.3f}, range {min(cpu):.3f}-{max(cpu):.3f}"
        )
    shares = [(r.status_share, r.samples) for r in rounds if r.status_share is not None]
    samples = sum(n for _, n in shares)
    if shares and samples:
        share = sum(s * n for s, n in shares) / samples
        lines.append(
            f"router samples with the status page's code on the stack, pages open: {share:.2%} "
            f"of {samples:,} (py-spy): what the page takes of the router's CPU, so the data "
            f"path keeps at least {1 - share:.3f}x of it"
        )
        met = 1 - share >= TARGET_RATIO and high >= TARGET_RATIO
        how = "the page's own CPU share, with the A/B's interval reaching it"
    else:
        met = geo_mean(throughput) >= TARGET_RATIO and (not cpu or geo_mean(cpu) >= TARGET_RATIO)
        how = "geometric means of throughput and CPU per request"
    verdict = "met" if met else "not met"
    lines.append(f"target (>= {TARGET_RATIO}x; judged on {how}): **{verdict}**")
    return lines, met


def markdown(
    command: str,
    options: Options,
    wrk_load: str,
    rounds: list[Round],
    viewers: int,
    notes: list[str],
) -> str:
    lines, _ = summary(rounds)
    docs = [r.with_page.notes for r in rounds]
    streamed = [n for ns in docs for n in ns if "documents" in n]
    table = [
        "| round | first | req/s without | req/s with the page | ratio | CPU ms/req without / with "
        "| CPU ratio | status code's share of samples |",
        "|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for k, one in enumerate(rounds, 1):
        table.append(f"| {k} | " + " | ".join(round_cells(one)) + " |")
    return (
        "\n".join(
            [
                *section_head(f"Status page A/B (`kvroute bench status`), {utc_stamp()}", command),
                f"- machine: {machine_line()}",
                f"- load: {wrk_load}",
                f"- setup: one kvroute process (default policy, the tiny model's tokenizer), "
                f"{options.upstreams} stub upstreams; windows alternate without / with {viewers} "
                "/status pages streaming the status document (ABBA order)",
                *(f"- {s}" for s in streamed[:1]),
                "",
                *table,
                "",
                *(f"- {line}" for line in lines),
                *(f"- note: {n}" for n in dict.fromkeys(notes)),
            ]
        )
        + "\n"
    )


def add_status_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="What an open /status page costs the data path: a paired A/B in one router process.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=positive_int, default=10, help="A/B pairs (default 10)")
    p.add_argument("--viewers", type=positive_int, default=2, help="/status pages open (default 2)")
    p.add_argument(
        "--duration", type=positive_int, default=5, help="seconds per window (default 5)"
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured seconds before each window")
    p.add_argument(
        "--concurrency", type=positive_int, default=32, help="wrk connections (default 32)"
    )
    p.add_argument("--threads", type=positive_int, default=2, help="wrk threads (default 2)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="Also sample the router with py-spy in each window with the page open (recordings "
        "in DIR) and report the share of its samples in the status page's code.",
    )
    add_report_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if args.warmup < 0:
        print("kvroute bench status: --warmup must be 0 or more", file=sys.stderr)
        return 2
    options = Options(
        concurrency=args.concurrency,
        duration_s=args.duration,
        warmup_s=args.warmup,
        threads=args.threads,
        targets=("kvroute",),
        output_md=args.output_md,
        record=not args.no_record,
        profile_dir=args.profile,
    )
    if not prepare_profile("status", args.profile):
        return 2
    try:
        wrk = choose_loadgen(options)
        load = load_line(options, wrk)
        print(f"versions: {versions_line(options, wrk)}\nload: {load}", flush=True)
        rounds, notes = run_rounds(options, args.rounds, args.viewers)
    except (LoadError, processes.StartError, OSError) as exc:
        print(f"kvroute bench status: {exc}", file=sys.stderr)
        return 2
    lines, _ = summary(rounds)
    print("\n".join(lines))
    if options.record:
        path = Path(options.output_md)
        command = reproduce_command(sys.argv[1:], "status")
        record(path, markdown(command, options, load, rounds, args.viewers, notes))
        print(f"appended to {path}")
    return 0 if rounds else 1
