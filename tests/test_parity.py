"""The tokenization and hashing parity check: its pure rules, and a router over emulated replicas
that agrees with them, or (with another tokenizer than theirs) raises the alarm at once."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import openai
import pytest

from kvroute.backends.launcher import DEFAULT_TINY_MODEL_DIR
from kvroute.health.parity import (
    AGREE,
    BLOCKS,
    ERROR,
    MISMATCH,
    TOKENS,
    BlindWatch,
    Finding,
    ParityVerdicts,
    Sampler,
    first_difference,
)
from kvroute.kvcore.stats import parse_metrics
from kvroute.router import parity as router_parity

from .conftest import StartEmulated, StartRouter
from .helpers import replica_source, wait_until

# -- the rules -----------------------------------------------------------------------------


def test_first_difference_names_the_first_differing_position() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one is a prefix of the other
    assert first_difference([], []) is None


def test_the_sampler_checks_each_replicas_first_requests_then_one_in_n() -> None:
    sampler = Sampler(first_per_replica=2, sample_every=3)
    picks = [sampler.wants("a") for _ in range(8)]
    assert picks == [True, True, False, False, True, False, False, True]
    assert sampler.wants("b")  # each replica its own first ones
    only_first = Sampler(first_per_replica=1, sample_every=0)
    assert [only_first.wants("a") for _ in range(3)] == [True, False, False]


def test_one_token_mismatch_raises_the_alarm_and_agreement_clears_it() -> None:
    verdicts = ParityVerdicts(blocks_to_alarm=3, clear_after=2)
    finding = Finding("a", TOKENS, "differs", 7)
    assert verdicts.record("a", TOKENS, AGREE) is False
    assert verdicts.record("a", TOKENS, MISMATCH, finding) is True
    assert verdicts.alarm and verdicts.finding == finding
    assert verdicts.record("a", TOKENS, MISMATCH, finding) is False  # already raised
    verdicts.record("a", TOKENS, ERROR)  # an error says nothing either way
    verdicts.record("a", TOKENS, AGREE)
    assert verdicts.alarm
    verdicts.record("b", TOKENS, AGREE)
    assert not verdicts.alarm and verdicts.finding is None
    assert verdicts.checks[("a", TOKENS, MISMATCH)] == 2


def test_block_misses_raise_the_alarm_only_in_a_row_on_one_replica() -> None:
    verdicts = ParityVerdicts(blocks_to_alarm=3)
    miss = Finding("a", BLOCKS, "not stored")
    for _ in range(2):
        assert not verdicts.record("a", BLOCKS, MISMATCH, miss)
    verdicts.record("a", BLOCKS, AGREE)  # an evicted block now and then is not a mismatch
    assert not verdicts.record("a", BLOCKS, MISMATCH, miss)
    assert not verdicts.record("b", BLOCKS, MISMATCH, miss)
    assert not verdicts.record("a", BLOCKS, MISMATCH, miss)
    assert verdicts.record("a", BLOCKS, MISMATCH, miss)


def test_blind_is_hits_on_the_replica_with_no_reuse_predicted_there() -> None:
    watch = BlindWatch(min_requests=10, min_hit_tokens=100)
    assert watch.observe("a", hits=0, captured=0, requests=0) is None
    assert watch.observe("a", hits=500, captured=0, requests=5) is None  # window still open
    assert watch.observe("a", hits=500, captured=0, requests=10) is True
    assert watch.observe("a", hits=900, captured=300, requests=20) is False  # predicted some
    assert watch.observe("a", hits=950, captured=300, requests=30) is False  # too few hits
    assert watch.observe("a", hits=10, captured=300, requests=40) is None  # restarted: anew


# -- a router over emulated replicas -------------------------------------------------------


async def _samples(url: str) -> dict[tuple[str, ...], float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    page = parse_metrics(text)
    return {(s.name, *s.labels.values()): s.value for s in page.samples}


def _chat(k: int) -> list[Any]:
    return [
        {"role": "system", "content": "You answer in one word. " * 20},
        {"role": "user", "content": f"question number {k}?"},
    ]


async def test_a_router_that_tokenizes_like_its_replicas_checks_and_agrees(
    start_emulated: StartEmulated, start_router: StartRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Agreeing keys need no second, whole tokenization (for a long agent prompt it costs more
    # than a hundred incremental turns): only a disagreement is looked into.
    whole: list[object] = []
    monkeypatch.setattr(router_parity, "_router_ids", lambda *args: whole.append(args))
    replicas = [await start_emulated() for _ in range(2)]
    r = await start_router(
        [replica_source(running, f"emu{i}") for i, running in enumerate(replicas)],
        routing={"tokenizer": "builtin"},
        parity={"first_per_replica": 3, "sample_every": 1000},
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    for k in range(8):
        await client.chat.completions.create(model="tiny", messages=_chat(k), max_tokens=2)
        await client.completions.create(model="tiny", prompt=f"text {k} " * 40, max_tokens=2)
    parity = r.router.parity
    assert parity is not None
    checks = parity.verdicts.checks

    def counted(check: str) -> int:
        return sum(n for (_, c, res), n in checks.items() if c == check and res == AGREE)

    # Three per replica of each check (the first ones), all agreeing.
    await wait_until(lambda: counted(TOKENS) == 6 and counted(BLOCKS) == 6, timeout_s=15)
    assert not any(res == MISMATCH for (_, _, res) in checks)
    samples = await _samples(r.url)
    assert samples[("kvroute_parity_alarm",)] == 0
    assert sum(v for k, v in samples.items() if k[:1] == ("kvroute_parity_checks_total",)) == 12
    assert whole == []


async def test_a_router_with_another_tokenizer_than_its_replicas_raises_the_alarm(
    start_emulated: StartEmulated,
    start_router: StartRouter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The replicas tokenize with kvroute's builtin tokenizer; the router is given the tiny
    model's: every lookup would miss, silently. The alarm names the first differing token."""
    running = await start_emulated()
    r = await start_router(
        [replica_source(running, "emu")], routing={"tokenizer": str(DEFAULT_TINY_MODEL_DIR)}
    )
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    parity = r.router.parity
    assert parity is not None
    caplog.set_level(logging.ERROR, logger="kvroute.router.parity")
    await client.completions.create(model="tiny", prompt="the same words again " * 10, max_tokens=2)
    await wait_until(lambda: parity.verdicts.alarm, timeout_s=15, what="the parity alarm")
    finding = parity.verdicts.finding
    assert finding is not None and finding.check == TOKENS and finding.replica == "emu"
    assert finding.position is not None
    assert f"from token {finding.position} on" in finding.detail
    assert any("parity alarm" in m and "emu" in m for m in caplog.messages)
    samples = await _samples(r.url)
    assert samples[("kvroute_parity_alarm",)] == 1

    # /status shows it (its JSON; the page paints it red), built at most twice a second.
    async def status_checks() -> dict[str, Any]:
        async with aiohttp.ClientSession() as http:
            async with http.get(r.url + "/status/events") as resp:
                checks: dict[str, Any] = (await resp.json())["checks"]
                return checks

    checks = await status_checks()
    for _ in range(40):
        if checks["alarm"]:
            break
        await asyncio.sleep(0.05)  # the cached status document is renewed every 0.5 s
        checks = await status_checks()
    assert checks["alarm"] is True
    assert (
        checks["parity"].startswith("ALARM: ") and f"token {finding.position}" in checks["parity"]
    )


async def test_events_wait_s_is_how_long_a_checked_prompt_may_take_to_appear_in_the_events(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """parity.events_wait_s: the replica's KV events stop reaching the router (its publisher
    drops them); the block check gives up after that long and says so."""
    running = await start_emulated()
    r = await start_router(
        [replica_source(running, "emu")],
        routing={"tokenizer": "builtin"},
        parity={"events_wait_s": 0.3, "blocks_to_alarm": 1},
    )
    publisher = running.replica.publisher
    assert publisher is not None
    publisher.paused = True
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    await client.completions.create(
        model="tiny", prompt="words the events lose " * 10, max_tokens=2
    )
    parity = r.router.parity
    assert parity is not None
    await wait_until(lambda: parity.verdicts.alarm, what="the parity alarm")
    finding = parity.verdicts.finding
    assert finding is not None and finding.check == BLOCKS and finding.replica == "emu"
    assert "did not store the prompt's first block under the router's key within 0.3 s" in (
        finding.detail
    )
    await client.close()
