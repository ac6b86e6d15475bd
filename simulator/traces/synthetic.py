"""Synthetic workloads from a one-line spec (pure, deterministic for a seed).

See ``SYNTHETIC_HELP`` for the grammar and the generators. Every generator draws Poisson arrivals
(exponential gaps at the given rate), token counts uniform in [0.5, 1.5] x their mean, and builds
block ids from named segments (``blocks.BlockIdAllocator``), so shared text becomes shared
prefixes exactly and nothing else does. Generators joined by ``+`` run side by side on the same
clock, with separate content (they share no text).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from .blocks import BlockIdAllocator, Prompt, Segment
from .errors import TraceError
from .model import Trace, TraceRequest
from .options import OptionValue, parse_options, require

SYNTHETIC_HELP = """\
Synthetic traces: --format synthetic --trace 'KIND[:key=value,...][+KIND[:...]]...'
Generators joined by '+' run side by side (e.g. 'chat:rate=1+hot-burst:rate=2').
Arrivals are Poisson; token counts are uniform in [0.5, 1.5] x the given mean. Every
generator takes duration=S (seconds of arrivals, default 600), block_tokens=N (prefix
granularity, default 64; all generators in one spec must agree) and output_tokens=N.
  multi-tenant  requests with a per-tenant system prompt and a unique question.
                tenants=8 rate=4 (req/s) system_tokens=2048 prompt_tokens=256
                output_tokens=128 zipf=1.0 (tenant popularity exponent, 0 = uniform)
                questions=0 (each tenant's fixed set of questions, asked again and again;
                0 = every question new; llm-d's tiered benchmark: tenants=250,questions=5)
  chat          multi-turn conversations: each turn resends the whole history plus a new
                message. rate=0.5 (new conversations/s) turns=6 (mean, geometric)
                think_s=20 (mean gap between turns) system_tokens=512 (shared by all)
                prompt_tokens=200 output_tokens=200 max_tokens=32768 (context cap)
  agent         agent loops: a long shared tool/system prefix, a task, then many quick
                steps that each append a tool result. rate=0.1 (new runs/s) steps=15
                (mean, geometric) step_s=3 (mean gap) system_tokens=6144 task_tokens=512
                tool_tokens=600 output_tokens=80 max_tokens=65536
  hot-burst     background requests with unique prompts plus bursts that all share one hot
                prompt (a new one each burst). rate=2 (background req/s) prompt_tokens=1024
                every=120 (s between burst starts) burst_s=10 burst_rate=40 (req/s)
                hot_tokens=2048 question_tokens=64 output_tokens=64
Example: 'multi-tenant:tenants=8,rate=4,duration=600'"""

COMMON: dict[str, OptionValue] = {"duration": 600.0, "block_tokens": 64}


@dataclass(frozen=True)
class _Kind:
    defaults: dict[str, OptionValue]
    generate: Callable[[_Context], list[TraceRequest]]


@dataclass
class _Context:
    """What a generator needs: its options, its random stream, the shared id allocator."""

    opts: dict[str, OptionValue]
    rng: random.Random
    blocks: BlockIdAllocator
    tag: int  # generator index: keeps content keys of different generators apart

    def num(self, key: str) -> float:
        return float(self.opts[key])

    def tokens(self, key: str) -> int:
        """A token count drawn uniformly in [0.5, 1.5] x the option's mean (at least 1)."""
        mean = self.num(key)
        if mean == 0:
            return 0
        return max(1, round(mean * self.rng.uniform(0.5, 1.5)))

    def arrivals(self, rate: float, start: float = 0.0, end: float | None = None) -> list[float]:
        """Poisson arrival times at ``rate`` per second in [start, end)."""
        stop = self.num("duration") if end is None else end
        times: list[float] = []
        t = start
        while True:
            t += self.rng.expovariate(rate)
            if t >= stop:
                return times
            times.append(t)

    def geometric(self, mean: float) -> int:
        """A count >= 1 with the given mean (geometric distribution)."""
        count = 1
        while self.rng.random() > 1.0 / mean:
            count += 1
        return count

    def prompt(self, *segments: Segment) -> Prompt:
        return self.blocks.empty().extend(segments)

    def request(self, arrival: float, prompt: Prompt, session: str | None) -> TraceRequest:
        return TraceRequest(
            arrival_s=arrival,
            input_tokens=prompt.tokens,
            output_tokens=self.tokens("output_tokens"),
            block_ids=prompt.block_ids(),
            session_id=session,
        )

    def key(self, *parts: Hashable) -> Hashable:
        return (self.tag, *parts)


def _multi_tenant(ctx: _Context) -> list[TraceRequest]:
    tenants = int(ctx.opts["tenants"])
    weights = [1.0 / (rank ** ctx.num("zipf")) for rank in range(1, tenants + 1)]
    system = [
        ctx.prompt((ctx.key("system", t), ctx.tokens("system_tokens"))) for t in range(tenants)
    ]
    questions = int(ctx.opts["questions"])
    # With a fixed set of questions per tenant, each drawn once: its length stays the same.
    asked: dict[tuple[int, int], int] = {}
    out: list[TraceRequest] = []
    for n, arrival in enumerate(ctx.arrivals(ctx.num("rate"))):
        tenant = ctx.rng.choices(range(tenants), weights)[0]
        if questions:
            q = ctx.rng.randrange(questions)
            if (tenant, q) not in asked:
                asked[tenant, q] = ctx.tokens("prompt_tokens")
            question = (ctx.key("question", tenant, q), asked[tenant, q])
        else:
            question = (ctx.key("question", n), ctx.tokens("prompt_tokens"))
        prompt = system[tenant].extend([question])
        out.append(ctx.request(arrival, prompt, f"tenant-{tenant}"))
    return out


def _conversations(ctx: _Context, *, chat: bool) -> list[TraceRequest]:
    """Chat and agent loops: sessions that resend their growing history at every turn."""
    mean_turns, gap_key = (ctx.num("turns"), "think_s") if chat else (ctx.num("steps"), "step_s")
    shared_system = ctx.prompt((ctx.key("system"), int(ctx.opts["system_tokens"])))
    duration, cap = ctx.num("duration"), int(ctx.opts["max_tokens"])
    out: list[TraceRequest] = []
    for session, start in enumerate(ctx.arrivals(ctx.num("rate"))):
        name = f"{'chat' if chat else 'agent'}-{session}"
        first_key = "prompt_tokens" if chat else "task_tokens"
        history = shared_system.extend([(ctx.key(name, "in", 0), ctx.tokens(first_key))])
        arrival = start
        for turn in range(ctx.geometric(mean_turns)):
            if turn:
                arrival += ctx.rng.expovariate(1.0 / ctx.num(gap_key))
                added = ctx.tokens("prompt_tokens" if chat else "tool_tokens")
                history = history.extend([(ctx.key(name, "in", turn), added)])
            if arrival >= duration or history.tokens > cap:
                break
            request = ctx.request(arrival, history, name)
            out.append(request)
            history = history.extend([(ctx.key(name, "out", turn), request.output_tokens)])
    return out


def _hot_burst(ctx: _Context) -> list[TraceRequest]:
    out = [
        ctx.request(
            arrival, ctx.prompt((ctx.key("background", n), ctx.tokens("prompt_tokens"))), None
        )
        for n, arrival in enumerate(ctx.arrivals(ctx.num("rate")))
    ]
    every, length = ctx.num("every"), ctx.num("burst_s")
    burst, start = 0, every / 2
    while start < ctx.num("duration"):
        hot = ctx.prompt((ctx.key("hot", burst), ctx.tokens("hot_tokens")))
        for n, arrival in enumerate(ctx.arrivals(ctx.num("burst_rate"), start, start + length)):
            question = (ctx.key("hot-question", burst, n), ctx.tokens("question_tokens"))
            out.append(ctx.request(arrival, hot.extend([question]), f"hot-{burst}"))
        burst += 1
        start += every
    return out


KINDS: dict[str, _Kind] = {
    "multi-tenant": _Kind(
        {"tenants": 8, "rate": 4.0, "system_tokens": 2048, "prompt_tokens": 256,
         "output_tokens": 128, "zipf": 1.0, "questions": 0},
        _multi_tenant,
    ),
    "chat": _Kind(
        {"rate": 0.5, "turns": 6.0, "think_s": 20.0, "system_tokens": 512, "prompt_tokens": 200,
         "output_tokens": 200, "max_tokens": 32768},
        lambda ctx: _conversations(ctx, chat=True),
    ),
    "agent": _Kind(
        {"rate": 0.1, "steps": 15.0, "step_s": 3.0, "system_tokens": 6144, "task_tokens": 512,
         "tool_tokens": 600, "output_tokens": 80, "max_tokens": 65536},
        lambda ctx: _conversations(ctx, chat=False),
    ),
    "hot-burst": _Kind(
        {"rate": 2.0, "prompt_tokens": 1024, "every": 120.0, "burst_s": 10.0,
         "burst_rate": 40.0, "hot_tokens": 2048, "question_tokens": 64, "output_tokens": 64},
        _hot_burst,
    ),
}  # fmt: skip


def is_synthetic_spec(text: str) -> bool:
    """Whether ``text`` starts like a synthetic spec (a generator name)."""
    return text.split("+", 1)[0].split(":", 1)[0].strip() in KINDS


def generate(spec: str, seed: int = 0) -> Trace:
    """The trace described by ``spec`` (see SYNTHETIC_HELP), the same for the same seed."""
    parts = [part.strip() for part in spec.split("+")]
    if not spec.strip() or not all(parts):
        raise TraceError(f"synthetic spec {spec!r}: empty generator (see --help for the grammar)")
    parsed: list[tuple[str, dict[str, OptionValue]]] = []
    for part in parts:
        kind, _, options = part.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            known = ", ".join(KINDS)
            raise TraceError(f"synthetic spec: unknown generator {kind!r} (known: {known})")
        opts = parse_options(options, {**COMMON, **KINDS[kind].defaults}, where=f"synthetic {kind}")
        _check(kind, opts)
        parsed.append((kind, opts))
    block_tokens = {int(opts["block_tokens"]) for _, opts in parsed}
    if len(block_tokens) > 1:
        raise TraceError(f"synthetic spec {spec!r}: generators disagree on block_tokens")
    blocks = BlockIdAllocator(block_tokens.pop())
    requests: list[TraceRequest] = []
    for tag, (kind, opts) in enumerate(parsed):
        rng = random.Random(f"kvroute-synthetic:{seed}:{tag}:{kind}")
        requests.extend(KINDS[kind].generate(_Context(opts, rng, blocks, tag)))
    if not requests:
        raise TraceError(f"synthetic spec {spec!r}: generates no requests (raise rate or duration)")
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(name=spec.strip(), block_tokens=blocks.block_tokens, requests=tuple(requests))


def _check(kind: str, opts: dict[str, OptionValue]) -> None:
    where = f"synthetic {kind}"
    for key, value in opts.items():
        if isinstance(value, str):
            continue
        require(math.isfinite(value), f"{where}: option {key!r}", "must be finite")
        if key == "zipf":
            require(value >= 0, f"{where}: option 'zipf'", "must be >= 0")
        elif key in ("system_tokens", "output_tokens", "questions"):
            require(value >= 0, f"{where}: option {key!r}", "must be >= 0")
        elif key in ("turns", "steps"):
            require(value >= 1, f"{where}: option {key!r}", "must be >= 1 (a mean count)")
        else:
            require(value > 0, f"{where}: option {key!r}", "must be positive")
