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


def streamed_bodies(
    body: bytes, end_of_stream: bool, *, request: bool
) -> Iterator[ep.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: ``body`` echoed in chunks of at most ``BODY_CHUNK_BYTES``."""
    if len(body) <= BODY_CHUNK_BYTES:  # the usual case: one message, the bytes as they came
        yield _streamed_body(body, end_of_stream, request)
        return
    view = memoryview(body)
    starts = range(0, len(body), BODY_CHUNK_BYTES)
    last = starts[-1]
    for start in starts:
        chunk = view[start : start + BODY_CHUNK_BYTES].tobytes()
        yield _streamed_body(chunk, end_of_stream and start == last, request)


def _streamed_body(chunk: bytes, end_of_stream: bool, request: bool) -> ep.ProcessingResponse:
    answer = ep.BodyResponse(
        response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(
                streamed_response=ep.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
            )
        )
    )
    if request:
        return ep.ProcessingResponse(request_body=answer)
    return ep.ProcessingResponse(response_body=answer)


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
