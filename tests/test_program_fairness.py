"""Program-aware fairness (``fairness.by: program``): under saturation the agent program that has
received the least goes first, a running program's cached turn is cheap, no wait is unbounded;
the same queue in front of the simulated fleet (``kvroute replay --max-in-flight``), and agents
that wait for their answers (``--closed-loop``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from kvroute.cli import main
from kvroute.kvcore.fair_queue import FairnessParams, FairQueue, Priority, TenantLimits, Ticket
from kvroute.router.config import ConfigError, config_from_dict
from kvroute.router.tenants import fairness_params
from kvroute.simulator.cli_replay import _admission
from kvroute.simulator.fleet.admission import AdmissionSpec, SimAdmission, program_of
from kvroute.simulator.fleet.fleet import next_turns
from kvroute.simulator.fleet.program_starts import ProgramStarts
from kvroute.simulator.fleet.programs import program_summary
from kvroute.simulator.fleet.results import SimResult
from kvroute.simulator.fleet.units import prepare
from kvroute.simulator.traces import load_trace

from .conftest import StartReplica, StartRouter
from .helpers import wait_until

DATA = Path(__file__).parent / "data"
CLAUDE_CODE = str(DATA / "claude_code_sessions_10.tar.xz")


def _queue(**params: Any) -> FairQueue:
    return FairQueue(FairnessParams(**params), lambda name: TenantLimits(), capacity=100)


def _served(queue: FairQueue, program: str, tokens: int) -> None:
    """``program`` was served a request of ``tokens`` prompt tokens (and no output)."""
    ticket = Ticket("default", Priority.STANDARD, tokens, program=program)
    queue.started(ticket)
    queue.finished(ticket, tokens, 0)


def _queued(queue: FairQueue, program: str, tokens: int, at: float) -> Ticket:
    ticket = Ticket("default", Priority.STANDARD, tokens, at, program=program)
    queue.offer(ticket)
    return ticket


def test_a_new_program_goes_before_a_long_one_that_came_first() -> None:
    queue = _queue(by="program")
    _served(queue, "long", 2_000_000)
    long_turn = _queued(queue, "long", 50_000, at=0.0)
    new = _queued(queue, "short", 50_000, at=1.0)
    assert queue.pick(now=2.0) is new
    assert queue.pick(now=2.0) is long_turn
    # By tenant (the default) the same arrivals keep their order.
    fifo = _queue()
    _served(fifo, "long", 2_000_000)
    first = _queued(fifo, "long", 50_000, at=0.0)
    _queued(fifo, "short", 50_000, at=1.0)
    assert fifo.pick(now=2.0) is first


def test_a_running_programs_cached_turn_is_not_made_to_wait_behind_a_cold_prompt() -> None:
    """The order is attained x program_attained_weight + the request's uncached tokens: a
    program 400k tokens in (20k at the default weight) whose next turn is cached but 1k tokens
    goes before a new program's 90k-token cold prompt; a much longer one does not."""
    queue = _queue(by="program")
    _served(queue, "running", 400_000)
    _served(queue, "marathon", 4_000_000)
    cold = _queued(queue, "new", 90_000, at=0.0)
    warm = _queued(queue, "running", 101_000, at=1.0)
    marathon = _queued(queue, "marathon", 201_000, at=2.0)
    uncached = {id(cold): 90_000, id(warm): 1_000, id(marathon): 1_000}

    def cost(ticket: Ticket) -> int:
        return uncached[id(ticket)]

    assert queue.pick(now=3.0, cost=cost) is warm  # 20k + 1k
    assert queue.pick(now=3.0, cost=cost) is cold  # 0 + 90k
    assert queue.pick(now=3.0, cost=cost) is marathon  # 200k + 1k
    # Without a cost (no prefix index), the whole prompt is the request's own cost.
    plain = _queue(by="program")
    _served(plain, "running", 400_000)
    first = _queued(plain, "new", 90_000, at=0.0)
    _queued(plain, "running", 101_000, at=1.0)
    assert plain.pick(now=2.0) is first


def test_no_request_waits_past_program_max_wait_s() -> None:
    queue = _queue(by="program", program_max_wait_s=30.0)
    _served(queue, "long", 5_000_000)
    starving = _queued(queue, "long", 10_000, at=0.0)
    for i in range(3):
        _queued(queue, f"new-{i}", 10_000, at=10.0 + i)
    assert queue.pick(now=29.0) is not starving  # new programs first while it may wait
    assert queue.pick(now=30.0) is starving  # then its wait is up: it goes first


def test_program_wait_share_mixes_a_long_wait_into_the_order_as_llm_d_does() -> None:
    """program_wait_share: service and wait, each normalised over the queue, weighed (1 - share)
    and share. A new program goes first by service alone; at llm-d's 0.2 one that received a
    little but has waited long (neither the least served nor the oldest); at 1 the oldest."""

    def first_picked(share: float) -> str:
        queue = _queue(by="program", program_attained_weight=1.0, program_wait_share=share)
        _served(queue, "little", 40_000)
        _served(queue, "much", 990_000)
        _queued(queue, "much", 10_000, at=0.0)  # 1M of service, waited 100 s: the oldest
        _queued(queue, "little", 10_000, at=40.0)  # 50k, waited 60 s
        _queued(queue, "new", 10_000, at=100.0)  # 10k (its own prompt alone), waited 0 s
        picked = queue.pick(now=100.0)
        assert picked is not None
        return picked.program

    assert first_picked(0.0) == "new"
    assert first_picked(0.2) == "little"  # 0.8 x (1 - 0.04) + 0.2 x 0.6 against 0.8 for new
    assert first_picked(1.0) == "much"
    queue = _queue(by="program", program_wait_share=0.2)
    only = _queued(queue, "alone", 10_000, at=0.0)
    assert queue.pick(now=1.0) is only


def test_the_routers_config_reaches_its_fair_queue() -> None:
    config = config_from_dict(
        {"fairness": {"by": "program", "program_wait_share": 0.2, "program_max_wait_s": 60}}
    )
    params = fairness_params(config)
    assert (params.by, params.program_wait_share, params.program_max_wait_s) == (
        "program",
        0.2,
        60,
    )


def test_what_programs_received_is_remembered_for_max_programs_of_them() -> None:
    queue = _queue(by="program", max_programs=3)
    for i in range(5):
        _served(queue, f"p{i}", 1000 * (i + 1))
    assert len(queue.programs) == 3
    assert queue.attained("p0") == 0.0  # the least recently served forgotten: new again
    assert queue.attained("p4") == 5000.0
    # By tenant, nothing is kept per program.
    plain = _queue()
    _served(plain, "p", 1000)
    assert plain.programs == {}


@pytest.mark.parametrize(
    ("fairness", "problem"),
    [
        ({"by": "session"}, "fairness.by: must be one of tenant, program, got 'session'"),
        ({"program_max_wait_s": 0}, "fairness.program_max_wait_s: must be a number of seconds"),
        ({"program_attained_weight": -1}, "fairness.program_attained_weight: must be a finite"),
        ({"max_programs": 0}, "fairness.max_programs: must be >= 1, got 0"),
        ({"program_wait_share": 1.5}, "fairness.program_wait_share: must be a number from 0 to 1"),
    ],
)
def test_bad_program_fairness_settings_name_the_key(fairness: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"fairness": fairness})
    assert any(problem in line for line in info.value.problems), info.value.problems


async def test_a_saturated_router_serves_a_short_program_before_a_long_programs_backlog(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """One slot, held. A long agent program (Claude Code's session in metadata.user_id) has
    been served and queues four more turns; a short program's first request arrives after
    them and is served first. Below saturation (a free slot) nothing waits at all."""
    a = await start_replica("a")
    r = await start_router(
        [a],
        limits={"max_concurrent_requests": 1, "max_queued_requests": 50},
        # Weight 1: the fake replica counts 3 prompt tokens a request, so what the long program
        # received (its usage) outweighs any difference between the queued prompts' sizes.
        fairness={"by": "program", "reserved_slots": 0, "program_attained_weight": 1.0},
    )
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="x", max_retries=0, timeout=20)

    def turn(session: str, text: str) -> asyncio.Task[Any]:
        user_id = f"user_{'7' * 64}_account__session_{session}"
        return asyncio.create_task(
            client.messages.create(
                model="tiny",
                max_tokens=3,
                messages=[{"role": "user", "content": text}],
                metadata={"user_id": user_id},
            )
        )

    long_session, short_session = "5" * 8 + "-long", "6" * 8 + "-short"
    try:
        for i in range(3):  # the long program's history: served at once, nothing queued
            await turn(long_session, f"earlier {i}")
        assert r.router.admission.queued == 0
        holder = turn(long_session, "hold")
        await wait_until(lambda: a.running == 1, what="the slot held")
        backlog = [turn(long_session, f"next {i}") for i in range(4)]
        await wait_until(lambda: r.router.admission.queued == 4, what="the long turns queued")
        short = turn(short_session, "first")
        await wait_until(lambda: r.router.admission.queued == 5, what="the short turn queued")
        async with aiohttp.ClientSession() as http, http.get(r.url + "/status/events") as resp:
            agents = (await resp.json())["agents"]
        assert agents["sessions_by_source"] == {"claude_code": 9}  # 3 + the holder + 5 queued
        assert agents["fairness_by"] == "program" and agents["programs_waiting"] == 2
        assert [w["program"] for w in agents["waiting"]] == [long_session, short_session]
        assert agents["waiting"][0]["queued"] == 4 and agents["waiting"][1]["received_tokens"] == 0
        assert agents["waiting"][0]["received_tokens"] > 0
        a.gate.set()
        await asyncio.gather(holder, short, *backlog)
    finally:
        await client.close()
    order = [_text_of(seen.body) for seen in a.seen[4:]]
    assert order[0] == "first", order
    assert sorted(order[1:]) == [f"next {i}" for i in range(4)]


def _text_of(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    return content if isinstance(content, str) else content[0]["text"]


def test_program_of_puts_a_sub_agent_in_its_parents_program() -> None:
    assert program_of("conv-7/agent-2", 3) == "conv-7"
    assert program_of("conv-7", 3) == "conv-7"
    assert program_of(None, 3) == "#3"


def test_sim_admission_keeps_at_most_max_in_flight_and_hands_slots_on() -> None:
    admission = SimAdmission(AdmissionSpec(max_in_flight=2, fairness="program"))
    assert admission.arrive(0, "long", 100_000, 0.0)
    assert admission.arrive(1, "long", 100_000, 0.0)
    assert not admission.arrive(2, "long", 100_000, 1.0)
    assert not admission.arrive(3, "short", 1_000, 2.0)
    assert admission.active == 2
    # The long program has received 200k: the short one's request takes the freed slot.
    assert admission.finished(0, 100_000, 10, 5.0) == [3]
    assert admission.finished(1, 100_000, 10, 6.0) == [2]
    assert admission.waited_s == {0: 0.0, 1: 0.0, 3: 3.0, 2: 5.0}
    fcfs = SimAdmission(AdmissionSpec(max_in_flight=1))
    assert fcfs.arrive(0, "a", 10, 0.0)
    assert not fcfs.arrive(1, "long", 10, 1.0)
    assert not fcfs.arrive(2, "short", 10, 2.0)
    assert fcfs.finished(0, 10, 1, 3.0) == [1]


def test_a_closed_loop_sends_each_turn_its_recorded_gap_after_the_previous_answer() -> None:
    trace = prepare(load_trace(CLAUDE_CODE, max_requests=300))
    following = next_turns(trace.requests)
    assert following, "the sessions' later turns follow their previous ones"
    for before, after in following.items():
        first, second = trace.requests[before], trace.requests[after]
        assert first.session_id == second.session_id
        assert second.gap_s is not None and second.gap_s >= 0
        assert first.arrival_s <= second.arrival_s
    # A session's first request follows nothing: it keeps its recorded time.
    firsts = {r.session_id: r.index for r in reversed(trace.requests)}
    assert not set(firsts.values()) & set(following.values())


def test_program_summary_splits_short_and_long_programs_at_the_median_size() -> None:
    nan = math.nan
    result = SimResult(
        policy="p",
        replicas=1,
        kv_capacity_tokens=1,
        arrival_s=[0.0, 1.0, 2.0, 3.0],
        input_tokens=[10, 10, 1000, 1000],
        output_tokens=[0, 0, 0, 0],
        first_token_s=[1.0, 3.0, 12.0, nan],
        finish_s=[2.0, 4.0, 13.0, nan],
        replica=[0, 0, 0, -1],
        queried_tokens=[0] * 4,
        hit_tokens=[0] * 4,
        reroutes=[0] * 4,
        rejected=[False] * 4,
        routed_requests=[3],
        routed_tokens=[0],
        failed_replicas=[],
        programs=["a", "a", "b", "b"],
        queue_wait_s=[0.0, 1.0, 9.0, nan],
        fairness="program",
        max_in_flight=1,
    )
    summary = program_summary(result)
    assert summary is not None
    assert summary["short_max_tokens"] == 20
    assert summary["short"]["programs"] == 1 and summary["long"]["programs"] == 1
    assert summary["short"]["ttft_mean_s"] == 1.5  # (1 + 2) / 2
    assert summary["short"]["completion_mean_s"] == 4.0
    assert summary["long"]["completion_mean_s"] is None  # one request never finished
    assert summary["long"]["queue_wait_max_s"] == 9.0


def test_replay_with_an_admission_limit_reports_programs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["replay", "--trace", CLAUDE_CODE, "--replicas", "1", "--closed-loop"]
    args += ["--max-in-flight", "2", "--fairness", "program", "--out", str(out)]
    assert main([*args, "--no-plots", "--quiet"]) == 0
    assert "programs (kv_aware, fairness program, max in flight 2): 10" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    programs = summary["programs"]
    assert programs["fairness"] == "program" and programs["max_in_flight"] == 2
    assert programs["short"]["programs"] + programs["long"]["programs"] == 10
    assert programs["all"]["requests"] == summary["requests"]
    assert programs["all"]["queue_wait_max_s"] > 0  # two slots for ten agents: some waited


def test_fairness_without_an_admission_limit_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["replay", "--trace", CLAUDE_CODE, "--fairness", "program", "--out", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--fairness orders the admission queue: give --max-in-flight N too" in err


def test_program_attained_weight_reaches_the_replays_admission(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = argparse.Namespace(
        max_in_flight=2,
        fairness="program",
        program_max_wait_s=30.0,
        program_attained_weight=0.0,
        program_wait_share=0.2,
    )
    spec = _admission(namespace)
    assert spec is not None and spec.program_attained_weight == 0.0
    assert spec.program_max_wait_s == 30.0
    assert SimAdmission(spec).queue.params.program_wait_share == 0.2
    args = ["replay", "--trace", CLAUDE_CODE, "--max-in-flight", "2", "--fairness", "program"]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--program-attained-weight", "-1", "--out", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--program-attained-weight: must be a finite number >= 0, got -1" in err
    with pytest.raises(SystemExit) as exited:
        main([*args, "--program-wait-share", "1.5", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "--program-wait-share: must be a number from 0 to 1, got 1.5" in capsys.readouterr().err


def test_programs_in_flight_start_each_program_when_one_ends() -> None:
    # Programs a (requests 0, 2), b (1: a session's first, 3: its sub-agent's first) and c (4);
    # request 2 follows 0 in the closed loop (held), the rest are their sessions' firsts.
    arrival_s = [10.0, 11.0, 12.0, 15.0, 20.0]
    starts = ProgramStarts(arrival_s, ["a", "b", "a", "b", "c"], held={2}, limit=2)
    assert starts.deferred == {0, 1, 3, 4}
    # a and b start together at the trace's first arrival, b's sub-agent at its recorded offset.
    assert sorted(starts.initial(10.0)) == [(10.0, 0), (10.0, 1), (14.0, 3)]
    assert starts.left(0, 30.0) == []  # a's next turn (2) is still to come
    assert starts.left(1, 31.0) == []
    assert starts.left(3, 40.0) == [(40.0, 4)]  # b is done: c takes its place at once
    assert starts.left(3, 41.0) == []  # a request leaves once
    assert starts.left(2, 50.0) == []  # a is done, nothing left to start
    assert starts.started == 3


def test_replay_with_programs_in_flight_runs_the_programs_that_many_at_a_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def makespan(*extra: str) -> float:
        out = tmp_path / "-".join(extra or ("recorded",))
        args = ["replay", "--trace", CLAUDE_CODE, "--replicas", "2", "--closed-loop", *extra]
        assert main([*args, "--out", str(out), "--no-plots", "--quiet"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["completed"] == summary["requests"]
        assert summary["programs"]["programs"] == 10
        at_a_time = summary["programs"]["programs_in_flight"]
        assert at_a_time == (int(extra[1]) if extra else None)
        if at_a_time:
            assert f"{at_a_time} programs at a time): 10" in capsys.readouterr().out
        return float(summary["makespan_s"])

    recorded = makespan()
    one = makespan("--programs-in-flight", "1")
    all_ten = makespan("--programs-in-flight", "10")
    # All ten from the first arrival: done when the longest is, sooner than at the sessions'
    # recorded starts; one at a time: each waits for the one before it to end.
    assert all_ten < recorded < one
    no_loop = ["replay", "--trace", CLAUDE_CODE, "--programs-in-flight", "3"]
    assert main([*no_loop, "--out", str(tmp_path / "x")]) == 2
    assert "programs in flight: a closed loop's (closed_loop) only" in capsys.readouterr().err


def test_replay_keeps_the_first_programs_and_caps_the_closed_loops_gaps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--programs N replays only the trace's first N programs (a drain with --programs-in-flight
    N, as llm-d runs them); --max-gap-s shortens the recorded gaps a closed loop waits."""
    trace = load_trace(CLAUDE_CODE)
    programs = [program_of(r.session_id, i) for i, r in enumerate(trace.requests)]
    first_three = list(dict.fromkeys(programs))[:3]
    pairs = zip(trace.requests, programs, strict=True)
    kept_gaps = [r.gap_s or 0.0 for r, p in pairs if p in first_three]
    assert max(kept_gaps) > 0.5  # the cap below shortens some

    def replay(*extra: str) -> dict[str, Any]:
        out = tmp_path / "-".join(extra)
        args = ["replay", "--trace", CLAUDE_CODE, "--replicas", "2", "--closed-loop", *extra]
        assert main([*args, "--out", str(out), "--no-plots", "--quiet"]) == 0
        return dict(json.loads((out / "summary.json").read_text()))

    drained = replay("--programs", "3", "--programs-in-flight", "3")
    assert drained["programs"]["programs"] == 3
    assert drained["requests"] == sum(p in first_three for p in programs)
    recorded = replay("--programs", "3", "--programs-in-flight", "3", "--max-gap-s", "1000000")
    capped = replay("--programs", "3", "--programs-in-flight", "3", "--max-gap-s", "0.5")
    assert recorded["makespan_s"] == drained["makespan_s"]  # no gap is that long
    assert capped["makespan_s"] < recorded["makespan_s"]
    open_loop = ["replay", "--trace", CLAUDE_CODE, "--max-gap-s", "5", "--out", str(tmp_path)]
    assert main(open_loop) == 2
    assert "--max-gap-s caps the gaps a closed loop waits: give --closed-loop too" in (
        capsys.readouterr().err
    )
