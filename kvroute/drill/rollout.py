"""``kvroute drill --scenario rollout``: replace every launched replica under load and report
what the clients saw.

Unlike the fault scenarios, the router launches the fleet itself (the config's ``launch:``
goes to ``kvroute serve`` as it is), because a rollout replaces the router's own processes.
Load starts, the rollout is asked for at ``--at`` seconds (``POST /admin/rollout``), and load
goes on until the rollout has ended and ``--duration`` has passed: every request sent while
replicas were drained and restarted is judged. The target is 0 failed and 0 cut streams.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from kvroute.backends.process import free_ports
from kvroute.bench.harness.processes import Child, managed
from kvroute.drill.faults import DrillError
from kvroute.drill.load import run_load_until
from kvroute.router.config import Config, api_key_value, resolve_secret
from kvroute.simulator.loadgen import Outcome

POLL_S = 0.25
# A rollout of real vLLM replicas takes minutes per replica on a small CPU box.
ROLLOUT_TIMEOUT_S = 3600.0
ROUTER_STOP_GRACE_S = 60.0  # the router stops the replicas it launched before it exits
CUT_KINDS = ("incomplete stream", "SSE error")


@dataclass
class RolloutReport:
    outcomes: list[Outcome]
    progress: dict[str, Any]
    resumed: float
    rate: float
    engine: str
    load_s: float
    args: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def cut(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.stream and o.error_kind in CUT_KINDS]

    @property
    def passed(self) -> bool:
        return not self.failed and self.progress.get("state") == "done"


def run_rollout_drill(
    config: Config,
    *,
    rate: float,
    at_s: float,
    duration_s: float,
    max_tokens: int,
    rollout: dict[str, Any],
    ready_timeout_s: float,
) -> RolloutReport:
    if config.launch is None:
        raise DrillError("--scenario rollout replaces launched replicas: the config needs launch:")
    from kvroute.drill.run import (  # the fault drill's waits, shared
        _admin_headers,
        _counters,
        _first_model,
    )

    count = config.launch.count
    port = free_ports(1)[0]
    config = msgspec.structs.replace(
        config, listen=msgspec.structs.replace(config.listen, port=port, host="127.0.0.1")
    )
    url = f"http://127.0.0.1:{port}"
    client_key = (
        resolve_secret(api_key_value(config.auth.api_keys[0]), "auth.api_keys[0]")
        if config.auth.api_keys
        else None
    )

    async def drive(router: Child) -> RolloutReport:
        async with aiohttp.ClientSession(headers=_admin_headers(config)) as http:
            await _wait_serving(http, url, router, count, ready_timeout_s)
            model = config.models[0] if config.models else await _first_model(http, url, client_key)
            before = await _counters(http, url)
            started = time.monotonic()
            ended: list[float] = []

            def stop() -> bool:
                now = time.monotonic()
                return bool(ended) and now >= max(ended[0] + 2.0, started + duration_s)

            load = asyncio.create_task(
                run_load_until(url, model, rate, max_tokens, started, stop, client_key)
            )
            await asyncio.sleep(max(0.0, started + at_s - time.monotonic()))
            print(f"kvroute drill: rollout at t={at_s:g}s", file=sys.stderr, flush=True)
            async with http.post(url + "/admin/rollout", json=rollout) as resp:
                body = await resp.json()
                if resp.status != 202:
                    load.cancel()
                    raise DrillError(f"the router refused the rollout: {body}")
            progress = await _follow(http, url)
            ended.append(time.monotonic())
            result = await load
            after = await _counters(http, url)
        return RolloutReport(
            result.outcomes,
            progress,
            after["resumed"] - before["resumed"],
            rate,
            config.launch.engine if config.launch is not None else "",
            time.monotonic() - started,
            list(rollout.get("args") or []),
        )

    with tempfile.TemporaryDirectory(prefix="kvroute-drill-") as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(msgspec.to_builtins(config)))
        argv = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)]
        with managed("router", argv, Path(tmp), grace_s=ROUTER_STOP_GRACE_S) as router:
            return asyncio.run(drive(router))


async def _wait_serving(
    http: aiohttp.ClientSession, url: str, router: Child, count: int, timeout_s: float
) -> None:
    """Until the router (which launches the fleet first) has every replica healthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = router.popen.poll()
        if code is not None:
            raise DrillError(f"the router exited with status {code}:\n{router.log_tail()}")
        try:
            async with http.get(url + "/admin/replicas") as resp:
                if resp.status == 200:
                    rows = (await resp.json())["replicas"]
                    if len(rows) == count and all(r["healthy"] for r in rows):
                        return
        except aiohttp.ClientError:
            pass  # still launching its replicas
        await asyncio.sleep(POLL_S)
    raise DrillError(f"the router and its {count} replicas were not up within {timeout_s:g} s")


async def _follow(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    deadline = time.monotonic() + ROLLOUT_TIMEOUT_S
    shown = 0
    while time.monotonic() < deadline:
        async with http.get(url + "/admin/rollout") as resp:
            progress: dict[str, Any] = (await resp.json())["rollout"]
        for step in progress["replaced"][shown:]:
            print(
                f"kvroute drill: {step['name']} replaced in {step['seconds']:.1f}s",
                file=sys.stderr,
                flush=True,
            )
        shown = len(progress["replaced"])
        if progress["state"] not in ("running", "paused"):
            return progress
        await asyncio.sleep(POLL_S)
    raise DrillError(f"the rollout did not end within {ROLLOUT_TIMEOUT_S:g} s")


def format_rollout_report(report: RolloutReport) -> str:
    outcomes = report.outcomes
    progress = report.progress
    steps = progress.get("replaced", [])
    per_replica = ", ".join(
        f"{s['name']} {s['seconds']:.1f}s (drain {s['drain_s']:.1f} + start {s['start_s']:.1f})"
        for s in steps
    )
    streams = sum(1 for o in outcomes if o.stream)
    moved = sum(s["moved"] for s in steps)
    lost = sum(s["lost"] for s in steps)
    lines = [
        f"drill: rollout of {len(progress.get('targets', []))} {report.engine} replicas "
        f"(max_unavailable {progress.get('max_unavailable')}, new args {report.args or 'unchanged'})"
        f"; {report.rate:g} req/s (half streamed) for {report.load_s:.0f}s",
        f"  rollout              {progress.get('state')}, {len(steps)} replaced",
        f"  requests sent        {len(outcomes)} ({streams} streamed)",
        f"  succeeded            {len(outcomes) - len(report.failed)}",
        f"  failed (lost)        {len(report.failed)}",
        f"  cut streams          {len(report.cut)}",
        f"  resumed mid-stream   {report.resumed:.0f}",
        f"  moved by drains      {moved} (lost with a replica: {lost})",
        f"  time per replica     {per_replica or '-'}",
    ]
    if progress.get("error"):
        lines.append(f"  error: {progress['error']}")
    for x in report.failed[:5]:
        lines.append(f"  lost: t={x.sent_at:.2f}s stream={x.stream} {x.error}")
    verdict = (
        "PASS, nothing lost or cut"
        if report.passed
        else f"FAIL, {len(report.failed)} failed, {len(report.cut)} cut"
        + ("" if progress.get("state") == "done" else f", rollout {progress.get('state')}")
    )
    lines.append("result: " + verdict)
    return "\n".join(lines)
