"""The batch lane's pure parts, without I/O: states, the input file's checks, result lines,
spare capacity, preemption and deadline pacing."""

from __future__ import annotations

import json

import pytest

from kvroute.kvcore.batch_pacing import behind, due, should_preempt, spare_slots
from kvroute.kvcore.fair_queue import FairnessParams, FairQueue, Priority, TenantLimits, Ticket
from kvroute.router.batch.model import (
    InvalidFile,
    Job,
    Result,
    Status,
    check_create,
    final_status,
    may_move,
    parse_input,
    render_files,
)
from kvroute.router.batch.store import StoreUrlError, check_store_url, store_path
from kvroute.router.config import ConfigError, config_from_dict


def line(custom_id: str = "a", **over: object) -> bytes:
    obj = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hi"},
        **over,
    }
    return json.dumps(obj).encode()


def test_the_states_move_as_openai_documents() -> None:
    assert may_move(Status.VALIDATING, Status.IN_PROGRESS)
    assert may_move(Status.IN_PROGRESS, Status.CANCELLING)
    assert may_move(Status.FINALIZING, Status.EXPIRED)
    assert not may_move(Status.COMPLETED, Status.CANCELLING)
    assert not may_move(Status.CANCELLED, Status.IN_PROGRESS)
    assert final_status(Status.CANCELLING, None) == Status.CANCELLED
    assert final_status(Status.FINALIZING, "expired") == Status.EXPIRED
    assert final_status(Status.FINALIZING, "completed") == Status.COMPLETED
    assert final_status(Status.IN_PROGRESS, None) is None


def test_a_good_file_parses_to_its_lines_with_their_numbers() -> None:
    data = line("a") + b"\n\n" + line("b", url="/v1/chat/completions") + b"\n"
    lines = parse_input(data, 10)
    assert [(x.line_no, x.custom_id, x.url) for x in lines] == [
        (1, "a", "/v1/completions"),
        (3, "b", "/v1/chat/completions"),
    ]
    assert json.loads(lines[0].body) == {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b"[1]", "line 1: must be a JSON object"),
        (line("a") + b"\n" + line("a"), "line 2: custom_id 'a' is used twice"),
        (line(""), "line 1: custom_id must be a string"),
        (line("a", method="GET"), 'line 1: method must be "POST"'),
        (line("a", url="/v1/embeddings"), "line 1: url must be one of"),
        (line("a", body="text"), "line 1: body must be a JSON object"),
        (line("a", body={"model": "m", "stream": True}), "line 1: body.stream must not be true"),
        (line("a", extra=1), "line 1: unknown field(s) extra"),
        (line("a", body={"prompt": "hi"}), "line 1: body.model: required"),
        (line("a", body={"model": 7, "prompt": "hi"}), "line 1: body.model: required"),
        (b"\n\n", "no request lines"),
        (line("a") + b"\n" + line("b") + b"\n" + line("c"), "more than batch.max_lines (2)"),
    ],
)
def test_a_bad_file_is_refused_naming_the_line_and_why(data: bytes, why: str) -> None:
    with pytest.raises(InvalidFile, match=None) as info:
        parse_input(data, 2)
    assert why in str(info.value)


def test_a_line_naming_a_model_the_router_does_not_serve_is_refused_naming_both() -> None:
    data = line("a") + b"\n" + line("b", body={"model": "gpt-4o", "prompt": "hi"})
    with pytest.raises(InvalidFile) as info:
        parse_input(data, 10, served=frozenset({"m", "m-lora"}))
    assert str(info.value) == (
        "line 2: body.model: 'gpt-4o' is not a model this router serves (it serves: m, m-lora)"
    )
    assert len(parse_input(line("a"), 10, served=frozenset({"m"}))) == 1
    # A catalog not known yet (no replica probed) refuses nothing, as online requests.
    assert len(parse_input(data, 10, served=frozenset())) == 2


def test_a_batch_request_is_checked_param_by_param() -> None:
    good = {"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h"}
    assert check_create(good) is None
    assert (check_create({**good, "completion_window": "1h"}) or "").startswith(
        "completion_window:"
    )
    assert (check_create({**good, "endpoint": "/v1/embeddings"}) or "").startswith("endpoint:")
    assert (check_create({**good, "input_file_id": ""}) or "").startswith("input_file_id:")
    assert (check_create({**good, "metadata": {"k": 1}}) or "").startswith("metadata:")
    assert check_create([]) is not None


def test_the_batch_object_has_openais_fields() -> None:
    job = Job("batch_1", "/v1/completions", "file-1", 100.5, 200.0, "t", Status.IN_PROGRESS)
    job.times = {"in_progress_at": 101.2}
    job.total, job.completed, job.failed = 3, 1, 1
    obj = job.to_openai()
    assert obj["object"] == "batch" and obj["completion_window"] == "24h"
    assert (obj["created_at"], obj["in_progress_at"], obj["completed_at"]) == (100, 101, None)
    assert obj["request_counts"] == {"total": 3, "completed": 1, "failed": 1}


def test_results_go_to_the_output_or_the_error_file_in_input_order() -> None:
    outcomes: list[tuple[int, str, Result | None]] = [
        (1, "ok", Result(200, b'{"x":1}', "r1")),
        (2, "bad", Result(400, b'{"error":{"message":"no"}}', "r2", "http_400", "no")),
        (3, "never", None),
    ]
    output, errors = render_files("batch_1", Status.EXPIRED, outcomes)
    assert output is not None and errors is not None
    (ok,) = [json.loads(x) for x in output.splitlines()]
    assert ok["custom_id"] == "ok" and ok["response"] == {
        "status_code": 200,
        "request_id": "r1",
        "body": {"x": 1},
    }
    bad, never = [json.loads(x) for x in errors.splitlines()]
    assert bad["response"]["status_code"] == 400 and bad["error"]["code"] == "http_400"
    assert never["response"] is None and never["error"]["code"] == "batch_expired"
    assert render_files("b", Status.COMPLETED, outcomes[:1])[1] is None


def test_spare_capacity_is_what_replicas_have_below_the_threshold() -> None:
    assert spare_slots([0, 1, 4], 4, False, 0, None) == 4 + 3 + 0
    assert spare_slots([0, 0], 4, True, 0, None) == 0  # an online request waits: none
    assert spare_slots([0, 0], 4, False, 6, None) == 2  # started lines not dispatched yet
    assert spare_slots([0, 0], 4, False, 0, 3) == 3  # admission's own limit
    assert spare_slots([], 4, False, 0, None) == 0


def test_preemption_needs_an_online_request_waiting_past_the_bound() -> None:
    assert should_preempt(0.6, 0.5, 1)
    assert not should_preempt(0.4, 0.5, 1)
    assert not should_preempt(None, 0.5, 1)
    assert not should_preempt(2.0, 0.5, 0)


def test_pacing_promotes_what_a_job_lacks_of_a_straight_line_to_its_target() -> None:
    # 100 lines, window 0..100, paced to end by 80: at 40, half is due.
    assert due(100, 0, 100, 40, 0.8) == 50
    assert due(100, 0, 100, 0, 0.8) == 0
    assert due(100, 0, 100, 90, 0.8) == 100
    assert behind(100, 30, 5, 0, 100, 40, 0.8) == 15
    assert behind(100, 60, 0, 0, 100, 40, 0.8) == 0  # ahead: nothing promoted


def test_store_urls() -> None:
    assert str(store_path("sqlite:///rel/b.db")) == "rel/b.db"
    assert str(store_path("sqlite:////abs/b.db")) == "/abs/b.db"
    check_store_url("postgresql://u@h:5432/db")
    for bad in ("mysql://x", "sqlite://host/x", "sqlite:///", "b.db"):
        with pytest.raises(StoreUrlError):
            check_store_url(bad)


def test_batch_config_problems_name_their_key() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {"batch": {"store": "mysql://x", "pace_fraction": 2, "poll_s": 0, "max_lines": 0}}
        )
    problems = info.value.problems
    assert any(p.startswith("batch.store: must be sqlite:///PATH") for p in problems), problems
    assert "batch.pace_fraction: must be in (0, 1], got 2.0" in problems
    assert "batch.poll_s: must be a finite number > 0, got 0.0" in problems
    assert "batch.max_lines: must be >= 1, got 0" in problems
    assert config_from_dict({}).batch is None  # off unless configured
    assert config_from_dict({"batch": {}}).batch is not None


def test_the_fair_queue_says_when_its_longest_waiting_online_request_arrived() -> None:
    queue = FairQueue(FairnessParams(), lambda name: TenantLimits(), capacity=10)
    assert queue.oldest_arrival(Priority.SHEDDABLE) is None
    queue.offer(Ticket("batch", Priority.SHEDDABLE, 1, arrived=1.0))
    assert queue.oldest_arrival(Priority.SHEDDABLE) is None  # batch-class work does not count
    queue.offer(Ticket("b", Priority.STANDARD, 1, arrived=5.0))
    queue.offer(Ticket("a", Priority.CRITICAL, 1, arrived=3.0))
    assert queue.oldest_arrival(Priority.SHEDDABLE) == 3.0
