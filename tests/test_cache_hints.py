"""A Messages client's ``cache_control`` ttl is read from its body and reaches the policy as
``RouteRequest.cache_ttl_s``, through the parser, the ledger and the live router."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from kvroute.kvcore.cache_hints import DEFAULT_TTL_S, cache_ttl_s, ttl_of
from kvroute.kvcore.ledger import DispatchLedger
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import FleetView, ReplicaState, RouteRequest
from kvroute.policies.kv_aware import KvAware
from kvroute.policies.types import Decision
from kvroute.router.agent_request import parse_messages

from .conftest import StartEmulated, StartRouter
from .helpers import replica_source

HOUR = {"type": "ephemeral", "ttl": "1h"}
FIVE = {"type": "ephemeral"}


def _body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": FIVE}],
        "messages": [{"role": "user", "content": "Fix the test."}],
    }
    body.update(extra)
    return body


def test_ttl_values() -> None:
    assert ttl_of(HOUR) == 3600.0
    assert ttl_of({"type": "ephemeral", "ttl": "5m"}) == 300.0
    assert ttl_of(FIVE) == DEFAULT_TTL_S == 300.0  # no ttl: Anthropic's default 5 minutes
    assert ttl_of({"type": "ephemeral", "ttl": 3600}) == DEFAULT_TTL_S  # not a ttl string
    assert ttl_of({"type": "persistent", "ttl": "1h"}) is None
    assert ttl_of("1h") is None and ttl_of(None) is None


def test_the_longest_ttl_of_system_tools_and_messages_wins() -> None:
    assert cache_ttl_s({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert cache_ttl_s(_body()) == 300.0
    tools = [{"name": "bash", "input_schema": {"type": "object"}, "cache_control": HOUR}]
    assert cache_ttl_s(_body(tools=tools)) == 3600.0
    result = {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "text", "text": "ok", "cache_control": HOUR}],
            }
        ],
    }
    assert cache_ttl_s(_body(messages=[result])) == 3600.0
    assert cache_ttl_s({"system": "plain", "messages": "not a list", "tools": None}) is None


def test_parse_messages_carries_the_hint() -> None:
    assert parse_messages(json.dumps(_body()).encode()).cache_ttl_s == 300.0
    plain = _body(system="You are a coding agent.")
    assert parse_messages(json.dumps(plain).encode()).cache_ttl_s is None
    content = [{"type": "text", "text": "Fix the test.", "cache_control": HOUR}]
    hour = _body(messages=[{"role": "user", "content": content}])
    assert parse_messages(json.dumps(hour).encode()).cache_ttl_s == 3600.0


class _Recording(KvAware):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[RouteRequest] = []

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        self.seen.append(request)
        return super().decide(request, fleet)


def test_the_ledger_passes_the_hint_to_the_policy() -> None:
    policy = _Recording()
    fleet = FleetView([ReplicaState("r0"), ReplicaState("r1")], membership_version=1)
    ledger = DispatchLedger(policy, fleet, PrefixIndex(), prediction_ttl_s=1.0)
    ledger.route(RouteRequest(64, 8, None, "s", (1, 2, 3, 4), cache_ttl_s=3600.0), 0.0, 16)
    assert policy.seen[-1].cache_ttl_s == 3600.0 and policy.seen[-1].prefix_tokens is not None


async def test_a_messages_ttl_reaches_the_live_routers_policy(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replica = await start_emulated(num_blocks=256)
    r = await start_router([replica_source(replica, "emu-0")], routing={"tokenizer": "builtin"})
    policy = r.router.policy
    seen: list[RouteRequest] = []
    decide = policy.decide

    def recording(request: RouteRequest, fleet: FleetView) -> Decision:
        seen.append(request)
        return decide(request, fleet)

    policy.decide = recording  # type: ignore[method-assign]
    content = [{"type": "text", "text": "Fix the test.", "cache_control": HOUR}]
    body = _body(messages=[{"role": "user", "content": content}])
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/messages", json=body) as resp:
            assert resp.status == 200, await resp.text()
        async with http.post(r.url + "/v1/messages", json=_body(system="plain")) as resp:
            assert resp.status == 200, await resp.text()
    assert [s.cache_ttl_s for s in seen] == [3600.0, None]
