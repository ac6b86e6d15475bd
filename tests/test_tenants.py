"""Tenants end to end, through the real ``openai`` client: who a request belongs to, budgets
that count the replica's own tokens (streams included), fair admission and shedding."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from kvroute.kvcore.stats import parse_metrics

from .conftest import RunningRouter, StartReplica, StartRouter
from .fake_replica import FAKE_PROMPT_TOKENS
from .helpers import wait_until

ALPHA_KEY = "key-of-alpha-0001"
PLAIN_KEY = "plain-key-0002"
ADMIN_KEY = "admin-key-0003"


def client_for(
    url: str, api_key: str = "unused", headers: dict[str, str] | None = None
) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=10, default_headers=headers
    )


async def tenants_of(r: RunningRouter, admin_key: str | None = None) -> dict[str, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    async with (
        aiohttp.ClientSession() as http,
        http.get(r.url + "/admin/tenants", headers=headers) as resp,
    ):
        assert resp.status == 200
        body = await resp.json()
    return {row["tenant"]: row for row in body["tenants"]}


async def test_the_tenant_comes_from_the_api_key_else_the_headers(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    keys = [{"key": ALPHA_KEY, "tenant": "alpha"}, PLAIN_KEY]
    r = await start_router([a], auth={"api_keys": keys, "admin_api_key": ADMIN_KEY})
    # The key's tenant wins over whatever the headers say.
    alpha = client_for(r.url, ALPHA_KEY, {"X-Tenant-Id": "beta"})
    await alpha.completions.create(model="tiny", prompt="hi", max_tokens=3)
    # A key without a tenant: the gateway's fairness id first, then X-Tenant-Id.
    gateway = {"x-gateway-inference-fairness-id": "gamma", "X-Tenant-Id": "beta"}
    await client_for(r.url, PLAIN_KEY, gateway).completions.create(model="tiny", prompt="hi")
    await client_for(r.url, PLAIN_KEY, {"X-Tenant-Id": "beta"}).completions.create(
        model="tiny", prompt="hi"
    )
    await client_for(r.url, PLAIN_KEY).completions.create(model="tiny", prompt="hi")
    tenants = await tenants_of(r, ADMIN_KEY)
    for name in ("alpha", "beta", "gamma", "default"):
        assert tenants[name]["requests"] == {"ok": 1}, (name, tenants[name])
        # Charged the replica's own counts (the fake says 3 in, 3 out).
        assert tenants[name]["tokens"] == {"input": FAKE_PROMPT_TOKENS, "output": 3}
    # The tenant header is not passed on as something else: the replica sees the request.
    assert len(a.seen) == 4


async def test_a_bad_tenant_header_is_a_clear_400(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    with pytest.raises(openai.BadRequestError) as info:
        await client_for(r.url, headers={"X-Tenant-Id": "x" * 200}).completions.create(
            model="tiny", prompt="hi"
        )
    assert isinstance(info.value.body, dict) and "x-tenant-id" in info.value.body["message"]
    assert not a.seen


async def test_over_budget_is_a_rate_limit_error_with_retry_after(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], tenants={"by_name": {"small": {"output_tokens_per_minute": 3}}})
    small = client_for(r.url, headers={"X-Tenant-Id": "small"})
    await small.completions.create(model="tiny", prompt="hi")  # 3 output tokens: all of it
    with pytest.raises(openai.RateLimitError) as info:
        await small.completions.create(model="tiny", prompt="hi")
    error = info.value
    assert isinstance(error.body, dict)
    assert error.body["type"] == "rate_limit_exceeded"
    assert error.body["code"] == "rate_limit_exceeded"
    assert "small" in error.body["message"] and "output" in error.body["message"]
    assert 1 <= int(error.response.headers["retry-after"]) <= 60
    assert len(a.seen) == 1  # refused by the router, never sent
    # Other tenants are not held back by it.
    await client_for(r.url, headers={"X-Tenant-Id": "other"}).completions.create(
        model="tiny", prompt="hi"
    )
    tenants = await tenants_of(r)
    assert tenants["small"]["rejections"] == {"over_budget": 1}
    assert tenants["small"]["budget"]["output"]["exhausted"]
    metrics = await _metrics(r)
    assert (
        metrics[
            ("kvroute_tenant_rejections_total", (("reason", "over_budget"), ("tenant", "small")))
        ]
        == 1
    )


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_streams_are_charged_the_replicas_usage_and_its_chunk_kept_only_when_asked(
    chat: bool, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])

    async def stream(tenant: str, **extra: Any) -> list[Any]:
        client = client_for(r.url, headers={"X-Tenant-Id": tenant})
        if chat:
            messages = [{"role": "user", "content": "hi"}]
            s = await client.chat.completions.create(
                model="tiny", messages=messages, stream=True, **extra
            )
        else:
            s = await client.completions.create(model="tiny", prompt="hi", stream=True, **extra)
        return [chunk async for chunk in s]

    plain = await stream("plain")
    # The router asked the replica for usage...
    assert a.seen[-1].body["stream_options"] == {"include_usage": True}
    # ...and kept its usage chunk from a client that did not ask.
    assert all(c.choices and c.usage is None for c in plain), plain
    text = "".join(c.choices[0].delta.content or "" if chat else c.choices[0].text for c in plain)
    assert text == "hello from a"
    asked = await stream("asked", stream_options={"include_usage": True})
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.completion_tokens == 3
    tenants = await tenants_of(r)
    for name in ("plain", "asked"):
        assert tenants[name]["tokens"] == {"input": FAKE_PROMPT_TOKENS, "output": 3}


async def test_a_saturated_router_serves_a_flooding_tenant_and_a_light_one_fairly(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """One slot, held; the heavy tenant queues 10 requests. The light tenant's first request
    is next in fair order, so it does not wait for the slot: it starts at once on a reserved
    slot (fairness.reserved_slots). Its next two queue (it is now ahead in service); once the
    slots free the two tenants take turns (equal service) until the light one has nothing left."""
    a = await start_replica("a")
    r = await start_router([a], limits={"max_concurrent_requests": 1, "max_queued_requests": 50})
    holder = asyncio.create_task(
        client_for(r.url, headers={"X-Tenant-Id": "holder"}).completions.create(
            model="tiny", prompt="hold"
        )
    )
    await wait_until(lambda: a.running == 1, what="the slot held")
    heavy = client_for(r.url, headers={"X-Tenant-Id": "heavy"})
    light = client_for(r.url, headers={"X-Tenant-Id": "light"})
    tasks = [
        asyncio.create_task(heavy.completions.create(model="tiny", prompt=f"h{i}"))
        for i in range(10)
    ]
    await wait_until(lambda: r.router.admission.queued == 10, what="heavy queued")
    tasks.append(asyncio.create_task(light.completions.create(model="tiny", prompt="hold")))
    await wait_until(lambda: a.running == 2, what="light served beside the held slot")
    assert r.router.admission.queued == 10  # the heavy backlog still waits
    tasks += [
        asyncio.create_task(light.completions.create(model="tiny", prompt=f"l{i}"))
        for i in range(2)
    ]
    await wait_until(lambda: r.router.admission.queued == 12, what="light queued")
    a.gate.set()
    await asyncio.gather(holder, *tasks)
    order = [s.headers["X-Tenant-Id"] for s in a.seen[1:]]
    assert order[0] == "light", order
    # While both were backlogged, the service was shared equally: 3 light in the first 6.
    assert order[:6].count("light") == 3, order
    assert r.router.admission.active == 0
    tenants = await tenants_of(r)
    assert tenants["heavy"]["requests"] == {"ok": 10}
    assert tenants["light"]["requests"] == {"ok": 3}
    metrics = await _metrics(r)
    queued = metrics[("kvroute_tenant_queue_seconds_count", (("tenant", "light"),))]
    assert queued == 3


async def test_critical_work_is_never_shed_while_sheddable_work_waits(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router(
        [a],
        limits={"max_concurrent_requests": 1, "max_queued_requests": 2},
        tenants={"by_name": {"batch": {"priority": "sheddable"}}},
        fairness={"objectives": {"pager": "critical"}},
    )

    def send(tenant: str, objective: str | None = None) -> asyncio.Task[Any]:
        headers = {"X-Tenant-Id": tenant}
        if objective is not None:
            headers["x-gateway-inference-objective"] = objective
        return asyncio.create_task(
            client_for(r.url, headers=headers).completions.create(model="tiny", prompt="hi")
        )

    holder = asyncio.create_task(client_for(r.url).completions.create(model="tiny", prompt="hold"))
    await wait_until(lambda: a.running == 1, what="the slot held")
    batch = send("batch")  # sheddable: its tenant's default class
    await wait_until(lambda: r.router.admission.queued == 1, what="batch queued")
    first = send("ops", "pager")  # critical by the objective's mapping
    await wait_until(lambda: r.router.admission.queued == 2, what="the queue full")
    second = send("ops", "critical")  # the queue is full: the sheddable request gives way
    with pytest.raises(openai.RateLimitError) as info:
        await batch
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "shed"
    assert info.value.response.headers["retry-after"] == "1"
    # Only critical work waits now: a standard arrival cannot shed it and is refused.
    with pytest.raises(openai.RateLimitError) as refused:
        await send("web")
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["code"] == "too_many_requests"
    a.gate.set()
    await asyncio.gather(holder, first, second)  # both critical requests served
    tenants = await tenants_of(r)
    assert tenants["ops"]["requests"] == {"ok": 2}
    assert tenants["batch"]["rejections"] == {"shed": 1}
    assert tenants["web"]["rejections"] == {"queue_full": 1}


async def test_sheddable_work_waits_at_most_its_bound(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router(
        [a],
        limits={"max_concurrent_requests": 1, "max_queued_requests": 4},
        fairness={"sheddable_max_wait_s": 0.2},
    )
    holder = asyncio.create_task(client_for(r.url).completions.create(model="tiny", prompt="hold"))
    await wait_until(lambda: a.running == 1, what="the slot held")
    headers = {"x-gateway-inference-objective": "sheddable"}
    with pytest.raises(openai.RateLimitError) as info:
        await client_for(r.url, headers=headers).completions.create(model="tiny", prompt="hi")
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "shed"
    assert "sheddable_max_wait_s" in info.value.body["message"]
    a.gate.set()
    await holder


async def test_status_and_metrics_show_tenants(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    await client_for(r.url, headers={"X-Tenant-Id": "t1"}).completions.create(
        model="tiny", prompt="hi"
    )
    async with aiohttp.ClientSession() as http, http.get(r.url + "/status/events") as resp:
        status = await resp.json()
    rows = {row["tenant"]: row for row in status["tenants"]}
    assert rows["t1"]["requests"] == 1 and rows["t1"]["tokens"]["output"] == 3
    metrics = await _metrics(r)
    assert metrics[("kvroute_tenant_tokens_total", (("kind", "input"), ("tenant", "t1")))] == 3
    assert metrics[("kvroute_tenant_requests_total", (("outcome", "ok"), ("tenant", "t1")))] == 1


async def _metrics(r: RunningRouter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_metrics(text).samples}


def test_bad_tenant_settings_are_one_line_each_naming_the_key() -> None:
    from kvroute.router.config import ConfigError, config_from_dict

    raw = {
        "auth": {"api_keys": ["plain-key-0002", {"key": "k-1234567", "tenant": " "}, {"kee": 1}]},
        "tenants": {
            "defaults": {"weight": 0, "priority": "urgent"},
            "by_name": {"acme": {"input_tokens_per_minute": -5, "max_concurent": 2}},
        },
        "fairness": {
            "sheddable_max_wait_s": 0,
            "objectives": {"pager": "high"},
            "reserved_slots": -1,
        },
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    problems = info.value.problems
    expected = [
        "auth.api_keys[2].kee: unknown key (did you mean 'key'?)",
        "auth.api_keys[2].key: missing; this key is required",
        "tenants.by_name.acme.max_concurent: unknown key (did you mean 'max_concurrent'?)",
    ]
    for line in expected:
        assert line in problems, problems
    for prefix in (
        "auth.api_keys[1].tenant: must not be empty",
        "tenants.defaults.weight: must be a finite number > 0",
        "tenants.defaults.priority: must be one of critical, standard, sheddable",
        "tenants.by_name.acme.input_tokens_per_minute: must be >= 0",
        "fairness.sheddable_max_wait_s: must be a number of seconds > 0",
        "fairness.objectives.pager: must be one of",
        "fairness.reserved_slots: must be >= 0",
    ):
        assert any(p.startswith(prefix) for p in problems), (prefix, problems)
    # A plain key list, as configs had it, stays valid.
    assert config_from_dict({"auth": {"api_keys": ["plain-key-0002"]}}).auth.api_keys
