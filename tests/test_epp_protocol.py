"""The endpoint picker protocol, message by message: a grpc.aio client plays Envoy.

What Envoy does not let a test provoke at will (subset hints, a served endpoint other than the
pick, trailers, a stream torn down mid-response) is sent here by hand, over the real gRPC
service, against a picker whose three endpoints are emulated replicas.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from kvroute.router.epp import h2_grpc as h2
from kvroute.router.epp import messages
from kvroute.router.epp.endpoints import address, in_subset, parse_subset
from kvroute.router.epp.server import PickerServer
from kvroute.router.epp.service import PROCESS, _status_and_type, usage_of

from .conftest import Running, launch_emulated
from .helpers import wait_until
from .test_epp_envoy import picker_config
from .test_epp_h2 import RawClient, grpc_message

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
BODY = json.dumps(
    {"model": "tiny", "prompt": "Protocol test prompt " * 40, "max_tokens": 3}
).encode()


@dataclass
class Picker:
    server: PickerServer
    replicas: list[Running]
    channel: grpc.aio.Channel
    port: int

    @property
    def addresses(self) -> list[str]:
        return [r.url.removeprefix("http://") for r in self.replicas]

    def in_flight(self) -> dict[str, int]:
        return {s.replica_id: s.in_flight for s in self.server.picker.core.fleet.replicas}


@pytest.fixture(scope="module")
async def picker() -> AsyncIterator[Picker]:
    started = [await launch_emulated() for _ in range(3)]
    runners: list[web.AppRunner] = [r for r, _ in started]
    server = picker_config([x for _, x in started])
    ports = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}")
    try:
        yield Picker(server, [x for _, x in started], channel, ports.grpc)
    finally:
        await channel.close()
        await server.stop(0)
        for runner in runners:
            await runner.cleanup()


def headers_message(
    path: str = "/v1/completions",
    method: str = "POST",
    end_of_stream: bool = False,
    mode: int = FULL_DUPLEX,
    subset: Sequence[str] | str | None = None,
) -> ep.ProcessingRequest:
    headers = [(":path", path), (":method", method), ("content-type", "application/json")]
    message = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
            ),
            end_of_stream=end_of_stream,
        ),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({messages.SUBSET: subset})
        message.metadata_context.filter_metadata[messages.SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def body_message(body: bytes, end_of_stream: bool, response: bool = False) -> ep.ProcessingRequest:
    part = ep.HttpBody(body=body, end_of_stream=end_of_stream)
    if response:
        return ep.ProcessingRequest(response_body=part)
    return ep.ProcessingRequest(request_body=part)


def response_headers_message(
    served: str | None, status: int = 200, content_type: str = "application/json"
) -> ep.ProcessingRequest:
    message = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                    base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode()),
                ]
            )
        )
    )
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({messages.SERVED: served})
        message.metadata_context.filter_metadata[messages.LB_NAMESPACE].CopyFrom(lb)
    return message


class Stream:
    """One ext_proc stream: send messages, read the picker's answers."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = ep_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, *messages_: ep.ProcessingRequest) -> None:
        for message in messages_:
            await asyncio.wait_for(self.call.write(message), 10)

    async def read(self) -> ep.ProcessingResponse:
        response = await asyncio.wait_for(self.call.read(), 10)
        assert isinstance(response, ep.ProcessingResponse), response
        return response

    async def close(self) -> None:
        await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:
            pass


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def destination_metadata(response: ep.ProcessingResponse) -> str:
    lb = response.dynamic_metadata.fields[messages.LB_NAMESPACE].struct_value
    return lb.fields[messages.DESTINATION].string_value


async def test_full_duplex_answers_headers_with_the_pick_then_echoes_the_body(
    picker: Picker,
) -> None:
    stream = Stream(picker.channel)
    half = len(BODY) // 2
    await stream.send(headers_message(), body_message(BODY[:half], False))
    await stream.send(body_message(BODY[half:], True))
    first = await stream.read()
    # The first answer is to the headers, and it carries the pick: nothing was sent earlier.
    assert first.WhichOneof("response") == "request_headers"
    common = first.request_headers.response
    assert common.clear_route_cache
    headers = set_headers(common)
    destinations = headers[messages.DESTINATION].split(",")
    assert sorted(destinations) == sorted(picker.addresses)  # the ranking: all three
    assert destination_metadata(first) == headers[messages.DESTINATION]
    assert headers["content-length"] == str(len(BODY))
    assert set(messages.SYSTEM_HEADERS) <= set(common.header_mutation.remove_headers)
    echoed = b""
    while True:
        answer = await stream.read()
        streamed = answer.request_body.response.body_mutation.streamed_response
        echoed += streamed.body
        if streamed.end_of_stream:
            break
    assert echoed == BODY
    assert picker.in_flight()[destinations[0]] == 1
    # A JSON response: its headers are answered with its body (one write, one wake-up).
    await stream.send(response_headers_message(destinations[0]))
    usage = b'{"usage": {"prompt_tokens": 40, "completion_tokens": 3}}'
    await stream.send(body_message(usage, True, response=True))
    assert (await stream.read()).WhichOneof("response") == "response_headers"
    echo = (await stream.read()).response_body.response.body_mutation.streamed_response
    assert (echo.body, echo.end_of_stream) == (usage, True)
    await stream.close()
    assert sum(picker.in_flight().values()) == 0


async def test_a_response_that_ends_with_its_stream_in_one_read_closes_its_request_completed(
    picker: Picker,
) -> None:
    """Envoy sends the last response message and the stream's end together: the answer and
    the trailers go back together, and the request is closed in the ledger as completed (200
    with its usage), not as torn down (499) by the stream's close."""
    counts = picker.server.picker.metrics.requests
    before = dict(counts)
    client = await RawClient.connect(picker.port)
    client.send(h2.HEADERS, h2.END_HEADERS, 1, client.headers_block(PROCESS))
    client.send(
        h2.DATA,
        0,
        1,
        grpc_message(headers_message().SerializeToString())
        + grpc_message(body_message(BODY, True).SerializeToString()),
    )
    await wait_until(lambda: sum(picker.in_flight().values()) == 1, what="picked")
    usage = b'{"usage": {"prompt_tokens": 40, "completion_tokens": 3}}'
    client.send(
        h2.DATA,
        h2.END_STREAM,
        1,
        grpc_message(response_headers_message(None).SerializeToString())
        + grpc_message(body_message(usage, True, response=True).SerializeToString()),
    )
    _, trailers, _ = await client.response(1)
    await client.close()
    assert trailers["grpc-status"] == "0"
    assert sum(picker.in_flight().values()) == 0
    added = {key: n - before.get(key, 0) for key, n in counts.items() if n != before.get(key, 0)}
    assert [(status, n) for (_, status, _), n in added.items()] == [(200, 1)]


async def test_an_event_streams_headers_are_answered_before_its_first_event(
    picker: Picker,
) -> None:
    """A stream's first event may be seconds away (prefill): its headers go on at once."""
    stream = Stream(picker.channel)
    await stream.send(headers_message(), body_message(BODY, True))
    await stream.read()  # the pick
    answer = await stream.read()  # the echoed body, in one message
    assert answer.request_body.response.body_mutation.streamed_response.end_of_stream
    await stream.send(response_headers_message(None, content_type="text/event-stream"))
    assert (await stream.read()).WhichOneof("response") == "response_headers"
    await stream.close()


async def test_the_picker_decomposes_prefix_reuse_with_the_usage_it_reads(
    picker: Picker,
) -> None:
    """Available and captured at the pick, confirmed from the response's cached_tokens (the
    same decomposition as the HTTP router's, kvcore/reuse.py)."""
    metrics = picker.server.picker.metrics
    prompt = {"model": "tiny", "prompt": "Reuse seen through the picker. " * 30, "max_tokens": 1}
    body = json.dumps(prompt).encode()

    def total(table: dict[tuple[str, str], int], kind: str) -> int:
        return sum(v for (_, k), v in table.items() if k == kind)

    async def exchange(usage: bytes) -> tuple[dict[str, str], dict[str, int]]:
        before = {k: total(metrics.reuse, k) for k in ("available", "captured", "confirmed")}
        before |= {k: total(metrics.reuse_lost, k) for k in ("workload", "routing", "index")}
        before["unconfirmed"] = sum(metrics.reuse_unconfirmed.values())
        stream = Stream(picker.channel)
        await stream.send(headers_message(), body_message(body, True))
        first = await stream.read()
        picked = set_headers(first.request_headers.response)[messages.DESTINATION].split(",")[0]
        await stream.read()  # the echoed body
        await stream.send(response_headers_message(picked))
        await stream.send(body_message(usage, True, response=True))
        added = set_headers((await stream.read()).response_headers.response)
        await stream.read()
        await stream.close()
        after = {k: total(metrics.reuse, k) for k in ("available", "captured", "confirmed")}
        after |= {k: total(metrics.reuse_lost, k) for k in ("workload", "routing", "index")}
        after["unconfirmed"] = sum(metrics.reuse_unconfirmed.values())
        return added, {k: after[k] - before[k] for k in after}

    cold = b'{"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}}'
    headers, moved = await exchange(cold)
    assert headers["x-kvroute-prefix-available-tokens"] == "0"
    assert moved["available"] == moved["captured"] == moved["confirmed"] == 0
    assert moved["workload"] > 0 and moved["unconfirmed"] == 0
    # Again: the pick follows its own prediction; the usage does not say what was reused.
    headers, moved = await exchange(b'{"usage": {"prompt_tokens": 9, "completion_tokens": 1}}')
    hit = int(headers["x-kvroute-prefix-hit-tokens"])
    assert int(headers["x-kvroute-prefix-available-tokens"]) == hit > 0
    captured = moved["captured"]
    assert moved["available"] == captured > 0 and moved["routing"] == 0
    assert (moved["unconfirmed"], moved["confirmed"], moved["index"]) == (1, 0, 0)
    # And once more, the engine reporting one block less than the index expected.
    usage = {"usage": {"prompt_tokens_details": {"cached_tokens": captured - 16}}}
    headers, moved = await exchange(json.dumps(usage).encode())
    assert (moved["captured"], moved["confirmed"], moved["index"]) == (captured, captured - 16, 16)


async def test_bodies_over_62000_bytes_are_echoed_in_chunks(picker: Picker) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x" * 200_000, "max_tokens": 1}).encode()
    stream = Stream(picker.channel)
    await stream.send(headers_message(), body_message(body, True))
    assert (await stream.read()).WhichOneof("response") == "request_headers"
    chunks = []
    while True:
        streamed = (await stream.read()).request_body.response.body_mutation.streamed_response
        chunks.append(streamed.body)
        if streamed.end_of_stream:
            break
    assert max(len(c) for c in chunks) <= messages.BODY_CHUNK_BYTES
    assert len(chunks) == 4 and b"".join(chunks) == body
    await stream.close()
    await wait_until(lambda: sum(picker.in_flight().values()) == 0, what="closed in the ledger")


async def test_subset_hint_limits_the_pick_and_503s_when_none_is_eligible(
    picker: Picker,
) -> None:
    only = picker.addresses[1]
    stream = Stream(picker.channel)
    await stream.send(headers_message(subset=[only]), body_message(BODY, True))
    first = await stream.read()
    assert set_headers(first.request_headers.response)[messages.DESTINATION] == only
    await stream.close()
    # A comma-joined string and a bare IP are accepted too.
    stream = Stream(picker.channel)
    await stream.send(headers_message(subset="127.0.0.1"), body_message(BODY, True))
    first = await stream.read()
    listed = set_headers(first.request_headers.response)[messages.DESTINATION].split(",")
    assert sorted(listed) == sorted(picker.addresses)
    await stream.close()

    stream = Stream(picker.channel)
    await stream.send(headers_message(subset=["10.9.9.9:8000"]), body_message(BODY, True))
    answer = await stream.read()
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "no_ready_endpoint"
    await stream.close()
    assert sum(picker.in_flight().values()) == 0


async def test_served_elsewhere_moves_the_request_in_the_ledger(picker: Picker) -> None:
    stream = Stream(picker.channel)
    await stream.send(headers_message(), body_message(BODY, True))
    first = await stream.read()
    picked, fallback = set_headers(first.request_headers.response)[messages.DESTINATION].split(",")[
        :2
    ]
    await stream.read()  # the echoed body
    before = picker.server.picker.decisions.served_elsewhere
    await stream.send(response_headers_message(fallback))
    decisions = picker.server.picker.decisions
    await wait_until(lambda: decisions.served_elsewhere == before + 1, what="served elsewhere")
    flights = picker.in_flight()
    assert (flights[picked], flights[fallback]) == (0, 1)
    # The stream is torn down before the response ends (client gone): closed all the same.
    stream.call.cancel()
    await wait_until(lambda: sum(picker.in_flight().values()) == 0, what="closed in the ledger")


async def test_trailers_end_the_body_and_are_answered_in_order(picker: Picker) -> None:
    stream = Stream(picker.channel)
    await stream.send(headers_message(), body_message(BODY, False))
    await stream.send(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    kinds = [(await stream.read()).WhichOneof("response") for _ in range(3)]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    await stream.close()


async def test_buffered_mode_puts_the_pick_on_the_body_answer(picker: Picker) -> None:
    stream = Stream(picker.channel)
    await stream.send(headers_message(mode=BUFFERED))
    first = await stream.read()  # answered at once, before any body
    assert first.WhichOneof("response") == "request_headers"
    assert messages.DESTINATION not in set_headers(first.request_headers.response)
    await stream.send(body_message(BODY, True))
    answer = await stream.read()
    common = answer.request_body.response
    headers = set_headers(common)
    assert headers["content-length"] == str(len(BODY))
    assert common.body_mutation.body == BODY
    assert destination_metadata(answer) == headers[messages.DESTINATION]
    await stream.close()


async def test_header_only_requests_are_answered_at_once(picker: Picker) -> None:
    stream = Stream(picker.channel)
    await stream.send(headers_message("/v1/models", "GET", end_of_stream=True))
    answer = await stream.read()
    destination = set_headers(answer.request_headers.response)[messages.DESTINATION]
    assert destination in picker.addresses
    assert destination_metadata(answer) == destination
    await stream.close()


async def test_bad_bodies_get_openai_errors_as_immediate_responses(picker: Picker) -> None:
    for body, status, param in (
        (b"{oops", 400, None),
        (b'{"model": "tiny", "messages": []}', 400, "messages"),
        (b'{"model": "other", "prompt": "x"}', 404, "model"),
    ):
        stream = Stream(picker.channel)
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        await stream.send(headers_message(path), body_message(body, True))
        answer = (await stream.read()).immediate_response
        assert answer.status.code == status, body
        error = json.loads(answer.body)["error"]
        assert error["message"] and error["param"] == param
        content_type = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
        assert content_type["content-type"] == b"application/json"
        await stream.close()


async def test_agent_api_bodies_are_picked_and_their_errors_keep_each_vendors_shape(
    picker: Picker,
) -> None:
    """Messages and Responses are parsed as vLLM converts them and keyed like chat: the same
    conversation picked twice finds the prefix its first pick predicted."""
    system = "You are a coding agent working in a large repository. " * 20
    messages_body = {"model": "tiny", "max_tokens": 4, "system": system,
                     "messages": [{"role": "user", "content": "List the files."}]}  # fmt: skip
    responses_body = {"model": "tiny", "instructions": system.upper(), "input": "List the files."}
    for path, obj in (("/v1/messages", messages_body), ("/v1/responses", responses_body)):
        hits = []
        for _ in range(2):
            stream = Stream(picker.channel)
            await stream.send(headers_message(path), body_message(json.dumps(obj).encode(), True))
            pick = set_headers((await stream.read()).request_headers.response)
            await stream.read()  # the echoed body
            served = pick[messages.DESTINATION].split(",")[0]
            await stream.send(response_headers_message(served, content_type="text/event-stream"))
            added = set_headers((await stream.read()).response_headers.response)
            hits.append(int(added["x-kvroute-prefix-hit-tokens"]))
            await stream.send(body_message(b"event: message_stop\ndata: {}\n\n", True, True))
            await stream.read()  # the response's end: the request finished, its prompt cached
            await stream.close()
        assert hits[0] == 0 and hits[1] > 0, path
    for path, body, shape in (
        ("/v1/messages", b'{"model": "tiny", "messages": []}', "anthropic"),
        ("/v1/messages/count_tokens", b"{oops", "anthropic"),
        ("/v1/responses", b'{"model": "tiny", "input": 3}', "openai"),
    ):
        stream = Stream(picker.channel)
        await stream.send(headers_message(path), body_message(body, True))
        answer = (await stream.read()).immediate_response
        assert answer.status.code == 400, path
        error = json.loads(answer.body)
        if shape == "anthropic":
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        else:
            assert error["error"]["param"] == "input"
        await stream.close()


def test_addresses_subsets_and_usage() -> None:
    assert address("10.0.0.5", 8000) == "10.0.0.5:8000"
    assert address("fd00::5", 8000) == "[fd00::5]:8000"
    subset = parse_subset(["10.0.0.5:8000, [fd00::5]:8001", "10.0.0.7"])
    assert in_subset("10.0.0.5:8000", subset)
    assert not in_subset("10.0.0.5:8001", subset)
    assert in_subset("[fd00::5]:8001", subset)
    assert in_subset("10.0.0.7:9000", subset)  # a bare IP matches any port
    body = b'{"id": "x", "usage": {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}}'
    assert usage_of(body, sse=False) == {"prompt": 7, "completion": 2, "cached": 4}
    sse = (
        b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert usage_of(sse, sse=True) == {"prompt": 5, "completion": 1}
    assert usage_of(b"data: [DONE]\n\n", sse=True) is None
    assert usage_of(b"{broken", sse=False) is None


async def test_an_oversized_body_is_refused_before_it_is_all_in() -> None:
    runner, replica = await launch_emulated()
    server = picker_config([replica])
    server.config.limits.max_body_bytes = 1000
    ports = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
            stream = Stream(channel)
            await stream.send(headers_message(), body_message(b"x" * 800, False))
            await stream.send(body_message(b"x" * 800, False))
            answer = (await stream.read()).immediate_response
            assert answer.status.code == 413
            assert json.loads(answer.body)["error"]["message"]
            await stream.close()
    finally:
        await server.stop(0)
        await runner.cleanup()


def test_streamed_bodies_split_only_past_the_chunk_bound() -> None:
    def bodies(body: bytes) -> list[tuple[bytes, bool]]:
        out = []
        for written in messages.streamed_bodies(body, True, request=False):
            answer = ep.ProcessingResponse.FromString(written)
            streamed = answer.response_body.response.body_mutation.streamed_response
            out.append((streamed.body, streamed.end_of_stream))
        return out

    bound = messages.BODY_CHUNK_BYTES
    assert bodies(b"") == [(b"", True)]
    assert bodies(b"y" * bound) == [(b"y" * bound, True)]  # one message, as it came
    assert bodies(b"y" * (bound + 1)) == [(b"y" * bound, False), (b"y", True)]


def test_the_shared_constant_answers_are_the_ones_built_per_stream() -> None:
    """The picker answers from module-level messages; they must be what it used to build."""
    assert messages.response_headers() == ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=ep.HeaderMutation())
        )
    )
    assert messages.passed_body(request=True) == ep.ProcessingResponse(
        request_body=ep.BodyResponse()
    )
    assert messages.trailers(request=False) == ep.ProcessingResponse(
        response_trailers=ep.TrailersResponse()
    )
    with_header = messages.response_headers([("x-kvroute-replica", "a")])
    assert set_headers(with_header.response_headers.response) == {"x-kvroute-replica": "a"}
    assert messages.response_headers() == ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=ep.HeaderMutation())
        )
    )  # untouched by the call that added a header


def test_response_status_and_type_read_from_raw_or_plain_values() -> None:
    headers = [
        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
        base_pb2.HeaderValue(key="Content-Type", value="text/event-stream; charset=utf-8"),
        base_pb2.HeaderValue(key="x-other", raw_value=b"1"),
    ]
    assert _status_and_type(headers) == ("200", "text/event-stream; charset=utf-8")
    assert _status_and_type([]) == ("", "")


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 62_000])
@pytest.mark.parametrize("end_of_stream", [False, True])
@pytest.mark.parametrize("request_side", [True, False])
def test_streamed_body_answers_are_what_protobuf_serializes(
    size: int, end_of_stream: bool, request_side: bool
) -> None:
    chunk = bytes(i % 256 for i in range(size))
    answer = ep.BodyResponse(
        response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(
                streamed_response=ep.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
            )
        )
    )
    expected = (
        ep.ProcessingResponse(request_body=answer)
        if request_side
        else ep.ProcessingResponse(response_body=answer)
    )
    written = messages.streamed_body(chunk, end_of_stream, request=request_side)
    assert written == expected.SerializeToString()
    assert ep.ProcessingResponse.FromString(written) == expected


async def test_a_request_queued_in_admission_waits_for_its_pick_and_a_cancel_frees_it() -> None:
    """With one request allowed at a time, the next one queues in the picker (it is not
    refused), gets its pick when the first finishes, and a queued one whose client leaves
    gives its place up."""
    runner, replica = await launch_emulated()
    config = picker_config([replica]).config
    limits = config.limits
    limits.max_concurrent_requests, limits.max_queued_requests = 1, 4
    limits.queue_timeout_s = 30.0
    config.fairness.reserved_slots = 0  # no start above the limit for a sparse tenant
    server = PickerServer(config)
    ports = await server.start()
    admission = server.picker.admission
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
            first = Stream(channel)
            await first.send(headers_message(), body_message(BODY, True))
            assert (await first.read()).HasField("request_headers")
            await first.read()  # the echoed body

            queued = Stream(channel)
            await queued.send(headers_message(), body_message(BODY, True))
            leaving = Stream(channel)
            await leaving.send(headers_message(), body_message(BODY, True))
            await wait_until(lambda: admission.queued == 2)
            leaving.call.cancel()
            await wait_until(lambda: admission.queued == 1)

            answered = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 1}}'
            await first.send(response_headers_message(None), body_message(answered, True, True))
            await first.read()
            await first.read()
            pick = await queued.read()  # the first one finished: the queued one's turn
            assert set_headers(pick.request_headers.response)[messages.DESTINATION]
            assert (admission.active, admission.queued) == (1, 0)
            await first.close()
            await queued.close()
            await wait_until(lambda: admission.active == 0)
    finally:
        await server.stop(0)
        await runner.cleanup()


@pytest.mark.parametrize(
    ("set_headers", "destinations"),
    [
        (
            [(messages.DESTINATION, "10.0.0.1:8000,10.0.0.2:8000"), ("content-length", "1068")],
            "10.0.0.1:8000,10.0.0.2:8000",
        ),
        ([(messages.DESTINATION, "[fd00::1]:8000")], "[fd00::1]:8000"),
        ([("x-long", "v" * 300)], ",".join(f"10.0.{i}.1:8000" for i in range(40))),
        ([], ""),
    ],
)
def test_the_pick_answer_is_what_protobuf_serializes(
    set_headers: list[tuple[str, str]], destinations: str
) -> None:
    expected = messages.request_headers(
        set_headers, messages.SYSTEM_HEADERS, destinations=destinations
    )
    written = messages.pick_headers_answer(set_headers, destinations)
    assert written == expected.SerializeToString()
    assert ep.ProcessingResponse.FromString(written) == expected
