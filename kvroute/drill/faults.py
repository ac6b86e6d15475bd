"""Inject a drill's fault into one replica: an emulated replica's fault switch, or signals.

Emulated replicas take faults over POST /admin/faults. Real vLLM replicas the drill launched
are faulted with signals to their process group: SIGKILL kills them (the launcher restarts
them, as a supervisor would), SIGSTOP/SIGCONT freeze them (the socket still accepts
connections, nothing answers: a stall).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvroute.backends.process import ManagedProcess, signal_group

SCENARIOS = ("kill", "stall", "slow", "flap", "error-burst")
# Flapping: this long down (longer than a drill config's first_byte_s), then this long up, over and over while the fault lasts.
FLAP_PERIOD_S = 2.0
SLOWDOWN = 5.0


class DrillError(Exception):
    """A drill that cannot run as asked (the message says why)."""


@dataclass
class Target:
    name: str
    url: str
    emulated: bool  # answers POST /admin/faults
    process: ManagedProcess | None  # launched by the drill: can be signalled

    def check(self, scenario: str) -> None:
        if self.emulated:
            return
        if self.process is None:
            raise DrillError(
                f"replica {self.name} is neither emulated nor launched by this drill: the drill "
                "cannot inject faults into it (use launch: in the config)"
            )
        if scenario in ("slow", "error-burst"):
            raise DrillError(
                f"scenario {scenario} needs emulated replicas (launch.engine: emulated); real "
                "vLLM replicas support kill, stall and flap"
            )


async def _set_faults(http: aiohttp.ClientSession, target: Target, **spec: Any) -> None:
    async with http.post(target.url + "/admin/faults", json=spec) as resp:
        if resp.status != 200:
            raise DrillError(f"{target.name} refused the fault {spec}: HTTP {resp.status}")


def _signal(target: Target, sig: signal.Signals) -> None:
    assert target.process is not None and target.process.pid is not None
    signal_group(target.process.pid, sig)


async def inject(
    scenario: str, target: Target, http: aiohttp.ClientSession, fault_s: float
) -> asyncio.Task[None] | None:
    """Start the fault; a task is returned for faults that play out over time (flap)."""
    if scenario == "kill":
        if target.process is not None:
            target.process.kill()
        else:
            with contextlib.suppress(aiohttp.ClientError):  # it may die before it answers
                await _set_faults(http, target, exit_after_s=0.0)
        return None
    if scenario == "flap":
        return asyncio.create_task(_flap(target, http, fault_s))
    if not target.emulated:  # stall, on a real replica
        _signal(target, signal.SIGSTOP)
        return None
    if scenario == "stall":
        await _set_faults(http, target, stall_s=fault_s)
    elif scenario == "slow":
        await _set_faults(http, target, slowdown=SLOWDOWN)
    elif scenario == "error-burst":
        await _set_faults(http, target, error_rate=1.0)
    return None


async def clear(scenario: str, target: Target, http: aiohttp.ClientSession) -> None:
    """End the fault (a killed replica comes back through its supervisor, if any)."""
    if scenario == "kill":
        return
    if not target.emulated:
        _signal(target, signal.SIGCONT)
        return
    with contextlib.suppress(aiohttp.ClientError):
        await _set_faults(http, target)


async def _flap(target: Target, http: aiohttp.ClientSession, fault_s: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + fault_s
    while loop.time() < end:
        down = min(FLAP_PERIOD_S, end - loop.time())
        if target.emulated:
            await _set_faults(http, target, stall_s=down, error_rate=0.0)
            await asyncio.sleep(2 * FLAP_PERIOD_S)
        else:
            _signal(target, signal.SIGSTOP)
            await asyncio.sleep(down)
            _signal(target, signal.SIGCONT)
            await asyncio.sleep(FLAP_PERIOD_S)
