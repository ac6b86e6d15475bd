"""/status tells the truth during an incident: every reason a replica is out of rotation (drift
quarantine, parity alarm, draining, rollout phase, breaker, down), "in rotation" counting only
replicas that take new requests, each replica's canary and parity results, and every name shown
as text, never as markup (issue 37, items 1 and 6)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from kvroute.health.parity import MISMATCH, TOKENS, Finding
from kvroute.router.config import config_from_dict
from kvroute.router.membership import DRAINING, STARTING
from kvroute.router.server import Router

from .cdp import Browser
from .conftest import RunningRouter, StartEmulated, StartReplica, StartRouter, launch_emulated

KEY = "status-truth-key"
# A replica name and a parity finding a hostile operator (or a compromised config source, such
# as Kubernetes discovery) could set: shown as text on the page, never run or parsed as HTML.
HOSTILE = "<img src=x onerror=\"window.pwned='name'\">&amp;'\""
HOSTILE_DETAIL = "</li><script>window.pwned='detail'</script><b>bold</b>"
HOSTILE_TENANT = "<svg onload=\"window.pwned='tenant'\"></svg>"
INTERVAL_S = 0.5


async def _status(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY}"}
    timeout = aiohttp.ClientTimeout(total=10)  # a router that does not answer fails the test
    async with http.get(url + "/status/events", headers=headers, timeout=timeout) as r:
        assert r.status == 200, await r.text()
        body: dict[str, Any] = await r.json()
        return body


async def _status_until(
    http: aiohttp.ClientSession, url: str, holds: Any, what: str, timeout_s: float = 10.0
) -> dict[str, Any]:
    """The status JSON once ``holds(status)`` is true (the document is rebuilt twice a second,
    so a change shows within a poll or two); fail naming ``what`` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        status = await _status(http, url)
        if holds(status):
            return status
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {json.dumps(status)[:2000]}")
        await asyncio.sleep(0.05)


def _rows(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in status["replicas"]}


async def _incident(
    start_emulated: StartEmulated, start_router: StartRouter
) -> tuple[RunningRouter, Any]:
    """Six emulated replicas behind a router with the drift canary on, driven into one state
    each by the mechanisms that put them there in production; returns the router and the
    runner of the replica that was killed."""
    replicas = [await start_emulated(kv_events=False) for _ in range(5)]
    victim_runner, victim = await launch_emulated(kv_events=False)
    names = ["ok", "drifter", "drainer", "flaky", HOSTILE]
    entries = [{"url": r.url, "name": n} for r, n in zip(replicas, names, strict=True)]
    entries.append({"url": victim.url, "name": "dead"})
    running = await start_router(
        entries,
        auth={"admin_api_key": KEY},
        routing={"tokenizer": "builtin"},  # kv_aware keys prefixes: the parity check is on
        breaker={"cooldown_s": 60.0},  # ejected for the whole test
        health={"interval_s": 0.2},
        canary={"enabled": True, "interval_s": INTERVAL_S, "max_tokens": 8},
    )
    router = running.router
    handles = router.replicas
    await _wait(lambda: all(h.drift.last_result == "agree" for h in handles.values()), "canary")

    # Drift: the emulator's drift fault, found and quarantined by the canary itself.
    async with httpx.AsyncClient(timeout=5) as http:
        answer = await http.post(replicas[1].url + "/admin/faults", json={"drift": 3})
        assert answer.status_code == 200, answer.text
    await _wait(lambda: handles["drifter"].state.quarantined, "drifter quarantined")
    # Draining: what FleetMembership.remove does first (a drain waits for requests in flight,
    # which this fleet has none of, so the phase is set as the drain sets it).
    router.fleet_control.membership.phases["drainer"] = DRAINING
    handles["drainer"].state.draining = True
    # Breaker: live traffic's failures, counted by the registry as the forwarder counts them.
    flaky = handles["flaky"]
    for _ in range(flaky.breaker.settings.consecutive_failures):
        router.registry.record(flaky, ok=False, kind="http_503")
    assert flaky.state.ejected
    # Parity: a token mismatch on the hostile-named replica raises the alarm.
    assert router.parity is not None
    finding = Finding(HOSTILE, TOKENS, HOSTILE_DETAIL, position=7)
    router.parity._record(HOSTILE, TOKENS, MISMATCH, finding)
    # Down: the replica's process is gone; its health probe fails.
    await victim_runner.cleanup()
    await _wait(lambda: not handles["dead"].state.healthy, "dead marked down")
    return running, victim_runner


async def _wait(predicate: Any, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_status_json_shows_every_reason_a_replica_is_out(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    running, victim_runner = await _incident(start_emulated, start_router)
    try:
        async with aiohttp.ClientSession() as http:
            status = await _status_until(
                http,
                running.url,
                lambda s: (
                    _rows(s)["dead"]["status"] == "down"
                    and _rows(s)[HOSTILE]["status"] == "parity alarm"
                ),
                "every replica in its state",
            )
    finally:
        await victim_runner.cleanup()
    rows = _rows(status)
    assert {name: row["status"] for name, row in rows.items()} == {
        "ok": "up",
        "drifter": "quarantined",
        "drainer": "draining",
        "flaky": "ejected",
        HOSTILE: "parity alarm",
        "dead": "down",
    }
    # In rotation: only replicas that take new requests. A parity alarm does not take a
    # replica out (its answers are right; the router's cache predictions for it are not).
    assert {n for n, r in rows.items() if r["in_rotation"]} == {"ok", HOSTILE}
    assert status["fleet"]["in_rotation"] == 2 and status["fleet"]["replicas"] == 6
    assert status["fleet"]["out"] == {
        "down": 1,
        "quarantined": 1,
        "draining": 1,
        "ejected": 1,
        "parity alarm": 1,
        "up": 1,
    }
    # Each one's reasons, in words a person reads.
    drifter = rows["drifter"]
    (reason,) = drifter["reasons"]
    assert reason["status"] == "quarantined"
    assert "output drift" in reason["why"] and "token 3" in reason["why"]
    assert drifter["drift"]["quarantined"] is True and drifter["drift"]["result"] == "drift"
    assert drifter["drift"]["position"] == 3
    assert rows["drainer"]["phase"] == "draining" and rows["drainer"]["draining"] is True
    assert rows["drainer"]["reasons"][0]["why"].startswith("draining")
    assert rows["flaky"]["breaker"] == "open"
    assert "breaker open" in rows["flaky"]["why"] and rows["flaky"]["ejected_for_s"] > 0
    assert rows["dead"]["down_reason"] and rows["dead"]["why"] == rows["dead"]["down_reason"]
    hostile = rows[HOSTILE]
    assert hostile["parity"] == {
        "check": TOKENS,
        "result": MISMATCH,
        "detail": HOSTILE_DETAIL,
        "alarm": True,
    }
    assert hostile["reasons"] == [
        {"status": "parity alarm", "why": f"parity alarm: {HOSTILE_DETAIL}"}
    ]
    # The canary's last result on the healthy ones; the fleet's checks raise the alarm.
    assert rows["ok"]["drift"]["result"] == "agree" and rows["ok"]["parity"] is None
    assert rows["ok"]["reasons"] == [] and rows["ok"]["why"] is None
    assert status["checks"]["alarm"] is True
    assert status["checks"]["drift"] == "QUARANTINED: drifter"
    assert status["checks"]["parity"].startswith("ALARM: ")


def test_rollout_phase_and_half_open_breaker_show() -> None:
    """A replacement still starting is out of rotation; a breaker on trial takes trial
    requests (in rotation) and says why."""
    config = config_from_dict(
        {"replicas": [{"url": "http://127.0.0.1:9", "name": n} for n in ("new", "trial")]}
    )
    router = Router(config)
    new, trial = router.replicas["new"], router.replicas["trial"]
    new.state.healthy = trial.state.healthy = True
    router.fleet_control.membership.phases["new"] = STARTING
    new.state.draining = True  # a started replica is held out until it is checked in
    for _ in range(trial.breaker.settings.consecutive_failures):
        router.registry.record(trial, ok=False, kind="connect")
    # The cool-down ends: the breaker lets a trial request through.
    router.registry.before_decision(trial.breaker.open_until + 0.01)
    assert trial.breaker.allows(trial.breaker.open_until + 0.01)
    status = json.loads(router.status.json())
    rows = _rows(status)
    assert rows["new"]["status"] == "draining" and rows["new"]["phase"] == "starting"
    assert [r["status"] for r in rows["new"]["reasons"]] == ["draining", "starting"]
    assert rows["new"]["in_rotation"] is False
    assert rows["trial"]["status"] == "half-open", rows["trial"]
    assert rows["trial"]["in_rotation"] is True
    assert "on trial after" in rows["trial"]["why"]
    assert status["fleet"]["in_rotation"] == 1
    assert status["checks"]["drift"] == "off (canary.enabled: false)"


@pytest.mark.browser
async def test_status_page_in_a_browser_shows_the_incident_and_escapes_names(
    start_emulated: StartEmulated, start_router: StartRouter, tmp_path: Path
) -> None:
    running, victim_runner = await _incident(start_emulated, start_router)
    # A tenant named like markup (printable ASCII is all the header asks).
    client = openai.AsyncOpenAI(
        base_url=running.url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Tenant-Id": HOSTILE_TENANT},
    )
    await client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    await client.close()
    browser = await Browser.launch(tmp_path / "profile")
    try:
        await browser.goto(f"{running.url}/status?key={KEY}")
        cards = "[...document.querySelectorAll('.card')]"
        await browser.wait_for(
            f"{cards}.length === 6 && {cards}.find(c => c.dataset.replica === 'dead')"
            ".dataset.status === 'down'",
            what="six cards, the dead replica's down",
        )
        shown = await browser.evaluate(
            f"Object.fromEntries({cards}.map(c => [c.dataset.replica, "
            "[c.dataset.status, c.querySelector('.badge').textContent, "
            "c.dataset.inRotation]]))"
        )
        assert shown == {
            "ok": ["up", "✔ UP", "yes"],
            "drifter": ["quarantined", "✖ QUARANTINED", "no"],
            "drainer": ["draining", "◌ DRAINING", "no"],
            "flaky": ["ejected", "✖ EJECTED", "no"],
            HOSTILE: ["parity alarm", "⚠ PARITY ALARM", "yes"],
            "dead": ["down", "✖ DOWN", "no"],
        }
        assert await browser.evaluate("document.getElementById('rotation').textContent") == (
            "2 / 6"
        )
        out = await browser.evaluate("document.getElementById('out').textContent")
        for words in ("1 quarantined", "1 draining", "1 ejected", "1 down", "1 parity alarm"):
            assert words in out
        drifter = "document.querySelector('[data-replica=\"drifter\"]')"
        assert "output drift" in await browser.evaluate(
            f"{drifter}.querySelector('.why').textContent"
        )
        assert (
            await browser.evaluate(f"{drifter}.querySelector('.drift').textContent")
        ).startswith("drift canary: QUARANTINED (drift from token 3)")
        checks = await browser.evaluate("document.getElementById('checks').textContent")
        assert "drift: QUARANTINED: drifter" in checks and "parity: ALARM" in checks
        # The hostile name and finding: text on the page, not elements, and nothing ran.
        hostile = f"{cards}.find(c => c.dataset.replica === {json.dumps(HOSTILE)})"
        assert await browser.evaluate(f"{hostile}.querySelector('h3').textContent") == HOSTILE
        reason = await browser.evaluate(f"{hostile}.querySelector('.why li').textContent")
        assert reason == f"parity alarm: {HOSTILE_DETAIL}"
        assert (
            await browser.evaluate(
                "document.querySelectorAll('main img, main b, main script, main svg').length"
            )
            == 0
        )
        tenants = "document.getElementById('tenants').textContent"
        await browser.wait_for(f"{tenants}.includes('requests')", what="the tenants line")
        assert (await browser.evaluate(tenants)).startswith(HOSTILE_TENANT + ": 1 requests")
        assert await browser.evaluate("window.pwned === undefined")
    finally:
        await browser.close()
        await victim_runner.cleanup()


async def test_prompts_never_appear_on_the_status_data_or_the_admin_api(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    secret = "the launch codes are 0000-SECRET-PROMPT-0000"
    a = await start_replica("a")
    r = await start_router([a], auth={"admin_api_key": KEY})
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
    await client.completions.create(model="tiny", prompt=secret, max_tokens=2)
    await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": secret}], max_tokens=2
    )
    await client.close()
    bearer = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=bearer) as http:
        status = await _status_until(
            http, r.url, lambda s: s["fleet"]["requests"] == 2, "both requests counted"
        )
        assert len(status["decisions"]) == 2
        for path in ("/status/events", "/admin/replicas", "/admin/tenants", "/metrics"):
            async with http.get(r.url + path) as resp:
                assert resp.status == 200, path
                assert "SECRET-PROMPT" not in await resp.text(), path
