"""``kvroute bench dp``: data-parallel replicas routed per rank, side by side with single-rank ones.

Emulated replicas (kvroute's vLLM emulator, ``--data-parallel-size``) serve a multi-tenant chat
workload (each tenant a long shared system prompt, multi-turn conversations, several in flight)
in three set-ups of the same total capacity, one after the other in one run, each through
``kvroute serve`` with kv_aware:

* ``single``: REPLICAS x RANKS single-rank replicas (the reference: routing sees every cache).
* ``dp-ranks``: REPLICAS replicas of RANKS data-parallel ranks, the router picking the rank
  (one endpoint per rank, each rank's KV events, X-data-parallel-rank).
* ``dp-vllm``: the same DP replicas with the router picking only the replica (no KV events:
  what a DP fleet got before ranks, ``kv_events: false``) and vLLM's own balancing picking the
  rank (the emulator's copy of vLLM's DP load balancer, which is not cache-aware).

For each: the engines' own prefix-cache hit rate (their /metrics, all ranks), TTFT p50/p99 and
requests/s. Targets: dp-ranks' hit rate at least 0.95x single's and its TTFT p99 within 10%;
dp-ranks' gain over dp-vllm is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvroute.backends.launcher import LaunchedFleet, LaunchedReplica, LaunchSpec, ensure_tiny_model
from kvroute.backends.process import free_ports
from kvroute.bench.argtypes import add_report_args, positive_int
from kvroute.bench.chat_load import (
    RunResult,
    record_counters,
    replica_counters,
    reset_prefix_caches,
    run_conversations,
)
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import HOST, Launch, serve_argv, start_router
from kvroute.bench.harness.host import machine_line, record, utc_stamp
from kvroute.bench.harness.report import first_line, ms, reproduce_command, section_head
from kvroute.simulator.workload import Conversation, multi_tenant_chat

MODEL = "tiny"
BLOCK_SIZE = 32
SETUPS = ("single", "dp-ranks", "dp-vllm")
TARGET_HIT_RATIO = 0.95
TARGET_TTFT_P99 = 1.10
# Sent through each router before the caches are reset and its run starts (not measured).
WARMUP = tuple(Conversation(1000 + i, f"Router warm-up {i}.", ("Hello.",)) for i in range(6))


@dataclass
class Options:
    replicas: int = 2
    ranks: int = 4
    tenants: int = 12
    conversations: int = 3
    turns: int = 3
    system_words: int = 300
    user_words: int = 30
    concurrency: int = 8
    max_tokens: int = 8
    kv_blocks: int | None = None  # per rank; None: about two tenants' conversations
    policy: str = "kv_aware"
    preset: str = "llama-3.1-8b-h100"
    time_scale: float = 1.0
    seed: int = 0
    rounds: int = 3
    log_dir: str | None = None
    startup_timeout_s: float = 120.0
    output_md: str = "BENCHMARKS.md"
    record: bool = True


@dataclass
class Row:
    setup: str
    result: RunResult | None = None
    error: str | None = None


@dataclass
class Outcome:
    rows: list[Row]
    kv_blocks: int = 0
    machine: str = field(default_factory=machine_line)

    def result(self, setup: str) -> RunResult | None:
        return next((r.result for r in self.rows if r.setup == setup), None)


def kv_blocks_for(options: Options, prompt_tokens: int) -> int:
    """Room for about two tenants' conversations per rank: a spread workload must evict."""
    return options.kv_blocks or (prompt_tokens // BLOCK_SIZE + 1) * 2 + 24


@contextlib.contextmanager
def running_fleet(
    options: Options, count: int, ranks: int, kv_blocks: int, log_dir: Path, prefix: str
) -> Iterator[list[LaunchedReplica]]:
    spec = LaunchSpec(
        engine="emulated", count=count, model=MODEL, model_path=None,
        tokenizer=str(ensure_tiny_model()), block_size=BLOCK_SIZE, num_gpu_blocks=kv_blocks,
        max_num_seqs=16, preset=options.preset, time_scale=options.time_scale, kv_events=True,
        host=HOST, log_dir=str(log_dir), startup_timeout_s=options.startup_timeout_s,
        max_restarts=0, kv_events_bind="tcp", data_parallel_size=ranks, name_prefix=prefix,
    )  # fmt: skip
    fleet = LaunchedFleet(spec)
    try:
        fleet.start()
        yield fleet.replicas
    finally:
        fleet.stop(grace_s=10)


def router_config(
    replicas: Sequence[LaunchedReplica], per_rank: bool, policy: str
) -> dict[str, object]:
    """``policy`` over ``replicas``: per rank with their events, or per replica without."""
    entries: list[dict[str, object]] = []
    for r in replicas:
        entry: dict[str, object] = {"url": r.url, "name": r.name}
        if per_rank:
            entry |= {"kv_events": r.kv_events, "kv_replay": r.kv_replay}
            entry["data_parallel_size"] = r.data_parallel_size
        entries.append(entry)
    return {
        "replicas": entries,
        "policy": {"name": policy},
        "routing": {"tokenizer": str(ensure_tiny_model()), "block_size": BLOCK_SIZE},
    }


async def measure(
    base: str, replicas: Sequence[LaunchedReplica], conversations: Sequence[Conversation],
    options: Options, label: str,
) -> RunResult:  # fmt: skip
    urls = [r.url for r in replicas]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await run_conversations(
            http, lambda _: base, WARMUP, RunResult("warm-up"),
            concurrency=options.concurrency, max_tokens=1, progress=False,
        )  # fmt: skip
        await reset_prefix_caches(http, urls)
        before = await replica_counters(http, urls)
        result = RunResult(label)
        await run_conversations(
            http, lambda _: base, conversations, result,
            concurrency=options.concurrency, max_tokens=options.max_tokens, progress=False,
        )  # fmt: skip
        record_counters(
            result, {r.url: r.name for r in replicas}, before, await replica_counters(http, urls)
        )
    return result


def run_setup(
    setup: str,
    replicas: Sequence[LaunchedReplica],
    per_rank: bool,
    conversations: Sequence[Conversation],
    options: Options,
    log_dir: Path,
) -> Row:
    row = Row(setup)
    config = log_dir / f"router-{setup}.json"  # JSON is YAML: serve --config reads it
    config.write_text(json.dumps(router_config(replicas, per_rank, options.policy)))
    (port,) = free_ports(1)
    launch = Launch(serve_argv(port, (), "--config", str(config)), "/ready")
    print(f"kvroute bench dp: {setup}", file=sys.stderr, flush=True)
    try:
        with contextlib.ExitStack() as stack:
            base = start_router(stack, setup, launch, port, log_dir, 120.0)[0]
            row.result = asyncio.run(measure(base, replicas, conversations, options, setup))
    except (processes.StartError, OSError, RuntimeError) as exc:
        row.error = first_line(exc)
        print(f"  {setup}: {row.error}", file=sys.stderr)
    return row


def run_bench(options: Options) -> Outcome:
    """Both fleets up at once; the set-ups take turns, ``rounds`` times (the machine's load
    moves: each set-up meets it alike), their runs pooled per set-up."""
    from kvroute.kvcore.tokenizer import HFTokenizerFiles

    conversations = multi_tenant_chat(
        options.tenants, options.conversations, options.turns,
        options.system_words, options.user_words, options.seed,
    )  # fmt: skip
    tokens = HFTokenizerFiles(ensure_tiny_model()).encode(conversations[0].system_prompt)
    kv_blocks = kv_blocks_for(options, len(tokens))
    outcome = Outcome([Row(s) for s in SETUPS], kv_blocks=kv_blocks)
    total = options.replicas * options.ranks
    with contextlib.ExitStack() as stack:
        log_dir = stack.enter_context(processes.session("dp-", keep_in=options.log_dir))
        singles = stack.enter_context(running_fleet(options, total, 1, kv_blocks, log_dir, "one-"))
        dps = stack.enter_context(
            running_fleet(options, options.replicas, options.ranks, kv_blocks, log_dir, "dp-")
        )
        fleets = {"single": (singles, True), "dp-ranks": (dps, True), "dp-vllm": (dps, False)}
        for _ in range(options.rounds):
            for row in outcome.rows:
                replicas, per_rank = fleets[row.setup]
                run = run_setup(row.setup, replicas, per_rank, conversations, options, log_dir)
                if run.error is not None:
                    row.error = run.error
                elif run.result is not None:
                    row.result = pooled(row.result, run.result)
    return outcome


def pooled(into: RunResult | None, run: RunResult) -> RunResult:
    """Rounds of one set-up as one: their requests together, the mean hit rate (each round
    sends the same requests)."""
    if into is None:
        run.per_replica = {}
        return run
    rounds = round(into.requests / run.requests) if run.requests else 1
    into.hit_rate = (into.hit_rate * rounds + run.hit_rate) / (rounds + 1)
    into.requests += run.requests
    into.errors += run.errors
    into.ttfts += run.ttfts
    into.latencies += run.latencies
    into.wall_s += run.wall_s
    return into


# ---------------------------------------------------------------- report


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(outcome: Outcome, options: Options) -> str:
    total = options.replicas * options.ranks
    lines = [
        f"Fleets of equal capacity: {total} single-rank emulated replicas vs {options.replicas} "
        f"of {options.ranks} data-parallel ranks ({outcome.kv_blocks} KV blocks of {BLOCK_SIZE} "
        f"and 16 sequences per rank; preset {options.preset}, time scale {options.time_scale:g}); "
        f"{options.tenants} tenants x {options.conversations} conversations x {options.turns} "
        f"turns, {options.concurrency} in flight, {options.rounds} rounds taking turns; kvroute "
        f"{options.policy}. {outcome.machine}",
        "",
        "| set-up | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | req/s | errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in outcome.rows:
        r = row.result
        if r is None:
            lines.append(f"| {row.setup} | failed: {row.error} | | | | |")
            continue
        lines.append(
            f"| {row.setup} | {r.hit_rate:.3f} | {ms(r.ttft_s(0.5))} | {ms(r.ttft_s(0.99))} "
            f"| {r.requests_per_s:.1f} | {r.errors} |"
        )
    single, ranks, vllm = (outcome.result(s) for s in ("single", "dp-ranks", "dp-vllm"))
    lines.append("")
    if single is not None and ranks is not None:
        hit = _ratio(ranks.hit_rate, single.hit_rate)
        p99 = _ratio(ranks.ttft_s(0.99), single.ttft_s(0.99))
        lines.append(
            f"- dp-ranks vs single: hit rate {hit:.3f}x (target >= {TARGET_HIT_RATIO}: "
            f"{'met' if hit >= TARGET_HIT_RATIO else 'MISSED'}), TTFT p99 {p99:.3f}x (target <= "
            f"{TARGET_TTFT_P99}: {'met' if p99 <= TARGET_TTFT_P99 else 'MISSED'})"
        )
    if ranks is not None and vllm is not None:
        lines.append(
            f"- dp-ranks vs dp-vllm (vLLM's balancing picks the rank): hit rate "
            f"{ranks.hit_rate:.3f} vs {vllm.hit_rate:.3f} "
            f"({ranks.hit_rate - vllm.hit_rate:+.3f}); TTFT dp-vllm / dp-ranks: p50 "
            f"{_ratio(vllm.ttft_s(0.5), ranks.ttft_s(0.5)):.2f}x, p99 "
            f"{_ratio(vllm.ttft_s(0.99), ranks.ttft_s(0.99)):.2f}x (above 1: per-rank routing "
            "is faster)"
        )
    return "\n".join(lines)


def add_dp_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "dp",
        help="Data-parallel replicas routed per rank vs single-rank replicas and vLLM's own "
        "rank balancing (emulated replicas).",
        # The set-ups' list and what is measured, as the module says it (kept as written).
        description="\n\n".join(__doc__.split("\n\n")[1:4]) if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Options()
    p.add_argument("--replicas", type=positive_int, default=d.replicas, help="DP replicas.")
    p.add_argument("--ranks", type=positive_int, default=d.ranks, help="Ranks per DP replica.")
    p.add_argument("--tenants", type=positive_int, default=d.tenants, help="Tenants.")
    p.add_argument(
        "--conversations", type=positive_int, default=d.conversations, help="Per tenant."
    )
    p.add_argument("--turns", type=positive_int, default=d.turns, help="Turns per conversation.")
    p.add_argument(
        "--system-words", type=positive_int, default=d.system_words,
        help="Words in each tenant's shared system prompt.",
    )  # fmt: skip
    p.add_argument("--user-words", type=positive_int, default=d.user_words, help="Per user turn.")
    p.add_argument("--concurrency", type=positive_int, default=d.concurrency, help="In flight.")
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens, help="Output tokens.")
    p.add_argument(
        "--kv-blocks", type=positive_int, default=None,
        help="KV blocks per rank (default: about two tenants' worth, so eviction matters).",
    )  # fmt: skip
    p.add_argument(
        "--policy", default=d.policy,
        help=f"The router's policy in every set-up (default {d.policy}).",
    )  # fmt: skip
    p.add_argument("--preset", default=d.preset, help=f"Latency model (default {d.preset}).")
    p.add_argument(
        "--time-scale", type=float, default=d.time_scale,
        help="Above 1 runs the modelled hardware slower (less CPU noise on a small machine).",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="Seed of the generated workload.")
    p.add_argument(
        "--rounds", type=positive_int, default=d.rounds,
        help=f"Times the set-ups take turns, pooled per set-up (default {d.rounds}).",
    )  # fmt: skip
    p.add_argument("--log-dir", help="Keep the replicas' and routers' logs here.")
    add_report_args(p)
    p.set_defaults(func=_cmd_dp)


def _cmd_dp(args: argparse.Namespace) -> int:
    if not args.time_scale > 0:
        print("kvroute bench dp: --time-scale must be above 0", file=sys.stderr)
        return 2
    options = Options(
        replicas=args.replicas, ranks=args.ranks, tenants=args.tenants,
        conversations=args.conversations, turns=args.turns, system_words=args.system_words,
        user_words=args.user_words, concurrency=args.concurrency, max_tokens=args.max_tokens,
        kv_blocks=args.kv_blocks, policy=args.policy, preset=args.preset, rounds=args.rounds, time_scale=args.time_scale, seed=args.seed,
        log_dir=args.log_dir, output_md=args.output_md, record=not args.no_record,
    )  # fmt: skip
    started = time.monotonic()
    outcome = run_bench(options)
    body = report(outcome, options)
    print(body)
    print(f"(bench took {time.monotonic() - started:.0f} s)", file=sys.stderr)
    if options.record:
        command = reproduce_command(sys.argv, "dp")
        title = f"Data-parallel ranks on emulated replicas, {utc_stamp()}"
        record(
            Path(options.output_md),
            "\n".join([*section_head(title, command), body]) + "\n",
            header=False,
        )
    return 1 if any(r.error for r in outcome.rows) else 0
