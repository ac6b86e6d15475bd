"""``kvroute replay --live --closed-loop --api messages``: agent sessions replayed live, each
turn after its previous answer, sessions named as Claude Code names them; and ``kvroute bench
programs``' argument checks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest
from aiohttp import web

from kvroute.cli import main
from kvroute.kvcore.agent_identity import CLAUDE_CODE, detect
from kvroute.kvcore.stats import parse_metrics
from kvroute.simulator.traces import Trace, TraceRequest
from kvroute.simulator.traces.live import claude_code_user_id, replay_live_async
from kvroute.simulator.traces.prompts import PromptBuilder

from .conftest import StartRouter
from .fake_replica import FakeReplica

GAP_S = 0.2  # the trace's tool-call gap
TIME_SCALE = 0.25


@dataclass
class TimedReplica(FakeReplica):
    """A fake replica that notes when each Messages request came and when its answer ended."""

    came: dict[str, float] = field(default_factory=dict)  # prompt -> monotonic time
    ended: dict[str, float] = field(default_factory=dict)
    user_ids: list[str] = field(default_factory=list)

    async def _agent(
        self, request: web.Request, body: dict[str, Any], api: str, prompt: str
    ) -> web.StreamResponse:
        self.came[prompt] = time.monotonic()
        self.user_ids.append(body["metadata"]["user_id"])
        try:
            return await super()._agent(request, body, api, prompt)
        finally:
            self.ended[prompt] = time.monotonic()


def agent_trace() -> Trace:
    """Two programs, one with a sub-agent; every request recorded at 0 s, so only the closed
    loop spaces a session's turns."""

    def turn(session: str, block: int, gap: float | None) -> TraceRequest:
        return TraceRequest(0.0, 48, 3, (block, block + 1, block + 2), session, gap)

    requests = (
        turn("conv_a", 10, None),
        turn("conv_a/agent_1", 20, None),
        turn("conv_b", 30, None),
        turn("conv_a", 40, GAP_S),
        turn("conv_a/agent_1", 50, GAP_S),
        turn("conv_b", 60, GAP_S),
        turn("conv_a", 70, GAP_S),
    )
    return Trace("agents", 16, requests)


async def test_closed_loop_sends_each_turn_a_gap_after_the_previous_answer(
    start_router: StartRouter,
) -> None:
    replica = TimedReplica(name="r")
    await replica.start()
    try:
        router = await start_router([replica])
        trace = agent_trace()
        summary = await replay_live_async(
            trace,
            router.url,
            model="tiny",
            time_scale=TIME_SCALE,
            api="messages",
            closed_loop=True,
            echo=None,
        )
        metrics = await _metrics(router.url)
    finally:
        await replica.stop()
    assert (summary["sent"], summary["ok"]) == (7, 7)
    # Each request's prompt, as the replay built it, says which request the replica got.
    builder = PromptBuilder(16, 16)
    prompts = [builder.prompt(r, salt=i) for i, r in enumerate(trace.requests)]
    assert set(replica.came) == set(prompts)
    chains: dict[str, list[int]] = {}
    for index, request in enumerate(trace.requests):
        chains.setdefault(str(request.session_id), []).append(index)
    for indices in chains.values():
        for before, after in pairwise(indices):
            # The next turn came the (time-scaled) gap after the replica ended the last answer.
            waited = replica.came[prompts[after]] - replica.ended[prompts[before]]
            assert waited >= GAP_S * TIME_SCALE
    # The chains' first requests went out together (recorded at 0 s), not one after another.
    firsts = [replica.came[prompts[indices[0]]] for indices in chains.values()]
    assert max(firsts) - min(firsts) < GAP_S * TIME_SCALE
    # Sessions as Claude Code sends them: a sub-agent names its parent's session.
    assert set(replica.user_ids) == {claude_code_user_id("conv_a"), claude_code_user_id("conv_b")}
    a, b = (detect({}, {"metadata": {"user_id": claude_code_user_id(p)}}) for p in "ab")
    assert a.source == b.source == CLAUDE_CODE and a.session != b.session
    # The router found every request's session by Claude Code's rule.
    assert metrics.sum("kvroute_sessions_detected_total", source="claude_code") == 7
    # programs: two, the short one (conv_b: 2 requests) and the long one (conv_a and its agent).
    programs = summary["programs"]
    assert programs["programs"] == 2
    assert programs["short"]["requests"] == 2 and programs["long"]["requests"] == 5
    for label in ("short", "long"):
        assert programs[label]["ttft_p50_s"] > 0
        # conv_a runs three turns with two gaps (plus its sub-agent's): at least 2 x the gap.
        assert programs[label]["completion_mean_s"] >= GAP_S * TIME_SCALE
    assert programs["long"]["completion_mean_s"] >= 2 * GAP_S * TIME_SCALE


async def _metrics(url: str) -> Any:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        return parse_metrics(await response.text())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--saturated-slots", "0"], "must be at least 1"),
        (["--saturated-slots", "8", "--unsaturated-slots", "4"], "--unsaturated-slots"),
        (["--time-scale", "0"], "must be more than 0"),
    ],
)
def test_bench_programs_refuses_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: object
    try:
        code = main(["bench", "programs", "--no-record", *args])
    except SystemExit as exited:  # argparse's own refusals
        code = exited.code
    assert code == 2
    assert message in capsys.readouterr().err


async def test_requests_spread_over_several_routers_in_turn(start_router: StartRouter) -> None:
    """``also``: request i goes to router i % N (as ``kvroute bench routers`` spreads them)."""
    replica = FakeReplica(name="r")
    await replica.start()
    try:
        routers = [await start_router([replica]) for _ in range(3)]
        summary = await replay_live_async(
            agent_trace(),
            routers[0].url,
            model="tiny",
            time_scale=TIME_SCALE,
            api="messages",
            closed_loop=True,
            echo=None,
            also=[r.url for r in routers[1:]],
        )
        served = [(await _metrics(r.url)).sum("kvroute_requests_total") for r in routers]
    finally:
        await replica.stop()
    assert summary["ok"] == 7
    assert served == [3, 2, 2]  # requests 0, 3, 6; 1, 4; 2, 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routers", "0,2"], "at least 1"),
        (["--routers", "two"], "expected numbers"),
        (["--share", "gossip"], "--share takes none, bus"),
        (["--trace", "no/such/trace.tar.xz"], "no trace at"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--max-prompt-tokens", "8"], "--max-prompt-tokens 16"),
        (["--preset", "no-such-gpu"], "--preset: "),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_bench_routers_refuses_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: object
    try:
        code = main(["bench", "routers", "--no-record", *args])
    except SystemExit as exited:
        code = exited.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_bench_routers_judges_each_set_up_by_its_median_ratio_to_the_same_rounds_one_router() -> (
    None
):
    from kvroute.bench import routers as bench

    def summary(hit: float, p50: float, p99: float) -> dict[str, object]:
        return {
            "trace": "t",
            "requests": 10,
            "trace_block_tokens": 16,
            "prefix_hit_rate": hit,
            "ttft_p50_s": p50,
            "ttft_p99_s": p99,
            "ok": 10,
            "failed": 0,
        }

    one, four = bench.Run(1, "none"), bench.Run(4, "bus")
    measured = [
        # Round 2's box is twice as slow for both: the ratio, not the p99, is what counts.
        bench.Measured(one, summary(0.8, 0.1, 0.2), 0),
        bench.Measured(four, summary(0.8, 0.1, 0.22), 0),
        bench.Measured(one, summary(0.8, 0.2, 0.4), 1),
        bench.Measured(four, summary(0.76, 0.2, 0.4), 1),
        bench.Measured(one, summary(0.8, 0.1, 0.2), 2),
        bench.Measured(four, summary(0.8, 0.1, 0.3), 2),
    ]
    text = bench.report(measured, bench.Options(rounds=3), "kvroute bench routers --rounds 3")
    assert "| 2 | 4 | bus | 76.0% | 0.95x | 0.200 | 0.400 | 1.00x |" in text
    assert "| 4 | bus | 1.00x | 1.00x | 1.10x |" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routers", "1"], "--routers must be at least 2"),
        (["--output-per-minute", "0"], "--output-per-minute must be at least 1"),
        (["--duration", "0"], "must be more than 0"),
    ],
)
def test_bench_budgets_refuses_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: object
    try:
        code = main(["bench", "budgets", "--no-record", *args])
    except SystemExit as exited:
        code = exited.code
    assert code == 2
    assert message in capsys.readouterr().err
