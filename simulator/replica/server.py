"""The emulated replica's HTTP surface: vLLM's OpenAI server, as far as a router can tell.

Completions and chat (streamed and not, vLLM's chunk shapes, usage and
``stream_options.include_usage``; ``logprobs`` and ``return_token_ids`` on non-streamed
completions; at temperature 0 the same answer on every replica), /v1/models, /health, /metrics
(vLLM's names, ``vllm:lora_requests_info`` with LoRA on), /tokenize, /detokenize,
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
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from xxhash import xxh3_64_intdigest

from kvroute.kvcore import pd
from kvroute.kvcore.tokenizer import Tokenizer
from kvroute.simulator.engine import Engine, EngineConfig, EngineRequest, RequestOutput

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

    @property
    def lora(self) -> bool:
        return self.enable_lora or bool(self.lora_modules) or self.allow_runtime_lora_updating


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
        self.engine = Engine(options.engine)
        self.metrics = ReplicaMetrics(
            options.served_model_name, options.engine, lambda: self.engine.stats, options.lora
        )
        # Adapters served now: name -> path (--lora-modules, then runtime loads and unloads).
        self.lora_modules = dict(options.lora_modules)
        self.publisher: KVEventPublisher | None = None
        kv = options.kv_events or {}
        if kv.get("enable_kv_cache_events") and kv.get("publisher", "zmq") == "zmq":
            self.publisher = KVEventPublisher(
                kv.get("endpoint", "tcp://*:5557"),
                kv.get("replay_endpoint"),
                topic=kv.get("topic", ""),
                layout=options.event_layout,
                buffer_steps=int(kv.get("buffer_steps", 10_000)),
                bind_host=options.kv_bind_host,
            )
        self.runner = EngineRunner(
            self.engine,
            options.time_scale,
            self.publisher.publish if self.publisher else lambda events: None,
            slowdown=lambda: self.faults.spec.slowdown,
        )
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
        app.router.add_get("/admin/faults", self.get_faults)
        app.router.add_post("/admin/faults", self.set_faults)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        self.runner.start()
        if self.publisher is not None:
            self.publisher.start()
        self._schedule_exit()

    async def _cleanup(self, app: web.Application) -> None:
        await self.runner.close()
        if self.publisher is not None:
            await self.publisher.close()
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
        stall = self.faults.stall_remaining()
        if stall:
            await asyncio.sleep(stall)
        if self.faults.should_error():
            return _error("Injected fault: internal server error.", 500, "InternalServerError")
        try:
            body = await _json_body(request)
            prompt_ids, max_tokens = self._prepare(body, chat)
            lora_name = self._lora_name(body)
            transfer = self._transfer(request, body)
        except BadRequest as exc:
            return _error(str(exc), exc.status, exc.error_type, exc.param)
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{request.headers.get('X-Request-Id') or os.urandom(8).hex()}-{next(self._ids)}"
        arrival = time.monotonic()
        params = transfer.params if transfer is not None else None
        try:
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
            queue = self.runner.submit(engine_request)
        except ValueError as exc:
            return _error(str(exc), 400, "BadRequestError")
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        try:
            if stream:
                return await self._stream(
                    request, body, chat, request_id, queue, arrival, include_usage, transfer
                )
            return await self._complete(body, chat, request_id, queue, arrival, transfer)
        except (asyncio.CancelledError, ConnectionResetError):
            self.runner.abort(request_id)
            if self.connector is not None:
                self.connector.release(request_id)  # no decode replica will learn of its blocks
            raise

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

    def _lora_name(self, body: dict[str, Any]) -> str | None:
        model = body.get("model")
        return model if isinstance(model, str) and model in self.lora_modules else None

    def _prepare(self, body: dict[str, Any], chat: bool) -> tuple[list[int], int]:
        model = body.get("model")
        if (
            model is not None
            and model != self.options.served_model_name
            and model not in self.lora_modules
        ):
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", param="messages")
            continue_final = bool(body.get("continue_final_message", False))
            add_generation = bool(body.get("add_generation_prompt", not continue_final))
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation,
                continue_final_message=continue_final,
            )
            prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
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
        if max_tokens is None:
            max_tokens = min(
                default_max, max(1, self.options.engine.max_model_len - len(prompt_ids))
            )
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer", param="max_tokens")
        if not prompt_ids:
            raise BadRequest("The prompt is empty.", param="prompt")
        limit = self.options.engine.max_model_len
        if len(prompt_ids) + max_tokens > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{len(prompt_ids)} input tokens and asks for {max_tokens} output tokens.",
                param="max_tokens",
            )
        return prompt_ids, max_tokens

    async def _complete(
        self,
        body: dict[str, Any],
        chat: bool,
        request_id: str,
        queue: asyncio.Queue[RequestOutput],
        arrival: float,
        transfer: _Transfer | None = None,
    ) -> web.Response:
        token_ids: list[int] = []
        first: RequestOutput | None = None
        last: RequestOutput | None = None
        while last is None or not last.finished:
            last = await queue.get()
            if first is None and last.new_token_ids:
                first = last
                self.metrics.ttft.observe(time.monotonic() - arrival)
            token_ids += last.new_token_ids
        self._finished(last, arrival)
        # Drift rewrites what is sent, not the engine's cache: a fault, not a model.
        token_ids = self.faults.drifted(token_ids, 0, self.options.engine.vocab_size)
        text = self.tokenizer.decode(token_ids)
        usage = _usage(last, len(token_ids))
        created = int(time.time())
        model = self._lora_name(body) or self.options.served_model_name
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

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        request_id: str,
        queue: asyncio.Queue[RequestOutput],
        arrival: float,
        include_usage: bool,
        transfer: _Transfer | None = None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        created = int(time.time())
        model = self._lora_name(body) or self.options.served_model_name
        kind = "chat.completion.chunk" if chat else "text_completion"
        drop_after = self.faults.spec.drop_after_chunks

        def chunk(choice: dict[str, Any], kv_params: Any = _NO_KV) -> bytes:
            obj = {
                "id": request_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if kv_params is not _NO_KV:
                obj["kv_transfer_params"] = kv_params
            return b"data: " + msgspec.json.encode(obj) + b"\n\n"

        chunks = 0
        generated = 0
        last_time = None
        while True:
            output = await queue.get()
            now = time.monotonic()
            if output.new_token_ids:
                if last_time is None:
                    self.metrics.ttft.observe(now - arrival)
                else:
                    self.metrics.itl.observe(now - last_time)
                last_time = now
            if chat and chunks == 0:
                # Like vLLM, the role chunk goes out with the first result from the engine.
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                await response.write(chunk({**role, "logprobs": None, "finish_reason": None}))
                chunks += 1
            vocab = self.options.engine.vocab_size
            new_ids = self.faults.drifted(output.new_token_ids, generated, vocab)
            generated += len(new_ids)
            text = self.tokenizer.decode(new_ids)
            finish = output.finish_reason if output.finished else None
            if chat:
                choice = {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if finish:
                choice["stop_reason"] = None
            kv_params = _NO_KV
            if transfer is not None:  # vLLM's content chunks carry it: null but on the last
                kv_params = self._kv_answer(transfer, output) if output.finished else None
            await response.write(chunk(choice, kv_params))
            chunks += 1
            if drop_after and chunks >= drop_after and not output.finished:
                self.runner.abort(request_id)
                assert request.transport is not None
                request.transport.close()  # injected fault: the connection breaks mid-stream
                return response
            if output.finished:
                break
        self._finished(output, arrival)
        if include_usage:
            obj = {
                "id": request_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(output, generated),
            }
            await response.write(b"data: " + msgspec.json.encode(obj) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

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

    def _finished(self, output: RequestOutput, arrival: float) -> None:
        self.metrics.e2e.observe(time.monotonic() - arrival)
        self.metrics.finished(output.finish_reason or "length")

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
        if "messages" in body:
            continue_final = bool(body.get("continue_final_message", False))
            text = self.tokenizer.apply_chat_template(
                body["messages"],
                add_generation_prompt=bool(body.get("add_generation_prompt", not continue_final)),
                continue_final_message=continue_final,
            )
            special = False
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
            special = bool(body.get("add_special_tokens", True))
        else:
            return _error("give 'prompt' (a string) or 'messages'", 400, "BadRequestError")
        tokens = self.tokenizer.encode(text, add_special_tokens=special)
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
        ok = self.runner.reset_prefix_cache()
        return web.json_response({"success": ok}, status=200 if ok else 409)

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response({"0": self.options.kv_events or {}})

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
