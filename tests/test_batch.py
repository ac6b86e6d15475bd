"""The batch lane end to end through the real ``openai`` client: upload, create, poll, download;
pagination; cancellation mid-run; expiry; preemption by online traffic."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvroute.kvcore.stats import parse_metrics

from .conftest import RunningRouter, StartReplica, StartRouter
from .helpers import wait_until


def client_for(r: RunningRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, prompt: str, model: str = "tiny") -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": prompt}]},
    }


def batch_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"store": f"sqlite:///{tmp_path / 'batches.db'}", "poll_s": 0.05, **extra}


async def wait_status(
    client: openai.AsyncOpenAI, batch_id: str, statuses: set[str], timeout_s: float = 20
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if loop.time() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s}s")
        await asyncio.sleep(0.05)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_batch_runs_every_line_once_and_reports_bad_ones_by_custom_id(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router([a, b], batch=batch_config(tmp_path))
    client = client_for(r)
    lines = [chat_line(f"req-{i}", f"prompt {i}") for i in range(30)]
    lines.append(chat_line("replica-400", "status:400"))
    uploaded = await client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch"
    )
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert (await client.files.retrieve(uploaded.id)).id == uploaded.id
    batch = await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"owner": "tests"},
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"owner": "tests"}
    assert batch.id.startswith("batch_") and batch.completion_window == "24h"
    done = await wait_status(client, batch.id, {"completed"})
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (31, 30)
    assert done.request_counts.failed == 1
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    output = await lines_of(client, done.output_file_id)
    failed = await lines_of(client, done.error_file_id)
    ids = [line["custom_id"] for line in output + failed]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"].startswith("hello")
    by_id = {f["custom_id"]: f for f in failed}
    assert by_id["replica-400"]["response"]["status_code"] == 400
    # Every good line reached a replica exactly once; the replicas shared them.
    prompts = a.completed + b.completed
    assert sorted(prompts) == sorted(f"prompt {i}" for i in range(30))
    assert a.completed and b.completed
    # The replica saw the line's own request id.
    seen = {s.headers.get("X-Request-Id") for s in a.seen + b.seen}
    assert f"{batch.id}-1" in seen
    with pytest.raises(openai.ConflictError, match="completed and can no longer be cancelled"):
        await client.batches.cancel(batch.id)


async def test_bad_files_and_bad_batches_get_a_clear_400(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router([a], batch=batch_config(tmp_path))
    client = client_for(r)
    good = chat_line("x", "hi")
    for content, expected in (
        (b'{"custom_id": "a"\n', "line 1: not valid JSON"),
        (jsonl([good, good]), "line 2: custom_id 'x' is used twice"),
        (
            jsonl([good, {**good, "custom_id": "y", "method": "GET"}]),
            'line 2: method must be "POST"',
        ),
        (jsonl([{**good, "url": "/v1/embeddings"}]), "line 1: url must be one of"),
        (jsonl([{**good, "body": [1]}]), "line 1: body must be a JSON object"),
        (b"", "the file has no request lines"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await client.files.create(file=("f.jsonl", io.BytesIO(content)), purpose="batch")
        assert expected in info.value.message, info.value.message
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        await client.files.create(file=("f.jsonl", io.BytesIO(jsonl([good]))), purpose="fine-tune")
    uploaded = await client.files.create(
        file=("f.jsonl", io.BytesIO(jsonl([good]))), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError, match="completion_window: must be '24h'"):
        await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match="every line must call the batch's endpoint"):
        await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        await client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch_nope")


def error_of(exc: openai.APIStatusError) -> str:
    """The error's message as the router sent it (the client's ``message`` adds the status)."""
    assert isinstance(exc.body, dict), exc.body
    return str(exc.body["message"])


async def wait_serving(client: openai.AsyncOpenAI, model: str, timeout_s: float = 10) -> None:
    """Until the router lists ``model`` (its catalog comes from the replicas' first probes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while model not in [m.id async for m in client.models.list()]:
        if loop.time() > deadline:
            raise AssertionError(f"the router does not list {model} after {timeout_s}s")
        await asyncio.sleep(0.05)


async def test_a_line_naming_a_model_the_router_does_not_serve_is_refused_at_upload(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    r = await start_router([await start_replica("a")], batch=batch_config(tmp_path))
    client = client_for(r)
    await wait_serving(client, "tiny")
    lines = [chat_line("ok-1", "hi"), chat_line("ok-2", "hi"), chat_line("gpt", "hi", "gpt-4o")]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.create(file=("f.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert error_of(refused.value) == (
        "The batch input file is not valid: line 3: body.model: 'gpt-4o' is not a model this "
        "router serves (it serves: tiny)."
    )
    assert (refused.value.code, refused.value.param) == ("invalid_file", "file")
    assert [f async for f in client.files.list()] == []  # nothing was kept


async def test_a_file_naming_a_model_no_longer_served_is_refused_at_batch_create(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    """Two routers on one store: the first serves "retired" and takes the file, the second
    (another config, or the first restarted without it) refuses the batch, naming the line."""
    a = await start_replica("a")
    store = batch_config(tmp_path)
    old = client_for(await start_router([a], batch=store, models=["tiny", "retired"]))
    new = client_for(await start_router([a], batch=store, models=["tiny"]))
    lines = [chat_line("ok", "hi"), chat_line("old", "hi", "retired")]
    uploaded = await old.files.create(file=("f.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        await new.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert error_of(refused.value) == (
        f"The batch input file {uploaded.id} is not valid: line 2: body.model: 'retired' is not "
        "a model this router serves (it serves: tiny)."
    )
    assert refused.value.param == "input_file_id"
    assert [b async for b in new.batches.list()] == []


async def test_batches_list_in_pages_newest_first(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router([a], batch=batch_config(tmp_path))
    client = client_for(r)
    uploaded = await client.files.create(
        file=("f.jsonl", io.BytesIO(jsonl([chat_line("x", "hi")]))), purpose="batch"
    )
    created = [
        (
            await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        ).id
        for _ in range(5)
    ]
    page = await client.batches.list(limit=2)
    assert [b.id for b in page.data] == created[::-1][:2] and page.has_more
    # The client's auto-pagination follows `after` through every page.
    assert [b.id async for b in client.batches.list(limit=2)] == created[::-1]
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/v1/batches?limit=0") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "limit"


async def test_cancel_aborts_running_lines_and_keeps_finished_results(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router([a], batch=batch_config(tmp_path, max_in_flight_per_replica=2))
    client = client_for(r)
    lines = [chat_line(f"quick-{i}", f"quick {i}") for i in range(3)]
    lines += [chat_line(f"held-{i}", "hold") for i in range(6)]
    uploaded = await client.files.create(
        file=("f.jsonl", io.BytesIO(jsonl(lines))), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await wait_until(lambda: len(a.completed) == 3 and a.running == 2, 10, "quick lines done")
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    loop = asyncio.get_running_loop()
    asked = loop.time()
    # The held lines never end on their own: an abort is the cancel's doing.
    await wait_until(lambda: a.aborted == 2, 10, "the replica to see both aborts")
    assert loop.time() - asked < 5.0
    done = await wait_status(client, batch.id, {"cancelled"})
    assert done.cancelled_at and done.cancelling_at
    output = await lines_of(client, done.output_file_id)
    failed = await lines_of(client, done.error_file_id)
    assert sorted(o["custom_id"] for o in output) == ["quick-0", "quick-1", "quick-2"]
    assert sorted(f["custom_id"] for f in failed) == [f"held-{i}" for i in range(6)]
    assert {f["error"]["code"] for f in failed} == {"batch_cancelled"}


async def metrics_of(r: RunningRouter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_metrics(text).samples}


async def test_a_batch_past_its_window_expires_with_partial_results(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    cfg = batch_config(tmp_path, window_s=2.0, max_in_flight_per_replica=1)
    r = await start_router([a], batch=cfg)
    client = client_for(r)
    lines = [chat_line("quick", "quick")] + [chat_line(f"held-{i}", "hold") for i in range(4)]
    uploaded = await client.files.create(
        file=("f.jsonl", io.BytesIO(jsonl(lines))), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await wait_status(client, batch.id, {"expired"}, timeout_s=10)
    assert done.expired_at and done.expired_at >= done.expires_at - 1
    assert a.aborted >= 1  # the held lines in flight at expiry were aborted
    output = await lines_of(client, done.output_file_id)
    failed = await lines_of(client, done.error_file_id)
    assert [o["custom_id"] for o in output] == ["quick"]
    assert sorted(f["custom_id"] for f in failed) == [f"held-{i}" for i in range(4)]
    assert {f["error"]["code"] for f in failed} == {"batch_expired"}
    assert done.request_counts is not None and done.request_counts.failed == 4


async def test_online_traffic_preempts_running_batch_lines(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router(
        [a],
        batch=batch_config(tmp_path, max_in_flight_per_replica=2, preempt_after_s=0.2),
        limits={"max_concurrent_requests": 2, "max_queued_requests": 10},
    )
    client = client_for(r)
    lines = [chat_line(f"held-{i}", "hold") for i in range(4)]
    uploaded = await client.files.create(
        file=("f.jsonl", io.BytesIO(jsonl(lines))), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await wait_until(lambda: a.running == 2, 10, "two batch lines on the replica")
    # Every slot is batch work: an online request queues, then takes a preempted line's slot.
    answer = await asyncio.wait_for(
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}]),
        5,
    )
    assert answer.choices[0].message.content == "hello from a"
    assert a.aborted >= 1
    metrics = await metrics_of(r)
    assert metrics[("kvroute_batch_preemptions_total", ())] >= 1
    # The preempted line is re-queued once its cancelled task has unwound: poll for it.
    requeued = ("kvroute_batch_lines_total", (("status", "requeued"),))
    async with asyncio.timeout(5):
        while (await metrics_of(r)).get(requeued, 0) < 1:
            await asyncio.sleep(0.05)
    a.gate.set()  # the held lines may finish now: each still has exactly one result
    done = await wait_status(client, batch.id, {"completed"})
    output = await lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == [f"held-{i}" for i in range(4)]
    metrics = await metrics_of(r)
    assert metrics[("kvroute_batch_lines_total", (("status", "completed"),))] == 4
    async with asyncio.timeout(5):  # the gauge is read from the store on the runner's tick
        while (await metrics_of(r)).get(("kvroute_batch_jobs", (("status", "completed"),))) != 1:
            await asyncio.sleep(0.05)


async def test_a_job_behind_its_pace_runs_without_spare_capacity(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    cfg = batch_config(tmp_path, max_in_flight_per_replica=1, window_s=6.0, pace_fraction=0.5)
    r = await start_router([a], batch=cfg)
    client = client_for(r)
    # An online request holds the replica's one batch slot: no spare capacity from here on.
    online = asyncio.create_task(
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hold"}])
    )
    await wait_until(lambda: a.running == 1, 5, "the online request on the replica")
    lines = [chat_line(f"line-{i}", f"line {i}") for i in range(4)]
    uploaded = await client.files.create(
        file=("f.jsonl", io.BytesIO(jsonl(lines))), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # Paced to end by 3 s: its lines are promoted as they fall due, and all run by then.
    done = await wait_status(client, batch.id, {"completed"}, timeout_s=6)
    assert done.request_counts is not None and done.request_counts.completed == 4
    assert not online.done()  # the replica never had spare capacity meanwhile
    a.gate.set()
    await online


async def test_without_a_batch_section_the_batch_routes_say_it_is_off(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    r = await start_router([await start_replica("a")])
    with pytest.raises(openai.NotFoundError, match="batch lane is off"):
        await client_for(r).batches.list()


async def test_uploads_that_are_not_a_usable_form_get_a_clear_error(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router([a], batch=batch_config(tmp_path, max_file_bytes=1000))
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/files", json={"purpose": "batch"}) as resp:
            assert resp.status == 400
            assert "multipart/form-data" in (await resp.json())["error"]["message"]
        form = aiohttp.FormData(default_to_multipart=True)
        form.add_field("purpose", "batch")
        async with http.post(r.url + "/v1/files", data=form) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "file"
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"x" * 2000, filename="big.jsonl")
        async with http.post(r.url + "/v1/files", data=form) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "file_too_large"
        async with http.get(r.url + "/v1/files/file-nope/content") as resp:
            assert resp.status == 404
    client = client_for(r)
    made = await client.files.create(
        file=("f.jsonl", io.BytesIO(jsonl([chat_line("x", "hi")]))), purpose="batch"
    )
    assert [f.id async for f in client.files.list()] == [made.id]


async def test_the_batch_api_needs_the_client_key_when_keys_are_set(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router(
        [a], batch=batch_config(tmp_path), auth={"api_keys": ["key-of-batch-1234"]}
    )
    with pytest.raises(openai.AuthenticationError):
        await client_for(r).batches.list()
    keyed = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="key-of-batch-1234", max_retries=0)
    assert (await keyed.batches.list()).data == []


async def test_a_tenant_sees_and_cancels_only_its_own_files_and_batches(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    """Files and batches belong to the tenant whose key made them: another tenant's list is
    empty and its ids answer 404, as ids that do not exist."""
    a = await start_replica("a")
    keys = [{"key": "key-of-acme-1234", "tenant": "acme"}, {"key": "key-of-zeta-1234",
            "tenant": "zeta"}]  # fmt: skip
    r = await start_router([a], batch=batch_config(tmp_path), auth={"api_keys": keys})

    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0, timeout=10)

    acme, zeta = client("key-of-acme-1234"), client("key-of-zeta-1234")
    upload = await acme.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line("c1", "hello")]))), purpose="batch"
    )
    batch = await acme.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert [f.id for f in (await acme.files.list()).data] == [upload.id]
    assert (await zeta.files.list()).data == [] and (await zeta.batches.list()).data == []
    for call in (
        zeta.files.retrieve(upload.id),
        zeta.files.content(upload.id),
        zeta.batches.retrieve(batch.id),
        zeta.batches.cancel(batch.id),
        zeta.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    done = await wait_status(acme, batch.id, {"completed"})
    assert [line["custom_id"] for line in await lines_of(acme, done.output_file_id)] == ["c1"]
    with pytest.raises(openai.NotFoundError):
        await zeta.files.content(done.output_file_id)


def _multipart(filename: bytes, content: bytes) -> tuple[bytes, str]:
    """A multipart body written by hand, so the file name's bytes go as they are (clients
    escape some characters; a hostile one need not). A name starting ``*=`` is sent as an
    RFC 5987 ``filename*`` (percent-encoded: any character gets through the header)."""
    boundary = "kvroute-boundary-1"
    field = (
        b"filename" + filename if filename.startswith(b"*=") else b'filename="' + filename + b'"'
    )
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '.encode()
        + field
        + b"\r\nContent-Type: application/jsonl\r\n\r\n"
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


async def test_uploaded_file_names_keep_no_path_and_no_control_characters(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router([a], batch=batch_config(tmp_path))
    content = jsonl([chat_line("x", "hi")])
    async with aiohttp.ClientSession() as http:

        async def upload(name: bytes) -> tuple[int, dict[str, Any]]:
            body, kind = _multipart(name, content)
            headers = {"Content-Type": kind}
            async with http.post(r.url + "/v1/files", data=body, headers=headers) as resp:
                return resp.status, await resp.json()

        for given, kept in (
            (b"../../etc/passwd", "passwd"),
            (b"C:\\\\Users\\\\me\\\\batch.jsonl", "batch.jsonl"),
            (b"\xc3\xa9t\xc3\xa9 <b>.jsonl", "été <b>.jsonl"),  # shown as text, never markup
        ):
            status, answer = await upload(given)
            assert status == 200, answer
            assert answer["filename"] == kept
        for given in (
            b"*=UTF-8''a%01b.jsonl",  # a control character
            b"*=UTF-8''a%0Ab.jsonl",  # a line break (a forged log line)
            b"*=UTF-8''a%E2%80%AEb.jsonl",  # right-to-left override
            b"x" * 300,
            b"dir/..",
        ):
            status, answer = await upload(given)
            assert status == 400, (given, answer)
            assert answer["error"]["code"] == "invalid_file_name", (given, answer)
            assert answer["error"]["param"] == "file"
        # Raw control characters, which aiohttp's header parser refuses first: a 400 too.
        for given in (b"a\x01b.jsonl", b"a\x7fb.jsonl"):
            status, answer = await upload(given)
            assert status == 400, answer
            assert answer["error"]["message"].startswith("The multipart body cannot be read")
    client = client_for(r)
    assert sorted([f.filename async for f in client.files.list()]) == [
        "batch.jsonl",
        "passwd",
        "été <b>.jsonl",
    ]


async def test_a_line_a_replica_keeps_failing_is_tried_batch_max_attempts_times_then_failed(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    a.fail_with = 500
    r = await start_router(
        [a],
        retry={"max_attempts": 1},
        breaker={"enabled": False},  # the replica's own 500s reach the lane, not a 503
        batch=batch_config(tmp_path, max_attempts=2),
    )
    client = client_for(r)
    uploaded = await client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line("always-500", "x")]))), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await wait_status(client, batch.id, {"completed"})
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 1)
    (failed,) = await lines_of(client, done.error_file_id)
    assert failed["custom_id"] == "always-500"
    assert failed["response"]["status_code"] == 500
    assert len(a.seen) == 2  # batch.max_attempts, each a try of its own a second apart
