"""The fast engine model: vLLM's scheduler over a unit-granular KV pool, with decode runs.

Same scheduling as ``simulator/engine`` (vLLM v1, FCFS): each step spends a token budget on the
running requests first (decode 1 token, or the next prefill chunk), then admits waiting requests
in order while blocks and ``max_num_seqs`` allow; a running request that needs a block when none
is free preempts the youngest (recompute). Steps cost ``LatencyModel.step_time``. Two
departures make a 12k-request trace take seconds instead of minutes:

* the KV pool caches trace blocks, not 16-token blocks (``kv_units``);
* a step where every running request only decodes, and nothing can be admitted, is planned as
  a *run* of identical decode steps up to the next finish (or until blocks would run out), timed
  in closed form (``steptime``). A request that arrives during a run cuts it at the next step
  boundary (``split``), so it is scheduled exactly when it would be step by step.

Preemption frees a request's output blocks uncached (vLLM keeps the full ones cached, so a
resumed request may hit them): slightly pessimistic under KV pressure.

P/D disaggregation (``pd_fleet``): ``add_prefilled`` queues a request whose prompt's KV was
computed on a prefill replica and moved here. On admission it takes blocks for its whole prompt
(and caches it, as vLLM does once the transferred blocks land) and computes only its last prompt
token, as vLLM's scheduler does for a request whose KV is all external: that step samples its
first token. Preempted, it recomputes its prompt here like any other request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvroute.simulator.engine.config import EngineConfig

from .kv_units import Holdings, IndexOp, Unit, UnitPool
from .offload_units import OffloadUnits, lower_hits
from .protocol import StepReport
from .steptime import DecodeTimer
from .units import SimRequest

_MAX_RUN_STEPS = 1 << 20


class _Seq:
    __slots__ = (
        "bounds",
        "computed",
        "first_pending",
        "generated",
        "length",
        "next_unit",
        "preempted",
        "prefilled",
        "private",
        "ready_at",
        "request",
        "to_generate",
        "unit_blocks",
        "units",
    )

    def __init__(self, request: SimRequest, bounds: list[int], extra: int, to_generate: int):
        self.request = request
        self.bounds = bounds  # per unit: KV blocks full once the unit is computed (cumulative)
        self.length = request.input_tokens + extra  # prompt (plus resumed output) + generated
        self.to_generate = to_generate
        self.generated = 0
        self.computed = 0
        self.units: list[Unit] = []  # cached units held, in prompt order
        self.unit_blocks = 0
        self.private = 0  # blocks held outside units
        self.next_unit = 0  # first prompt unit not yet hit or cached
        self.first_pending = True  # this engine's first token (the fleet knows the client's)
        self.preempted = False
        self.prefilled = False  # its prompt's KV arrives from a prefill replica (P/D)
        self.ready_at = 0.0  # loading its prefix from an offload tier until then


@dataclass(slots=True)
class _Plan:
    start: float
    end: float
    scheduled: list[tuple[_Seq, int]]
    run_steps: int  # > 1: a run of decode steps
    context: int  # total context at the run's first step


class FastEngine:
    """One replica: vLLM v1 scheduling, unit-granular prefix cache, closed-form decode runs."""

    def __init__(
        self, config: EngineConfig, block_tokens: int, holdings: Holdings | None = None
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.block_tokens = block_tokens
        self.index_block_tokens = block_tokens
        self.pool = UnitPool(config.num_blocks, holdings)
        self.offload = [OffloadUnits(tier) for tier in config.offload]
        self.loading: list[_Seq] = []  # admitted, their prefix loading from an offload tier
        self.loaded_tokens: dict[str, int] = {}  # per medium: prompt tokens loaded from it
        self._now = 0.0
        self.timer = DecodeTimer(config.latency)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.seqs: dict[int, _Seq] = {}
        self.plan: _Plan | None = None
        self._lookups: list[tuple[int, int, int]] = []
        self.num_preemptions = 0
        self.steps = 0
        self.runs = 0

    # -- the fleet's interface --------------------------------------------------------

    def route_hashes(self, request: SimRequest) -> tuple[int, ...]:
        return request.route_hashes

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage()

    def add(self, request: SimRequest, extra_tokens: int, to_generate: int) -> None:
        bs, bt = self.block_size, self.block_tokens
        n = request.input_tokens
        bounds = [min((i + 1) * bt, n) // bs for i in range(len(request.unit_keys))]
        seq = _Seq(request, bounds, extra_tokens, to_generate)
        self.seqs[request.index] = seq
        self.waiting.append(seq)

    def add_prefilled(self, request: SimRequest) -> None:
        """Queue a request whose prompt was prefilled on another replica (see the module doc)."""
        self.add(request, 0, request.output_tokens)
        self.seqs[request.index].prefilled = True

    def cached_prompt_tokens(self, request: SimRequest) -> int:
        """Prompt tokens of ``request`` this replica's cache holds now, in whole KV blocks."""
        hits = self.pool.lookup(request.unit_keys)
        n = request.input_tokens
        return min(len(hits) * self.block_tokens, n) // self.block_size * self.block_size

    def start(self, now: float) -> float | None:
        self._now = now
        scheduled, admitted_or_preempted = self._schedule()
        if not scheduled:
            if not self.loading:
                return None
            # Nothing to run until a load lands: an empty step that ends there.
            end = min(s.ready_at for s in self.loading)
            self.plan = _Plan(now, end, [], 1, 0)
            return end
        self.steps += 1
        run = 1
        context = 0
        if not admitted_or_preempted and all(
            n == 1 and s.computed == s.length for s, n in scheduled
        ):
            run, context = self._decode_run(scheduled)
        if run > 1:
            self.runs += 1
            duration = self.timer.run_time(len(scheduled), context, run)
        else:
            num_tokens = attention = kv_read = 0
            for seq, n in scheduled:
                c = seq.computed
                num_tokens += n
                attention += n * (c - n) + n * (n + 1) // 2
                kv_read += c
            duration = self.config.latency.step_time(num_tokens, attention, kv_read)
        self.plan = _Plan(now, now + duration, scheduled, run, context)
        return now + duration

    def split(self, now: float) -> float:
        plan = self.plan
        assert plan is not None
        if plan.run_steps > 1 and now < plan.end:
            m = len(plan.scheduled)
            done = self.timer.steps_within(m, plan.context, now - plan.start, plan.run_steps)
            steps = min(plan.run_steps, done + 1)
            if steps < plan.run_steps:
                plan.run_steps = steps
                plan.end = plan.start + self.timer.run_time(m, plan.context, steps)
        return plan.end

    def complete(self) -> StepReport:
        plan = self.plan
        assert plan is not None
        self.plan = None
        report = StepReport(lookups=self._lookups)
        self._lookups = []
        if plan.run_steps > 1:
            self._finish_run(plan, plan.run_steps, report)
        else:
            end = plan.end
            for seq, _ in plan.scheduled:
                if seq.computed >= seq.length:
                    self._sample(seq, 1, end, end, report)
            self._drop_finished()
        report.index_ops = self.pool.take_ops()
        return report

    def fail(self, now: float) -> tuple[StepReport, dict[int, int]]:
        plan = self.plan
        report = StepReport(lookups=self._lookups)
        self._lookups = []
        if plan is not None and plan.run_steps > 1:
            m = len(plan.scheduled)
            done = self.timer.steps_within(m, plan.context, now - plan.start, plan.run_steps)
            if done:
                self._finish_run(plan, done, report)
        self.plan = None
        left = {index: seq.generated for index, seq in self.seqs.items()}
        self.seqs = {}
        self.waiting.clear()
        self.running = []
        self.loading = []
        return report, left

    # -- scheduling -------------------------------------------------------------------

    def _schedule(self) -> tuple[list[tuple[_Seq, int]], bool]:
        """This step's (request, tokens) in batch order, and whether it admitted or preempted.

        As ``simulator.engine.Scheduler.schedule``; computed tokens include the step on return.
        """
        running = self.running
        if self.loading:
            # Loads that landed: those requests run from their next uncached token on.
            now = self._now
            landed = [s for s in self.loading if s.ready_at <= now]
            if landed:
                self.loading = [s for s in self.loading if s.ready_at > now]
                running.extend(landed)
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.length - seq.computed, budget)
            ok = True
            while not self._allocate(seq, n):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1
        admitted = False
        if not preempted:
            waiting = self.waiting
            limit = self.config.max_num_seqs
            while waiting and budget > 0 and len(running) + len(self.loading) < limit:
                seq = waiting[0]
                n = self._admit(seq, budget)
                if n == 0:
                    break
                waiting.popleft()
                admitted = True
                if n < 0:  # its prefix loads from an offload tier first
                    self.loading.append(seq)
                    continue
                running.append(seq)
                scheduled.append((seq, n))
                budget -= n
        for seq, n in scheduled:
            seq.computed += n
        return scheduled, admitted or preempted

    def _admit(self, seq: _Seq, budget: int) -> int:
        """Look up the prefix, take its units and blocks for the first chunk: the chunk's
        tokens, or 0 (nothing changed) when the blocks do not suffice."""
        pool = self.pool
        bs = self.block_size
        hits = pool.lookup(seq.request.unit_keys)
        if self.offload and not seq.prefilled:
            loaded = self._admit_loading(seq, hits)
            if loaded is not None:
                return loaded
        hit_blocks = seq.bounds[len(hits) - 1] if hits else 0
        # The last token is always computed (its logits give the next token).
        hit_tokens = min(hit_blocks * bs, (seq.length - 1) // bs * bs)
        # A prefilled prompt's KV is here already but for its last token: its blocks are
        # allocated below, and only that token is computed (no prefix-cache lookup is counted).
        done = seq.length - 1 if seq.prefilled else hit_tokens
        n = min(seq.length - done, budget)
        new_blocks = max(0, -(-(done + n) // bs) - hit_blocks)
        from_queue = sum(u.blocks for u in hits if u.ref == 0)
        if new_blocks + from_queue > pool.free_blocks:
            return 0
        pool.touch(hits)
        pool.allocate(new_blocks)
        seq.units = hits
        seq.unit_blocks = hit_blocks
        seq.private = new_blocks
        seq.next_unit = len(hits)
        seq.computed = done
        if not seq.preempted and not seq.prefilled:
            self._lookups.append((seq.request.index, seq.length, hit_tokens))
        self._cache_full(seq, done + n)
        return n

    def _admit_loading(self, seq: _Seq, hits: list[Unit]) -> int | None:
        """Admit ``seq`` if offload tiers hold the units after its GPU hits: take GPU blocks
        for them, cache them there (as vLLM does once they are loaded) and start the load; -1
        then, 0 if the blocks do not suffice, None if no tier holds the next unit (admit as
        usual)."""
        request = seq.request
        keys = request.unit_keys
        bs = self.block_size
        # Whole prompt units only, and never the last prompt token (its logits are needed).
        limit = min(request.full_units, len(seq.bounds))
        while limit and seq.bounds[limit - 1] * bs > seq.length - 1:
            limit -= 1
        start = len(hits)
        if start >= limit:
            return None
        found = lower_hits(self.offload, keys[start:limit])
        if not found:
            return None
        m = len(found)
        gpu_blocks = seq.bounds[start - 1] if start else 0
        total_blocks = seq.bounds[start + m - 1]
        new_blocks = total_blocks - gpu_blocks
        pool = self.pool
        from_queue = sum(u.blocks for u in hits if u.ref == 0)
        if new_blocks + from_queue > pool.free_blocks:
            return 0
        pool.touch(hits)
        pool.allocate(new_blocks)
        seq.units = list(hits)
        seq.unit_blocks = gpu_blocks
        seq.private = new_blocks
        seq.next_unit = start
        done = total_blocks * bs
        seq.computed = done
        if not seq.preempted:
            self._lookups.append((request.index, seq.length, done))
        self._cache_full(seq, done)  # the loaded units join the GPU cache, announced there
        seconds = 0.0
        per_token = self.config.latency.kv_bytes_per_token
        previous = gpu_blocks
        for i, tier in enumerate(found):
            blocks = seq.bounds[start + i] - previous
            previous = seq.bounds[start + i]
            tier.touch((keys[start + i],))
            seconds += blocks * bs * per_token / tier.tier.load_bytes_per_s
            self.loaded_tokens[tier.medium] = self.loaded_tokens.get(tier.medium, 0) + blocks * bs
        seq.ready_at = self._now + seconds
        return -1

    def _allocate(self, seq: _Seq, n: int) -> bool:
        end = seq.computed + n
        need = -(-end // self.block_size) - seq.unit_blocks - seq.private
        if need > 0:
            if need > self.pool.free_blocks:
                return False
            self.pool.allocate(need)
            seq.private += need
        if seq.next_unit < len(seq.bounds):
            self._cache_full(seq, end)
        return True

    def _cache_full(self, seq: _Seq, end: int) -> None:
        """Cache the prompt units whose blocks are full once ``end`` tokens are computed
        (vLLM caches full blocks when it allocates them) and announce the whole ones."""
        full = min(end, seq.length) // self.block_size
        bounds = seq.bounds
        i = seq.next_unit
        if i >= len(bounds) or bounds[i] > full:
            return
        request = seq.request
        keys = request.unit_keys
        whole = request.full_units
        pool = self.pool
        announced: list[int] = []
        parent: int | None = keys[i - 1] if i else None
        previous = bounds[i - 1] if i else 0
        while i < len(bounds) and bounds[i] <= full:
            blocks = bounds[i] - previous
            previous = bounds[i]
            unit = pool.register(keys[i], blocks, i < whole) if blocks else None
            if unit is not None:
                seq.units.append(unit)
                seq.unit_blocks += blocks
                seq.private -= blocks
                if i < whole:
                    announced.append(keys[i])
            elif announced:  # a copy cached already breaks the chain of this event
                pool.stored(announced, parent)
                announced = []
            if not announced:
                parent = keys[i]
            i += 1
        first = seq.next_unit
        seq.next_unit = i
        if announced:
            pool.stored(announced, parent)
        if self.offload and first < whole:
            # Write-through: each full unit computed (or loaded) is stored to every tier.
            end_unit = min(i, whole)
            units = [
                (keys[k], bounds[k] - (bounds[k - 1] if k else 0)) for k in range(first, end_unit)
            ]
            ops: list[IndexOp] = []
            before = keys[first - 1] if first else None
            for tier in self.offload:
                tier.store(units, before, ops)
            pool.extend_ops(ops)

    def _preempt(self, seq: _Seq) -> None:
        self.pool.release(seq.units, 0, seq.private)
        seq.units = []
        seq.unit_blocks = seq.private = seq.computed = seq.next_unit = 0
        seq.preempted = True
        seq.prefilled = False  # its transferred KV is gone: it recomputes its prompt here
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- decode runs ------------------------------------------------------------------

    def _decode_run(self, scheduled: list[tuple[_Seq, int]]) -> tuple[int, int]:
        """How many identical decode steps to plan from here, and their first step's context."""
        steps = min(s.to_generate - s.generated for s, _ in scheduled)
        steps = min(steps, _MAX_RUN_STEPS)
        if steps <= 1:
            return 1, 0
        free = self.pool.free_blocks
        if self._run_blocks(scheduled, steps) > free:
            lo, hi = 1, steps
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._run_blocks(scheduled, mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            steps = lo
        context = sum(s.computed for s, _ in scheduled)
        return steps, context

    def _run_blocks(self, scheduled: list[tuple[_Seq, int]], steps: int) -> int:
        """Blocks the run's later steps take beyond what the first step allocated."""
        bs = self.block_size
        more = steps - 1
        return sum(
            max(0, -(-(s.computed + more) // bs) - s.unit_blocks - s.private) for s, _ in scheduled
        )

    def _finish_run(self, plan: _Plan, steps: int, report: StepReport) -> None:
        """Apply ``steps`` steps of a decode run: tokens, their blocks, first tokens, finishes."""
        first_end = plan.start + self.timer.run_time(len(plan.scheduled), plan.context, 1)
        last_end = plan.start + self.timer.run_time(len(plan.scheduled), plan.context, steps)
        need = self._run_blocks(plan.scheduled, steps)
        if need:
            self.pool.allocate(need)
        bs = self.block_size
        for seq, _ in plan.scheduled:
            seq.computed += steps - 1
            blocks = -(-seq.computed // bs) - seq.unit_blocks - seq.private
            if blocks > 0:
                seq.private += blocks
            self._sample(seq, steps, first_end, last_end, report)
        self._drop_finished()

    # -- tokens and finishes ----------------------------------------------------------

    def _sample(
        self,
        seq: _Seq,
        tokens: int,
        first_end: float,
        last_end: float,
        report: StepReport,
    ) -> None:
        seq.generated += tokens
        seq.length += tokens
        index = seq.request.index
        if seq.first_pending:
            seq.first_pending = False
            report.first_tokens.append((index, first_end))
        if seq.generated >= seq.to_generate:
            report.finished.append((index, last_end))
            del self.seqs[index]
            bs = self.block_size
            # The KV holds every token but the last sampled one.
            junk = max(0, min(seq.private, (seq.length - 1) // bs - seq.unit_blocks))
            self.pool.release(seq.units, junk, seq.private - junk)
            seq.units = []
            seq.private = seq.unit_blocks = 0
            seq.to_generate = -1  # finished marker

    def _drop_finished(self) -> None:
        self.running = [s for s in self.running if s.to_generate >= 0]
