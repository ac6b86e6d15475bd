"""``kvroute bench tokenize``: what router-side tokenization costs, and whether it stalls the loop.

For prompts of several lengths: the time to tokenize and hash one prompt (inline), and, while
``--concurrent`` such prompts are being tokenized, the longest gap between two ticks of a 1 ms
timer on the event loop, with everything inline versus long prompts offloaded to the worker
processes (``routing.tokenize_inline_chars``). The loop's longest stall is what every other
request in flight waits on.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.argtypes import add_report_args, positive_int
from kvroute.bench.harness.host import record, utc_stamp
from kvroute.bench.harness.report import reproduce_command, section_head
from kvroute.router.prompt_tokenizer import PromptTokenizer

WORDS = [
    "the",
    "cache",
    "router",
    "token",
    "block",
    "replica",
    "prompt",
    "answer",
    "stream",
    "naïve",
    "café",
    "日本語",
    "🦙",
]


@dataclass
class Line:
    chars: int
    tokens: int
    inline_ms: float
    stall_inline_ms: float
    stall_offload_ms: float


def text_of(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


async def _max_stall(work: asyncio.Future[object]) -> float:
    """Longest gap between ticks of a 1 ms timer while ``work`` runs."""
    worst = 0.0
    last = time.perf_counter()
    while not work.done():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst = max(worst, now - last - 0.001)
        last = now
    await work
    return worst


async def measure(spec: str, lengths: Sequence[int], concurrent: int, processes: int) -> list[Line]:
    inline = PromptTokenizer(spec, inline_chars=10**12, processes=0)
    offload = PromptTokenizer(spec, inline_chars=4096, processes=processes)
    offload.start()
    lines = []
    try:
        await offload.blocks("warm up the worker processes " * 400, True, 16, None)
        for n, chars in enumerate(lengths):
            texts = [text_of(chars, seed=1000 * n + i) for i in range(concurrent)]
            started = time.perf_counter()
            one = await inline.blocks(texts[0], True, 16, None)
            inline_ms = (time.perf_counter() - started) * 1000

            async def run_all(tok: PromptTokenizer, texts: list[str] = texts) -> object:
                await asyncio.sleep(0.005)  # let the ticker start first
                return await asyncio.gather(*(tok.blocks(t, True, 16, None) for t in texts))

            stall_inline = await _max_stall(asyncio.ensure_future(run_all(inline)))
            stall_offload = await _max_stall(asyncio.ensure_future(run_all(offload)))
            assert one is not None  # the inline path never breaks
            lines.append(
                Line(chars, one.tokens, inline_ms, stall_inline * 1000, stall_offload * 1000)
            )
    finally:
        offload.close()
    return lines


def format_table(lines: Sequence[Line], concurrent: int) -> str:
    out = [
        f"| prompt chars | tokens | tokenize + hash, inline ms | loop stall, {concurrent} inline, ms "
        f"| loop stall, {concurrent} offloaded, ms |",
        "|---|---|---|---|---|",
    ]
    for line in lines:
        out.append(
            f"| {line.chars:,} | {line.tokens:,} | {line.inline_ms:.2f} | "
            f"{line.stall_inline_ms:.1f} | {line.stall_offload_ms:.1f} |"
        )
    return "\n".join(out)


def add_tokenize_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "tokenize",
        help="Router-side tokenization: cost per prompt and event-loop stalls, inline vs offloaded.",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory, or 'builtin' (default: the tiny test model's).",
    )
    p.add_argument("--lengths", default="1000,10000,100000,400000", help="Prompt lengths (chars).")
    p.add_argument("--concurrent", type=positive_int, default=4, help="Prompts tokenized at once.")
    p.add_argument("--processes", type=positive_int, default=1, help="Tokenizer worker processes.")
    add_report_args(p)
    p.set_defaults(func=_cmd_tokenize)


def _cmd_tokenize(args: argparse.Namespace) -> int:
    spec = args.tokenizer
    if spec is None:
        from kvroute.backends.launcher import ensure_tiny_model

        spec = str(ensure_tiny_model())
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        print(f"kvroute bench tokenize: --lengths: not integers: {args.lengths!r}", file=sys.stderr)
        return 2
    if not lengths or min(lengths) < 1:
        print(
            "kvroute bench tokenize: --lengths must be positive integers",
            file=sys.stderr,
        )
        return 2
    lines = asyncio.run(measure(spec, lengths, args.concurrent, args.processes))
    table = format_table(lines, args.concurrent)
    print(table)
    if not args.no_record:
        argv = sys.argv if "tokenize" in sys.argv else []
        command = reproduce_command(argv, "tokenize", report_args=True)  # the command as given
        section = [
            *section_head(f"Router-side tokenization, {utc_stamp()}", command),
            table,
            "",
            f"- tokenizer: {spec}; {args.processes} worker process(es); prompts above 4,096 "
            "characters offloaded",
        ]
        record(Path(args.output_md), "\n".join(section) + "\n", header=False)
    return 0
