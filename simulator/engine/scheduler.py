"""The scheduler: continuous batching policy (vLLM v1's ``Scheduler``, FCFS).

Each step it spends a token budget (``max_num_batched_tokens``), first on the running requests in
order (a decode costs one token, an unfinished prefill continues with a chunk), then on waiting
requests in arrival order, up to ``max_num_seqs`` running. A prompt longer than what is left of
the budget is chunked over several steps. When a running request needs a block and none is free,
the youngest running request is preempted by recompute: its blocks are freed (they stay cached)
and it goes back to the front of the queue; no waiting request is admitted in a step that
preempted. A request whose prompt KV was moved in from a prefill replica (P/D) is admitted with
those tokens computed: only its last prompt token is, as in vLLM. With ``max_loras``, a waiting request whose LoRA adapter would be one too many in
the running batch is skipped (it keeps its place) for the next one, as vLLM does. The mechanism
(blocks, hits, caching) is the KV cache manager's.
"""

from __future__ import annotations

from collections import deque

from .kv_cache_manager import KVCacheManager
from .request import Sequence, Status


class Scheduler:
    """Waiting queue, running batch, and the choice of what each step computes."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int = 0,
    ) -> None:
        self.kv = kv
        self.max_loras = max_loras  # 0: no limit
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.kv_bytes_per_token = 0.0  # for offload loads' time (the engine sets it)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take an unfinished request out (abort) and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's work: (request, tokens to compute) pairs, in batch order.

        On return each scheduled request's ``num_computed_tokens`` already includes this step's
        tokens (vLLM's ``_update_after_schedule``); a request whose computed tokens reach its
        length samples its next token when the step completes.
        """
        kv = self.kv
        running = self.running
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = len(seq.token_ids) - seq.num_computed_tokens
            if n > budget:
                n = budget
            while not kv.allocate_slots(seq, n):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1

        if not preempted:
            waiting = self.waiting
            bs = kv.block_size
            limit = self.max_loras
            loras = {s.lora_name for s in running if s.lora_name is not None} if limit else None
            skipped: list[Sequence] = []
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                seq = waiting[0]
                lora = seq.lora_name
                if loras is not None and lora is not None and lora not in loras:
                    if len(loras) >= limit:
                        skipped.append(waiting.popleft())  # no adapter slot for it this step
                        continue
                    loras.add(lora)
                hits = kv.get_computed_blocks(seq)
                num_hit_tokens = len(hits) * bs
                # KV already here: the prefix hit, or more when moved in from a prefill replica
                # (whose blocks are allocated and cached now, as vLLM's once received); the
                # prompt's last token is computed all the same, for its logits.
                ready = num_hit_tokens
                loaded = 0
                if kv.pool.offload and not seq.external_tokens and seq.num_preemptions == 0:
                    # Loaded back from an offload tier (the connector's lookup after the GPU's).
                    loaded = kv.offload_hits(seq, len(hits))
                    ready += loaded * bs
                if seq.external_tokens:
                    ready = max(ready, min(seq.external_tokens, len(seq.token_ids) - 1))
                n = min(len(seq.token_ids) - ready, budget)
                if not kv.allocate_slots(seq, ready - num_hit_tokens + n, hits):
                    break
                waiting.popleft()
                if loaded:
                    kv.charge_load(seq, len(hits), loaded, self.kv_bytes_per_token)
                    seq.num_external_tokens = loaded * bs  # vLLM counts them as external
                kv.record_lookup(seq, num_hit_tokens)
                seq.num_computed_tokens = ready
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = ready
                if seq.external_tokens:
                    # As vLLM's connector count: every moved-in token no local hit covers.
                    seq.num_external_tokens = max(0, seq.external_tokens - num_hit_tokens)
                    seq.external_tokens = 0  # moved in once: after a preemption, recomputed
                seq.status = Status.RUNNING
                running.append(seq)
                scheduled.append((seq, n))
                budget -= n
            waiting.extendleft(reversed(skipped))

        for seq, n in scheduled:
            seq.num_computed_tokens += n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def drop_finished(self) -> None:
        self.running = [s for s in self.running if s.status is Status.RUNNING]
