"""``kvroute epp --pool-name``: the picker's endpoints from an InferencePool, end to end.

There is no Kubernetes API server on these machines: ``tests/k8s_api.py`` serves the list/watch
protocol as the API server does. One pod at 127.0.0.1 with two target ports (two data-parallel
ranks) stands for the pool; each rank is an emulated replica publishing its KV events on the
port the pod's ``kvroute.io/kv-events-ports`` annotation names.
"""

from __future__ import annotations

from pathlib import Path

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.router.config import config_from_dict
from kvroute.router.epp import messages
from kvroute.router.epp.server import PickerServer

from .conftest import launch_emulated
from .helpers import wait_until
from .k8s_api import PODS, POOLS, FakeKubeAPI, make_pod, make_pool, set_ready
from .test_epp_protocol import BODY, Stream, body_message, headers_message, set_headers


async def readiness(port: int) -> int:
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness")
        )
    return int(reply.status)


async def destinations(channel: aio.Channel) -> list[str] | int:
    """The pick's fallback list, or the status of the picker's immediate answer."""
    stream = Stream(channel)
    await stream.send(headers_message(), body_message(BODY, True))
    answer = await stream.read()
    await stream.close()
    if answer.HasField("immediate_response"):
        return int(answer.immediate_response.status.code)
    return set_headers(answer.request_headers.response)[messages.DESTINATION].split(",")


async def test_picker_follows_an_inference_pool(tmp_path: Path) -> None:
    started = [await launch_emulated() for _ in range(2)]
    ranks = [r for _, r in started]
    ports = [int(r.url.rsplit(":", 1)[1]) for r in ranks]
    events = [r.events.rsplit(":", 1)[1] for r in ranks]
    api = await FakeKubeAPI().start()
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    config = config_from_dict(
        {
            "routing": {"tokenizer": "builtin", "block_size": 16},
            "epp": {
                "grpc_port": 0,
                "health_port": 0,
                "metrics_port": 0,
                "pool_name": "vllm-pool",
                "kubeconfig": str(kubeconfig),
            },
        }
    )
    server = PickerServer(config)
    try:
        picker_ports = await server.start()
        # No pool yet: alive, not ready (the gateway's probes keep traffic away).
        assert await readiness(picker_ports.health) == health_pb2.HealthCheckResponse.NOT_SERVING
        api.put(POOLS, make_pool(ports=ports))
        api.put(
            PODS,
            make_pod(
                "vllm-0", "127.0.0.1", annotations={"kvroute.io/kv-events-ports": ",".join(events)}
            ),
        )
        await wait_until(lambda: server.synced.is_set(), what="the pool synced")
        assert await readiness(picker_ports.health) == health_pb2.HealthCheckResponse.SERVING
        addresses = {f"127.0.0.1:{p}" for p in ports}
        picker = server.picker
        assert set(picker.address) >= {"vllm-0-rank-0", "vllm-0-rank-1"}
        # Each rank's KV events are followed at the annotated port.
        sources = {endpoint for _, endpoint in picker.core.kv_events.stats_by_source()}
        assert sources == {r.events for r in ranks}
        async with aio.insecure_channel(f"127.0.0.1:{picker_ports.grpc}") as channel:
            listed = await destinations(channel)
            assert isinstance(listed, list) and set(listed) == addresses

            # The pod leaves readiness: it leaves the picks at once.
            api.update(PODS, "vllm-0", set_ready(False))
            await wait_until(lambda: len(picker.registry) == 0, what="endpoints gone")
            assert await destinations(channel) == 503
            # Back in readiness: picked again without waiting for a probe.
            api.update(PODS, "vllm-0", set_ready(True))
            await wait_until(lambda: picker.registry.in_rotation() == 2, what="endpoints back")
            listed = await destinations(channel)
            assert isinstance(listed, list) and set(listed) == addresses
    finally:
        await server.stop(0)
        await api.stop()
        for runner, _ in started:
            await runner.cleanup()
