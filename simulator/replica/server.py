"""The emulated replica's HTTP surface: vLLM's OpenAI server, as far as a router can tell.

Completions and chat (streamed and not, vLLM's chunk shapes, usage and
``stream_options.include_usage``; ``logprobs`` and ``return_token_ids`` on non-streamed
completions; at temperature 0 the same answer on every replica; chat rendered with the
request's tools, template kwargs and ``add_special_tokens`` as vLLM renders it), Anthropic
Messages and OpenAI Responses (``agent_api``, on the same engine path), /v1/models, /health,
/metrics (vLLM's names, ``vllm:lora_requests_info`` with LoRA on), /tokenize, /detokenize,
/reset_prefix_cache, /kv_event_sources, /load, /version, /v1/load_lora_adapter and
/v1/unload_lora_adapter (only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, as vLLM), and
/admin/faults for drills. A client that disconnects aborts its request in the engine, as in
vLLM. With ``--kv-transfer-config`` (NixlConnector), requests' ``kv_transfer_params`` take part
in prefill/decode disaggregation (``kv_connector``); without it they are ignored and answered
null, as vLLM does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from xxhash import xxh3_64_intdigest

from kvroute.kvcore import pd
from kvroute.kvcore.kv_events import rank_endpoint
from kvroute.kvcore.tokenizer import ChatTemplateError, Tokenizer, render_chat
from kvroute.simulator.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from kvroute.simulator.engine.dp_balance import DPBalancer, RankLoad

from .faults import Faults, FaultSpec
from .kv_connector import KV_READ_PATH, KVConnector, KVRead
from .kv_publisher import KVEventPublisher
from .metrics import ReplicaMetrics
from .runner import EngineRunner

VERSION = "0.32.0+kvroute-emulated"
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class _Transfer:
    """A request that carried ``kv_transfer_params``: what its answer needs to know."""

    params: pd.KVTransferParams | None  # None: no KV connector here, so ignored (answered null)
    local_address: tuple[str, int]  # where it came in: how decode replicas reach this one


# Marks a streamed chunk without a kv_transfer_params key (the request carried none).
_NO_KV: Any = object()


@dataclass(frozen=True)
class Run:
    """A request in the engine: its id, the queue its outputs arrive on, when it came."""

    request_id: str
    queue: asyncio.Queue[RequestOutput]
    arrival: float
    rank: int = 0  # the data-parallel rank (engine) serving it


class Frames(Protocol):
    """What one API writes for a streamed request (``EmulatedReplica.relay`` drives it):
    each returns the bytes to send, b"" for nothing."""

    def head(self) -> bytes: ...

    def opening(self, first: RequestOutput) -> bytes: ...

    def step(self, text: str, output: RequestOutput) -> bytes: ...

    def closing(self, last: RequestOutput, generated: int) -> bytes: ...


@dataclass(frozen=True)
class ReplicaOptions:
    served_model_name: str
    engine: EngineConfig
    time_scale: float = 1.0
    kv_events: dict[str, Any] | None = None  # vLLM's --kv-events-config
    # Wildcard TCP KV-event endpoints (tcp://*:P) are bound on this address only (None: on
    # every interface, as vLLM does): the replica's --host.
    kv_bind_host: str | None = None
    event_layout: str = "map"
    model_path: str = "kvroute-emulated"
    # LoRA adapters as vLLM's --lora-modules: name -> path. A request naming one is served
    # by the base engine with the adapter's name in its blocks' hash keys and KV events.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # vLLM's --enable-lora (implied by lora_modules); ``engine.max_loras`` is --max-loras.
    enable_lora: bool = False
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: serve /v1/load_lora_adapter and unload.
    allow_runtime_lora_updating: bool = False
    # vLLM's --kv-transfer-config (checked by kvcore.pd.parse_kv_transfer_config): a
    # NixlConnector serves requests' kv_transfer_params (P/D disaggregation); None: ignored.
    kv_transfer: dict[str, Any] | None = None
    # Emulator only: the link prompt KV moves over, for the modelled transfer time
    # (kvcore.pd.link_bytes_per_s: "nvlink", "rdma" or GB/s).
    kv_link: str = "rdma"
    # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: how long unread blocks stay held.
    kv_hold_timeout_s: float = pd.HOLD_TIMEOUT_S
    # vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST: the host decode replicas read KV from; None: the
    # address each prefill request came in on (the side channel is this replica's HTTP port).
    side_channel_host: str | None = None
    # vLLM's --enable-auto-tool-choice: /v1/messages requests with tools are served (without
    # it they are refused, as vLLM without a tool parser refuses them); the emulated tool
    # parser finds no calls, so the answer is text.
    enable_auto_tool_choice: bool = False
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: /v1/responses keeps responses (and their chat
    # messages) in memory for previous_response_id and GET /v1/responses/{id}; the emulator
    # keeps the newest ``responses_store_size`` (vLLM never evicts).
    responses_store: bool = False
    responses_store_size: int = 10_000
    # vLLM's --enable-scale-out: /v1/chat/completions/render and the token-in
    # /inference/v1/generate (simulator/replica/scale_out.py).
    enable_scale_out: bool = False
    # vLLM's --data-parallel-size: this many engines (ranks) behind the one HTTP port, each
    # with its own KV cache, KV-event publisher (the endpoint offset by its rank) and metrics.
    data_parallel_size: int = 1

    @property
    def lora(self) -> bool:
        return self.enable_lora or bool(self.lora_modules) or self.allow_runtime_lora_updating


@dataclass(frozen=True, slots=True)
class EngineRank:
    """One data-parallel rank: its engine, the runner that drives it, its event publisher."""

    engine: Engine
    runner: EngineRunner
    publisher: KVEventPublisher | None


class BadRequest(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        error_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.error_type, self.param = status, error_type, param


def _error(message: str, status: int, error_type: str, param: str | None = None) -> web.Response:
    # vLLM >= 0.11's ErrorResponse shape.
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return web.json_response(body, status=status)


class EmulatedReplica:
    def __init__(
        self, options: ReplicaOptions, tokenizer: Tokenizer, faults: Faults | None = None
    ) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.faults = faults or Faults()
        size = options.data_parallel_size
        if size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {size}")
        if size > 1 and options.kv_transfer is not None:
            raise ValueError(
                "--data-parallel-size above 1 with --kv-transfer-config is not emulated"
            )
        self.ranks = [self._rank(options, k) for k in range(size)]
        self.balancer = DPBalancer()
        # Rank 0's parts, for what has one engine (P/D transfers, the load endpoint).
        self.engine, self.runner, self.publisher = (
            self.ranks[0].engine,
            self.ranks[0].runner,
            self.ranks[0].publisher,
        )
        self.metrics = ReplicaMetrics(
            options.served_model_name,
            options.engine,
            lambda: [r.engine.stats for r in self.ranks],
            options.lora,
        )
        # Adapters served now: name -> path (--lora-modules, then runtime loads and unloads).
        self.lora_modules = dict(options.lora_modules)
        self.connector: KVConnector | None = None
        if options.kv_transfer is not None:
            pd.check_kv_transfer_config(options.kv_transfer)
            latency = options.engine.latency
            self.connector = KVConnector(
                self.engine,
                pd.link_bytes_per_s(options.kv_link, latency.num_gpus),
                options.time_scale,
                options.kv_hold_timeout_s,
                options.side_channel_host,
            )
        self._ids = itertools.count()
        self._created = int(time.time())

    def _rank(self, options: ReplicaOptions, rank: int) -> EngineRank:
        engine = Engine(options.engine)
        publisher = None
        kv = options.kv_events or {}
        if kv.get("enable_kv_cache_events") and kv.get("publisher", "zmq") == "zmq":
            replay = kv.get("replay_endpoint")
            publisher = KVEventPublisher(
                rank_endpoint(kv.get("endpoint", "tcp://*:5557"), rank),
                rank_endpoint(replay, rank) if replay else None,
                topic=kv.get("topic", ""),
                layout=options.event_layout,
                buffer_steps=int(kv.get("buffer_steps", 10_000)),
                data_parallel_rank=rank,
                bind_host=options.kv_bind_host,
            )
        runner = EngineRunner(
            engine,
            options.time_scale,
            publisher.publish if publisher else lambda events: None,
            slowdown=lambda: self.faults.spec.slowdown,
        )
        return EngineRank(engine, runner, publisher)

    def pick_rank(self, request: web.Request | None) -> int:
        """The rank named by the X-data-parallel-rank header (vLLM reads it as an int and ignores
        one that is not), else vLLM's own balancing (simulator/engine/dp_balance.py). A rank
        beyond the replica's is a 400, as vLLM's engine client refuses it."""
        text = request.headers.get("X-data-parallel-rank") if request is not None else None
        if text is not None:
            try:
                rank = int(text)
            except ValueError:
                rank = None
            if rank is not None:
                if not 0 <= rank < len(self.ranks):
                    raise BadRequest(
                        f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)})."
                    )
                return rank
        if len(self.ranks) == 1:
            return 0
        loads = [
            RankLoad(s.num_waiting, s.num_running, s.kv_cache_usage)
            for s in (r.engine.stats for r in self.ranks)
        ]
        return self.balancer.pick(loads)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.router.add_get("/load", self.load)
        app.router.add_get("/version", self.version)
        if self.options.allow_runtime_lora_updating:
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        if self.connector is not None:
            app.router.add_post(KV_READ_PATH, self.kv_read)
        from .agent_api import AgentAPIs  # (it builds on this module)

        AgentAPIs(self).routes(app)
        if self.options.enable_scale_out:
            from .scale_out import ScaleOutAPIs  # (it builds on this module)

            ScaleOutAPIs(self).routes(app)
        app.router.add_get("/admin/faults", self.get_faults)
        app.router.add_post("/admin/faults", self.set_faults)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        for rank in self.ranks:
            rank.runner.start()
            if rank.publisher is not None:
                rank.publisher.start()
        self._schedule_exit()

    async def _cleanup(self, app: web.Application) -> None:
        for rank in self.ranks:
            await rank.runner.close()
            if rank.publisher is not None:
                await rank.publisher.close()
        if self.connector is not None:
            await self.connector.close()

    def _schedule_exit(self) -> None:
        if self.faults.spec.exit_after_s >= 0:
            asyncio.get_running_loop().call_later(self.faults.spec.exit_after_s, os._exit, 1)

    # -- generation --------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            await self.admit()
            body = await _json_body(request)
            prompt_ids, max_tokens = self._prepare(body, chat)
            lora_name = self.lora_name(body)
            transfer = self._transfer(request, body)
            rank = self.pick_rank(request)
        except BadRequest as exc:
            return _error(str(exc), exc.status, exc.error_type, exc.param)
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = self.request_id(prefix, request)
        params = transfer.params if transfer is not None else None
        try:
            run = await self.start(
                request_id, prompt_ids, max_tokens, body, lora_name, params, rank=rank
            )
        except ValueError as exc:
            return _error(str(exc), 400, "BadRequestError")
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        if stream:
            frames = _CompletionFrames(self, body, chat, request_id, include_usage, transfer)
            return await self.answer(run, self.relay(request, run, frames))
        return await self.answer(run, self._complete(body, chat, run, transfer))

    # -- the engine path every API shares ----------------------------------------------

    async def admit(self) -> None:
        """The faults every generation request meets first: a stall, then maybe a 500."""
        stall = self.faults.stall_remaining()
        if stall:
            await asyncio.sleep(stall)
        if self.faults.should_error():
            raise BadRequest("Injected fault: internal server error.", 500, "InternalServerError")

    def request_id(self, prefix: str, request: web.Request) -> str:
        """vLLM's ``<prefix>-<X-Request-Id or random>`` (made unique for the engine)."""
        base = request.headers.get("X-Request-Id") or os.urandom(8).hex()
        return f"{prefix}-{base}-{next(self._ids)}"

    async def start(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        body: dict[str, Any],
        lora_name: str | None,
        params: pd.KVTransferParams | None = None,
        *,
        rank: int | None = None,
    ) -> Run:
        """Submit a prepared request to the engine of ``rank`` (None: vLLM's balancing);
        ValueError: the engine refuses it."""
        if rank is None:
            rank = self.pick_rank(None)
        arrival = time.monotonic()
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        engine_request = EngineRequest(
            request_id,
            prompt_ids,
            max_tokens,
            arrival,
            lora_name=lora_name,
            cache_salt=salt,
            token_seed=_greedy_seed(body, prompt_ids, lora_name),
            hold_blocks=params is not None and params.do_remote_decode,
        )
        if params is not None and params.do_remote_prefill and self.connector is not None:
            self.engine.check_request(engine_request)  # before a transfer, not after it
            external = await self.connector.pull(params, engine_request)
            engine_request.external_computed_tokens = external
        return Run(request_id, self.ranks[rank].runner.submit(engine_request), arrival, rank)

    async def answer(self, run: Run, reply: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """``reply``'s response; a client that goes away aborts the request, as in vLLM."""
        try:
            return await reply
        except (asyncio.CancelledError, ConnectionResetError):
            self.ranks[run.rank].runner.abort(run.request_id)
            if self.connector is not None:
                self.connector.release(run.request_id)  # no decode replica will learn of it
            raise

    async def collect(self, run: Run) -> tuple[RequestOutput, list[int]]:
        """A non-streamed request's last output and all its (drifted) tokens."""
        token_ids: list[int] = []
        first: RequestOutput | None = None
        last: RequestOutput | None = None
        while last is None or not last.finished:
            last = await run.queue.get()
            if first is None and last.new_token_ids:
                first = last
                self.metrics.ranks[run.rank].ttft.observe(time.monotonic() - run.arrival)
            token_ids += last.new_token_ids
        self._finished(last, run.arrival, run.rank)
        # Drift rewrites what is sent, not the engine's cache: a fault, not a model.
        return last, self.faults.drifted(token_ids, 0, self.options.engine.vocab_size)

    async def relay(self, request: web.Request, run: Run, frames: Frames) -> web.StreamResponse:
        """Stream a request's engine steps as ``frames`` writes them: the head at once, the
        opening with the first engine result, a frame per step, then the closing. The
        ``drop_after_chunks`` fault breaks the connection after that many writes (of those
        that write anything) unless the request has finished."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        drop_after = self.faults.spec.drop_after_chunks
        chunks = 0
        if head := frames.head():
            await response.write(head)
            chunks += 1
        generated = 0
        last_time = None
        while True:
            output = await run.queue.get()
            now = time.monotonic()
            if output.new_token_ids:
                if last_time is None:
                    self.metrics.ranks[run.rank].ttft.observe(now - run.arrival)
                else:
                    self.metrics.ranks[run.rank].itl.observe(now - last_time)
                last_time = now
            if chunks == 0 and (opening := frames.opening(output)):
                await response.write(opening)
                chunks += 1
            vocab = self.options.engine.vocab_size
            new_ids = self.faults.drifted(output.new_token_ids, generated, vocab)
            generated += len(new_ids)
            frame = frames.step(self.tokenizer.decode(new_ids), output)
            if frame:
                await response.write(frame)
                chunks += 1
            if drop_after and chunks >= drop_after and not output.finished:
                self.ranks[run.rank].runner.abort(run.request_id)
                assert request.transport is not None
                request.transport.close()  # injected fault: the connection breaks mid-stream
                return response
            if output.finished:
                break
        self._finished(output, run.arrival, run.rank)
        await response.write(frames.closing(output, generated))
        await response.write_eof()
        return response

    def chat_prompt(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> list[int]:
        """A chat request's prompt tokens, rendered with the fields vLLM hands the template
        and tokenized without special tokens unless the request asks (as vLLM)."""
        continue_final = body.get("continue_final_message") is True
        tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
        options = {
            "add_generation_prompt": body.get("add_generation_prompt", not continue_final)
            is not False,
            "continue_final_message": continue_final,
            "tools": tools if isinstance(tools, list) else None,
            "chat_template_kwargs": kwargs if isinstance(kwargs, dict) else None,
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        try:
            text = render_chat(self.tokenizer, messages, options)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc)) from None
        return self.tokenizer.encode(
            text, add_special_tokens=body.get("add_special_tokens") is True
        )

    def check_model(self, model: Any) -> None:
        """404 for a model this replica does not serve (None: not named, served)."""
        if (
            model is not None
            and model != self.options.served_model_name
            and model not in self.lora_modules
        ):
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    def max_tokens(
        self,
        prompt_ids: list[int],
        max_tokens: Any,
        default: int = DEFAULT_CHAT_MAX_TOKENS,
        param: str = "max_tokens",
    ) -> int:
        """The request's output limit (``default`` when None), checked against the context
        length as vLLM 0.32 checks it: a prompt longer than the context, or a limit longer than
        the whole context, is refused; a limit past what the prompt leaves is cut to it
        (vLLM's get_max_tokens), and no room left at all is a limit of 0, which it refuses."""
        limit = self.options.engine.max_model_len
        if len(prompt_ids) > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {len(prompt_ids)} input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        if max_tokens is None:
            max_tokens = min(default, max(1, limit - len(prompt_ids)))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"{param} must be a positive integer", param=param)
        if not prompt_ids:
            raise BadRequest("The prompt is empty.", param="prompt")
        if max_tokens > limit:
            raise BadRequest(
                f"{param}={max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                param=param,
            )
        room = limit - len(prompt_ids)
        if room < 1:
            raise BadRequest("max_tokens must be at least 1, got 0.", param="max_tokens")
        return min(max_tokens, room)

    def _transfer(self, request: web.Request, body: dict[str, Any]) -> _Transfer | None:
        """The request's ``kv_transfer_params`` (None: it carries none). Its type is checked
        always, as vLLM's request model does; its fields only with a KV connector, as only
        NixlConnector reads them: a BadRequest names a wrong one."""
        raw = body.get("kv_transfer_params")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise BadRequest(
                "kv_transfer_params must be an object or null", param="kv_transfer_params"
            )
        params = None
        if self.connector is not None:
            try:
                params = pd.parse_kv_transfer_params(raw)
            except ValueError as exc:
                raise BadRequest(str(exc), param="kv_transfer_params") from None
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        local = ("127.0.0.1", 0)
        if isinstance(sockname, tuple):  # (host, port), and more for IPv6
            local = (str(sockname[0]), int(sockname[1]))
        return _Transfer(params, local)

    def _kv_answer(self, transfer: _Transfer, output: RequestOutput) -> dict[str, Any] | None:
        """The answer's ``kv_transfer_params``: where a finished request's held blocks are
        (prefill side); null otherwise, as vLLM answers."""
        if output.held_block_ids is None or self.connector is None:
            return None
        return self.connector.hold(output.request_id, output.held_block_ids, transfer.local_address)

    def lora_name(self, body: dict[str, Any]) -> str | None:
        model = body.get("model")
        return model if isinstance(model, str) and model in self.lora_modules else None

    def _prepare(self, body: dict[str, Any], chat: bool) -> tuple[list[int], int]:
        self.check_model(body.get("model"))
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", param="messages")
            prompt_ids = self.chat_prompt(messages, body)
            default_max = DEFAULT_CHAT_MAX_TOKENS
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_ids = self.tokenizer.encode(prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                prompt_ids = list(prompt)
            else:
                raise BadRequest("prompt must be a string or a list of token ids", param="prompt")
            default_max = DEFAULT_COMPLETION_MAX_TOKENS
            max_tokens = body.get("max_tokens")
        return prompt_ids, self.max_tokens(prompt_ids, max_tokens, default_max)

    async def _complete(
        self, body: dict[str, Any], chat: bool, run: Run, transfer: _Transfer | None = None
    ) -> web.Response:
        last, token_ids = await self.collect(run)
        request_id = run.request_id
        text = self.tokenizer.decode(token_ids)
        usage = _usage(last, len(token_ids))
        created = int(time.time())
        model = self.lora_name(body) or self.options.served_model_name
        if chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": [],
            }
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": last.finish_reason,
                "stop_reason": None,
            }
            obj = {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._logprobs(body, token_ids),
                "finish_reason": last.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            if body.get("return_token_ids") is True:
                choice["token_ids"] = token_ids
            obj = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        if transfer is not None:
            obj["kv_transfer_params"] = self._kv_answer(transfer, last)
        return web.Response(body=msgspec.json.encode(obj), content_type="application/json")

    def _logprobs(self, body: dict[str, Any], token_ids: list[int]) -> dict[str, Any] | None:
        """vLLM's completions ``logprobs`` for ``token_ids`` when the request asks (an integer
        ``logprobs``): each token the top-1 by a clear margin (2-3 nats) over made-up
        alternatives, the same on every replica."""
        k = body.get("logprobs")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS:
            return None
        as_ids = body.get("return_tokens_as_token_ids") is True
        vocab = self.options.engine.vocab_size

        def spell(token: int) -> str:
            return f"token_id:{token}" if as_ids else self.tokenizer.decode([token])

        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        offset = 0
        for position, token in enumerate(token_ids):
            top = made_up_top_logprobs(token, position, max(1, k), vocab)
            text = spell(token)
            tokens.append(text)
            token_logprobs.append(top[0][1])
            top_logprobs.append({spell(t): lp for t, lp in top})
            text_offset.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }

    def _finished(self, output: RequestOutput, arrival: float, rank: int = 0) -> None:
        self.metrics.ranks[rank].e2e.observe(time.monotonic() - arrival)
        self.metrics.finished(output.finish_reason or "length", rank)

    # -- the rest of vLLM's surface ----------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.options.served_model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": self.options.model_path,
            "parent": None,
            "max_model_len": self.options.engine.max_model_len,
        }
        adapters = [
            {**card, "id": name, "root": path, "parent": self.options.served_model_name}
            for name, path in self.lora_modules.items()
        ]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime load: ``{"lora_name", "lora_path"}``; the adapter is then listed and
        served (its slot is taken when its requests run, as in vLLM)."""
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return _error(str(exc), 400, "BadRequestError")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(
                "Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput"
            )
        if name in self.lora_modules:
            return _error(
                f"The lora adapter '{name}' has already been loaded.", 400, "InvalidUserInput"
            )
        self.lora_modules[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return _error(str(exc), 400, "BadRequestError")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _error("'lora_name' needs to be provided to unload a LoRA adapter.", 400,
                          "InvalidUserInput")  # fmt: skip
        if self.lora_modules.pop(name, None) is None:
            return _error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return _error(str(exc), 400, "BadRequestError")
        if isinstance(body.get("messages"), list):
            try:
                tokens = self.chat_prompt(body["messages"], body)
            except BadRequest as exc:
                return _error(str(exc), exc.status, exc.error_type, exc.param)
        elif isinstance(body.get("prompt"), str):
            special = bool(body.get("add_special_tokens", True))
            tokens = self.tokenizer.encode(body["prompt"], add_special_tokens=special)
        else:
            return _error("give 'prompt' (a string) or 'messages'", 400, "BadRequestError")
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.options.engine.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return _error(str(exc), 400, "BadRequestError")
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return _error("tokens must be a list of integers", 400, "BadRequestError")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = all([r.runner.reset_prefix_cache() for r in self.ranks])
        return web.json_response({"success": ok}, status=200 if ok else 409)

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        # vLLM >= 0.32: each rank's publisher config, its endpoints offset by the rank.
        kv = self.options.kv_events or {}
        sources = {}
        for rank in range(len(self.ranks)):
            config = dict(kv)
            for key in ("endpoint", "replay_endpoint"):
                if config.get(key):
                    config[key] = rank_endpoint(config[key], rank)
            sources[str(rank)] = config
        return web.json_response(sources)

    async def load(self, request: web.Request) -> web.Response:
        stats = self.engine.stats
        return web.json_response({"server_load": stats.num_running + stats.num_waiting})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def kv_read(self, request: web.Request) -> web.Response:
        """``POST /kvroute/kv_read`` (emulator only): a decode replica reads a request's held
        KV blocks, which ends their hold; 404 when this replica does not hold them."""
        assert self.connector is not None
        try:
            read = msgspec.json.decode(await request.read(), type=KVRead)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(f"bad KV read: {exc}", 400, "BadRequestError")
        problem = self.connector.serve_read(read)
        if problem is not None:
            return _error(problem, 404, "NotFoundError")
        return web.json_response({"request_id": read.request_id, "block_ids": read.block_ids})

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            spec = msgspec.json.decode(await request.read(), type=FaultSpec)
            self.faults.update(spec)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return _error(f"bad fault spec: {exc}", 400, "BadRequestError")
        self._schedule_exit()
        return web.json_response(self.faults.as_dict())


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _greedy_seed(body: dict[str, Any], prompt_ids: list[int], lora_name: str | None) -> int | None:
    """Temperature 0: tokens seeded by the prompt (and adapter) alone, so every replica gives
    the same greedy answer, as replicas with the same weights do; else None (sampled)."""
    temperature = body.get("temperature")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature:
        return None
    key = ",".join(map(str, prompt_ids)) + "|" + (lora_name or "")
    return xxh3_64_intdigest(key.encode())


def made_up_top_logprobs(
    token: int, position: int, k: int, vocab_size: int
) -> list[tuple[int, float]]:
    """``token`` and k-1 other tokens with falling logprobs: the top-1 2-3 nats above the next."""
    h = xxh3_64_intdigest(b"logprobs", token * 65_537 + position)
    top1 = -(0.02 + (h & 0xFFFF) / 0xFFFF * 0.3)
    out = [(token, top1)]
    seen = {token}
    for j in range(1, min(k, vocab_size)):
        alt = (
            token + 1 + xxh3_64_intdigest(b"alt", h % 1_000_003 + j) % (vocab_size - 1)
        ) % vocab_size
        while alt in seen:
            alt = (alt + 1) % vocab_size
        seen.add(alt)
        out.append((alt, top1 - 2.0 - ((h >> 16) & 0xFFFF) / 0xFFFF - 0.5 * (j - 1)))
    return out


def _usage(output: RequestOutput, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": output.num_prompt_tokens,
        "total_tokens": output.num_prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


class _CompletionFrames:
    """Completions' and chat's chunks, as vLLM streams them."""

    def __init__(
        self,
        replica: EmulatedReplica,
        body: dict[str, Any],
        chat: bool,
        request_id: str,
        include_usage: bool,
        transfer: _Transfer | None,
    ) -> None:
        self.replica, self.chat, self.include_usage = replica, chat, include_usage
        self.transfer = transfer
        self.fields: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": replica.lora_name(body) or replica.options.served_model_name,
        }

    def _chunk(self, choice: dict[str, Any], kv_params: Any = _NO_KV) -> bytes:
        obj = {**self.fields, "choices": [choice]}
        if kv_params is not _NO_KV:
            obj["kv_transfer_params"] = kv_params
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    def head(self) -> bytes:
        return b""

    def opening(self, first: RequestOutput) -> bytes:
        if not self.chat:
            return b""
        # Like vLLM, the role chunk goes out with the first result from the engine.
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        return self._chunk({**role, "logprobs": None, "finish_reason": None})

    def step(self, text: str, output: RequestOutput) -> bytes:
        finish = output.finish_reason if output.finished else None
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                      "finish_reason": finish}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = None
        kv_params = _NO_KV
        if self.transfer is not None:  # vLLM's content chunks carry it: null but on the last
            kv_params = None
            if output.finished:
                kv_params = self.replica._kv_answer(self.transfer, output)
        return self._chunk(choice, kv_params)

    def closing(self, last: RequestOutput, generated: int) -> bytes:
        usage = b""
        if self.include_usage:
            obj: dict[str, Any] = {**self.fields, "choices": [], "usage": _usage(last, generated)}
            usage = b"data: " + msgspec.json.encode(obj) + b"\n\n"
        return usage + b"data: [DONE]\n\n"
