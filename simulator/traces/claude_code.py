"""Claude Code sessions in the kv-cache-tester (WEKA) format, streamed from a tar archive.

One JSON file per conversation: ``block_size`` (64), ``hash_id_scope`` ("local" or "global") and
``requests``, each ``{"t": s since the conversation start, "type": "n"|"s", "in", "out",
"hash_ids"}`` or a sub-agent ``{"t", "type": "subagent", "agent_id", "requests": [...]}`` whose
requests' ``t`` count from the sub-agent's start. The source may be a tar archive (any compression,
read as a stream: nothing is unpacked to disk), a directory of such files, or one file.

What the loader adds, since the format has no absolute times:
- Session arrivals: conversations start as a Poisson process at ``session_rate`` per second (the
  first at 0), in archive order (sorted names for a directory); the seed fixes the gaps.
- Sub-agents are flattened: a request at ``parent start + sub-agent t + request t``, with session
  id ``<conversation>/<agent_id>`` (the parent's requests use ``<conversation>``).
- Gaps: each request after the first of its list (the parent's, or one sub-agent's) records the
  seconds from the previous response to it (``gap_s``): the file's ``think_time`` (tool calls and
  the user), else its ``t`` less the previous request's ``t`` and ``api_time``. A closed-loop
  replay (``kvroute replay --closed-loop``) sends it that long after that response.
- Id scopes: "local" ids are made unique per conversation (sub-agents share their parent's
  namespace), so equal ids in different conversations never meet; "global" ids are shared by all
  conversations with that scope.
- A stream request followed by a non-stream one with identical hash_ids (type "s" then "n") is one
  API call logged twice: the pair becomes one request (the first's time, the larger output).
- Re-blocking: ``block_tokens`` (default 512, a multiple of the file's block_size) groups the
  file's ids into coarser blocks, each named by its parent and the ids it groups. Prefix sharing is
  rounded down to whole blocks (under 1 % of these ~100k-token prompts) and memory drops by the
  same factor: 64-token ids for the whole archive would need about 750 MB of tuples. A block not
  entirely covered by the file's ids (the partial tail) gets an id of its own.
"""

from __future__ import annotations

import math
import os
import random
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from .errors import TraceError
from .model import Trace, TraceRequest
from .options import OptionValue, parse_options, require

DEFAULTS: dict[str, OptionValue] = {"session_rate": 0.05, "block_tokens": 512}


class _Request(msgspec.Struct):
    t: float
    type: str = "n"
    input_tokens: int = msgspec.field(name="in", default=0)
    out: int = 0
    hash_ids: msgspec.Raw = msgspec.Raw(b"[]")  # decoded lazily: most of it repeats the last one
    agent_id: str = ""
    requests: list[_Request] | None = None
    api_time: float | None = None  # seconds the API call took, as recorded
    think_time: float | None = None  # seconds from the previous response to this request


class _Conversation(msgspec.Struct):
    requests: list[_Request]
    block_size: int = 64
    hash_id_scope: str = "local"
    id: str = ""


_decoder = msgspec.json.Decoder(_Conversation)
_ids_decoder = msgspec.json.Decoder(list[int])


def load_claude_code(
    path: str,
    options: str = "",
    *,
    seed: int = 0,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
) -> Trace:
    """The sessions at ``path`` on one clock (see the module docstring).

    ``window_s`` and ``max_requests`` (on the generated clock, as ``load_trace`` applies them)
    only let reading stop early, once no later conversation can contribute.
    """
    opts = parse_options(options, DEFAULTS, where="claude-code")
    rate, block_tokens = float(opts["session_rate"]), int(opts["block_tokens"])
    require(0 < rate < math.inf, "claude-code: option 'session_rate'", "must be positive")
    require(block_tokens >= 1, "claude-code: option 'block_tokens'", "must be at least 1")
    window_start, window_end = window_s if window_s is not None else (0.0, math.inf)
    rng = random.Random(f"kvroute-claude-code:{seed}")
    ids = _IdSpace(block_tokens)
    requests: list[TraceRequest] = []
    start = 0.0
    seen = 0
    for where, blob in _sources(path):
        if start >= window_end or (
            max_requests is not None
            and len(requests) >= max_requests
            and sum(window_start <= r.arrival_s < start for r in requests) >= max_requests
        ):
            break
        conversation = _decode(blob, where)
        name = conversation.id or os.path.basename(where).removesuffix(".json")
        requests.extend(_flatten(conversation, name, start, ids, where))
        seen += 1
        start += rng.expovariate(rate)
    if not seen:
        raise TraceError(f"{path}: no conversation files (*.json) found")
    if not requests:
        raise TraceError(f"{path}: the conversations hold no requests")
    requests.sort(key=lambda r: r.arrival_s)
    name = os.path.basename(path.rstrip("/")).split(".", 1)[0]
    return Trace(name=name, block_tokens=block_tokens, requests=tuple(requests))


def _sources(path: str) -> Iterator[tuple[str, bytes]]:
    """(where, bytes) of each conversation file under ``path``, in a fixed order."""
    if os.path.isdir(path):
        for entry in sorted(os.listdir(path)):
            if entry.endswith(".json"):
                yield os.path.join(path, entry), _read(os.path.join(path, entry))
        return
    if path.endswith(".json"):
        yield path, _read(path)
        return
    try:
        with tarfile.open(path, "r|*") as archive:
            for member in archive:
                if member.isfile() and member.name.endswith(".json"):
                    file = archive.extractfile(member)
                    if file is not None:
                        yield f"{path}:{member.name}", file.read()
    except (tarfile.TarError, EOFError, OSError) as error:
        # lzma, gzip and bz2 corruption surface as OSError or EOFError subclasses.
        raise TraceError(f"{path}: cannot read the archive ({error})") from None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise TraceError(f"{path}: cannot read ({error.strerror or error})") from None


def _decode(blob: bytes, where: str) -> _Conversation:
    try:
        conversation = _decoder.decode(blob)
    except msgspec.ValidationError as error:
        raise TraceError(f"{where}: {error}") from None
    except msgspec.DecodeError as error:
        raise TraceError(f"{where}: not valid JSON ({error})") from None
    require(conversation.block_size >= 1, f"{where}: 'block_size'", "must be at least 1")
    require(
        conversation.hash_id_scope in ("local", "global"),
        f"{where}: 'hash_id_scope'",
        f"must be 'local' or 'global', got {conversation.hash_id_scope!r}",
    )
    return conversation


@dataclass
class _Previous:
    """The last request of one request list: most of the next one repeats its ids."""

    raw: bytes = b"[]"
    kind: str = ""
    t: float | None = None  # when the last request was sent (None: none yet)
    api_time: float | None = None
    source_ids: list[int] | None = None
    block_ids: tuple[int, ...] = ()


class _IdSpace:
    """Numbers coarse blocks: the same parent and the same file ids keep the same number."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._next = 0
        self._global: dict[tuple[int, tuple[int, ...]], int] = {}
        self.global_root = self.fresh()

    def fresh(self) -> int:
        self._next += 1
        return self._next

    def scope(self, hash_id_scope: str) -> tuple[dict[tuple[int, tuple[int, ...]], int], int]:
        """The (chunk table, root) for a conversation: its own for "local", shared for "global"."""
        if hash_id_scope == "global":
            return self._global, self.global_root
        return {}, self.fresh()

    def number(
        self, table: dict[tuple[int, tuple[int, ...]], int], key: tuple[int, tuple[int, ...]]
    ) -> int:
        found = table.get(key)
        if found is None:
            found = table[key] = self.fresh()
        return found


def _flatten(
    conversation: _Conversation, name: str, start: float, ids: _IdSpace, where: str
) -> list[TraceRequest]:
    file_block = conversation.block_size
    if ids.block_tokens % file_block:
        raise TraceError(
            f"{where}: block_tokens {ids.block_tokens} is not a multiple of the file's "
            f"block_size {file_block} (set claude-code:block_tokens=N)"
        )
    table, root = ids.scope(conversation.hash_id_scope)
    blocks = _Blocks(ids, table, root, ids.block_tokens // file_block, file_block)
    out: list[TraceRequest] = []
    lists = [(conversation.requests, start, name, f"{where}: requests")]
    while lists:
        requests, offset, session, at = lists.pop()
        previous = _Previous()
        for index, request in enumerate(requests):
            here = f"{at}[{index}]"
            if not (0 <= request.t < math.inf):
                raise TraceError(f"{here}: 't' must be a number >= 0, got {request.t!r}")
            if request.type == "subagent":
                agent = f"{name}/{request.agent_id or index}"
                lists.append(
                    (request.requests or [], offset + request.t, agent, f"{here}.requests")
                )
                continue
            if request.input_tokens < 1 or request.out < 0:
                raise TraceError(f"{here}: 'in' must be >= 1 and 'out' >= 0")
            raw = bytes(request.hash_ids)
            if raw == previous.raw and previous.kind == "s" and request.type == "n" and out:
                last = out[-1]
                if last.output_tokens < request.out:
                    out[-1] = TraceRequest(
                        last.arrival_s, last.input_tokens, request.out, last.block_ids, session
                    )
                previous.kind = "collapsed"
                continue
            block_ids = blocks.convert(raw, request.input_tokens, previous, here)
            out.append(
                TraceRequest(
                    offset + request.t,
                    request.input_tokens,
                    request.out,
                    block_ids,
                    session,
                    _gap(request, previous),
                )
            )
            previous.kind = request.type
            previous.t, previous.api_time = request.t, request.api_time
    return out


def _gap(request: _Request, previous: _Previous) -> float | None:
    """Seconds from the previous response of the same request list to ``request``: its
    ``think_time`` (the tool call or the user), else the recorded send times less the previous
    call's ``api_time``; None for the first request of a list."""
    if previous.t is None:
        return None
    if request.think_time is not None and request.think_time >= 0:
        return request.think_time
    since = request.t - previous.t - (previous.api_time or 0.0)
    return max(0.0, since)


@dataclass
class _Blocks:
    """Turns a request's file ids (raw JSON) into coarse block ids, reusing the last request's."""

    ids: _IdSpace
    table: dict[tuple[int, tuple[int, ...]], int]
    root: int
    group: int  # file ids per coarse block
    file_block: int  # tokens per file id

    def convert(
        self, raw: bytes, input_tokens: int, previous: _Previous, where: str
    ) -> tuple[int, ...]:
        common, tail = (
            _common_prefix(raw, previous.raw) if previous.source_ids is not None else (0, raw)
        )
        try:
            decoded = _ids_decoder.decode(tail)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers ({error})") from None
        source = (previous.source_ids or [])[:common] + decoded
        known = min(len(source), input_tokens // self.file_block)
        whole = known // self.group
        reused = min(common // self.group, len(previous.block_ids), whole)
        block_ids = list(previous.block_ids[:reused])
        parent = block_ids[-1] if block_ids else self.root
        for chunk in range(reused, whole):
            key = (parent, tuple(source[chunk * self.group : (chunk + 1) * self.group]))
            parent = self.ids.number(self.table, key)
            block_ids.append(parent)
        total = math.ceil(input_tokens / (self.group * self.file_block))
        block_ids.extend(self.ids.fresh() for _ in range(total - whole))
        previous.raw, previous.source_ids = raw, source
        previous.block_ids = tuple(block_ids[:whole])
        return tuple(block_ids)


def _common_prefix(raw: bytes, previous: bytes) -> tuple[int, bytes]:
    """How many leading ids two JSON integer lists share (read from their bytes; a lower bound,
    exact for lists written alike), and the JSON list of ``raw``'s ids after those."""
    if raw == previous:
        return raw.count(b",") + (1 if raw.strip(b"[] \n") else 0), b"[]"
    limit = min(len(raw), len(previous))
    low, high = 0, limit  # raw[:low] == previous[:low]; raw[:high] differs unless high == limit
    if raw[:limit] == previous[:limit]:
        low = limit
    while high - low > 1:
        middle = (low + high) // 2
        if raw[:middle] == previous[:middle]:
            low = middle
        else:
            high = middle
    same = low
    common = raw.count(b",", 0, same)
    cut = raw.rfind(b",", 0, same)
    ends = (b",", b"]")
    if (
        raw[same : same + 1] in ends
        and previous[same : same + 1] in ends
        and raw[same - 1 : same].isdigit()
    ):
        common, cut = common + 1, same  # the id ending here is whole in both lists
    if cut < 0:
        return 0, raw
    return common, b"[]" if raw[cut : cut + 1] == b"]" else b"[" + raw[cut + 1 :]
