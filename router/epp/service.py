"""Envoy's ``ExternalProcessor`` service: one gRPC stream per HTTP request through the gateway.

The order Envoy requires is headers, then body, then trailers, in each direction. With
``FULL_DUPLEX_STREAMED`` request bodies (the reference gateways' mode) the picker holds its
answer to the request headers until the body is complete, picks, then answers the headers
(the pick) and echoes the body in chunks. With ``BUFFERED`` bodies it answers the headers at
once and puts the pick on the body's answer, with the body and its ``content-length``. The
mode is read from the stream's first message (``protocol_config``). Responses are echoed
chunk by chunk as they come, while the usage is read and the request closed in the ledger.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from functools import partial
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError

from kvroute.kvcore.reuse import available_tokens

from .. import errors
from ..usage import usage_of
from . import messages
from .endpoints import parse_subset
from .h2_grpc import INTERNAL, INVALID_ARGUMENT, Handler, Stream
from .messages import Answer
from .picker import EndpointPicker, Pick

log = logging.getLogger(__name__)

BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE
# Response bytes kept to read the usage from: a JSON body whole up to this, an SSE stream's tail.
USAGE_BYTES = 1 << 20
SSE_TAIL_BYTES = 64 << 10


PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def handlers(picker: EndpointPicker) -> dict[str, Handler]:
    return {PROCESS: lambda stream: ProcessCall(picker, stream)}


class ProcessCall:
    """``ExternalProcessor.Process``: one stream, one HTTP request through the gateway.

    Each message is answered as it is handled. The message that completes the request body
    starts the pick in a task of its own (admission may queue it: asyncio's timeouts need a
    task) and holds the messages after it, so answers keep Envoy's order; every other message
    is answered within the callback that read it, with no task at all.
    """

    __slots__ = ("exchange", "half_closed", "inbox", "stream", "task")

    def __init__(self, picker: EndpointPicker, stream: Stream) -> None:
        self.stream = stream
        self.exchange = _Exchange(picker)
        self.inbox: deque[ep.ProcessingRequest] = deque()
        self.task: asyncio.Future[None] | None = None
        self.half_closed = False

    def on_message(self, data: bytes) -> None:
        if self.stream.finished:
            return
        try:
            message = ep.ProcessingRequest.FromString(data)
        except DecodeError:
            self.on_cancel()  # a pick in flight unwinds, releasing what it holds
            self.stream.finish(INVALID_ARGUMENT, "not a ProcessingRequest")
            return
        self.inbox.append(message)
        if self.task is None:
            self._drain()

    def on_half_close(self) -> None:
        self.half_closed = True
        if self.task is None and not self.inbox:
            self._end()

    def on_cancel(self) -> None:
        """Envoy reset the stream (client gone), the connection closed, or the stream failed."""
        self.inbox.clear()
        task = self.task
        if task is not None:
            task.cancel()  # a started pick unwinds (admission released), then the close
        self.exchange.close()

    def _drain(self) -> None:
        while self.inbox:
            try:
                result = self.exchange.on(self.inbox.popleft())
            except Exception:
                log.exception("ext_proc message failed")
                self._fail()
                return
            if type(result) is list:
                self._answer(result)
                continue
            assert isinstance(result, Coroutine)
            self.task = task = asyncio.ensure_future(self._resume(result))
            # Cancelled before its first step, the pick never started: nothing to unwind.
            task.add_done_callback(partial(_close_unstarted, result))
            return
        if self.half_closed:
            self._end()

    async def _resume(self, pick: Coroutine[Any, Any, list[Answer]]) -> None:
        try:
            answers = await pick
        except asyncio.CancelledError:
            self.task = None  # no cycle through the task's traceback
            self.exchange.close()
            raise
        except Exception:
            log.exception("ext_proc message failed")
            self.task = None
            self._fail()
            return
        self.task = None
        if self.stream.finished:  # failed meanwhile (a bad message after this one)
            self.exchange.close()
            return
        self._answer(answers)
        self._drain()

    def _answer(self, answers: list[Answer]) -> None:
        self.stream.send_all(
            answer if type(answer) is bytes else answer.SerializeToString() for answer in answers
        )
        deferred = self.exchange.deferred
        if deferred is not None:
            self.exchange.deferred = None
            # Envoy goes on with the request meanwhile. Before any other pick: a pick is a
            # task, and a read's work runs at its end.
            self.stream.after_write(deferred)

    def _end(self) -> None:
        self.stream.finish()  # the trailers go with the last answer, in its write
        self.stream.after_write(self.exchange.close)  # after its bookkeeping, not before

    def _fail(self) -> None:
        self.inbox.clear()
        self.exchange.close()
        self.stream.finish(INTERNAL, "the endpoint picker failed")


def _close_unstarted(pick: Coroutine[Any, Any, Any], _: object) -> None:
    pick.close()  # a no-op once it ran


class _Exchange:
    """One HTTP request's ext_proc stream."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.request_mode = FULL_DUPLEX
        self.response_mode = FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        # The request body's chunks as Envoy sent them, joined once for the pick (a body in
        # one chunk, the usual 1 KB prompt, is never copied).
        self.chunks: list[bytes] = []
        self.body_bytes = 0
        self.pick: Pick | None = None
        self.picked = False
        self.status = 0
        self.sse = False
        self.response_tail = bytearray()
        self.response_bytes = 0
        # A whole (not streamed) response's headers answer, held for its body's: one write
        # and one wake-up of Envoy for both.
        self.held_headers: Answer | None = None
        # Bookkeeping that the last answer need not wait for: run once it is written.
        self.deferred: Callable[[], None] | None = None

    def on(self, message: ep.ProcessingRequest) -> list[Answer] | Coroutine[Any, Any, list[Answer]]:
        """The answers to this message, or (the body complete) the pick that makes them."""
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.request_mode = config.request_body_mode
            self.response_mode = config.response_body_mode
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(message)
        if kind == "request_body":
            body = message.request_body
            if self.picked:
                return []
            chunk = body.body  # upb copies the field on every read: once
            self.chunks.append(chunk)
            self.body_bytes += len(chunk)
            limit = self.picker.config.limits.max_body_bytes
            if self.body_bytes > limit:
                self.picked = True  # refused before the rest arrives: nothing more to pick
                self.chunks.clear()
                too_large = errors.body_too_large(limit)
                return [_immediate(self.picker, too_large, self.headers.get(":path", ""))]
            if not body.end_of_stream:
                if self.request_mode == FULL_DUPLEX:
                    return []
                return [messages.passed_body(request=True)]
            return self._picked()
        if kind == "request_trailers":
            if self.picked:
                return [messages.trailers(request=True)]
            return self._picked_before_trailers()
        if kind == "response_headers":
            return self._on_response_headers(message)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "response_trailers":
            self._finish(completed=True)
            return [*self._held(), messages.trailers(request=False)]
        return []

    # -- request ------------------------------------------------------------------------

    def _on_request_headers(self, message: ep.ProcessingRequest) -> list[Answer]:
        self.headers = _header_map(message.request_headers.headers.headers)
        self.subset = _subset_hint(message)
        if message.request_headers.end_of_stream or self.request_mode == NO_BODY:
            # Nothing to parse (GET /v1/models, ...): any endpoint that may take it.
            self.picked = True
            try:
                destination = self.picker.pick_any(self.subset)
            except errors.ApiError as exc:
                return [_immediate(self.picker, exc)]
            return [
                messages.request_headers(
                    [(messages.DESTINATION, destination)],
                    messages.SYSTEM_HEADERS,
                    destinations=destination,
                )
            ]
        if self.request_mode == FULL_DUPLEX:
            return []  # answered with the pick, once the body is in
        return [messages.request_headers()]

    async def _picked_before_trailers(self) -> list[Answer]:
        return [*await self._picked(ended=False), messages.trailers(request=True)]

    async def _picked(self, ended: bool = True) -> list[Answer]:
        """The body is complete: pick, and answer in the order the mode requires."""
        self.picked = True
        body = b"".join(self.chunks)
        self.chunks.clear()
        try:
            self.pick = pick = await self.picker.pick(
                self.headers.get(":path", ""), body, self.headers, self.subset
            )
        except errors.ApiError as exc:
            return [_immediate(self.picker, exc, self.headers.get(":path", ""))]
        except Exception:  # a bug must cost this request a 500, not the gateway its picker
            log.exception("pick failed")
            failed = errors.ApiError(500, "The endpoint picker failed.", error_type="server_error")
            return [_immediate(self.picker, failed, self.headers.get(":path", ""))]
        self.deferred = partial(self.picker.placed, pick)
        destinations = ",".join(pick.destinations)
        set_headers = [(messages.DESTINATION, destinations)]
        if pick.rank is not None:  # the rank picked on a data-parallel pod (vLLM reads it)
            set_headers.append((messages.DP_RANK, str(pick.rank)))
        if self.request_mode == FULL_DUPLEX:
            set_headers.append(("content-length", str(len(body))))
            return [
                messages.pick_headers_answer(set_headers, destinations),
                *messages.streamed_bodies(body, ended, request=True),
            ]
        return [
            messages.buffered_request_body(body, set_headers, messages.SYSTEM_HEADERS, destinations)
        ]

    # -- response -----------------------------------------------------------------------

    def _on_response_headers(self, message: ep.ProcessingRequest) -> list[Answer]:
        status, content_type = _status_and_type(message.response_headers.headers.headers)
        self.status = int(status or 0)
        self.sse = content_type.startswith("text/event-stream")
        pick = self.pick
        added: list[tuple[str, str]] = []
        if pick is not None:
            pick.status = self.status
            served = _served_endpoint(message)
            if served:
                self.picker.served(pick, served)
            if self.picker.config.decision_headers:
                d = pick.dispatch
                added = [
                    ("x-kvroute-replica", d.replica),
                    ("x-kvroute-reason", d.reason),
                    ("x-kvroute-prefix-hit-tokens", str(d.cached_tokens)),
                    (
                        "x-kvroute-prefix-available-tokens",
                        str(available_tokens(d.request, d.ranked)),
                    ),
                ]
            if message.response_headers.end_of_stream:
                self._finish(completed=True)
        answer = messages.response_headers(added)
        if (
            self.response_mode == FULL_DUPLEX
            and not self.sse
            and not message.response_headers.end_of_stream
        ):
            # Full duplex: Envoy sends the body on without waiting for this answer. A JSON
            # body follows its headers at once; a stream's first event may take seconds, so
            # its headers are answered now.
            self.held_headers = answer
            return []
        return [answer]

    def _held(self) -> list[Answer]:
        held = self.held_headers
        if held is None:
            return []
        self.held_headers = None
        return [held]

    def _on_response_body(self, body: ep.HttpBody) -> list[Answer]:
        pick = self.pick
        chunk = body.body  # upb copies the field on every read: once
        ended = body.end_of_stream
        if pick is not None:
            self._keep_for_usage(chunk)
            if (chunk and pick.first_byte_at is None) or ended:
                # The ledger's part waits until the answer is on its way to Envoy.
                self.deferred = partial(self._response_progress, bool(chunk), ended)
        if self.response_mode == FULL_DUPLEX:
            return [*self._held(), *messages.streamed_bodies(chunk, ended, request=False)]
        return [messages.passed_body(request=False)]

    def _response_progress(self, first_bytes: bool, ended: bool) -> None:
        pick = self.pick
        assert pick is not None
        if first_bytes:
            self.picker.first_byte(pick, self.status)
        if ended:
            self._read_usage()
            self._finish(completed=True)

    def _keep_for_usage(self, chunk: bytes) -> None:
        self.response_bytes += len(chunk)
        tail = self.response_tail
        if self.sse:
            tail += chunk
            if len(tail) > 2 * SSE_TAIL_BYTES:
                del tail[: len(tail) - SSE_TAIL_BYTES]
        elif self.response_bytes <= USAGE_BYTES:
            tail += chunk
        else:
            tail.clear()  # too large to decode for its usage: not worth the memory

    def _read_usage(self) -> None:
        if self.status != 200 or not self.response_tail:
            return
        usage = usage_of(bytes(self.response_tail), self.sse)
        if usage:
            self.picker.observe_usage(usage, self.pick)

    def _finish(self, completed: bool) -> None:
        if self.pick is not None:
            self.picker.finish(self.pick, completed)

    def close(self) -> None:
        """The stream ended: a request still open was torn down (client gone, Envoy reset)."""
        self._finish(completed=False)


def _header_map(headers: Any) -> dict[str, str]:
    return {h.key.lower(): h.raw_value.decode("latin-1") or h.value for h in headers}


def _status_and_type(headers: Any) -> tuple[str, str]:
    """A response's ``:status`` and ``content-type``, all it needs of its headers."""
    status = content_type = ""
    for h in headers:
        key = h.key.lower()
        if key == ":status":
            status = h.raw_value.decode("latin-1") or h.value
        elif key == "content-type":
            content_type = h.raw_value.decode("latin-1") or h.value
    return status, content_type


def _metadata_field(message: ep.ProcessingRequest, namespace: str, key: str) -> Any:
    filters: Mapping[str, Any] = message.metadata_context.filter_metadata
    if namespace not in filters:
        return None
    fields = filters[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    which = value.WhichOneof("kind")
    if which == "string_value":
        return value.string_value
    if which == "list_value":
        return [v.string_value for v in value.list_value.values]
    return None


def _subset_hint(message: ep.ProcessingRequest) -> frozenset[str] | None:
    value = _metadata_field(message, messages.SUBSET_NAMESPACE, messages.SUBSET)
    if value is None:
        return None
    return parse_subset([value] if isinstance(value, str) else value)


def _served_endpoint(message: ep.ProcessingRequest) -> str | None:
    value = _metadata_field(message, messages.LB_NAMESPACE, messages.SERVED)
    return value if isinstance(value, str) else None


def _immediate(
    picker: EndpointPicker, exc: errors.ApiError, path: str = ""
) -> ep.ProcessingResponse:
    """The error answered to the client in its API's shape (Anthropic's for Messages)."""
    picker.metrics.observe_rejected(exc.status, exc.code or exc.error_type)
    body = exc.body()
    if errors.shape_of_path(path) == errors.ANTHROPIC:
        body = errors.anthropic_error_body(exc.status, exc.message)
    return messages.immediate(exc.status, body, list((exc.headers or {}).items()))
