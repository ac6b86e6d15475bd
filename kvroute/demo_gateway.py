"""``kvroute demo --gateway``: the demo's workload through a real Envoy, with and without the
endpoint picker, on the fleet the demo launched."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import aiohttp
import msgspec

from kvroute.backends.launcher import LaunchedFleet
from kvroute.backends.process import free_ports
from kvroute.bench.chat_load import RunResult, measured_run
from kvroute.gateway import EnvoyProcess, GatewaySpec
from kvroute.router.config import config_from_dict
from kvroute.router.epp.server import PickerServer
from kvroute.router.launching import routing_for_launch
from kvroute.simulator.workload import Conversation


def picker_for(fleet: LaunchedFleet, policy: str, ledger_bus: str | None = None) -> PickerServer:
    """``kvroute epp`` as an operator would run it for this fleet (ports picked free)."""
    grpc_port, health_port, metrics_port = free_ports(3)
    config = config_from_dict(
        {
            "replicas": [
                {"url": r.url, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
                for r in fleet.replicas
            ],
            "policy": {"name": policy},
            "health": {"interval_s": 1.0},
            "epp": {
                "grpc_port": grpc_port,
                "health_port": health_port,
                "metrics_port": metrics_port,
                "ledger_bus": ledger_bus,
            },
        }
    )
    routing = routing_for_launch(config.routing, fleet.spec)
    return PickerServer(msgspec.structs.replace(config, routing=routing))


async def run_gateway_demo(
    fleet: LaunchedFleet,
    policies: list[str],
    conversations: list[Conversation],
    args: argparse.Namespace,
) -> list[RunResult]:
    pods = [("127.0.0.1", int(r.url.rsplit(":", 1)[1])) for r in fleet.replicas]
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-gateway-", dir=args.log_dir))
    results = []
    pickers: list[PickerServer] = []
    envoy: EnvoyProcess | None = None
    count = max(1, args.pickers)
    try:
        for policy in [None, *policies]:
            if envoy is not None:
                envoy.stop()
            for picker in pickers:
                await picker.stop(0)
            pickers = [
                picker_for(fleet, policy or "round_robin", args.ledger_bus) for _ in range(count)
            ]
            grpc_ports = [(await picker.start()).grpc for picker in pickers]
            listen, admin, direct = free_ports(3)
            at = [("127.0.0.1", port) for port in grpc_ports]
            spec = GatewaySpec(pods, at, listen, admin, direct_port=direct)
            envoy = EnvoyProcess(spec, workdir / (policy or "direct"))
            envoy.start()
            await asyncio.to_thread(envoy.wait_for_pickers, count)
            port = direct if policy is None else listen
            many = f"{count} " if count > 1 else ""
            if args.ledger_bus and count > 1:
                many += "bus-shared "
            label = "envoy round robin" if policy is None else f"envoy + {many}epp {policy}"
            url = f"http://127.0.0.1:{port}"
            results.append(await _run(fleet, url, label, conversations, args))
        if args.keep_running and envoy is not None:
            await _serve_until_interrupted(envoy, pickers[-1] if pickers else None)
    finally:
        if envoy is not None:
            envoy.stop()
        for picker in pickers:
            await picker.stop(0)
    return results


async def _run(
    fleet: LaunchedFleet,
    url: str,
    label: str,
    conversations: list[Conversation],
    args: argparse.Namespace,
) -> RunResult:
    async with aiohttp.ClientSession() as http:
        return await measured_run(
            http,
            {r.url: r.name for r in fleet.replicas},
            url,
            label,
            conversations,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            api=args.api,
        )


async def _serve_until_interrupted(envoy: EnvoyProcess, picker: PickerServer | None) -> None:
    spec = envoy.spec
    body = '{"model": "tiny", "prompt": "Hello", "max_tokens": 8}'
    lines = [
        "",
        f"kvroute demo: Envoy on http://127.0.0.1:{spec.listen_port} (admin :{spec.admin_port})",
    ]
    if picker is not None:
        ports = picker.ports
        lines.append(
            f"  asks kvroute epp (ext_proc :{ports.grpc}, metrics :{ports.metrics}/metrics)"
        )
    lines += [
        f"  try: curl http://127.0.0.1:{spec.listen_port}/v1/completions "
        f"-H 'content-type: application/json' -d '{body}'",
        "  Ctrl-C stops everything.",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)
    await asyncio.Event().wait()
