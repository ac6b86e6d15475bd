"""Forward one request to one replica and relay its answer to the client.

Bodies go out as received and come back as received: non-streamed answers are read whole
(they are small JSON), streamed ones are relayed as they arrive. A stream that may be resumed
elsewhere goes through a ``StreamTranscript`` (router/resume.py), which forwards whole SSE
events only and remembers what was sent; other streams are relayed chunk by chunk untouched.
A request sent as token ids (routing.send_tokens) is the exception: its generate answer is
rewritten in the client's API as it arrives (kvcore/token_path.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from kvroute.kvcore.token_path import Answer

from .errors import anthropic_error_body
from .resume import Transcript
from .sse import sse_error
from .upstream_client import HOP_BY_HOP, UpstreamClient, UpstreamError, UpstreamResponse
from .usage import StreamTail, UsageStripper, strip_usage_events, usage_of


def anthropic_error_from_replica(data: bytes, status: int) -> bytes:
    """A replica's error answer to a Messages request in Anthropic's shape: vLLM answers
    its validation errors in OpenAI's and its others with its own type names."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        obj = None
    message = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        message = obj["error"].get("message")
    if not isinstance(message, str):
        message = data.decode("utf-8", "replace")[:2000] or f"The replica answered HTTP {status}."
    return anthropic_error_body(status, message)


def response_id_of(data: bytes, stream: bool = False) -> str | None:
    """A Responses answer's id: the body's, or its stream's first event's (response.created,
    whose ``response`` holds it)."""
    if stream:
        start = data.find(b"data:")
        if start < 0:
            return None
        end = data.find(b"\n", start)
        data = data[start + 5 : end if end >= 0 else len(data)]
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    inner = obj.get("response")
    if stream and isinstance(inner, dict):
        obj = inner
    found = obj.get("id")
    return found if isinstance(found, str) else None


class UpstreamUnavailable(Exception):
    """The replica failed before any byte reached the client; another replica may be tried."""

    def __init__(self, kind: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.status = status  # an HTTP status the router chose not to relay (5xx, 429)


@dataclass(frozen=True, slots=True)
class Timeouts:
    first_byte_s: float  # a stream's response headers
    first_token_s: float  # a stream's first chunk; a whole non-streamed answer
    idle_s: float  # between two chunks


@dataclass(slots=True)
class Relayed:
    """What happened, for metrics and for the caller's next step."""

    response: web.StreamResponse
    status: int
    ttfb_s: float
    # The stream broke mid-way: why. The client's stream is left open when it can be resumed
    # (``resumable``); otherwise it was ended with an SSE error event and [DONE].
    broken: str | None = None
    resumable: bool = False
    client_gone: bool = False
    # The prompt tokens the engine says it reused from its prefix cache, when the answer's usage
    # says (vLLM with --enable-prompt-tokens-details; a stream's only with include_usage).
    cached_tokens: int | None = None
    replica: str = ""  # the replica that answered (set by the forwarder)
    # The replica's token usage (prompt, completion, cached): a stream's only with include_usage.
    usage: dict[str, int] | None = None
    # A Responses answer's id (the replica keeps it for a follow-up's previous_response_id).
    response_id: str | None = None


# The router's own X-Request-Id replaces the replica's.
_NOT_RELAYED = HOP_BY_HOP | {b"x-request-id"}


def _response_headers(upstream: UpstreamResponse, extra: list[tuple[str, str]]) -> CIMultiDict[str]:
    pairs = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in upstream.headers
        if name.lower() not in _NOT_RELAYED
    ]
    return CIMultiDict(pairs + extra)


# Server errors that say what the request asked for, not how the replica is: vLLM answers 501
# to a feature it does not implement (Responses' background mode), on every replica alike.
REQUESTS_FAULT = frozenset((501, 505))


def replica_fault(status: int) -> bool:
    """A 5xx that counts against the replica (its breaker) and is worth another one."""
    return status >= 500 and status not in REQUESTS_FAULT


def retryable_status(status: int) -> bool:
    """Answers worth another replica: server errors, overload (429) and the replica's own timeout
    (408); every other 4xx (and a 501: not implemented anywhere) is the request's fault and
    would fail anywhere."""
    return replica_fault(status) or status in (408, 429)


class ClientRequest(Protocol):
    """What the path reads of a client's request: an HTTP one (``web.Request``), or one the
    router makes itself (a batch line, ``pipeline.InternalRequest``)."""

    @property
    def raw_path(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


@dataclass(slots=True)
class ClientExchange:
    """The client's side of one request, shared by every try at it (retries and resumes)."""

    request: ClientRequest
    headers: Iterable[tuple[bytes, bytes]]  # the client's headers passed on to replicas
    expect_stream: bool
    # Tracks a stream that may be resumed elsewhere (whole SSE events, text sent so far).
    transcript: Transcript | None
    # The client's stream once open, so the caller can still end it well-formed if it gives
    # up (a total timeout) while a relay is under way, and continuations write into it.
    stream: web.StreamResponse | None = None
    tries: int = 0  # replicas tried so far, retries and resumes included
    # The router asked for the usage chunk the client did not: keep it from the client.
    strip_usage: bool = False
    # Whether a break in this stream now would be resumed elsewhere (set by the pipeline for
    # streams it may resume); a drain cuts only streams that would be.
    resume_check: Callable[[], bool] | None = None
    # Until when a failed whole answer would still be tried on another replica (the retry
    # budget less one backoff); set by the pipeline.
    retry_until: float = 0.0
    # The API the client speaks (ParsedRequest.api): errors and broken streams end in its shape.
    api: str = "chat"


@dataclass(slots=True)
class UpstreamCall:
    """One try on one replica."""

    base_url: str
    body: bytes
    upstream_headers: bytes  # raw header lines added to the client's
    response_headers: list[tuple[str, str]]  # added to the replica's answer
    retry_status: bool  # raise UpstreamUnavailable for a retryable status instead of relaying
    resume: bool = False  # continue the client's open stream (a continuation)
    path: str | None = None  # where on the replica; None: the client's path
    # Sent as token ids: the generate answer, written in the client's API on its way.
    answer: Answer | None = None


async def relay(
    client: UpstreamClient,
    exchange: ClientExchange,
    call: UpstreamCall,
    timeouts: Timeouts,
    on_first_byte: Callable[[int], None] | None = None,
) -> Relayed:
    """Send ``call.body`` to the replica and relay the answer to the exchange's client.

    ``on_first_byte(status)`` is called once the replica has answered: the first chunk of a
    stream (its first token: the prefill is done), or the headers of a whole response.
    Raises ``UpstreamUnavailable`` only while nothing has been sent to the client yet, and for
    a 5xx (but 501/505), 408 or 429 answer when ``call.retry_status`` (the caller will try
    another replica).
    A streamed request's headers must come within ``first_byte_s`` (vLLM sends them at once);
    a non-streamed one's come with the whole answer, within ``first_token_s``.
    """
    expect_stream = exchange.expect_stream
    headers_timeout_s = timeouts.first_byte_s if expect_stream else timeouts.first_token_s
    started = time.perf_counter()
    try:
        upstream = await client.post(
            call.base_url,
            (call.path or exchange.request.raw_path).encode(),
            exchange.headers,
            call.upstream_headers,
            call.body,
            headers_timeout_s,
        )
    except UpstreamError as exc:
        # vLLM answers a stream's headers at once: silence means the replica is stalled.
        kind = "stalled" if expect_stream and exc.kind == "timeout" else exc.kind
        raise UpstreamUnavailable(kind, str(exc)) from None
    try:
        status = upstream.status
        if (call.retry_status and retryable_status(status)) or (call.resume and status >= 400):
            # A continuation's error cannot be spliced into the client's stream either.
            raise UpstreamUnavailable(f"http_{status}", f"answered HTTP {status}", status)
        streaming = (upstream.header(b"content-type") or b"").startswith(b"text/event-stream")
        if streaming and call.answer is not None and status < 400:
            upstream = _Answered(upstream, call.answer)  # type: ignore[assignment]
        first = b""
        if streaming:
            # Until the first token: queueing and prefill.
            try:
                first = await upstream.read_chunk(timeouts.first_token_s)
            except UpstreamError as exc:
                raise UpstreamUnavailable(exc.kind, str(exc)) from None
        upstream.started()
        # What a drain may cut (router/drain.py): a whole answer while another try is left (it
        # is then retried elsewhere); a stream when the pipeline can resume it.
        if not streaming:
            if call.retry_status:
                upstream.movable = functools.partial(_retry_left, exchange)
        elif exchange.transcript is not None and status < 400:
            upstream.movable = exchange.resume_check
        if on_first_byte is not None:
            on_first_byte(status)
        if not streaming:
            try:
                data = await upstream.read(timeouts.first_token_s)
            except UpstreamError as exc:
                raise UpstreamUnavailable(exc.kind, str(exc)) from None
            headers = _response_headers(upstream, call.response_headers)
            if call.answer is not None and status < 400:
                data = call.answer.whole(data)
            if status >= 400 and exchange.api in _ANTHROPIC_APIS:
                data = anthropic_error_from_replica(data, status)
            response = web.Response(body=data, status=status, headers=headers)
            usage = usage_of(data, sse=False) if status < 400 else None
            cached = usage.get("cached") if usage else None
            relayed = Relayed(
                response, status, time.perf_counter() - started, cached_tokens=cached, usage=usage
            )
            if exchange.api == "responses" and status < 400:
                relayed.response_id = response_id_of(data)
            return relayed
        ttfb_s = time.perf_counter() - started
        stream = exchange.stream if call.resume else await _open_stream(exchange, upstream, call)
        assert stream is not None
        transcript = exchange.transcript
        strip = exchange.strip_usage
        if transcript is None or status >= 400:
            relayed = await _relay_raw(
                upstream, stream, first, status, ttfb_s, timeouts.idle_s, strip, exchange.api
            )
        else:
            api = exchange.api
            relayed = await _relay_events(
                upstream, stream, first, status, ttfb_s, timeouts.idle_s, transcript, strip, api
            )
        if exchange.api == "responses" and status < 400 and not call.resume:
            # The transcript read the whole response.created event; without one, the first
            # read's (a response.created larger than one read loses the id).
            found = transcript.response_id if transcript is not None else None
            relayed.response_id = found or response_id_of(first, stream=True)
        return relayed
    finally:
        # Closing an unfinished response is how the replica learns the client has gone.
        upstream.close()


_ANTHROPIC_APIS = frozenset(("messages", "count_tokens"))


class _Answered:
    """A generate stream read as the client's API's stream: what the relay reads of an
    UpstreamResponse, its chunks rewritten by the answer writer (kvcore/token_path.py)."""

    def __init__(self, upstream: UpstreamResponse, answer: Answer) -> None:
        self._upstream = upstream
        self._answer = answer
        self._ended = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._upstream, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:  # movable: the relay marks the response itself
            setattr(self._upstream, name, value)

    async def read_chunk(self, idle_timeout_s: float) -> bytes:
        while not self._ended:
            chunk = await self._upstream.read_chunk(idle_timeout_s)
            if not chunk:
                self._ended = True
                return self._answer.end()
            out = self._answer.feed(chunk)
            if out:
                return out
        return b""


def _retry_left(exchange: ClientExchange) -> bool:
    return time.monotonic() < exchange.retry_until


async def _open_stream(
    exchange: ClientExchange, upstream: UpstreamResponse, call: UpstreamCall
) -> web.StreamResponse:
    """The client's stream, with the replica's status and headers (and the router's)."""
    if not isinstance(exchange.request, web.Request):
        # An internal request never asks to stream (batch lines are checked for it).
        raise UpstreamUnavailable("protocol", "a stream answered a request without a client")
    headers = _response_headers(upstream, call.response_headers)
    stream = web.StreamResponse(status=upstream.status, headers=headers)
    await stream.prepare(exchange.request)
    exchange.stream = stream
    return stream


async def _relay_raw(
    upstream: UpstreamResponse,
    stream: web.StreamResponse,
    chunk: bytes,
    status: int,
    ttfb_s: float,
    idle_timeout_s: float,
    strip_usage: bool = False,
    api: str = "chat",
) -> Relayed:
    tail = StreamTail()
    # Whole events only when the usage chunk must be kept from the client; untouched otherwise.
    stripper = UsageStripper() if strip_usage else None
    try:
        while chunk:
            out = stripper.feed(chunk) if stripper is not None else chunk
            if out:
                await stream.write(out)
            tail.add(chunk)
            chunk = await upstream.read_chunk(idle_timeout_s)
        if stripper is not None and (rest := stripper.end()):
            await stream.write(rest)
        await stream.write_eof()
    except UpstreamError as exc:
        return await end_broken_stream(stream, status, ttfb_s, str(exc), api)
    except ConnectionResetError:
        return Relayed(stream, status, ttfb_s, client_gone=True)
    usage = tail.usage() if status < 400 else None
    cached = usage.get("cached") if usage else None
    return Relayed(stream, status, ttfb_s, cached_tokens=cached, usage=usage)


async def _relay_events(
    upstream: UpstreamResponse,
    stream: web.StreamResponse,
    chunk: bytes,
    status: int,
    ttfb_s: float,
    idle_timeout_s: float,
    transcript: Transcript,
    strip_usage: bool = False,
    api: str = "chat",
) -> Relayed:
    tail = StreamTail()  # the replica's own events: the usage is in its last ones
    try:
        while chunk:
            out = transcript.feed(chunk)
            if out and strip_usage:
                out = strip_usage_events(out)  # the transcript forwards whole events only
            if out:
                await stream.write(out)
            tail.add(chunk)
            chunk = await upstream.read_chunk(idle_timeout_s)
    except UpstreamError as exc:
        reason = str(exc)
    except ConnectionResetError:
        return Relayed(stream, status, ttfb_s, client_gone=True)
    else:
        try:
            last = transcript.end()
            if last and strip_usage:
                last = strip_usage_events(last)
            if last:
                await stream.write(last)
        except ConnectionResetError:
            return Relayed(stream, status, ttfb_s, client_gone=True)
        if transcript.done or transcript.finished or transcript.blocker is not None:
            try:
                if not transcript.done and (closing := transcript.closing()):
                    await stream.write(closing)  # an agent stream ended before its last event
                await stream.write_eof()
            except ConnectionResetError:
                return Relayed(stream, status, ttfb_s, client_gone=True)
            usage = tail.usage()
            cached = usage.get("cached") if usage else None
            return Relayed(stream, status, ttfb_s, cached_tokens=cached, usage=usage)
        reason = "the replica ended the stream before it finished"
    if transcript.resumable():
        return Relayed(stream, status, ttfb_s, broken=reason, resumable=True)
    return await end_broken_stream(stream, status, ttfb_s, reason, api, transcript)


async def end_broken_stream(
    stream: web.StreamResponse,
    status: int,
    ttfb_s: float,
    reason: str,
    api: str = "chat",
    transcript: Transcript | None = None,
) -> Relayed:
    """Too late to pick another replica: end the stream well-formed, never silently cut (in
    its API's error event, numbered after the transcript's events where it numbers them)."""
    message = f"The replica failed mid-stream: {reason}"
    error = transcript.error_event(message) if transcript is not None else b""
    try:
        await stream.write(error or sse_error(message, api=api))
        await stream.write_eof()
    except ConnectionResetError:
        return Relayed(stream, status, ttfb_s, broken=reason, client_gone=True)
    return Relayed(stream, status, ttfb_s, broken=reason)
