"""The endpoint picker over a data-parallel pod: it picks a rank as it picks a replica, names
it in the x-data-parallel-rank header it adds on the way to the pod, lists the pod's address
once, and the rank it named is the engine that serves (a grpc.aio client plays Envoy and then
sends the request on as Envoy would, with the picker's headers)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest

from kvroute.backends.kubernetes import PoolEndpoint, _data_parallel_size
from kvroute.router.config import config_from_dict
from kvroute.router.epp import messages
from kvroute.router.epp.server import PickerServer

from .conftest import Running, launch_emulated
from .test_dp_ranks import engine_samples
from .test_epp_protocol import Stream, body_message, headers_message, response_headers_message
from .test_epp_protocol import set_headers as answered_headers


@pytest.fixture(scope="module")
async def dp_picker() -> AsyncIterator[tuple[PickerServer, Running, grpc.aio.Channel]]:
    runner, pod = await launch_emulated(num_blocks=256, data_parallel_size=4)
    config = config_from_dict(
        {
            "replicas": [
                {
                    "url": pod.url,
                    "name": "pod",
                    "kv_events": pod.events,
                    "data_parallel_size": 4,
                }
            ],
            "routing": {"tokenizer": "builtin", "block_size": 16},
            # A probe past 1 s on a loaded box took a rank out (unhealthy_after 1).
            "health": {"interval_s": 0.5, "timeout_s": 5.0, "unhealthy_after": 1},
            "epp": {"grpc_port": 0, "health_port": 0, "metrics_port": 0},
        }
    )
    server = PickerServer(config)
    ports = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}")
    try:
        yield server, pod, channel
    finally:
        await channel.close()
        await server.stop(0)
        await runner.cleanup()


async def pick_and_serve(
    channel: grpc.aio.Channel, pod: Running, prompt: str
) -> tuple[list[str], str]:
    """One request through the picker and on to the pod: (destinations, rank header)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
    stream = Stream(channel)
    await stream.send(headers_message(), body_message(body, True))
    first = await stream.read()
    headers = answered_headers(first.request_headers.response)
    destinations = headers[messages.DESTINATION].split(",")
    rank = headers[messages.DP_RANK]
    while not (
        await stream.read()
    ).request_body.response.body_mutation.streamed_response.end_of_stream:
        pass
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"http://{destinations[0]}/v1/completions",
            data=body,
            headers={"content-type": "application/json", "x-data-parallel-rank": rank},
        ) as resp,
    ):
        answer = await resp.read()
        assert resp.status == 200
    await stream.send(response_headers_message(destinations[0]))
    await stream.send(body_message(answer, True, response=True))
    await stream.read()
    await stream.read()
    await stream.close()
    return destinations, rank


async def test_the_picker_names_a_rank_and_keeps_a_prefix_on_it(
    dp_picker: tuple[PickerServer, Running, grpc.aio.Channel],
) -> None:
    server, pod, channel = dp_picker
    ranks = {}
    for tenant in range(3):
        prompt = f"tenant {tenant} shared instructions " * 12
        destinations, rank = await pick_and_serve(channel, pod, prompt + "first")
        assert destinations == [pod.url.removeprefix("http://")]  # the pod once, not per rank
        ranks[tenant] = rank
        _, again = await pick_and_serve(channel, pod, prompt + "second")
        assert again == rank  # its prefix is on that rank
    # The ranks named are the engines that served: two requests each.
    finished = await engine_samples(pod.url, "vllm:e2e_request_latency_seconds_count")
    expected: dict[str, float] = {}
    for rank in ranks.values():
        expected[rank] = expected.get(rank, 0) + 2
    assert {k: v for k, v in finished.items() if v} == expected
    assert sorted(server.picker.registry.handles) == [f"pod@dp{k}" for k in range(4)]


def test_the_data_parallel_annotation_gives_ranks_per_target_port() -> None:
    assert _data_parallel_size("p", None) == 1
    assert _data_parallel_size("p", "8") == 8
    assert _data_parallel_size("p", "zero") == 1  # logged, routed as one rank
    assert _data_parallel_size("p", "0") == 1
    assert PoolEndpoint("p-rank-0", "10.0.0.5", 8000, (), 8).data_parallel_size == 8
