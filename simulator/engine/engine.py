"""The engine model: one vLLM replica's scheduling and KV cache, stepped in virtual time.

``Engine.step(now)`` runs one scheduler iteration: schedule, "execute" (advance computed tokens,
sample deterministic tokens) and report the step's modelled duration, per-request outputs and
the KV events it caused. Nothing here reads a clock, sleeps or does I/O: the emulated replica
steps it in real time, the fleet simulator in simulated time.

For prefill/decode disaggregation a request may arrive with its prompt's KV moved in from
another replica (``external_computed_tokens``), or keep its blocks held when it finishes
(``hold_blocks``) until ``release_held``; moving the KV is the caller's business.
"""

from __future__ import annotations

from collections.abc import Iterable

from .config import EngineConfig
from .hashing import extend_block_hashes, token_bytes
from .kv_cache_manager import KVCacheManager
from .outputs import EngineStats, RequestOutput, StepOutput
from .request import EngineRequest, Sequence, Status, generated_token, new_sequence
from .scheduler import Scheduler


class Engine:
    """One replica's engine core: add and abort requests, step, read stats."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.offload
        )
        self._scheduler = Scheduler(
            self._kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_loras
        )
        self._scheduler.kv_bytes_per_token = config.latency.kv_bytes_per_token
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        # Finished requests whose blocks stay held for a remote reader (P/D prefill side).
        self._held: dict[str, Sequence] = {}
        self._prompt_tokens = 0
        self._prompt_by_source = [0, 0, 0]  # in PROMPT_SOURCES' order
        self._prompt_cached = 0
        self._generation_tokens = 0
        self.last_step_time = 0.0

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. ValueError, with the reason, for one the engine could never serve."""
        self.check_request(request)
        cfg = self.config
        seq = new_sequence(request, cfg.seed, cfg.block_size, cfg.enable_prefix_caching)
        self._requests[request.request_id] = seq
        self._scheduler.add(seq)

    def check_request(self, request: EngineRequest) -> None:
        """What ``add_request`` checks, without queueing: a ValueError says what is wrong."""
        cfg = self.config
        rid = request.request_id
        prompt = request.prompt_token_ids
        if rid in self._requests:
            raise ValueError(f"request {rid!r}: a request with this id is already in the engine")
        if not prompt:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(
                f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens!r}"
            )
        total = len(prompt) + request.max_tokens
        if total > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({len(prompt)} tokens) + max_tokens "
                f"({request.max_tokens}) = {total} exceeds max_model_len {cfg.max_model_len}"
            )
        # The last sampled token is never fed back, so the KV holds total - 1 tokens at most.
        blocks_needed = -(-(total - 1) // cfg.block_size)
        if blocks_needed > cfg.num_blocks:
            raise ValueError(
                f"request {rid!r}: needs {blocks_needed} KV blocks but the cache has "
                f"{cfg.num_blocks}"
            )
        try:
            token_bytes(prompt)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"request {rid!r}: prompt token ids must be int64 integers") from exc
        external = request.external_computed_tokens
        if not isinstance(external, int) or not 0 <= external <= len(prompt):
            raise ValueError(
                f"request {rid!r}: external_computed_tokens must lie in [0, {len(prompt)}], "
                f"got {external!r}"
            )
        if rid in self._held:
            raise ValueError(f"request {rid!r}: a finished request with this id holds blocks")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks are freed (and stay cached). Unknown ids are ignored.

        The next ``step`` reports it with ``finish_reason="abort"``.
        """
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self._scheduler.remove(seq)
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work: queued or running requests, or aborts not yet reported."""
        return bool(self._requests or self._aborted)

    def step(self, now: float) -> StepOutput:
        """One scheduler iteration at virtual time ``now``.

        ``now`` is only recorded (``last_step_time``): a step's cost depends on its batch alone.
        A step with nothing to compute takes 0 s and still delivers pending abort outputs and
        events (such as the AllBlocksCleared of a reset made while idle).
        """
        self.last_step_time = now
        cfg = self.config
        outputs: list[RequestOutput] = []
        if self._aborted:
            for seq in self._aborted:
                outputs.append(
                    RequestOutput(
                        seq.request_id,
                        [],
                        True,
                        "abort",
                        seq.num_prompt_tokens,
                        max(seq.num_cached_tokens, 0),
                    )
                )
            self._aborted = []

        scheduled = self._scheduler.schedule()
        if not scheduled:
            return StepOutput(0.0, outputs, self._kv.pool.take_events())

        # One pass: the batch's shape for the latency model, then "execution" of each request.
        bs = cfg.block_size
        caching = cfg.enable_prefix_caching
        vocab = cfg.vocab_size
        num_tokens = attention_context = kv_read = generated = 0
        any_finished = False
        for seq, n in scheduled:
            computed = seq.num_computed_tokens  # already includes this step's n tokens
            num_tokens += n
            attention_context += n * (computed - n) + n * (n + 1) // 2
            kv_read += computed
            token_ids = seq.token_ids
            if computed < len(token_ids):
                continue  # a prefill chunk: no token yet
            position = len(token_ids) - seq.num_prompt_tokens
            token = generated_token(seq.token_seed, position, vocab)
            token_ids.append(token)
            generated += 1
            if position == 0:
                self._count_prompt(seq)
            finished = position + 1 >= seq.max_tokens
            held = None
            if finished:
                seq.status = Status.FINISHED
                if seq.hold_blocks:
                    held = self._hold(seq)
                else:
                    self._kv.free(seq)
                del self._requests[seq.request_id]
                any_finished = True
            elif caching and len(token_ids) % bs == 0:
                extend_block_hashes(
                    seq.block_hashes, token_ids, bs, seq.extra_first, seq.extra_rest
                )
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    [token],
                    finished,
                    "length" if finished else None,
                    seq.num_prompt_tokens,
                    seq.num_cached_tokens,
                    held,
                )
            )
        self._generation_tokens += generated
        if any_finished:
            self._scheduler.drop_finished()
        duration = cfg.latency.step_time(num_tokens, attention_context, kv_read)
        if self._kv.pending_load_s:
            # Loads from offload tiers, charged to the step that admits their requests: vLLM
            # loads asynchronously, overlapped with other requests' steps (pessimistic here).
            duration += self._kv.pending_load_s
            self._kv.pending_load_s = 0.0
        return StepOutput(duration, outputs, self._kv.pool.take_events())

    def _count_prompt(self, seq: Sequence) -> None:
        """A request's prompt tokens by source, at its first token: vLLM's
        ``PromptTokenStats.update_from_output``, quirk included (a prompt hit in full but its
        last token counts that token as a cache hit and as computed, once too many)."""
        prompt, cached, external = (
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            seq.num_external_tokens,
        )
        recomputed = 1 if cached + 1 == prompt else 0
        by_source = self._prompt_by_source
        by_source[0] += prompt - cached
        by_source[1] += cached + recomputed - external
        by_source[2] += external
        self._prompt_cached += cached
        self._prompt_tokens += prompt

    def _hold(self, seq: Sequence) -> list[int]:
        self._held[seq.request_id] = seq
        return [block.block_id for block in seq.blocks]

    def held_block_ids(self, request_id: str) -> list[int] | None:
        """The blocks a finished request still holds for a remote reader (None: holds none)."""
        seq = self._held.get(request_id)
        return None if seq is None else [block.block_id for block in seq.blocks]

    def release_held(self, request_id: str) -> bool:
        """Free a finished request's held blocks (they stay cached); False if it holds none."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self._kv.free(seq)
        return True

    @property
    def num_held(self) -> int:
        """Finished requests whose blocks are held for a remote reader."""
        return len(self._held)

    def cached_prompt_tokens(self, request: EngineRequest) -> int:
        """Prompt tokens of ``request`` that this engine's prefix cache holds now, as its
        admission would find them (whole blocks, never the last token): the part a decode
        replica need not read from a prefill replica."""
        cfg = self.config
        seq = new_sequence(request, cfg.seed, cfg.block_size, cfg.enable_prefix_caching)
        return len(self._kv.get_computed_blocks(seq)) * cfg.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, like vLLM: refused (False) while a request holds any block
        (a finished one held for a remote reader too).

        On success the next ``step`` carries an AllBlocksCleared event.
        """
        return self._kv.pool.reset_prefix_cache()

    @property
    def stats(self) -> EngineStats:
        kv = self._kv
        return EngineStats(
            num_running=len(self._scheduler.running),
            num_waiting=len(self._scheduler.waiting),
            kv_cache_usage=kv.pool.usage(),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self._scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            running_loras=_adapters(self._scheduler.running),
            waiting_loras=_adapters(self._scheduler.waiting),
            prompt_tokens_by_source=(
                self._prompt_by_source[0],
                self._prompt_by_source[1],
                self._prompt_by_source[2],
            ),
            prompt_tokens_cached=self._prompt_cached,
            offload_load_bytes=int(
                sum(kv.loaded_tokens.values()) * self.config.latency.kv_bytes_per_token
            ),
            offload_load_seconds=kv.load_seconds,
            offload_store_bytes=int(
                sum(s.stored_blocks for s in kv.pool.offload)
                * self.config.block_size
                * self.config.latency.kv_bytes_per_token
            ),
            offload=bool(kv.pool.offload),
        )


def _adapters(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The distinct LoRA adapters of ``seqs``, in first-seen order."""
    return tuple(dict.fromkeys(s.lora_name for s in seqs if s.lora_name is not None))
