"""Anthropic's Message Batches API on the batch lane, through the real ``anthropic`` client:
create, retrieve, list in pages, results as JSONL, cancel mid-run, expiry, delete, the tenant
charged, refusals in Anthropic's shape, and a ``kill -9`` of the router mid-batch."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import yaml

from kvroute.backends.process import free_ports

from .conftest import StartReplica, StartRouter
from .fake_replica import FAKE_PROMPT_TOKENS
from .helpers import wait_until
from .test_batch import batch_config, wait_serving
from .test_batch_durability import start_router as start_router_process


def claude_for(url: str, **headers: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=url, api_key="unused", max_retries=0, timeout=10, default_headers=headers
    )


def request(custom_id: str, prompt: str, model: str = "tiny", **params: Any) -> Any:
    messages = [{"role": "user", "content": prompt}]
    body = {"model": model, "max_tokens": 8, "messages": messages, **params}
    return {"custom_id": custom_id, "params": body}


async def wait_ended(
    client: anthropic.AsyncAnthropic, batch_id: str, timeout_s: float = 20
) -> anthropic.types.messages.MessageBatch:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        batch = await client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        if loop.time() > deadline:
            raise AssertionError(f"{batch_id} still {batch.processing_status} after {timeout_s}s")
        await asyncio.sleep(0.05)


async def results_of(client: anthropic.AsyncAnthropic, batch_id: str) -> dict[str, Any]:
    return {r.custom_id: r.result async for r in await client.messages.batches.results(batch_id)}


async def test_a_message_batch_runs_each_request_once_and_charges_its_tenant(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    r = await start_router(
        [a, b], batch=batch_config(tmp_path), tenants={"by_name": {"agents": {}}}
    )
    client = claude_for(r.url, **{"X-Tenant-Id": "agents"})
    requests = [request(f"req-{i}", f"prompt {i}") for i in range(20)]
    requests.append(request("r400", "status:400"))
    created = await client.messages.batches.create(requests=requests)
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.processing == 21
    assert created.expires_at > created.created_at and created.ended_at is None
    done = await wait_ended(client, created.id)
    counts = done.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (20, 1, 0)
    assert (counts.canceled, counts.expired) == (0, 0)
    assert done.ended_at is not None and done.cancel_initiated_at is None
    assert done.results_url == f"{r.url}/v1/messages/batches/{created.id}/results"
    results = await results_of(client, created.id)
    assert sorted(results) == sorted(q["custom_id"] for q in requests)  # each exactly once
    ok = results["req-0"]
    assert ok.type == "succeeded" and ok.message.content[0].text.startswith("hello from")
    assert ok.message.usage.input_tokens == FAKE_PROMPT_TOKENS
    refused = results["r400"]
    assert refused.type == "errored" and refused.error.error.type == "invalid_request_error"
    assert refused.error.error.message == "scripted 400"
    # Every good request reached a replica exactly once, as a Messages request.
    assert sorted(a.completed + b.completed) == sorted(f"prompt {i}" for i in range(20))
    assert {s.path for s in a.seen + b.seen} == {"/v1/messages"}
    # The batch's tenant was charged the replicas' usage (3 in, 3 out per answer).
    async with aiohttp.ClientSession() as http, http.get(r.url + "/admin/tenants") as resp:
        tenants = {row["tenant"]: row for row in (await resp.json())["tenants"]}
    assert tenants["agents"]["tokens"] == {"input": 20 * FAKE_PROMPT_TOKENS, "output": 60}
    # A Message Batch is not one of OpenAI's batches, and the reverse.
    oai = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    assert [x async for x in oai.batches.list()] == []
    with pytest.raises(openai.NotFoundError):
        await oai.batches.retrieve(created.id)
    # Ended: no cancel; deleted, it is gone (results included).
    with pytest.raises(anthropic.BadRequestError, match="has ended"):
        await client.messages.batches.cancel(created.id)
    gone = await client.messages.batches.delete(created.id)
    assert (gone.id, gone.type) == (created.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.batches.retrieve(created.id)
    # Another tenant never sees a tenant's batches.
    other = claude_for(r.url, **{"X-Tenant-Id": "others"})
    kept = await client.messages.batches.create(requests=[request("one", "one")])
    with pytest.raises(anthropic.NotFoundError):
        await other.messages.batches.retrieve(kept.id)
    assert [x async for x in other.messages.batches.list()] == []


async def test_bad_requests_get_a_400_naming_the_request_in_anthropics_shape(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    cfg = batch_config(tmp_path, max_file_bytes=4000, max_lines=3)
    r = await start_router([await start_replica("a")], batch=cfg)
    client = claude_for(r.url)
    good = request("ok", "hi")
    no_max_tokens = {"custom_id": "x", "params": {"model": "tiny", "messages": []}}
    bad_role = request("y", "hi")
    bad_role["params"]["messages"][0]["role"] = "robot"
    for requests, expected in (
        ([], "requests: required"),
        ([good, no_max_tokens], "requests[1].params.max_tokens: 'max_tokens' is required"),
        ([good, bad_role], "requests[1].params.messages[0].role: 'messages[0].role' must be"),
        ([good, good], "requests[1].custom_id: 'ok' is used by an earlier request"),
        ([request("has space", "hi")], "requests[0].custom_id: must be 1-64 characters"),
        ([request("x" * 65, "hi")], "requests[0].custom_id"),
        ([request("s", "hi", stream=True)], "requests[0].params.stream: must not be true"),
        ([{**good, "extra": 1}], "requests[0]: unknown field(s) extra"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.batches.create(requests=requests)
        assert expected in refused.value.message, refused.value.message
        assert refused.value.body["type"] == "error"  # type: ignore[index]
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match=r"more than batch\.max_lines \(3\)"):
        await client.messages.batches.create(requests=[request(f"n{i}", "x") for i in range(4)])
    with pytest.raises(anthropic.APIStatusError, match=r"larger than batch\.max_file_bytes") as big:
        await client.messages.batches.create(requests=[request("big", "x" * 5000)])
    assert big.value.status_code == 413
    assert big.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.batches.retrieve("msgbatch_nope")
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        await client.messages.batches.list(limit=0)
    assert [x async for x in client.messages.batches.list()] == []  # nothing was created


async def test_a_request_naming_a_model_the_router_does_not_serve_is_refused_at_create(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    r = await start_router([await start_replica("a")], batch=batch_config(tmp_path))
    await wait_serving(openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x"), "tiny")
    client = claude_for(r.url)
    requests = [request("ok", "hi"), request("opus", "hi", model="claude-opus-4-1")]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.batches.create(requests=requests)
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Invalid request: requests[1].params.model: 'claude-opus-4-1' is not a "
            "model this router serves (it serves: tiny)",
        },
    }
    assert [x async for x in client.messages.batches.list()] == []  # nothing was created


async def test_batches_list_in_pages_newest_first(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    r = await start_router([await start_replica("a")], batch=batch_config(tmp_path))
    client = claude_for(r.url)
    ids = [
        (await client.messages.batches.create(requests=[request("x", "x")])).id for _ in range(5)
    ]
    newest_first = ids[::-1]
    assert [x.id async for x in client.messages.batches.list(limit=2)] == newest_first
    page = await client.messages.batches.list(limit=2)
    assert [x.id for x in page.data] == newest_first[:2] and page.has_more
    assert (page.first_id, page.last_id) == (newest_first[0], newest_first[1])
    after = await client.messages.batches.list(limit=2, after_id=newest_first[1])
    assert [x.id for x in after.data] == newest_first[2:4] and after.has_more
    before = await client.messages.batches.list(limit=2, before_id=newest_first[3])
    assert [x.id for x in before.data] == newest_first[1:3] and before.has_more
    first = await client.messages.batches.list(limit=5, before_id=newest_first[2])
    assert [x.id for x in first.data] == newest_first[:2] and not first.has_more


async def test_cancel_aborts_running_requests_and_keeps_finished_results(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    r = await start_router([a], batch=batch_config(tmp_path, max_in_flight_per_replica=2))
    client = claude_for(r.url)
    requests = [request(f"quick-{i}", f"quick {i}") for i in range(3)]
    requests += [request(f"held-{i}", "hold") for i in range(4)]
    created = await client.messages.batches.create(requests=requests)
    await wait_until(lambda: len(a.completed) == 3 and a.running == 2, 10, "quick ones done")
    canceling = await client.messages.batches.cancel(created.id)
    assert canceling.processing_status in ("canceling", "ended")
    assert canceling.cancel_initiated_at is not None
    await wait_until(lambda: a.aborted == 2, 10, "the replica to see both aborts")
    done = await wait_ended(client, created.id)
    assert (done.request_counts.succeeded, done.request_counts.canceled) == (3, 4)
    assert done.request_counts.errored == 0
    results = await results_of(client, created.id)
    assert {k for k, v in results.items() if v.type == "succeeded"} == {"quick-0", "quick-1",
                                                                        "quick-2"}  # fmt: skip
    assert {k for k, v in results.items() if v.type == "canceled"} == {
        f"held-{i}" for i in range(4)
    }
    assert (await client.messages.batches.cancel(created.id)).processing_status == "ended"


async def test_a_message_batch_behind_its_pace_runs_without_spare_capacity(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    cfg = batch_config(tmp_path, max_in_flight_per_replica=1, window_s=6.0, pace_fraction=0.5)
    r = await start_router([a], batch=cfg)
    client = claude_for(r.url)
    # An online Messages request holds the replica's one batch slot: no spare capacity.
    online = asyncio.create_task(
        client.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hold"}]
        )
    )
    await wait_until(lambda: a.running == 1, 5, "the online request on the replica")
    created = await client.messages.batches.create(
        requests=[request(f"line-{i}", f"line {i}") for i in range(4)]
    )
    # Paced to end by 3 s: its requests are promoted as they fall due, and all run by then.
    done = await wait_ended(client, created.id, timeout_s=6)
    assert done.request_counts.succeeded == 4
    assert not online.done()  # the replica never had spare capacity meanwhile
    a.gate.set()
    await online


async def test_a_batch_past_its_window_ends_with_its_unrun_requests_expired(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    a = await start_replica("a")
    cfg = batch_config(tmp_path, window_s=2.0, max_in_flight_per_replica=1)
    r = await start_router([a], batch=cfg)
    client = claude_for(r.url)
    requests = [request("quick", "quick")] + [request(f"held-{i}", "hold") for i in range(3)]
    created = await client.messages.batches.create(requests=requests)
    with pytest.raises(anthropic.BadRequestError, match="has not ended"):
        await client.messages.batches.delete(created.id)
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        await client.messages.batches.results(created.id)
    done = await wait_ended(client, created.id, timeout_s=10)
    assert (done.request_counts.succeeded, done.request_counts.expired) == (1, 3)
    results = await results_of(client, created.id)
    assert results["quick"].type == "succeeded"
    assert {results[f"held-{i}"].type for i in range(3)} == {"expired"}


async def test_without_a_batch_section_message_batches_say_the_lane_is_off(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    r = await start_router([await start_replica("a")])
    client = claude_for(r.url)
    with pytest.raises(anthropic.NotFoundError, match="batch lane is off") as off:
        await client.messages.batches.list()
    assert off.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError, match="batch lane is off"):
        await client.messages.batches.create(requests=[request("x", "x")])


async def test_the_message_batches_api_needs_the_client_key_when_keys_are_set(
    start_replica: StartReplica, start_router: StartRouter, tmp_path: Path
) -> None:
    r = await start_router(
        [await start_replica("a")],
        batch=batch_config(tmp_path),
        auth={"api_keys": ["key-of-agents-1234"]},
    )
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await claude_for(r.url).messages.batches.list()
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    client = anthropic.AsyncAnthropic(
        base_url=r.url, auth_token="key-of-agents-1234", max_retries=0, timeout=10
    )
    assert [x async for x in client.messages.batches.list()] == []


def stored_results(db: Path) -> set[int]:
    with sqlite3.connect(db) as conn:
        return {row[0] for row in conn.execute("SELECT line_no FROM kvr_results")}


@pytest.mark.slow
async def test_kill_9_mid_message_batch_then_restart_loses_and_repeats_nothing(
    start_replica: StartReplica, tmp_path: Path
) -> None:
    """As tests/test_batch_durability.py, for a Message Batch."""
    lines = 100
    replicas = [await start_replica(name) for name in ("a", "b")]
    for replica in replicas:
        replica.delay_s = 0.1
    (port,) = free_ports(1, "127.0.0.1")
    db = tmp_path / "batches.db"
    config = tmp_path / "router.yaml"
    batch = {"store": f"sqlite:///{db}", "poll_s": 0.05, "lease_s": 2.0,
             "max_in_flight_per_replica": 4}  # fmt: skip
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "replicas": [{"url": r.url, "name": r.name} for r in replicas],
                "health": {"interval_s": 0.2},
                "batch": batch,
            }
        )
    )
    url = f"http://127.0.0.1:{port}"
    router = await start_router_process(config, port)
    try:
        created = await claude_for(url).messages.batches.create(
            requests=[request(f"line-{i}", f"line {i}") for i in range(lines)]
        )
        await wait_until(lambda: len(stored_results(db)) >= lines // 4, 30, "a quarter stored")
        router.send_signal(signal.SIGKILL)
        await router.wait()
        before = stored_results(db)
        assert lines // 4 <= len(before) < lines
        router = await start_router_process(config, port)
        client = claude_for(url)  # the old client's pooled connections died with the router
        done = await wait_ended(client, created.id, timeout_s=60)
        results = await results_of(client, created.id)
    finally:
        if router.returncode is None:
            router.send_signal(signal.SIGKILL)
            await router.wait()
    assert done.request_counts.succeeded == lines
    assert sorted(results) == sorted(f"line-{i}" for i in range(lines))
    assert {r.type for r in results.values()} == {"succeeded"}
    finished: dict[str, int] = {}
    for replica in replicas:
        for prompt in replica.completed:
            finished[prompt] = finished.get(prompt, 0) + 1
    assert set(finished) == {f"line {i}" for i in range(lines)}
    repeated = {p for p, n in finished.items() if n > 1}
    assert {f"line {no - 1}" for no in before} & repeated == set()
