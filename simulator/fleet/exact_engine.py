"""The exact engine model (``simulator.engine.Engine``, 16-token blocks) behind the fleet's
engine interface: step by step, real token ids, real KV events and router hashes.

Slow on long traces (per-token lists, a hash per KV block, one step per decode token), so the
fleet uses it to measure the fast engine's fidelity on slices. Prompts are made of tokens
derived from the unit keys (unit key ``k`` holds tokens ``k * block_tokens + j``), so equal
block-id prefixes give equal token prefixes and equal engine block hashes.
"""

from __future__ import annotations

from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, tier_of
from kvroute.simulator.engine import Engine, EngineRequest
from kvroute.simulator.engine.config import EngineConfig
from kvroute.simulator.engine.outputs import StepOutput

from .kv_units import IndexOp
from .protocol import StepReport
from .units import SimRequest

_TOKEN_SPACE = 2**31  # prompt tokens derived from units lie below; resumed output above


def prompt_tokens(request: SimRequest, block_tokens: int) -> list[int]:
    """The prompt's token ids: each unit's tokens follow from its key."""
    tokens: list[int] = []
    left = request.input_tokens
    for key in request.unit_keys:
        n = min(block_tokens, left)
        base = (key * block_tokens) % _TOKEN_SPACE
        tokens.extend(range(base, base + n))
        left -= n
    return tokens


class ExactEngine:
    """``simulator.engine.Engine`` stepped one scheduler iteration at a time."""

    def __init__(self, config: EngineConfig, block_tokens: int) -> None:
        self.engine = Engine(config)
        self.block_tokens = block_tokens
        self.block_size = config.block_size
        self.index_block_tokens = config.block_size
        self._hashes: dict[int, tuple[int, ...]] = {}
        self._pending: StepOutput | None = None
        self._end = 0.0
        self._delivered: dict[int, int] = {}  # trace index -> tokens generated here
        self.steps = 0
        self.runs = 0

    @property
    def num_preemptions(self) -> int:
        return self.engine.stats.num_preemptions

    def route_hashes(self, request: SimRequest) -> tuple[int, ...]:
        hashes = self._hashes.get(request.index)
        if hashes is None:
            tokens = prompt_tokens(request, self.block_tokens)
            hashes = self._hashes[request.index] = tuple(block_hashes(tokens, self.block_size))
        return hashes

    @property
    def num_waiting(self) -> int:
        return self.engine.stats.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.engine.stats.kv_cache_usage

    def add(self, request: SimRequest, extra_tokens: int, to_generate: int) -> None:
        tokens = prompt_tokens(request, self.block_tokens)
        if extra_tokens:
            base = _TOKEN_SPACE + (request.index * 7919) % (_TOKEN_SPACE - extra_tokens)
            tokens.extend(range(base, base + extra_tokens))
        self._delivered[request.index] = 0
        self.engine.add_request(EngineRequest(str(request.index), tokens, to_generate, 0.0))

    def start(self, now: float) -> float | None:
        if not self.engine.has_unfinished_requests():
            return None
        out = self.engine.step(now)
        if out.duration_s == 0.0 and not out.outputs and not out.events:
            return None
        self.steps += 1
        self._pending = out
        self._end = now + out.duration_s
        return self._end

    def split(self, now: float) -> float:
        return self._end

    def complete(self) -> StepReport:
        out = self._pending
        assert out is not None
        self._pending = None
        report = StepReport()
        end = self._end
        delivered = self._delivered
        for o in out.outputs:
            index = int(o.request_id)
            if not o.new_token_ids:
                continue
            got = delivered[index]
            if got == 0:
                report.first_tokens.append((index, end))
                report.lookups.append((index, o.num_prompt_tokens, o.num_cached_tokens))
            delivered[index] = got + len(o.new_token_ids)
            if o.finished:
                report.finished.append((index, end))
                del delivered[index]
        report.index_ops = [_op(e) for e in out.events]
        return report

    def fail(self, now: float) -> tuple[StepReport, dict[int, int]]:
        self._pending = None  # the step in progress never completes
        left = dict(self._delivered)
        self._delivered = {}
        return StepReport(), left


def _op(event: object) -> IndexOp:
    if isinstance(event, BlockStored):
        return (
            "stored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            tier_of(event.medium, event.locality),
        )
    if isinstance(event, BlockRemoved):
        return ("removed", event.block_hashes, tier_of(event.medium, event.locality))
    assert isinstance(event, AllBlocksCleared)
    return ("cleared",)
