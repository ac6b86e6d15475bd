"""The output-drift canary end to end: three emulated replicas behind a router, one drifts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvroute.health.canary import CanaryRunner, CanarySettings
from kvroute.health.drift import DRIFT, DriftState
from kvroute.policies import ReplicaState

from .conftest import StartEmulated, StartRouter
from .helpers import wait_until

INTERVAL_S = 0.5


async def _set_faults(url: str, **faults: Any) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.post(url + "/admin/faults", json=faults)
        assert response.status_code == 200, response.text


async def _admin_rows(router_url: str) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(router_url + "/admin/replicas")
    assert response.status_code == 200, response.text
    return {row["name"]: row for row in response.json()["replicas"]}


async def _served_by(router_url: str, requests: int) -> set[str]:
    client = openai.AsyncOpenAI(
        base_url=router_url + "/v1", api_key="unused", max_retries=0, timeout=10
    )
    seen = set()
    for i in range(requests):
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=f"hello number {i}", max_tokens=2
        )
        seen.add(raw.headers["X-Kvroute-Replica"])
    await client.close()
    return seen


async def test_a_drifting_replica_is_quarantined_within_one_interval_and_returns(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replicas = [await start_emulated(kv_events=False) for _ in range(3)]
    names = ["r0", "r1", "r2"]
    running = await start_router(
        [{"url": r.url, "name": n} for r, n in zip(replicas, names, strict=True)],
        policy={"name": "round_robin"},
        canary={"enabled": True, "interval_s": INTERVAL_S, "max_tokens": 8},
    )
    router = running.router
    handles = router.replicas
    await wait_until(
        lambda: all(h.drift.last_result == "agree" for h in handles.values()),
        timeout_s=10,
        what="a first canary round that finds the three replicas agreeing",
    )
    assert await _served_by(running.url, 6) == set(names)

    await _set_faults(replicas[2].url, drift=3)
    loop = asyncio.get_running_loop()
    injected_at = loop.time()
    await wait_until(
        lambda: handles["r2"].state.quarantined,
        timeout_s=INTERVAL_S + 2.0,  # one interval, plus a round's own time on a busy box
        what="r2 quarantined for drift",
    )
    took = loop.time() - injected_at
    print(f"drift injected -> quarantined in {took:.2f}s (interval {INTERVAL_S}s)")

    rows = await _admin_rows(running.url)
    row = rows["r2"]
    assert row["quarantined"] is True
    assert row["quarantine_reason"] == "drift"
    assert row["drift"]["position"] == 3  # the drift fault starts at output token 3
    assert row["drift"]["reference"] == "majority"
    assert row["drift"]["expected"][0] != row["drift"]["got"][0]
    assert row["drift"]["margin"] >= 0.5
    assert len(row["drift"]["expected"]) == len(row["drift"]["got"]) == 8 - 3
    assert not rows["r0"]["quarantined"] and rows["r0"]["quarantine_reason"] is None
    # Client requests no longer go there (the real openai client, the decision header).
    assert await _served_by(running.url, 6) == {"r0", "r1"}
    async with httpx.AsyncClient(timeout=5) as http:
        metrics = (await http.get(running.url + "/metrics")).text
    assert 'kvroute_replica_quarantined{replica="r2"} 1.0' in metrics
    assert 'kvroute_canary_checks_total{replica="r2",result="drift"}' in metrics
    assert 'kvroute_canary_checks_total{replica="r0",result="agree"}' in metrics

    await _set_faults(replicas[2].url)  # the fault cleared: r2 answers like the others again
    await wait_until(
        lambda: not handles["r2"].state.quarantined,
        timeout_s=INTERVAL_S + 2.0,
        what="r2 back in rotation after agreeing again",
    )
    rows = await _admin_rows(running.url)
    assert rows["r2"]["quarantined"] is False and rows["r2"]["drift"] is None
    assert rows["r2"]["canary"]["last_result"] == "agree"
    assert await _served_by(running.url, 6) == set(names)


async def test_min_margin_reports_a_difference_below_it_as_a_near_tie_and_quarantines_nothing(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """canary.min_margin: the same drift as above, judged against a margin no greedy choice
    reaches, is a near-tie (a flip between two tokens the model can hardly tell apart): counted
    and shown, and the replica keeps serving."""
    replicas = [await start_emulated(kv_events=False) for _ in range(3)]
    names = ["r0", "r1", "r2"]
    running = await start_router(
        [{"url": r.url, "name": n} for r, n in zip(replicas, names, strict=True)],
        policy={"name": "round_robin"},
        canary={"enabled": True, "interval_s": INTERVAL_S, "max_tokens": 8, "min_margin": 1000.0},
    )
    handles = running.router.replicas
    await wait_until(
        lambda: all(h.drift.last_result == "agree" for h in handles.values()),
        timeout_s=10,
        what="a first canary round that finds the three replicas agreeing",
    )
    await _set_faults(replicas[2].url, drift=3)
    await wait_until(
        lambda: handles["r2"].drift.last_result == "near_tie",
        timeout_s=10,
        what="a canary round that finds r2's difference",
    )
    rows = await _admin_rows(running.url)
    assert rows["r2"]["quarantined"] is False and rows["r2"]["quarantine_reason"] is None
    assert rows["r2"]["canary"]["last_result"] == "near_tie"
    assert await _served_by(running.url, 6) == set(names)
    async with httpx.AsyncClient(timeout=5) as http:
        metrics = (await http.get(running.url + "/metrics")).text
    assert 'kvroute_canary_checks_total{replica="r2",result="near_tie"}' in metrics
    assert 'kvroute_replica_quarantined{replica="r2"} 0.0' in metrics


async def test_an_admin_can_unquarantine_and_the_last_replica_is_never_quarantined(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replicas = [await start_emulated(kv_events=False) for _ in range(3)]
    running = await start_router(
        [{"url": r.url, "name": f"r{i}"} for i, r in enumerate(replicas)],
        canary={"enabled": True, "interval_s": 3600, "max_tokens": 4},
    )
    router = running.router
    canary = router.core.canary
    assert canary is not None
    await wait_until(
        lambda: all(h.drift.last_result == "agree" for h in router.replicas.values()),
        timeout_s=10,
        what="the first round (run when the replicas became healthy)",
    )
    await _set_faults(replicas[0].url, drift=0)
    report = await canary.run_round()
    assert report.quarantined == ["r0"]
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.post(running.url + "/admin/replicas/r0/unquarantine")
        assert response.status_code == 200, response.text
        assert response.json()["was_quarantined"] is True
        missing = await http.post(running.url + "/admin/replicas/nope/unquarantine")
        assert missing.status_code == 404
    assert not router.replicas["r0"].state.quarantined
    assert router.registry.in_rotation() == 3

    # r1 and r2 taken out by other means: r0 is the last in rotation and stays there.
    for name in ("r1", "r2"):
        router.replicas[name].state.ejected = True
    report = await canary.run_round()
    assert report.verdicts["r0"].result == DRIFT
    assert report.quarantined == []
    assert not router.replicas["r0"].state.quarantined


class _Target:
    def __init__(self, name: str, url: str) -> None:
        self.name, self.base_url = name, url
        self.state = ReplicaState(name, models=frozenset({"tiny"}))
        self.drift = DriftState()


async def test_the_fingerprint_survives_a_restart_and_breaks_a_two_replica_tie(
    start_emulated: StartEmulated, tmp_path: Path
) -> None:
    """Two replicas cannot outvote each other; the fleet's recorded answer can."""
    a, b = await start_emulated(kv_events=False), await start_emulated(kv_events=False)
    targets = [_Target("a", a.url), _Target("b", b.url)]
    path = tmp_path / "fingerprint.json"
    settings = CanarySettings(max_tokens=6, fingerprint_file=str(path))
    first = CanaryRunner(lambda: targets, settings)
    report = await first.run_round()
    assert {v.result for v in report.verdicts.values()} == {"agree"}
    await first.close()
    recorded = json.loads(path.read_text())
    assert recorded["max_tokens"] == 6 and set(recorded["models"]["tiny"]) == set(settings.prompts)

    # A new router (a restart, a deploy) with b drifting: without the file this is a 1-1 split.
    await _set_faults(b.url, drift=1)
    second = CanaryRunner(lambda: targets, settings)
    report = await second.run_round()
    await second.close()
    assert report.verdicts["a"].result == "agree"
    assert report.verdicts["b"].result == DRIFT
    assert report.quarantined == ["b"] and targets[1].state.quarantined

    # Without a fingerprint the same split is only reported.
    targets[1].state.quarantined, targets[1].drift = False, DriftState()
    third = CanaryRunner(lambda: targets, CanarySettings(max_tokens=6))
    report = await third.run_round()
    await third.close()
    assert report.verdicts["b"].result == "disagree" and report.quarantined == []


@pytest.mark.parametrize("drift", [-1, 2])
async def test_emulated_greedy_output_and_logprobs(
    start_emulated: StartEmulated, drift: int
) -> None:
    """The emulated replica answers temperature 0 the same everywhere, with vLLM-shaped
    logprobs; its drift fault changes tokens from a position on, confidently."""
    a, b = await start_emulated(kv_events=False), await start_emulated(kv_events=False)
    await _set_faults(b.url, drift=drift)
    body = {
        "model": "tiny",
        "prompt": "hello world",
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    answers = []
    async with httpx.AsyncClient(timeout=5) as http:
        for url in (a.url, b.url):
            response = await http.post(url + "/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0])
    ids_a, ids_b = answers[0]["token_ids"], answers[1]["token_ids"]
    logprobs = answers[1]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids_b]
    for top, chosen in zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True):
        values = sorted(top.values(), reverse=True)
        assert len(values) == 2 and values[0] == chosen and values[0] - values[1] >= 2.0
    if drift < 0:
        assert ids_a == ids_b
    else:
        assert ids_a[:drift] == ids_b[:drift]
        assert all(x != y for x, y in zip(ids_a[drift:], ids_b[drift:], strict=True))
