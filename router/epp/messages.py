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
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: destinations}})
    return metadata


def request_headers(
    set_headers: Headers = (), remove: Sequence[str] = (), *, destinations: str | None = None
) -> ep.ProcessingResponse:
    """The request-headers answer; with ``destinations``, the pick (header and metadata)."""
    common = ep.CommonResponse(
        header_mutation=header_mutation(set_headers, remove), clear_route_cache=True
    )
    response = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
    if destinations is not None:
        response.dynamic_metadata.CopyFrom(destination_metadata(destinations))
    return response


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
    response = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
    response.dynamic_metadata.CopyFrom(destination_metadata(destinations))
    return response


def streamed_bodies(
    body: bytes, end_of_stream: bool, *, request: bool
) -> Iterator[ep.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: ``body`` echoed in chunks of at most ``BODY_CHUNK_BYTES``."""
    view = memoryview(body)
    starts = range(0, len(body), BODY_CHUNK_BYTES) if body else (0,)
    last = starts[-1]
    for start in starts:
        chunk = bytes(view[start : start + BODY_CHUNK_BYTES])
        streamed = ep.StreamedBodyResponse(
            body=chunk, end_of_stream=end_of_stream and start == last
        )
        answer = ep.BodyResponse(
            response=ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        )
        if request:
            yield ep.ProcessingResponse(request_body=answer)
        else:
            yield ep.ProcessingResponse(response_body=answer)


def passed_body(*, request: bool) -> ep.ProcessingResponse:
    """A body chunk let through unchanged (modes other than FULL_DUPLEX_STREAMED)."""
    if request:
        return ep.ProcessingResponse(request_body=ep.BodyResponse())
    return ep.ProcessingResponse(response_body=ep.BodyResponse())


def response_headers(set_headers: Headers = ()) -> ep.ProcessingResponse:
    common = ep.CommonResponse(header_mutation=header_mutation(set_headers))
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))


def trailers(*, request: bool) -> ep.ProcessingResponse:
    if request:
        return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
    return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


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
