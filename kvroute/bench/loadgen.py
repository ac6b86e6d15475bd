"""``kvroute bench overhead``'s load: wrk when installed, else a built-in asyncio client.

Both run a fixed number of connections for a fixed time, each connection sending the next
request as soon as the last one is answered (closed loop), and both return a ``LoadResult``.
This is a wrk stand-in that POSTs one body as fast as a router answers, as cheaply as it can
(the client shares the machine with the router it measures); the OpenAI load generator that
reads and judges answers (the live replay, the drill, the demo) is ``kvroute.simulator.loadgen``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvroute.kvcore.stats import percentile
from kvroute.simulator.workload import filler

HEADERS = {"Content-Type": "application/json"}


class LoadError(RuntimeError):
    """The load generator could not run or its output could not be read."""


@dataclass(frozen=True)
class LoadResult:
    requests: int
    duration_s: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int = 0  # wrk counts statuses >= 400 here ("Non-2xx or 3xx responses")
    socket_errors: int = 0  # connect, read, write and timeout errors

    @property
    def errors(self) -> int:
        return self.non_2xx + self.socket_errors


# Where a body's bytes say so, each request puts its own number (so no two bodies are the same:
# a router that caches a prompt's tokens by its text finds nothing to reuse).
MARKER = b"@REQ@"


@dataclass(frozen=True)
class Load:
    url: str
    body: bytes  # MARKER in it: each request's number there
    concurrency: int
    duration_s: int
    threads: int = 2


# ---------------------------------------------------------------------------- wrk


def find_wrk() -> str | None:
    return shutil.which("wrk")


def wrk_version(wrk: str) -> str:
    """``wrk -v`` prints e.g. "wrk debian/4.1.0-3+b2 [epoll] ..." (and exits 1)."""
    try:
        out = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "wrk"
    first = (out.stdout or out.stderr).splitlines()
    return " ".join(first[0].split()[:2]) if first else "wrk"


def _lua_string(text: str) -> str:
    """``text`` as a Lua long string, its level above any ``]]`` inside."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    return f"[{eq}[{text}]{eq}]"


def wrk_script(body: bytes) -> str:
    """A Lua script that makes every wrk request ``POST`` the given JSON body; where the body
    holds MARKER, each request its own number there (``<wrk thread>-<count>``)."""
    head = 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
    if MARKER not in body:
        return head + f"wrk.body = {_lua_string(body.decode())}\n"
    before, after = (_lua_string(part.decode()) for part in body.split(MARKER, 1))
    return head + (
        "local made = 0\n"
        "function setup(thread)\n  made = made + 1\n  thread:set('tid', made)\nend\n"
        "local count = 0\n"
        "function request()\n  count = count + 1\n"
        f"  return wrk.format(nil, nil, nil, {before} .. tid .. '-' .. count .. {after})\nend\n"
    )


def numbered(body: bytes, number: int) -> bytes:
    """``body`` with MARKER (if any) replaced by ``number``: what wrk's script sends."""
    return body.replace(MARKER, str(number).encode(), 1)


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_RE_PERCENTILE = re.compile(r"^\s*([\d.]+)%\s+([\d.]+)(us|ms|s|m|h)\s*$", re.M)
_RE_REQUESTS = re.compile(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m|h)", re.M)
_RE_RPS = re.compile(r"^Requests/sec:\s+([\d.]+)", re.M)
_RE_NON_2XX = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")
_RE_SOCKET = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def to_ms(value: str, unit: str) -> float:
    return float(value) * _UNITS_MS[unit]


def parse_wrk(output: str) -> LoadResult:
    """Read requests/s, p50/p99, non-2xx and socket errors from ``wrk --latency`` output."""
    rps = _RE_RPS.search(output)
    total = _RE_REQUESTS.search(output)
    if rps is None or total is None:
        raise LoadError(f"cannot read wrk output:\n{output.strip()}")
    percentiles = {float(p): to_ms(v, u) for p, v, u in _RE_PERCENTILE.findall(output)}
    if 50.0 not in percentiles or 99.0 not in percentiles:
        raise LoadError(f"no latency distribution in wrk output (run it with --latency):\n{output}")
    non_2xx = _RE_NON_2XX.search(output)
    socket_errors = _RE_SOCKET.search(output)
    return LoadResult(
        requests=int(total.group(1)),
        duration_s=to_ms(total.group(2), total.group(3)) / 1e3,
        requests_per_s=float(rps.group(1)),
        p50_ms=percentiles[50.0],
        p99_ms=percentiles[99.0],
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(g) for g in socket_errors.groups()) if socket_errors else 0,
    )


def wrk_output(
    wrk: str,
    url: str,
    script: str,
    threads: int,
    concurrency: int,
    duration_s: int,
    prefix: str = "kvroute-bench-",
) -> str:
    """What wrk prints after ``duration_s`` of ``concurrency`` connections to ``url``, each
    request made by the Lua ``script``; LoadError when it fails or hangs."""
    threads = max(1, min(threads, concurrency))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix=prefix) as f:
        f.write(script)
        f.flush()
        argv = [
            wrk, f"-t{threads}", f"-c{concurrency}", f"-d{duration_s}s",
            "--latency", "-s", f.name, url,
        ]  # fmt: skip
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
        except subprocess.TimeoutExpired as exc:
            raise LoadError(f"wrk did not finish: {exc}") from exc
    if out.returncode != 0:
        raise LoadError(f"wrk exited with {out.returncode}: {(out.stdout + out.stderr).strip()}")
    return out.stdout


def run_wrk(wrk: str, load: Load) -> LoadResult:
    script = wrk_script(load.body)
    return parse_wrk(
        wrk_output(wrk, load.url, script, load.threads, load.concurrency, load.duration_s)
    )


# ---------------------------------------------------------------------- built-in


async def _builtin(load: Load) -> LoadResult:
    import aiohttp  # imported here so that `kvroute --help` stays quick

    latencies_ms: list[float] = []
    counts = {"non_2xx": 0, "socket": 0}
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        deadline = time.monotonic() + load.duration_s
        sent_count = itertools.count()

        async def connection() -> None:
            while time.monotonic() < deadline:
                body = numbered(load.body, next(sent_count))
                sent = time.perf_counter()
                try:
                    async with session.post(load.url, data=body, headers=HEADERS) as resp:
                        await resp.read()
                        if resp.status >= 400:
                            counts["non_2xx"] += 1
                except (aiohttp.ClientError, TimeoutError):
                    counts["socket"] += 1
                    continue
                latencies_ms.append((time.perf_counter() - sent) * 1e3)

        started = time.perf_counter()
        await asyncio.gather(*(connection() for _ in range(load.concurrency)))
        elapsed = time.perf_counter() - started
    done = len(latencies_ms)
    return LoadResult(
        requests=done,
        duration_s=elapsed,
        requests_per_s=done / elapsed if elapsed > 0 else 0.0,
        p50_ms=percentile(latencies_ms, 0.5, method="nearest_rank") if done else 0.0,
        p99_ms=percentile(latencies_ms, 0.99, method="nearest_rank") if done else 0.0,
        non_2xx=counts["non_2xx"],
        socket_errors=counts["socket"],
    )


def run_builtin(load: Load) -> LoadResult:
    """Closed-loop load from one Python process (aiohttp on uvloop)."""
    import uvloop

    return uvloop.run(_builtin(load))


def run_load(wrk: str | None, load: Load) -> LoadResult:
    """Run ``load`` with wrk when a path is given, else with the built-in generator."""
    return run_wrk(wrk, load) if wrk else run_builtin(load)


# ------------------------------------------------------------- agent conversations


@dataclass(frozen=True)
class Conversations:
    """Agent-like chats: each starts with ``start_chars`` of history and every request adds a
    user message, then the (made-up) reply is carried into the next turn: ``turn_chars``."""

    url: str  # .../v1/chat/completions
    model: str
    count: int  # conversations, spread over the connections; none is ever in flight twice
    concurrency: int
    start_chars: int = 220_000
    turn_chars: int = 2_000
    seed: int = 0
    # Every request a conversation new to the router (its first turn: a system message of its
    # own ahead of the same history), instead of the next turn of one it has seen.
    cold: bool = False


def _message(role: str, content: str) -> bytes:
    return json.dumps({"role": role, "content": content}).encode()


class _Conversation:
    def __init__(self, spec: Conversations, index: int) -> None:
        self.rng = random.Random(spec.seed * 100_003 + index)
        self.turn_chars = spec.turn_chars
        self.messages = bytearray(_message("system", filler(self.rng, spec.turn_chars * 2)))
        while len(self.messages) < spec.start_chars:
            for role in ("user", "assistant"):
                self.messages += b"," + _message(role, filler(self.rng, spec.turn_chars // 2))
        self.head = (
            b'{"model": ' + json.dumps(spec.model).encode() + b', "max_tokens": 8, "messages": ['
        )
        self.cold = spec.cold
        self.index = index
        self.sent = 0

    def next_body(self) -> bytes:
        if self.cold:  # a new conversation: nothing of it cached anywhere
            self.sent += 1
            new = _message("system", f"session {self.index}-{self.sent}")
            return self.head + new + b"," + self.messages + b"]}"
        self.messages += b"," + _message("user", filler(self.rng, self.turn_chars // 2))
        return self.head + self.messages + b"]}"

    def replied(self) -> None:
        if not self.cold:
            self.messages += b"," + _message("assistant", filler(self.rng, self.turn_chars // 2))


@dataclass(frozen=True)
class ConversationResult:
    load: LoadResult
    mean_body_bytes: float
    first_turn_ms: float  # median latency of the conversations' first requests (the warm-up)
    # Median latency of a new conversation's first turn sent alone (nothing else in flight):
    # what one cold long turn costs, apart from the queue the concurrent first turns make.
    cold_turn_alone_ms: float
    window: tuple[float, float]  # the measured window, in time.monotonic()


WindowHook = Callable[[float, float], None]


async def _conversations(
    spec: Conversations,
    warmup_s: float,
    duration_s: float,
    on_window: WindowHook | None = None,
) -> ConversationResult:
    import aiohttp

    conversations = [_Conversation(spec, i) for i in range(spec.count)]
    latencies_ms: list[float] = []
    first_ms: list[float] = []
    sizes: list[int] = []
    counts = {"non_2xx": 0, "socket": 0}
    connector = aiohttp.TCPConnector(limit=spec.concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        alone_ms = await _cold_turns_alone(session, spec)
        window = {"from": math.inf, "to": math.inf}  # set once every first turn is answered
        pending = [spec.concurrency]

        async def turn(conversation: _Conversation, measured: bool) -> float | None:
            body = conversation.next_body()
            sent = time.perf_counter()
            try:
                async with session.post(spec.url, data=body, headers=HEADERS) as resp:
                    await resp.read()
                    if resp.status >= 400:
                        counts["non_2xx"] += measured
            except (aiohttp.ClientError, TimeoutError):
                counts["socket"] += measured
                return None
            conversation.replied()
            if measured:
                sizes.append(len(body))
            return (time.perf_counter() - sent) * 1e3

        async def connection(mine: list[_Conversation]) -> None:
            for conversation in mine:  # every conversation's first turn, before the warm-up
                ms = await turn(conversation, False)
                if ms is not None:
                    first_ms.append(ms)
            pending[0] -= 1
            if not pending[0]:
                window["from"] = time.monotonic() + warmup_s
                window["to"] = window["from"] + duration_s
                if on_window is not None:
                    on_window(window["from"], window["to"])
            while time.monotonic() < window["to"]:
                for conversation in mine:
                    now = time.monotonic()
                    if now >= window["to"]:
                        break
                    measured = now >= window["from"]
                    ms = await turn(conversation, measured)
                    if ms is not None and measured:
                        latencies_ms.append(ms)

        shares = [conversations[i :: spec.concurrency] for i in range(spec.concurrency)]
        pending[0] = sum(1 for share in shares if share)
        await asyncio.gather(*(connection(share) for share in shares if share))
    done = len(latencies_ms)
    load = LoadResult(
        requests=done,
        duration_s=duration_s,
        requests_per_s=done / duration_s,
        p50_ms=percentile(latencies_ms, 0.5, method="nearest_rank") if done else 0.0,
        p99_ms=percentile(latencies_ms, 0.99, method="nearest_rank") if done else 0.0,
        non_2xx=counts["non_2xx"],
        socket_errors=counts["socket"],
    )
    mean_body = sum(sizes) / len(sizes) if sizes else 0.0
    first = percentile(first_ms, 0.5, method="nearest_rank") if first_ms else 0.0
    alone = percentile(alone_ms, 0.5, method="nearest_rank") if alone_ms else 0.0
    return ConversationResult(load, mean_body, first, alone, (window["from"], window["to"]))


COLD_TURNS_ALONE = 5


async def _cold_turns_alone(session: Any, spec: Conversations) -> list[float]:
    """COLD_TURNS_ALONE conversations the load never uses, each's first turn sent alone, one
    after another: the latency of a whole long history new to the router."""
    import aiohttp

    latencies = []
    for k in range(COLD_TURNS_ALONE):
        body = _Conversation(spec, spec.count + k).next_body()
        sent = time.perf_counter()
        try:
            async with session.post(spec.url, data=body, headers=HEADERS) as resp:
                await resp.read()
                if resp.status >= 400:
                    continue
        except (aiohttp.ClientError, TimeoutError):
            continue
        latencies.append((time.perf_counter() - sent) * 1e3)
    return latencies


def run_conversations(
    spec: Conversations, warmup_s: float, duration_s: float, on_window: WindowHook | None = None
) -> ConversationResult:
    """Closed-loop agent conversations: each connection takes its conversations in turn; the
    first turn of each (the whole history new to the router) falls in the warm-up.
    ``on_window(start, end)`` learns the measured window (monotonic) as soon as it is set."""
    import uvloop

    return uvloop.run(_conversations(spec, warmup_s, duration_s, on_window))
