"""``kvroute replica``: serve the engine model in real time, as a vLLM replica would."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import uvloop
from aiohttp import web

from kvroute.kvcore import pd
from kvroute.kvcore.tokenizer import load_tokenizer
from kvroute.simulator.engine import PRESETS, EngineConfig, latency_preset
from kvroute.simulator.engine.offload import cpu_offload

from .faults import Faults, FaultSpec
from .server import EmulatedReplica, ReplicaOptions


def add_replica_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "replica",
        help="Run an emulated vLLM replica (engine model in real time).",
        description=(
            "Serve the engine model (paged KV cache with prefix caching, continuous batching, a "
            "roofline latency model) in real time behind vLLM's HTTP API, /metrics and ZMQ KV "
            "events. Flag names follow vLLM's where they mean the same."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="Listen address (default 127.0.0.1).")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000).")
    p.add_argument("--served-model-name", default="tiny", help="The model name clients send.")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve, as vLLM's flag: requests naming one are served by the base "
        "engine, with the adapter's name in their blocks' hash keys and KV events.",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="Serve LoRA adapters (implied by --lora-modules, and by "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the environment, which also serves "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM).",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="Distinct LoRA adapters in one running batch, as vLLM's (default 1): a request "
        "whose adapter would be one too many waits for a slot.",
    )
    p.add_argument("--block-size", type=int, default=16, help="Tokens per KV block.")
    p.add_argument(
        "--num-gpu-blocks-override", type=int, default=2048, help="KV capacity in blocks."
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        metavar="GIB",
        help="vLLM's flag: offload KV to a CPU tier of this many GiB (native backend: every "
        "cached block stored there too, GPU misses loaded back at PCIe speed, events with "
        "medium CPU). Default: none.",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="Largest running batch.")
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="As vLLM: this many engines (ranks) behind the one HTTP port, each with its own KV "
        "cache (--num-gpu-blocks-override blocks each), KV events on the configured endpoint "
        "offset by its rank (tcp: port + rank, ipc: path + _dpK) and metrics labelled "
        'engine="K". A request goes to the rank in its X-data-parallel-rank header, else to '
        "the least loaded rank as vLLM's own balancer picks it (default 1).",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="Per-step token budget."
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=8192,
        help="Longest prompt plus output in tokens, as vLLM's (default 8192).",
    )
    p.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help='As vLLM: {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}. '
        "ipc:// endpoints are bound as Unix sockets; tcp://*:P is bound on --host only.",
    )
    p.add_argument(
        "--event-layout",
        choices=["map", "array"],
        default="map",
        help="KV event encoding: map (vLLM >= 0.24, default) or array (vLLM <= 0.23).",
    )
    p.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        type=_kv_transfer_config,
        help='As vLLM, for prefill/decode disaggregation: {"kv_connector": "NixlConnector", '
        '"kv_role": "kv_both"} (or kv_producer, kv_consumer). Requests\' kv_transfer_params '
        "are then served as NixlConnector does: do_remote_decode holds the prompt's KV blocks "
        "for a decode replica (until read, or VLLM_NIXL_ABORT_REQUEST_TIMEOUT seconds, 480), "
        "do_remote_prefill reads them from the prefill replica over this replica's HTTP port "
        "(VLLM_NIXL_SIDE_CHANNEL_HOST overrides the host it advertises) instead of computing "
        "them, or computes them when the read fails. Without it, kv_transfer_params are "
        "ignored and answered null.",
    )
    p.add_argument(
        "--kv-link",
        metavar="LINK",
        type=_kv_link,
        default="rdma",
        help="Emulator only: the link a prompt's KV moves over from a prefill replica, for the "
        "modelled transfer time (setup + tokens x the preset's KV bytes per token / speed): "
        "nvlink (450 GB/s), rdma (50 GB/s per GPU of the preset, default) or GB/s as a number.",
    )
    p.add_argument(
        "--preset",
        default="llama-3.1-8b-h100",
        type=_preset_name,
        metavar="NAME[@SPEED]",
        help=f"Latency model: {', '.join(sorted(PRESETS))}; NAME@SPEED runs it at SPEED times "
        "its pace (@0.5: every step twice as long), for mixed pools.",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="Multiply every modelled step time (>1: slower).",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="HF tokenizer files (default: built-in tokenizer)."
    )
    p.add_argument(
        "--seed", type=int, default=0, help="Seed of the tokens the engine model generates."
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="As vLLM's flag: serve /v1/messages and /v1/messages/count_tokens requests that "
        "carry tools (rendered into the prompt) instead of refusing them with 400, as vLLM "
        "without a tool parser does. The emulated model calls no tools: answers are text.",
    )
    p.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="As vLLM's flag: serve /v1/chat/completions/render and the token-in "
        "/inference/v1/generate (what the router's routing.send_tokens sends requests to).",
    )
    p.add_argument(
        "--responses-store",
        action="store_true",
        help="Keep /v1/responses answers (the newest 10,000) for previous_response_id and GET "
        "/v1/responses/{id}, as vLLM does with VLLM_ENABLE_RESPONSES_API_STORE=1 in the "
        "environment (which also turns this on); without it store is ignored and both give 404.",
    )
    faults = p.add_argument_group("fault injection (also at run time: POST /admin/faults)")
    faults.add_argument(
        "--error-rate", type=float, default=0.0, help="Fraction of requests answered 500."
    )
    faults.add_argument(
        "--stall-s", type=float, default=0.0, help="Accept but answer nothing for S seconds."
    )
    faults.add_argument(
        "--slowdown", type=float, default=1.0, help="Every step takes this many times longer."
    )
    faults.add_argument(
        "--drop-after-chunks", type=int, default=0, help="Close streams after N chunks."
    )
    faults.add_argument(
        "--exit-after-s", type=float, default=-1.0, help="Exit with code 1 after S seconds."
    )
    faults.add_argument(
        "--drift",
        type=int,
        default=-1,
        metavar="POSITION",
        help="Output drift: from output token POSITION on (0: the first), emit other tokens, "
        "confidently, as wrong weights would (what the router's drift canary catches).",
    )
    p.set_defaults(func=run_replica_command)


def _kv_config(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"kvroute replica: --kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SystemExit("kvroute replica: --kv-events-config must be a JSON object")
    return config


def _kv_transfer_config(text: str) -> dict[str, Any]:
    try:
        return pd.parse_kv_transfer_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _preset_name(text: str) -> str:
    try:
        latency_preset(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _kv_link(text: str) -> str:
    try:
        pd.link_bytes_per_s(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _hold_timeout_s(env: Mapping[str, str]) -> float:
    """vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT (seconds), default 480."""
    text = env.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT")
    if text is None:
        return pd.HOLD_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"VLLM_NIXL_ABORT_REQUEST_TIMEOUT must be seconds > 0, not {text!r}")
    return seconds


def _lora_modules(specs: list[str]) -> dict[str, str]:
    """vLLM's ``--lora-modules name=path`` (a bare name is its own path)."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
        modules[name] = path or name
    return modules


def responses_store(env: Mapping[str, str]) -> bool:
    """vLLM's reading of VLLM_ENABLE_RESPONSES_API_STORE: an integer, on when not 0."""
    text = env.get("VLLM_ENABLE_RESPONSES_API_STORE", "0").strip() or "0"
    try:
        return bool(int(text))
    except ValueError:
        raise ValueError(
            f"VLLM_ENABLE_RESPONSES_API_STORE must be an integer, not {text!r}"
        ) from None


def runtime_lora_updating(env: Mapping[str, str]) -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true", any case."""
    return env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def run_replica_command(args: argparse.Namespace) -> int:
    try:
        faults = Faults()
        faults.update(
            FaultSpec(
                error_rate=args.error_rate,
                stall_s=args.stall_s,
                slowdown=args.slowdown,
                drop_after_chunks=args.drop_after_chunks,
                exit_after_s=args.exit_after_s,
                drift=args.drift,
            )
        )
        lora_modules = _lora_modules(args.lora_modules)
        runtime_lora = runtime_lora_updating(os.environ)
        lora = args.enable_lora or bool(lora_modules) or runtime_lora
        if args.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {args.max_loras}")
        hold_timeout_s = _hold_timeout_s(os.environ)
        store = args.responses_store or responses_store(os.environ)
        tokenizer = load_tokenizer(args.tokenizer, clock=datetime.now)
        latency = latency_preset(args.preset)
        engine = EngineConfig(
            block_size=args.block_size,
            num_blocks=args.num_gpu_blocks_override,
            offload=cpu_offload(args.kv_offloading_size, latency, args.block_size),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            latency=latency,
            vocab_size=tokenizer.vocab_size,
            seed=args.seed,
            max_loras=args.max_loras if lora else 0,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"kvroute replica: {exc}", file=sys.stderr)
        return 2
    options = ReplicaOptions(
        served_model_name=args.served_model_name,
        engine=engine,
        time_scale=args.time_scale,
        kv_events=_kv_config(args.kv_events_config),
        kv_bind_host=args.host,
        event_layout=args.event_layout,
        model_path=args.tokenizer or "kvroute-emulated",
        lora_modules=lora_modules,
        enable_lora=args.enable_lora,
        allow_runtime_lora_updating=runtime_lora,
        kv_transfer=args.kv_transfer_config,
        kv_link=args.kv_link,
        kv_hold_timeout_s=hold_timeout_s,
        side_channel_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or None,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        responses_store=store,
        enable_scale_out=args.enable_scale_out,
        data_parallel_size=args.data_parallel_size,
    )
    try:
        replica = EmulatedReplica(options, tokenizer, faults)
    except ValueError as exc:
        print(f"kvroute replica: {exc}", file=sys.stderr)
        return 2
    try:
        uvloop.run(_serve(replica, args.host, args.port))
    except OSError as exc:  # the port is taken, the address is not ours, ...
        print(f"kvroute replica: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(replica: EmulatedReplica, host: str, port: int) -> None:
    runner = web.AppRunner(replica.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    # A router opens connections in bursts (thousands of streams at once): aiohttp's default
    # accept backlog of 128 would refuse them; the router's own is 2048.
    await web.TCPSite(runner, host, port, backlog=2048).start()
    print(f"emulated replica listening on http://{host}:{port}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
