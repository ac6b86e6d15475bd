"""ext_proc responses, built from Envoy's protos (``xds-protos``).

Body chunks stay under 62,000 bytes (Envoy's streamed mutations must be under 64 KiB; the
reference picker uses the same bound).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

BODY_CHUNK_BYTES = 62_000
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
FAIRNESS_ID = "x-gateway-inference-fairness-id"
OBJECTIVE = "x-gateway-inference-objective"
# vLLM's header naming the data-parallel rank (engine) that serves the request.
DP_RANK = "x-data-parallel-rank"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Set by the gateway and the picker only: never forwarded from the client to the pod.
SYSTEM_HEADERS = (
    FAIRNESS_ID,
    OBJECTIVE,
    "x-gateway-model-name-rewrite",
    SUBSET,
    SERVED,
)

Headers = Sequence[tuple[str, str]]
# What a stream sends: a message, or one already in its wire format.
Answer = ep.ProcessingResponse | bytes


def header_mutation(set_headers: Headers, remove: Sequence[str] = ()) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def destination_metadata(destinations: str) -> struct_pb2.Struct:
    # Built from its fields: Struct.update converts through Python dicts (3x the time).
    lb = struct_pb2.Struct(fields={DESTINATION: struct_pb2.Value(string_value=destinations)})
    return struct_pb2.Struct(fields={LB_NAMESPACE: struct_pb2.Value(struct_value=lb)})


def request_headers(
    set_headers: Headers = (), remove: Sequence[str] = (), *, destinations: str | None = None
) -> ep.ProcessingResponse:
    """The request-headers answer; with ``destinations``, the pick (header and metadata)."""
    common = ep.CommonResponse(
        header_mutation=header_mutation(set_headers, remove), clear_route_cache=True
    )
    if destinations is None:
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=common),
        dynamic_metadata=destination_metadata(destinations),
    )


def pick_headers_answer(set_headers: Headers, destinations: str) -> bytes:
    """The pick as the request-headers answer, in protobuf's wire format (what
    ``request_headers(set_headers, SYSTEM_HEADERS, destinations=...)`` serializes to, as a
    test holds): the header mutation, the system headers removed, the route cache cleared
    and the ``envoy.lb`` metadata, without building some twenty message objects a request."""
    mutation = b"".join(_header_option(k, v) for k, v in set_headers) + _REMOVE_SYSTEM
    common = _field(2, mutation) + _CLEAR_ROUTE_CACHE  # header_mutation, clear_route_cache
    lb = _map_entry(DESTINATION, _field(3, destinations.encode()))  # Value.string_value
    metadata = _map_entry(LB_NAMESPACE, _field(5, lb))  # Value.struct_value
    # ProcessingResponse.request_headers{response}, .dynamic_metadata
    return _field(1, _field(1, common)) + _field(8, metadata)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (messages, strings, bytes)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _header_option(key: str, value: str) -> bytes:
    """HeaderValueOption{header: {key, raw_value}, append_action: OVERWRITE_IF_EXISTS_OR_ADD}."""
    header = _field(1, key.encode()) + _field(3, value.encode())
    return _field(1, _field(1, header) + _OVERWRITE)


def _map_entry(key: str, value: bytes) -> bytes:
    """One entry of a ``Struct``'s ``fields`` map (field 1: key 1, value 2)."""
    return _field(1, _field(1, key.encode()) + _field(2, value))


def buffered_request_body(
    body: bytes, set_headers: Headers, remove: Sequence[str], destinations: str
) -> ep.ProcessingResponse:
    """BUFFERED mode: the pick rides on the body answer, with the body and its length."""
    headers = [*set_headers, ("content-length", str(len(body)))]
    common = ep.CommonResponse(
        header_mutation=header_mutation(headers, remove),
        body_mutation=ep.BodyMutation(body=body),
        clear_route_cache=True,
    )
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=common),
        dynamic_metadata=destination_metadata(destinations),
    )


def streamed_bodies(body: bytes, end_of_stream: bool, *, request: bool) -> Iterator[bytes]:
    """FULL_DUPLEX_STREAMED: ``body`` echoed in chunks of at most ``BODY_CHUNK_BYTES``, each
    answer already serialized."""
    if len(body) <= BODY_CHUNK_BYTES:  # the usual case: one message
        yield streamed_body(body, end_of_stream, request=request)
        return
    view = memoryview(body)
    starts = range(0, len(body), BODY_CHUNK_BYTES)
    last = starts[-1]
    for start in starts:
        chunk = view[start : start + BODY_CHUNK_BYTES]
        yield streamed_body(chunk, end_of_stream and start == last, request=request)


def streamed_body(chunk: bytes | memoryview, end_of_stream: bool, *, request: bool) -> bytes:
    """``ProcessingResponse{request_body|response_body: {response: {body_mutation:
    {streamed_response: {body, end_of_stream}}}}}`` in protobuf's wire format, written here:
    building the message objects and serializing them copied a 62 KB chunk three times. The
    bytes are what ``SerializeToString`` gives (a test holds them equal)."""
    size = len(chunk)
    # proto3 leaves out empty fields: an empty body is no field at all.
    body_field = 1 + _varint_size(size) + size if size else 0
    inner = body_field + (2 if end_of_stream else 0)
    mutation = 1 + _varint_size(inner) + inner
    common = 1 + _varint_size(mutation) + mutation
    answer = 1 + _varint_size(common) + common
    head = b"".join(
        (
            _REQUEST_BODY if request else _RESPONSE_BODY,
            _varint(answer),
            b"\x0a",  # BodyResponse.response
            _varint(common),
            b"\x1a",  # CommonResponse.body_mutation
            _varint(mutation),
            b"\x1a",  # BodyMutation.streamed_response
            _varint(inner),
            b"\x0a" + _varint(size) if size else b"",  # StreamedBodyResponse.body
        )
    )
    return b"".join((head, chunk, b"\x10\x01" if end_of_stream else b""))  # .end_of_stream


_REQUEST_BODY = b"\x1a"  # ProcessingResponse.request_body: field 3, length-delimited
_RESPONSE_BODY = b"\x22"  # ProcessingResponse.response_body: field 4


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


_OVERWRITE = b"\x18" + bytes([base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD])
_CLEAR_ROUTE_CACHE = b"\x28\x01"  # CommonResponse.clear_route_cache: field 5, true
_REMOVE_SYSTEM = b"".join(_field(2, name.encode()) for name in SYSTEM_HEADERS)


# Answers that never vary, built once (each stream would otherwise build them anew). Shared
# between streams: gRPC only serializes them, and nothing may mutate them.
_PASSED = {
    True: ep.ProcessingResponse(request_body=ep.BodyResponse()),
    False: ep.ProcessingResponse(response_body=ep.BodyResponse()),
}
_TRAILERS = {
    True: ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    False: ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}
_RESPONSE_HEADERS = ep.ProcessingResponse(
    response_headers=ep.HeadersResponse(
        response=ep.CommonResponse(header_mutation=ep.HeaderMutation())
    )
)


def passed_body(*, request: bool) -> ep.ProcessingResponse:
    """A body chunk let through unchanged (modes other than FULL_DUPLEX_STREAMED)."""
    return _PASSED[request]


def response_headers(set_headers: Headers = ()) -> ep.ProcessingResponse:
    if not set_headers:
        return _RESPONSE_HEADERS
    common = ep.CommonResponse(header_mutation=header_mutation(set_headers))
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))


def trailers(*, request: bool) -> ep.ProcessingResponse:
    return _TRAILERS[request]


def immediate(status: int, body: bytes, headers: Headers = ()) -> ep.ProcessingResponse:
    """Answer the client directly (400, 404, 413, 429, 503, ...) without reaching a pod."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=header_mutation([("content-type", "application/json"), *headers]),
            body=body,
            details="kvroute_epp",
        )
    )
