"""Azure LLM inference traces (2023, Splitwise): ``TIMESTAMP,ContextTokens,GeneratedTokens``.

The files carry arrival times and token counts but no prompt content, so prefixes are synthesized
with a reuse model (deterministic for the seed; every knob is a format option, e.g.
``--format azure:apps=32,followup=0.3``):

- ``apps`` applications (default 16) with a system prompt each, of ``system_tokens`` tokens on
  average (default 1024, uniform in [0.5, 1.5] x), picked with Zipf(``zipf``, default 1.0)
  popularity.
- Each request first tries to continue a conversation (probability ``followup``, default 0.5): of up
  to 8 conversations sampled among those active in the last ``session_s`` seconds (default 600),
  the one with the longest history that fits in the request's ContextTokens. Its prompt is that
  conversation's previous prompt, then its previous answer, then new text filling the rest.
- Otherwise the request starts a new conversation: with probability ``system_share`` (default 0.8)
  its prompt begins with its app's system prompt (cut to the request's length if longer), and the
  rest is text of its own.
- ``block_tokens`` (default 64) is the prefix granularity of the resulting block ids.

Timestamps become seconds since the first row; rows are sorted by time if the file is not.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from datetime import datetime

from .blocks import BlockIdAllocator, Prompt, Segment
from .errors import TraceError
from .model import Trace, TraceRequest
from .options import OptionValue, parse_options, require

DEFAULTS: dict[str, OptionValue] = {
    "apps": 16,
    "system_tokens": 1024,
    "zipf": 1.0,
    "followup": 0.5,
    "system_share": 0.8,
    "session_s": 600.0,
    "block_tokens": 64,
}
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
CANDIDATES = 8


@dataclass(frozen=True)
class _Row:
    time: datetime
    input_tokens: int
    output_tokens: int


@dataclass
class _Conversation:
    name: str
    prompt: Prompt  # of its latest request
    output_tokens: int
    output_key: tuple[str, int]
    last_s: float

    @property
    def history_tokens(self) -> int:
        return self.prompt.tokens + self.output_tokens


def load_azure(
    path: str,
    options: str = "",
    *,
    seed: int = 0,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
) -> Trace:
    """The Azure trace at ``path`` with synthesized prefixes (see the module docstring).

    The reuse model only looks back, so ``window_s`` and ``max_requests`` (as ``load_trace``
    applies them) let it stop early without changing the requests it keeps.
    """
    opts = parse_options(options, DEFAULTS, where="azure")
    _check(opts)
    rows = _read_rows(path)
    rows.sort(key=lambda row: row.time)
    first = rows[0].time
    window_start, window_end = window_s if window_s is not None else (0.0, math.inf)
    model = _ReuseModel(opts, random.Random(f"kvroute-azure:{seed}"))
    requests: list[TraceRequest] = []
    kept = 0
    for row in rows:
        arrival = (row.time - first).total_seconds()
        if arrival >= window_end or (max_requests is not None and kept >= max_requests):
            break
        requests.append(model.request(arrival, row.input_tokens, row.output_tokens))
        kept += arrival >= window_start
    name = path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".csv")
    return Trace(name=name, block_tokens=model.blocks.block_tokens, requests=tuple(requests))


def _check(opts: dict[str, OptionValue]) -> None:
    def number(key: str) -> float:
        return float(opts[key])

    require(int(opts["apps"]) >= 1, "azure: option 'apps'", "must be at least 1")
    require(int(opts["block_tokens"]) >= 1, "azure: option 'block_tokens'", "must be at least 1")
    require(number("system_tokens") >= 0, "azure: option 'system_tokens'", "must be >= 0")
    require(0 <= number("zipf") < math.inf, "azure: option 'zipf'", "must be >= 0")
    require(number("session_s") > 0, "azure: option 'session_s'", "must be positive")
    for key in ("followup", "system_share"):
        require(0 <= number(key) <= 1, f"azure: option {key!r}", "must be in [0, 1]")


def _read_rows(path: str) -> list[_Row]:
    rows: list[_Row] = []
    try:
        with open(path, newline="", encoding="utf-8") as file:
            reader = csv.reader(file)
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{path}: empty file")
            header = [name.strip() for name in header]
            missing = [name for name in COLUMNS if name not in header]
            if missing:
                raise TraceError(
                    f"{path}:1: missing column(s) {', '.join(missing)} (expected {','.join(COLUMNS)})"
                )
            columns = [header.index(name) for name in COLUMNS]
            for number, fields in enumerate(reader, start=2):
                if fields:
                    rows.append(_parse_row(fields, columns, where=f"{path}:{number}"))
    except OSError as error:
        raise TraceError(f"{path}: cannot read ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (Azure traces are CSV)") from None
    except csv.Error as error:
        raise TraceError(f"{path}: malformed CSV ({error})") from None
    if not rows:
        raise TraceError(f"{path}: no requests in the file")
    return rows


def _parse_row(fields: list[str], columns: list[int], *, where: str) -> _Row:
    if len(fields) <= max(columns):
        raise TraceError(f"{where}: expected {len(COLUMNS)} fields, got {len(fields)}")
    stamp, context, generated = (fields[i].strip() for i in columns)
    return _Row(
        _parse_time(stamp, where),
        _parse_count(context, "ContextTokens", where, minimum=1),
        _parse_count(generated, "GeneratedTokens", where, minimum=0),
    )


def _parse_time(text: str, where: str) -> datetime:
    """``2023-11-16 18:17:03.9799600``: fractions of any length (Python takes up to 6 digits)."""
    base, _, fraction = text.partition(".")
    try:
        moment = datetime.fromisoformat(base)
        if fraction:
            if not fraction.isdigit():
                raise ValueError
            moment = moment.replace(microsecond=int(fraction[:6].ljust(6, "0")))
    except ValueError:
        raise TraceError(
            f"{where}: TIMESTAMP {text!r} is not a time like 2023-11-16 18:17:03.9799600"
        ) from None
    return moment


def _parse_count(text: str, column: str, where: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise TraceError(f"{where}: {column} must be an integer >= {minimum}, got {text!r}")
    return value


class _ReuseModel:
    """Gives each request a prompt of its length, made of shared and new segments."""

    def __init__(self, opts: dict[str, OptionValue], rng: random.Random) -> None:
        self.rng = rng
        self.blocks = BlockIdAllocator(int(opts["block_tokens"]))
        apps = int(opts["apps"])
        mean_system = float(opts["system_tokens"])
        self.system = [round(mean_system * rng.uniform(0.5, 1.5)) for _ in range(apps)]
        self.weights = [1.0 / rank ** float(opts["zipf"]) for rank in range(1, apps + 1)]
        self.followup = float(opts["followup"])
        self.system_share = float(opts["system_share"])
        self.session_s = float(opts["session_s"])
        self.active: list[_Conversation] = []
        self.count = 0

    def request(self, arrival_s: float, input_tokens: int, output_tokens: int) -> TraceRequest:
        conversation = None
        if self.rng.random() < self.followup:
            conversation = self._continued(arrival_s, input_tokens)
        if conversation is None:
            conversation = self._started(arrival_s, input_tokens)
        else:
            history = conversation.history_tokens
            conversation.prompt = conversation.prompt.extend(
                [
                    (conversation.output_key, conversation.output_tokens),
                    (("text", self.count), input_tokens - history),
                ]
            )
        self.count += 1
        conversation.output_tokens = output_tokens
        conversation.output_key = ("answer", self.count)
        conversation.last_s = arrival_s
        return TraceRequest(
            arrival_s=arrival_s,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            block_ids=conversation.prompt.block_ids(),
            session_id=conversation.name,
        )

    def _continued(self, now: float, input_tokens: int) -> _Conversation | None:
        """The sampled active conversation with the longest history that fits, if any."""
        picks = self.rng.sample(range(len(self.active)), min(CANDIDATES, len(self.active)))
        best: _Conversation | None = None
        for index in sorted(picks, reverse=True):
            candidate = self.active[index]
            if now - candidate.last_s > self.session_s:
                self.active[index] = self.active[-1]  # stale: swap-remove, highest index first
                self.active.pop()
            elif candidate.history_tokens <= input_tokens and (
                best is None or candidate.history_tokens > best.history_tokens
            ):
                best = candidate
        return best

    def _started(self, now: float, input_tokens: int) -> _Conversation:
        segments: list[Segment] = []
        if self.rng.random() < self.system_share:
            app = self.rng.choices(range(len(self.system)), self.weights)[0]
            segments.append((("system", app), min(self.system[app], input_tokens)))
        used = sum(tokens for _, tokens in segments)
        segments.append((("text", self.count), input_tokens - used))
        prompt = self.blocks.empty().extend(segments)
        conversation = _Conversation(f"conv-{self.count}", prompt, 0, ("answer", -1), now)
        self.active.append(conversation)
        return conversation
