"""Several pickers sharing their dispatches over a real NATS server (Debian's nats-server).

Two pickers in front of the same two replicas, which publish no KV events: what one picker
sends somewhere, the other learns only through the bus.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvroute.kvcore.stats import parse_metrics
from kvroute.router.config import config_from_dict
from kvroute.router.epp.server import PickerServer
from kvroute.router.ledger_bus import DISPATCH, LedgerEvent

from .conftest import Running, StartEmulated
from .helpers import wait_until
from .test_epp_protocol import BODY, Stream, body_message, headers_message, set_headers


def picker(replicas: list[Running], bus: str | None) -> PickerServer:
    return PickerServer(
        config_from_dict(
            {
                "replicas": [
                    {"url": r.url, "name": r.url.removeprefix("http://")} for r in replicas
                ],
                "routing": {"tokenizer": "builtin", "block_size": 16},
                "epp": {
                    "grpc_port": 0,
                    "health_port": 0,
                    "metrics_port": 0,
                    "ledger_bus": bus,
                    "ledger_bus_subject": "kvroute.test",
                },
            }
        )
    )


@pytest.fixture
async def two_pickers(
    start_emulated: StartEmulated, nats_url: str
) -> AsyncIterator[tuple[PickerServer, PickerServer]]:
    replicas = [await start_emulated(kv_events=False) for _ in range(2)]
    a, b = picker(replicas, nats_url), picker(replicas, nats_url)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.stop(0)
        await b.stop(0)


async def first_pick(server: PickerServer, body: bytes = BODY) -> tuple[str, Stream]:
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.ports.grpc}")
    stream = Stream(channel)
    await stream.send(headers_message(), body_message(body, True))
    answer = await stream.read()
    await stream.read()  # the echoed body
    return set_headers(answer.request_headers.response)["x-gateway-destination-endpoint"].split(
        ","
    )[0], stream


async def test_a_prefix_sent_by_one_picker_is_followed_by_the_other(
    two_pickers: tuple[PickerServer, PickerServer],
) -> None:
    a, b = two_pickers
    where, stream_a = await first_pick(a)
    b_states = {s.replica_id: s for s in b.picker.core.fleet.replicas}
    # B counts A's request in flight there, and predicts A's prompt cached there.
    await wait_until(lambda: b_states[where].in_flight == 1, what="A's dispatch on B")
    again, stream_b = await first_pick(b)
    assert again == where
    # A's request ends: B's count of it ends too (B's own request is still open).
    await stream_a.close()
    await wait_until(lambda: b_states[where].in_flight == 1, what="A's finish on B")
    assert b.picker.bus is not None and b.picker.bus.remote_open == 0
    await stream_b.close()
    a_states = {s.replica_id: s for s in a.picker.core.fleet.replicas}
    await wait_until(lambda: a_states[where].in_flight == 0, what="B's finish on A")
    # What each picker's metrics port says of it: connected, A's dispatch sent and applied on B.
    page_a, page_b = await _bus_samples(a), await _bus_samples(b)
    assert page_a["connected", "dispatch", ""] == page_b["connected", "dispatch", ""] == 1
    assert page_a["updates_total", "dispatch", "sent"] >= 2  # its dispatch and its finish
    assert page_b["updates_total", "dispatch", "applied"] >= 1


async def _bus_samples(server: PickerServer) -> dict[tuple[str, str, str], float]:
    """kvroute_bus_* from the picker's metrics port: (name, bus, direction) -> value."""
    url = f"http://127.0.0.1:{server.ports.metrics}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        page = parse_metrics(await resp.read())
    return {
        (
            s.name.removeprefix("kvroute_bus_"),
            s.labels["bus"],
            s.labels.get("direction", ""),
        ): s.value
        for s in page.samples
        if s.name.startswith("kvroute_bus_") and not s.name.endswith("_created")
    }


async def test_without_the_bus_the_other_picker_knows_nothing(
    start_emulated: StartEmulated,
) -> None:
    replicas = [await start_emulated(kv_events=False) for _ in range(2)]
    a, b = picker(replicas, None), picker(replicas, None)
    await a.start()
    await b.start()
    try:
        _, stream = await first_pick(a)
        assert all(s.in_flight == 0 for s in b.picker.core.fleet.replicas)
        await stream.close()
    finally:
        await a.stop(0)
        await b.stop(0)


async def test_a_silent_picker_s_dispatches_are_closed(
    two_pickers: tuple[PickerServer, PickerServer],
) -> None:
    _, b = two_pickers
    bus = b.picker.bus
    assert bus is not None
    replica = b.picker.core.fleet.replicas[0].replica_id
    now = asyncio.get_running_loop().time()
    bus._heard["crashed-picker"] = now
    bus.apply("crashed-picker", LedgerEvent(DISPATCH, 1, replica, 100, 10, 0, []), now)
    state = b.picker.core.fleet.replicas[0]
    assert (state.in_flight, bus.remote_open) == (1, 1)
    assert bus.forget_silent(now + bus.silence_s + 1) == 1
    assert (state.in_flight, bus.remote_open) == (0, 0)


async def test_a_busy_picker_sends_no_heartbeat_and_a_quiet_one_does(
    two_pickers: tuple[PickerServer, PickerServer],
) -> None:
    """Any message tells the others a picker is alive: a heartbeat goes only after a quiet
    ``heartbeat_s``, and the others keep hearing a busy picker without one."""
    a, b = two_pickers
    bus_a, bus_b = a.picker.bus, b.picker.bus
    assert bus_a is not None and bus_b is not None
    await wait_until(lambda: bus_a.messages > 0, what="A's first message")
    sent = bus_a._sent_at
    assert not bus_a.beat_due(sent + bus_a.heartbeat_s / 2)
    assert bus_a.beat_due(sent + bus_a.heartbeat_s)
    # A quiet picker's heartbeats keep it heard (and its dispatches open) on the other.
    await wait_until(lambda: bus_a.origin in bus_b._heard, timeout_s=5, what="A heard on B")
    heard = bus_b._heard[bus_a.origin]
    await wait_until(
        lambda: bus_b._heard[bus_a.origin] > heard, timeout_s=5, what="A's next heartbeat"
    )
