"""Mooncake JSONL traces (FAST'25 release): one request per line.

``{"timestamp": ms since trace start, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}``; ``hash_ids`` name 512-token prefix blocks (``block_tokens`` option for
other releases), ``len(hash_ids) == ceil(input_length / block_tokens)``, and an equal id at an equal
position means an equal prefix, which is exactly ``TraceRequest.block_ids``. Rows are sorted by
timestamp (stably) if the file is not.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import TraceError
from .model import Trace, TraceRequest
from .options import parse_options, require

DEFAULTS = {"block_tokens": 512}


def load_mooncake(path: str, options: str = "") -> Trace:
    """The Mooncake trace at ``path``; ``options`` like ``"block_tokens=512"``."""
    opts = parse_options(options, DEFAULTS, where="mooncake")
    block_tokens = int(opts["block_tokens"])
    require(block_tokens >= 1, "mooncake: option 'block_tokens'", "must be at least 1")
    requests: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    requests.append(_parse_row(line, block_tokens, where=f"{path}:{number}"))
    except OSError as error:
        raise TraceError(f"{path}: cannot read ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (Mooncake traces are JSON lines)") from None
    if not requests:
        raise TraceError(f"{path}: no requests in the file")
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(name=_name(path), block_tokens=block_tokens, requests=tuple(requests))


def _parse_row(line: str, block_tokens: int, *, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    timestamp = _number(row, "timestamp", where)
    input_tokens = _count(row, "input_length", where, minimum=1)
    output_tokens = _count(row, "output_length", where, minimum=0)
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in hash_ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    expected = math.ceil(input_tokens / block_tokens)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_tokens}, expected "
            f"{expected} ({block_tokens}-token blocks; set mooncake:block_tokens=N for other sizes)"
        )
    return TraceRequest(
        arrival_s=timestamp / 1000.0,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        block_ids=tuple(hash_ids),
    )


def _number(row: dict[str, Any], key: str, where: str) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise TraceError(f"{where}: {key!r} must be a number >= 0, got {value!r}")
    return float(value)


def _count(row: dict[str, Any], key: str, where: str, *, minimum: int) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _name(path: str) -> str:
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return base.removesuffix(".jsonl")
