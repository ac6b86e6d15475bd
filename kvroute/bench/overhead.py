"""``kvroute bench overhead``: the router's own cost, next to direct access and peer routers.

One run starts N instant-answer stub upstreams, then measures each target one after another
with the same closed-loop load: the first stub directly, kvroute (round_robin and its default
policy), vllm-router (round_robin, cache_aware) and smg (cache_aware). The stubs cost almost
nothing, so what a router adds over ``direct`` is its own overhead. The machine running this is
often small and shared, so read the ratios within one run, not the absolute numbers.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.backends.process import free_ports
from kvroute.bench.harness import processes
from kvroute.bench.harness.fleet import (
    HOST,
    Launch,
    find_executable,
    peer_launch,
    running_stubs,
    serve_argv,
)
from kvroute.bench.harness.host import (
    kvroute_version,
    machine_line,
    package_version,
    python_version,
    record,
    shown_path,
    utc_stamp,
)
from kvroute.bench.harness.report import (
    errors_cell,
    one_line,
    ratio,
    reproduce_command,
    section_head,
)
from kvroute.bench.harness.sampling import CpuSampler
from kvroute.bench.loadgen import (
    COLD_TURNS_ALONE,
    MARKER,
    Conversations,
    Load,
    LoadError,
    LoadResult,
    find_wrk,
    numbered,
    run_conversations,
    run_load,
    wrk_version,
)
from kvroute.bench.profiling import Frame, PySpy, frames_table, top_frames
from kvroute.policies import DEFAULT_POLICY
from kvroute.simulator.workload import filler

INSTALL_HINT = "install with: pip install -e '.[bench]'"


@dataclass(frozen=True)
class Target:
    name: str  # what --targets takes
    router: str  # "direct", "kvroute", "vllm-router" or "smg"
    policy: str | None  # None: the router's default
    workers: int = 1  # kvroute only: router processes sharing the port
    status_viewers: int = 0  # kvroute only: /status pages open (SSE streams) while measured


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("direct", "direct", None),
        Target("kvroute-rr", "kvroute", "round_robin"),
        Target("kvroute", "kvroute", None),
        Target("kvroute-rr-w2", "kvroute", "round_robin", workers=2),
        Target("kvroute-w2", "kvroute", None, workers=2),
        # The A/B for the status page: kvroute with two /status pages open (ask with --targets).
        Target("kvroute-status", "kvroute", None, status_viewers=2),
        Target("vllm-router-rr", "vllm-router", "round_robin"),
        Target("vllm-router-ca", "vllm-router", "cache_aware"),
        Target("smg-ca", "smg", "cache_aware"),
        Target("smg-rr", "smg", "round_robin"),  # not run by default; ask with --targets
    )
}
DEFAULT_TARGETS = [
    "direct",
    "kvroute-rr",
    "kvroute",
    "kvroute-rr-w2",
    "kvroute-w2",
    "vllm-router-rr",
    "vllm-router-ca",
    "smg-ca",
]
# The distributions whose versions the report shows, by router.
DISTRIBUTIONS = {"kvroute": "kvroute", "vllm-router": "vllm-router", "smg": "smg"}


@dataclass(frozen=True)
class Options:
    concurrency: int = 32
    duration_s: int = 10
    warmup_s: int = 2
    upstreams: int = 2
    targets: tuple[str, ...] = tuple(DEFAULT_TARGETS)
    stream: bool = False
    model: str = "stub-model"
    loadgen: str = "auto"  # "auto" (wrk if installed), "wrk" or "builtin"
    threads: int = 2
    startup_timeout_s: float = 60.0
    peer_bin_dir: str | None = None
    output_md: str = "BENCHMARKS.md"
    record: bool = True
    # "fixed": one small completion POSTed over and over (wrk); "agent": growing chat
    # conversations (built-in client), kvroute tokenizing them with the tiny model's tokenizer;
    # "agent-plain": the same with a chat template that emits no special token (``role:
    # content`` lines); "agent-cold": every request a new conversation's first turn; "chat-1k":
    # short chat completions (a ~1 KB user message, each request its own; wrk).
    workload: str = "fixed"
    conversations: int = 32
    start_kb: int = 220
    turn_kb: float = 2.0
    tokenizer: str | None = None  # kvroute's --tokenizer (default: the tiny model's)
    profile_dir: str | None = None  # py-spy recordings of each router go here
    # The targets run this many times, their order reversed every other round: on a shared
    # box one run's ratio moves with whatever else ran then; the median of per-round ratios
    # does much less.
    rounds: int = 1


@dataclass
class Row:
    target: Target
    result: LoadResult | None = None
    mean_body_kb: float | None = None  # agent workload
    first_turn_ms: float | None = None  # agent workload: a whole new conversation
    cold_turn_alone_ms: float | None = None  # agent workload: one new conversation, alone
    error: str | None = None  # why it has no result (skipped or failed)
    startup_s: float | None = None
    notes: list[str] = field(default_factory=list)
    cpu_ms_per_request: float | None = None  # the router's processes, over the window
    profile: list[Frame] | None = None  # py-spy's top frames (--profile)

    @property
    def label(self) -> str:
        if self.target.router == "direct":
            return "-"
        policy = self.target.policy or f"{DEFAULT_POLICY} (default)"
        return f"{policy}, {self.target.workers} workers" if self.target.workers > 1 else policy


# ---------------------------------------------------------------- command lines


def launch_for(
    target: Target,
    upstreams: list[str],
    port: int,
    metrics_port: int,
    exe: str,
    tokenizer: str | None = None,
) -> Launch:
    """The command line that starts ``target`` in front of ``upstreams``, and its ready path."""
    if target.router == "kvroute":
        flags = ["--tokenizer", tokenizer] if tokenizer else []
        if target.policy:
            flags += ["--policy", target.policy]
        if target.workers > 1:
            flags += ["--workers", str(target.workers)]
        return Launch(serve_argv(port, upstreams, *flags), "/ready")
    return peer_launch(target.router, exe, upstreams, port, metrics_port, target.policy)


def request_body(model: str, stream: bool) -> bytes:
    body: dict[str, object] = {"model": model, "prompt": "Say ok, eight times.", "max_tokens": 8}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


CHAT_USER_CHARS = 1000  # chat-1k's user message


def chat_body(model: str, stream: bool) -> bytes:
    """chat-1k's request: a short system message and a ~1 KB user message that starts with the
    request's own number (MARKER), so no two prompts are the same."""
    rng = random.Random(1)
    body: dict[str, object] = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": MARKER.decode() + " " + filler(rng, CHAT_USER_CHARS)},
        ],
        "max_tokens": 8,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def fixed_request(options: Options) -> tuple[str, bytes]:
    """The path and body wrk sends over and over (fixed and chat-1k)."""
    if options.workload == "chat-1k":
        return "/v1/chat/completions", chat_body(options.model, options.stream)
    return "/v1/completions", request_body(options.model, options.stream)


# ---------------------------------------------------------------------- running


def smoke_check(url: str, body: bytes) -> str | None:
    """Send one request; None when it is answered 2xx, else what went wrong."""
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
            return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200].decode('utf-8', 'replace')}"
    except OSError as exc:
        return str(exc)


def measure(
    base_url: str, options: Options, wrk: str | None, row: Row, router_pid: int | None
) -> None:
    """Warm up, then run the measured load against ``base_url``; fill ``row``, with the
    router's CPU per request (and where it goes, with ``--profile``) when it has a process."""
    sampler = CpuSampler(router_pid) if router_pid is not None else None
    spy: list[PySpy] = []

    def window_opens(start: float, end: float) -> None:
        if router_pid is None or not options.profile_dir or row.target.router != "kvroute":
            return  # py-spy reads Python processes: the peers are Rust
        out = Path(options.profile_dir) / f"{row.target.name}.raw"
        delay = max(0.0, start - time.monotonic())
        threading.Timer(delay, lambda: spy.append(PySpy(router_pid, end - start, out))).start()

    viewers = StatusViewers(base_url, row.target.status_viewers)
    with sampler or contextlib.nullcontext(), viewers:
        if is_agent(options.workload):
            spec = Conversations(
                base_url + "/v1/chat/completions",
                options.model,
                options.conversations,
                options.concurrency,
                options.start_kb * 1000,
                int(options.turn_kb * 1000),
                cold=options.workload == "agent-cold",
            )
            done = run_conversations(spec, options.warmup_s, options.duration_s, window_opens)
            row.result = done.load
            row.mean_body_kb = done.mean_body_bytes / 1000
            row.first_turn_ms = done.first_turn_ms
            row.cold_turn_alone_ms = done.cold_turn_alone_ms
            window = done.window
        else:
            path, body = fixed_request(options)
            url = base_url + path
            problem = smoke_check(url, numbered(body, 0))
            if problem:
                row.notes.append(f"first request failed ({problem})")
            load = Load(url, body, options.concurrency, options.duration_s, options.threads)
            if options.warmup_s > 0:
                warm = Load(url, body, options.concurrency, options.warmup_s, options.threads)
                run_load(wrk, warm)
            start = time.monotonic()
            window_opens(start, start + options.duration_s)
            row.result = run_load(wrk, load)
            window = (start, time.monotonic())
    if viewers.count:
        row.notes.append(
            f"{viewers.events} /status documents streamed to {viewers.count} open pages"
        )
    measured = row.result is not None and row.result.requests and window[1] < float("inf")
    if sampler is not None and measured:
        cpu_s = sampler.cpu_between(*window)
        # wrk counts the requests of its own window: scale the CPU to the run's duration.
        per_s = cpu_s / (window[1] - window[0])
        row.cpu_ms_per_request = 1000 * per_s / row.result.requests_per_s
    for recording in spy:
        problem = recording.wait(timeout_s=30)
        if problem:
            row.notes.append(problem)
        else:
            row.profile = top_frames(recording.out)


class StatusViewers:
    """``count`` people with the router's /status page open: each an SSE stream of the
    status document (one a second), read on a thread until the measurement ends."""

    def __init__(self, base_url: str, count: int) -> None:
        self.url = base_url + "/status/events"
        self.count = count
        self.events = 0  # documents received, over all viewers
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> StatusViewers:
        for _ in range(self.count):
            thread = threading.Thread(target=self._view, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _view(self) -> None:
        request = urllib.request.Request(self.url, headers={"Accept": "text/event-stream"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                for line in response:
                    if line.startswith(b"data: "):
                        self.events += 1
                    if self._stop.is_set():
                        return
        except (OSError, urllib.error.URLError):
            return  # the router went away: the row's own numbers say so


@contextlib.contextmanager
def running_target(
    target: Target, upstreams: list[str], options: Options, log_dir: Path, row: Row
) -> Iterator[tuple[str, int | None]]:
    """Start the target (nothing for ``direct``), yield its base URL and process id, stop it
    afterwards."""
    if target.router == "direct":
        yield upstreams[0], None
        return
    exe = "" if target.router == "kvroute" else executable_for(target, options)
    port, metrics_port = free_ports(2)
    # kvroute's cache-aware path tokenizes every prompt exactly (round robin skips it).
    tokenizer = agent_tokenizer(options) if target.router == "kvroute" else None
    launch = launch_for(target, upstreams, port, metrics_port, exe, tokenizer)
    base = f"http://{HOST}:{port}"
    started = time.monotonic()
    with processes.managed(
        target.name, launch.argv, log_dir, base + launch.ready_path, options.startup_timeout_s
    ) as child:
        row.startup_s = time.monotonic() - started
        yield base, child.pid


AGENT_WORKLOADS = ("agent", "agent-plain", "agent-cold")
# agent-plain's chat template: one ``role: content`` line per message, no special token.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def is_agent(workload: str) -> bool:
    return workload in AGENT_WORKLOADS


def agent_tokenizer(options: Options) -> str:
    """kvroute tokenizes prompts exactly: with this tokenizer (the tiny model's by default);
    agent-plain: its tokenizer files with PLAIN_TEMPLATE as the chat template."""
    if options.tokenizer:
        base = Path(options.tokenizer).expanduser()
    else:
        from kvroute.backends.launcher import ensure_tiny_model

        base = Path(ensure_tiny_model())
    if options.workload != "agent-plain":
        return str(base)
    return str(plain_template_copy(base))


def plain_template_copy(base: Path) -> Path:
    """``base``'s tokenizer files beside it with PLAIN_TEMPLATE (written once)."""
    import shutil

    out = base.parent / f"{base.name}-plain-template"
    out.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    config = out / "tokenizer_config.json"
    if config.is_file():  # chat_template.jinja wins anyway; drop the other to be plain
        data = json.loads(config.read_text(encoding="utf-8"))
        data.pop("chat_template", None)
        config.write_text(json.dumps(data), encoding="utf-8")
    (out / "chat_template.jinja").write_text(PLAIN_TEMPLATE, encoding="utf-8")
    return out


def executable_for(target: Target, options: Options) -> str:
    exe = find_executable(target.router, options.peer_bin_dir)
    if exe is None:
        raise FileNotFoundError(target.router)
    return exe


def skip_reason(target: Target, options: Options) -> str | None:
    if target.router in ("direct", "kvroute"):
        return None
    if find_executable(target.router, options.peer_bin_dir) is None:
        where = f"in {options.peer_bin_dir}, " if options.peer_bin_dir else ""
        return (
            f"{target.router} not found ({where}next to {sys.executable} or on PATH); "
            f"{INSTALL_HINT}"
        )
    return None


def run_target(
    target: Target, upstreams: list[str], options: Options, wrk: str | None, log_dir: Path
) -> Row:
    row = Row(target)
    reason = skip_reason(target, options)
    if reason:
        row.error = f"skipped: {reason}"
        return row
    try:
        with running_target(target, upstreams, options, log_dir, row) as (base_url, pid):
            measure(base_url, options, wrk, row, pid)
    except (processes.StartError, LoadError, OSError) as exc:
        row.error = f"failed: {exc}"
    return row


# ---------------------------------------------------------------------- report


@dataclass(frozen=True)
class Context:
    date: str
    command: str
    machine: str
    versions: str
    load: str


def versions_line(options: Options, wrk: str | None) -> str:
    parts = [kvroute_version()]
    for router in ("vllm-router", "smg"):
        exe = find_executable(router, options.peer_bin_dir)
        version = package_version(DISTRIBUTIONS[router], exe)
        parts.append(f"{router} {version or 'not installed'}")
    parts.append(python_version())
    parts.append(wrk_version(wrk) if wrk else "built-in load generator (aiohttp)")
    return ", ".join(parts)


def load_line(options: Options, wrk: str | None) -> str:
    if is_agent(options.workload):
        turns = (
            "each request a new conversation (its own system message ahead of the same history: "
            "nothing cached)"
            if options.workload == "agent-cold"
            else f"each request adding {options.turn_kb:g} KB (a user message, then the reply "
            "carried into the next turn)"
        )
        template = (
            ", chat template without special tokens (role: content lines)"
            if options.workload == "agent-plain"
            else ""
        )
        return (
            f"built-in, {options.concurrency} connections, {options.duration_s} s per target "
            f"after {options.warmup_s} s warmup; {options.workload} workload: "
            f"{options.conversations} chat conversations starting at {options.start_kb} KB of "
            f"history{template}, {turns}, "
            f"POST /v1/chat/completions (max_tokens 8); first {COLD_TURNS_ALONE} new "
            "conversations' first turns one at a time (cold turn alone), then each "
            f"conversation's first request (its whole history new to the router) all at once "
            f"before the warmup (first turn); kvroute tokenizes with "
            f"--tokenizer {shown_path(agent_tokenizer(options))}; {options.upstreams} stub "
            "upstreams"
        )
    gen = f"wrk, {min(options.threads, options.concurrency)} threads" if wrk else "built-in"
    kind = "streaming" if options.stream else "non-streaming"
    what = (
        f"chat-1k workload: {kind} POST /v1/chat/completions (max_tokens 8), a system message "
        f"and a {CHAT_USER_CHARS // 1000} KB user message, each request's its own (its number "
        "first), kvroute rendering the chat template"
        if options.workload == "chat-1k"
        else f"{kind} POST /v1/completions (max_tokens 8)"
    )
    return (
        f"{gen}, {options.concurrency} connections, {options.duration_s} s per target after "
        f"{options.warmup_s} s warmup; {what}; "
        f"kvroute tokenizes with --tokenizer {shown_path(agent_tokenizer(options))}; "
        f"{options.upstreams} stub upstreams"
    )


def direct_result(rows: list[Row]) -> LoadResult | None:
    for row in rows:
        if row.target.router == "direct" and row.result is not None:
            return row.result
    return None


def format_table(rows: list[Row]) -> str:
    """A Markdown table: one row per target, with ratios to ``direct``."""
    if any(row.mean_body_kb is not None for row in rows):
        return agent_table(rows)
    base = direct_result(rows)
    lines = [
        "| target | policy | req/s | p50 ms | p99 ms | errors | req/s vs direct | p99 vs direct "
        "| router CPU ms/req | req/s per core |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        r = row.result
        if r is None:
            status = (row.error or "failed").split(":", 1)[0]
            lines.append(
                f"| {row.target.name} | {row.label} | - | - | - | {status} (see notes) | - | - "
                "| - | - |"
            )
            continue
        lines.append(
            f"| {row.target.name} | {row.label} | {r.requests_per_s:.0f} | {r.p50_ms:.2f} "
            f"| {r.p99_ms:.2f} | {errors_cell(r)} "
            f"| {ratio(r.requests_per_s, base.requests_per_s if base else None)} "
            f"| {ratio(r.p99_ms, base.p99_ms if base else None)} | {cpu_cells(row)} |"
        )
    return "\n".join(lines)


def agent_table(rows: list[Row]) -> str:
    """The agent workload's table: decisions/s with the mean body and a first turn's cost."""
    base = direct_result(rows)
    lines = [
        "| target | policy | req/s | p50 ms | p99 ms | errors | mean body KB | first turn ms "
        "| cold turn alone ms | req/s vs direct | router CPU ms/req | req/s per core |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        r = row.result
        if r is None:
            status = (row.error or "failed").split(":", 1)[0]
            lines.append(
                f"| {row.target.name} | {row.label} | - | - | - | {status} | - | - | - | - | - "
                "| - |"
            )
            continue
        lines.append(
            f"| {row.target.name} | {row.label} | {r.requests_per_s:.0f} | {r.p50_ms:.2f} "
            f"| {r.p99_ms:.2f} | {errors_cell(r)} | {row.mean_body_kb or 0:.0f} "
            f"| {row.first_turn_ms or 0:.0f} | {row.cold_turn_alone_ms or 0:.0f} "
            f"| {ratio(r.requests_per_s, base.requests_per_s if base else None)} "
            f"| {cpu_cells(row)} |"
        )
    return "\n".join(lines)


def cpu_cells(row: Row) -> str:
    """The router's CPU per request and what one core would route at that cost."""
    cpu = row.cpu_ms_per_request
    if cpu is None or cpu <= 0:
        return "- | -"
    return f"{cpu:.2f} | {1000 / cpu:.0f}"


def profile_sections(rows: list[Row]) -> list[str]:
    """Each profiled router's top frames (py-spy, over its measured window)."""
    out = []
    for row in rows:
        if row.profile:
            out += [
                "",
                f"Where {row.target.name}'s CPU goes (py-spy over the measured window, "
                "top frames by self time):",
                "",
                frames_table(row.profile),
            ]
    return out


def smg_ratio_line(rows: list[Row]) -> str:
    """kvroute's throughput (default policy and round_robin) over smg cache_aware's."""
    by_name = {row.target.name: row.result for row in rows}
    smg = by_name.get("smg-ca")
    if smg is None or not smg.requests_per_s:
        return "kvroute/smg throughput ratio: n/a (smg cache_aware not measured)"
    parts = []
    for name, label in (
        ("kvroute", f"{DEFAULT_POLICY} (default)"),
        ("kvroute-rr", "round_robin"),
        ("kvroute-w2", f"{DEFAULT_POLICY} (default), 2 workers"),
        ("kvroute-rr-w2", "round_robin, 2 workers"),
    ):
        result = by_name.get(name)
        if result is not None:
            parts.append(f"kvroute {label} {result.requests_per_s / smg.requests_per_s:.2f}x")
    if not parts:
        return "kvroute/smg throughput ratio: n/a (kvroute not measured)"
    return "kvroute/smg throughput ratio (vs smg cache_aware): " + ", ".join(parts)


def run_notes(rows: list[Row], options: Options, wrk: str | None) -> list[str]:
    stubs = f"{options.upstreams} stub{'s' if options.upstreams != 1 else ''}"
    notes = [f"direct loads only the first stub; the routers spread the load over {stubs}."]
    names = {row.target.name for row in rows if row.result is not None}
    if "vllm-router-ca" in names:
        notes.append(
            "vllm-router cache_aware tokenizes every request on every worker "
            "(POST /v1/completions/render, then /tokenize); the stub answers 404 to both, so it "
            "routes without tokens and still pays those failed calls. Real vLLM answers them."
        )
    if not wrk:
        notes.append(
            "built-in Python load generator: its own CPU use caps the numbers; compare ratios."
        )
    for row in rows:
        r = row.result
        if r is not None and r.errors:
            notes.append(
                f"{row.target.name}: {r.errors} of {r.requests + r.socket_errors} requests "
                "failed; its numbers are not comparable."
            )
        notes.extend(f"{row.target.name}: {note}" for note in row.notes)
        if row.error:
            notes.append(f"{row.target.name}: " + one_line(row.error))
    return notes


# kvroute's targets and the peer each is judged against (the targets: kv_aware against
# smg cache_aware, round robin against vllm-router round robin).
RATIO_PAIRS = (
    ("kvroute", "smg-ca"),
    ("kvroute-w2", "smg-ca"),
    ("kvroute-rr", "vllm-router-rr"),
    ("kvroute-rr-w2", "vllm-router-rr"),
)


def round_order(targets: Sequence[Target], round_index: int) -> list[Target]:
    """Every other round in reverse, so no target always runs right after the same one or
    always early in the run (a box that gets busier or quieter favours neither)."""
    return list(targets) if round_index % 2 == 0 else list(reversed(targets))


def median_rows(rounds: Sequence[Sequence[Row]]) -> list[Row]:
    """Each target's median round by req/s (the lower middle of an even count), in the
    first round's order; a target with no result in any round keeps its first row."""
    by_name: dict[str, list[Row]] = {}
    for rows in rounds:
        for row in rows:
            by_name.setdefault(row.target.name, []).append(row)
    out = []
    for runs in by_name.values():
        measured = sorted(
            (r for r in runs if r.result is not None),
            key=lambda r: r.result.requests_per_s if r.result else 0.0,
        )
        out.append(measured[(len(measured) - 1) // 2] if measured else runs[0])
    return out


def round_ratios(rounds: Sequence[Sequence[Row]]) -> dict[tuple[str, str], list[float]]:
    """Per pair in RATIO_PAIRS, kvroute's req/s over its peer's in each round both ran."""
    out: dict[tuple[str, str], list[float]] = {}
    for mine, peer in RATIO_PAIRS:
        ratios = []
        for rows in rounds:
            got = {row.target.name: row.result for row in rows}
            a, b = got.get(mine), got.get(peer)
            if a is not None and b is not None and b.requests_per_s > 0:
                ratios.append(a.requests_per_s / b.requests_per_s)
        if ratios:
            out[(mine, peer)] = ratios
    return out


def round_ratios_line(rounds: Sequence[Sequence[Row]]) -> str:
    ratios = round_ratios(rounds)
    if not ratios:
        return f"per-round ratios over {len(rounds)} rounds: n/a (no kvroute target and its peer)"
    parts = []
    for (mine, peer), values in ratios.items():
        ordered = sorted(values)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        each = ", ".join(f"{v:.2f}" for v in values)
        parts.append(f"{mine}/{peer} median {median:.2f}x (rounds: {each})")
    return f"per-round ratios over {len(rounds)} rounds (req/s): " + "; ".join(parts)


def ratio_lines(rows: list[Row], rounds: Sequence[Sequence[Row]]) -> list[str]:
    if len(rounds) <= 1:
        return [smg_ratio_line(rows)]
    return [
        round_ratios_line(rounds),
        f"each target's row is its median round by req/s, of {len(rounds)} (order reversed "
        "every other round)",
    ]


def report(
    context: Context, rows: list[Row], notes: list[str], rounds: Sequence[Sequence[Row]] = ()
) -> str:
    return "\n".join(
        [
            f"date: {context.date}",
            f"command: {context.command}",
            f"machine: {context.machine}",
            f"versions: {context.versions}",
            f"load: {context.load}",
            "",
            format_table(rows),
            "",
            *ratio_lines(rows, rounds),
            *(f"note: {n}" for n in notes),
            *profile_sections(rows),
        ]
    )


def markdown_section(
    context: Context, rows: list[Row], notes: list[str], rounds: Sequence[Sequence[Row]] = ()
) -> str:
    agent = " (agent conversations)" if options_agent(rows) else ""
    lines = [
        *section_head(f"Router overhead{agent}, {context.date}", context.command),
        f"- machine: {context.machine}",
        f"- versions: {context.versions}",
        f"- load: {context.load}",
        "",
        format_table(rows),
        "",
        *ratio_lines(rows, rounds),
        "",
        *(f"- {n}" for n in notes),
        *profile_sections(rows),
    ]
    return "\n".join(lines) + "\n"


def options_agent(rows: list[Row]) -> bool:
    return any(row.mean_body_kb is not None for row in rows)


# ------------------------------------------------------------------------- main


def choose_loadgen(options: Options) -> str | None:
    """The wrk path to use, or None for the built-in generator."""
    if options.loadgen == "builtin" or is_agent(options.workload):
        return None
    wrk = find_wrk()
    if wrk is None and options.loadgen == "wrk":
        raise LoadError("wrk not found on PATH (Debian/Ubuntu: apt-get install wrk)")
    return wrk


def run_overhead(options: Options, argv: Sequence[str]) -> int:
    wrk = choose_loadgen(options)
    targets = [TARGETS[name] for name in options.targets]
    context = Context(
        date=utc_stamp(),
        command=reproduce_command(argv, "overhead"),
        machine=machine_line(),
        versions=versions_line(options, wrk),
        load=load_line(options, wrk),
    )
    print(f"command: {context.command}\nload: {context.load}", flush=True)
    rounds: list[list[Row]] = []
    with (
        processes.session() as log_dir,
        running_stubs(options.upstreams, options.model, log_dir, options.startup_timeout_s) as ups,
    ):
        try:
            for r in range(options.rounds):
                order = round_order(targets, r)
                runs: list[Row] = []
                for i, target in enumerate(order, 1):
                    head = f"round {r + 1}/{options.rounds} " if options.rounds > 1 else ""
                    print(f"[{head}{i}/{len(order)}] {target.name} ...", end=" ", flush=True)
                    row = run_target(target, ups, options, wrk, log_dir)
                    runs.append(row)
                    print(progress(row), flush=True)
                rounds.append(runs)
        except (KeyboardInterrupt, SystemExit):
            print("\ninterrupted: stopping the processes it started", file=sys.stderr, flush=True)
            raise
    rows = median_rows(rounds) if len(rounds) > 1 else rounds[0]
    notes = run_notes(rows, options, wrk)
    print()
    print(report(context, rows, notes, rounds))
    if options.record:
        path = Path(options.output_md)
        record(path, markdown_section(context, rows, notes, rounds))
        print(f"\nappended to {path}")
    measured = [row for row in rows if row.result is not None]
    return 0 if measured else 1


def progress(row: Row) -> str:
    if row.result is None:
        return one_line(row.error or "no result", 300)
    r = row.result
    up = f", ready in {row.startup_s:.1f} s" if row.startup_s is not None else ""
    return f"{r.requests_per_s:.0f} req/s, p99 {r.p99_ms:.2f} ms, {r.errors} errors{up}"
