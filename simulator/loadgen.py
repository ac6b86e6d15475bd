"""Load on a live fleet: OpenAI requests sent at planned times, each one's outcome recorded.

The one load generator of kvroute's live measurements:

* ``send`` posts one completions, chat, Anthropic Messages or OpenAI Responses request
  (streamed or not; the API is the URL's) and records what the client saw in an ``Outcome``: status, the replica the router names, time to first content, to the
  last content and to the end, tokens, text, and whether the answer was whole;
* ``run_open_loop`` sends a plan of requests at their times (open loop: a request goes out when
  it is due, whatever the earlier ones are doing), optionally at most N in flight, recording
  how late each went out;
* ``run_closed_loop`` sends chains of requests (agent sessions): a chain's first request when
  it is due, each next one a gap after the previous one's answer ended;
* ``run_conversations`` sends multi-turn chats (``simulator.workload``), each turn when the
  previous one is answered, several conversations at once.

Users: ``kvroute replay --live`` (``simulator.traces.live``: a trace's arrivals, time-scaled),
``kvroute drill`` (``kvroute.drill.load``: a fixed rate), ``kvroute demo`` and ``kvroute bench
prefix`` (``kvroute.bench.chat_load``: conversations), ``kvroute bench fidelity``'s probes
(``send``). It lives in the simulator, not the outer ring with the others, because the live
replay is part of the simulator, which may not import the outer ring (kvroute.cli, bench,
drill, demo); the outer ring imports it from here. Nothing in it is simulated.

Not here: ``kvroute bench overhead``'s load (``kvroute.bench.loadgen``), a closed-loop wrk
stand-in that POSTs one body as fast as the router answers and reads nothing of the answers,
so that the client costs as little as possible on the machine the router is measured on.

An answer is whole when it came with status 200, carried no error event, and had a
``finish_reason`` (and, streamed, ended with ``data: [DONE]``); a Messages answer its
``stop_reason`` (streamed: ``message_stop``), a Responses answer its status (streamed:
``response.completed``). Anything else is an error (``Outcome.error``), with a short kind for
counting (``Outcome.error_kind``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from .workload import Conversation

REPLICA_HEADER = "X-Kvroute-Replica"


@dataclass(slots=True)
class Outcome:
    """What the client saw of one request; durations in seconds from when it was sent."""

    stream: bool
    sent_at: float = 0.0  # seconds after the load started
    late_s: float = 0.0  # after its planned time (waiting for a free slot included)
    status: int = 0  # the HTTP status; 0 when none came
    replica: str = ""  # the router's X-Kvroute-Replica header
    ttft_s: float | None = None  # to the first content (not streamed: to the whole answer)
    last_token_s: float | None = None  # to the last content
    latency_s: float | None = None  # to the end of the answer
    chunks: int = 0  # events that carried content
    usage_tokens: int | None = None  # completion_tokens in the answer's usage
    finished: bool = False  # a choice had a finish_reason
    done: bool = False  # the stream ended with [DONE]
    error: str = ""  # why the answer is not whole; "" when it is
    error_kind: str = ""  # the error in a few words: "HTTP 503", "SSE error", "TimeoutError", ...
    text: str = ""  # the content (only when asked for)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tokens(self) -> int:
        """Tokens received: the server's usage count, else one per content event."""
        return self.usage_tokens or self.chunks

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (streams of two tokens or more)."""
        if not self.stream or self.ttft_s is None or self.last_token_s is None:
            return None
        tokens = self.tokens
        return (self.last_token_s - self.ttft_s) / (tokens - 1) if tokens > 1 else None

    def fail(self, kind: str, error: str = "") -> None:
        self.error_kind = kind
        self.error = error or kind


def _content(choice: Mapping[str, Any]) -> str:
    """The text of a completions choice, or of a chat choice's delta (streamed) or message."""
    if "text" in choice:
        return choice.get("text") or ""
    part = choice.get("delta") or choice.get("message")
    return (part.get("content") or "") if isinstance(part, dict) else ""


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"an answer that is not a JSON object: {str(value)[:80]}")
    return value


def _error_message(error: object) -> str:
    message = error.get("message", "") if isinstance(error, dict) else error
    return str(message)[:200]


async def send(
    http: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    outcome: Outcome | None = None,
    *,
    keep_text: bool = False,
) -> Outcome:
    """POST ``body`` (a completions or chat request; ``stream`` in it says how it is answered) to
    ``url`` and record what came back in ``outcome`` (a new one if not given).

    Never raises for what the server or the network did: that is in ``outcome.error``.
    """
    if outcome is None:
        outcome = Outcome(stream=bool(body.get("stream")))
    sent = time.monotonic()
    pieces: list[str] = []
    try:
        async with http.post(url, json=body) as resp:
            outcome.status = resp.status
            outcome.replica = resp.headers.get(REPLICA_HEADER, "")
            if resp.status != 200:
                detail = (await resp.text())[:200]
                outcome.fail(f"HTTP {resp.status}", f"HTTP {resp.status}: {detail}")
                return outcome
            api = _agent_api(url)
            if api is not None:
                await _agent_answer(resp, api, outcome, sent, pieces, keep_text)
                return outcome
            if not outcome.stream:
                data = _object(await resp.json())
                outcome.ttft_s = outcome.last_token_s = time.monotonic() - sent
                if "error" in data:
                    outcome.fail("error", f"error: {_error_message(data['error'])}")
                    return outcome
                for choice in data.get("choices") or ():
                    pieces.append(_content(choice))
                    outcome.finished = outcome.finished or bool(choice.get("finish_reason"))
                outcome.usage_tokens = (data.get("usage") or {}).get("completion_tokens")
                if not outcome.finished:
                    outcome.fail("no finish_reason", "answer without a finish_reason")
                return outcome
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    outcome.done = True
                    continue
                event = _object(json.loads(payload))
                if "error" in event:
                    outcome.fail("SSE error", f"SSE error: {_error_message(event['error'])}")
                    return outcome
                if event.get("usage"):
                    outcome.usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or ():
                    text = _content(choice)
                    if text:
                        _content_came(outcome, sent, text, pieces if keep_text else None)
                    if choice.get("finish_reason"):
                        outcome.finished = True
            if not (outcome.finished and outcome.done):
                outcome.fail("incomplete stream", "stream ended without finish_reason and [DONE]")
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        outcome.fail(type(exc).__name__, f"{type(exc).__name__}: {exc}")
    finally:
        outcome.latency_s = time.monotonic() - sent
        if keep_text:
            outcome.text = "".join(pieces)
    return outcome


def _agent_api(url: str) -> str | None:
    """The agent API a URL speaks ("messages", "responses"), or None for chat / completions."""
    path = url.split("?", 1)[0]
    for api in ("messages", "responses"):
        if path.endswith("/v1/" + api):
            return api
    return None


async def _agent_answer(
    resp: aiohttp.ClientResponse,
    api: str,
    outcome: Outcome,
    sent: float,
    pieces: list[str],
    keep_text: bool,
) -> None:
    """A Messages or Responses answer into ``outcome``: whole, or its stream's events."""
    if not outcome.stream:
        data = _object(await resp.json())
        outcome.ttft_s = outcome.last_token_s = time.monotonic() - sent
        if api == "messages":
            texts = [b.get("text") or "" for b in data.get("content") or () if isinstance(b, dict)]
            outcome.finished = bool(data.get("stop_reason"))
        else:
            texts = [
                part.get("text") or ""
                for item in data.get("output") or ()
                if isinstance(item, dict)
                for part in item.get("content") or ()
                if isinstance(part, dict)
            ]
            outcome.finished = data.get("status") in ("completed", "incomplete")
        pieces.extend(texts)
        outcome.usage_tokens = (data.get("usage") or {}).get("output_tokens")
        if not outcome.finished:
            outcome.fail("no finish_reason", "answer without a stop reason or status")
        return
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        event = _object(json.loads(line[6:]))
        kind = event.get("type")
        text = ""
        if kind == "error":
            error = event.get("error", event)
            outcome.fail("SSE error", f"SSE error: {_error_message(error)}")
            return
        if kind == "content_block_delta":
            delta = event.get("delta")
            text = (delta.get("text") or "") if isinstance(delta, dict) else ""
        elif kind == "response.output_text.delta":
            text = event.get("delta") or ""
        elif kind == "message_delta":
            outcome.finished = bool((event.get("delta") or {}).get("stop_reason"))
            outcome.usage_tokens = (event.get("usage") or {}).get("output_tokens")
        elif kind in ("message_stop", "response.completed"):
            outcome.done = True
            if kind == "response.completed":
                response = event.get("response") or {}
                outcome.finished = response.get("status") in ("completed", "incomplete")
                outcome.usage_tokens = (response.get("usage") or {}).get("output_tokens")
        if text:
            _content_came(outcome, sent, text, pieces if keep_text else None)
    if not (outcome.finished and outcome.done):
        outcome.fail("incomplete stream", "stream ended without its stop reason and last event")


def _content_came(outcome: Outcome, sent: float, text: str, kept: list[str] | None) -> None:
    """A streamed event with content: its time, counted, its text kept when asked."""
    outcome.last_token_s = time.monotonic() - sent
    if outcome.ttft_s is None:
        outcome.ttft_s = outcome.last_token_s
    outcome.chunks += 1
    if kept is not None:
        kept.append(text)


def request_body(
    api: str, model: str, system: str | None, turns: Sequence[Mapping[str, str]], max_tokens: int,
    *, session: str | None = None, extra: Mapping[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """The path and streamed body that send this conversation in ``api`` ("chat",
    "messages", "responses"): the same conversation, each API's own shape."""
    body: dict[str, Any] = {"model": model, "stream": True}
    if api == "messages":
        body.update(max_tokens=max_tokens, messages=list(turns))
        if system:
            body["system"] = system
        if session:
            body["metadata"] = {"user_id": session}
        path = "/v1/messages"
    elif api == "responses":
        body.update(max_output_tokens=max_tokens, input=list(turns))
        if system:
            body["instructions"] = system
        if session:
            body["user"] = session
        path = "/v1/responses"
    elif api == "chat":
        head = [{"role": "system", "content": system}] if system else []
        body.update(max_tokens=max_tokens, messages=head + list(turns))
        if session:
            body["user"] = session
        path = "/v1/chat/completions"
    else:
        raise ValueError(f"unknown API {api!r}: chat, messages or responses")
    body.update(extra or {})
    return path, body


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of an open-loop plan."""

    at_s: float  # when to send it, seconds after the load started
    url: str
    body: Mapping[str, Any]


async def run_open_loop(
    http: aiohttp.ClientSession,
    plan: Iterable[Planned],
    *,
    started: float | None = None,
    concurrency: int | None = None,
    on_done: Callable[[int, Outcome], None] | None = None,
) -> int:
    """Send each planned request when it is due (``started``, a ``time.monotonic()``, plus its
    ``at_s``); return how many were sent.

    With ``concurrency``, a request due while that many are in flight waits for one to end
    (``Outcome.late_s`` says how long it went out after its time). ``on_done(index, outcome)``
    is called as each request ends, so a long plan (a generator) holds only what is in flight.
    """
    start = time.monotonic() if started is None else started
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    running: set[asyncio.Task[None]] = set()

    async def one(index: int, request: Planned, outcome: Outcome) -> None:
        try:
            await send(http, request.url, request.body, outcome)
        finally:
            if slots is not None:
                slots.release()
        if on_done is not None:
            on_done(index, outcome)

    sent = 0
    try:
        for index, request in enumerate(plan):
            due = start + request.at_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            now = time.monotonic()
            outcome = Outcome(
                stream=bool(request.body.get("stream")),
                sent_at=now - start,
                late_s=max(0.0, now - due),
            )
            task = asyncio.create_task(one(index, request, outcome))
            running.add(task)
            task.add_done_callback(running.discard)
            sent += 1
        if running:
            await asyncio.gather(*running)
    finally:
        for task in running:
            task.cancel()
    return sent


async def run_closed_loop(
    http: aiohttp.ClientSession,
    starts: Iterable[tuple[int, float]],
    following: Mapping[int, int],
    gap_s: Callable[[int], float],
    build: Callable[[int], tuple[str, Mapping[str, Any]]],
    *,
    started: float | None = None,
    concurrency: int | None = None,
    on_done: Callable[[int, Outcome], None] | None = None,
) -> int:
    """Send chains of requests, by index, in a closed loop; return how many were sent.

    ``starts``: (index, seconds after ``started``) of each chain's first request, in time
    order; ``following[i]``: the request sent ``gap_s(that one)`` seconds after request i's
    answer ended (a chain ends at an index it does not name). ``build(i)``: request i's URL
    and body, built just before it goes out. With ``concurrency`` at most that many are in
    flight (``Outcome.late_s``: how long after it was due a request went out, waiting for a
    slot included); ``on_done(i, outcome)`` as each one ends, before its follower is due.
    """
    start = time.monotonic() if started is None else started
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    running: set[asyncio.Task[None]] = set()
    sent = 0

    async def chain(index: int, due: float) -> None:
        nonlocal sent
        while True:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            url, body = build(index)
            if slots is not None:
                await slots.acquire()
            now = time.monotonic()
            outcome = Outcome(
                stream=bool(body.get("stream")), sent_at=now - start, late_s=max(0.0, now - due)
            )
            sent += 1
            try:
                await send(http, url, body, outcome)
            finally:
                if slots is not None:
                    slots.release()
            if on_done is not None:
                on_done(index, outcome)
            if index not in following:
                return
            index = following[index]
            due = time.monotonic() + max(0.0, gap_s(index))

    try:
        for index, at_s in starts:
            due = start + at_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(chain(index, due))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)
    finally:
        for task in running:
            task.cancel()
    return sent


async def run_conversations(
    http: aiohttp.ClientSession,
    url_for_tenant: Callable[[int], str],
    conversations: Sequence[Conversation],
    *,
    concurrency: int,
    max_tokens: int,
    model: str = "tiny",
    scripted_replies: bool = True,
    on_done: Callable[[Outcome], None] | None = None,
    api: str = "chat",
) -> None:
    """Every conversation turn by turn, streamed requests to ``url_for_tenant(tenant)`` in
    ``api`` (chat completions, Anthropic Messages or OpenAI Responses: ``request_body``),
    ``concurrency`` conversations at once.

    With ``scripted_replies`` the assistant turns sent back are fixed text, so every router
    sees the very same prompts; otherwise the model's own replies are sent back, as a chat
    client would.
    """
    slots = asyncio.Semaphore(concurrency)

    async def converse(conversation: Conversation) -> None:
        async with slots:
            messages: list[dict[str, str]] = []
            base = url_for_tenant(conversation.tenant)
            for turn, text in enumerate(conversation.user_turns):
                messages.append({"role": "user", "content": text})
                path, body = request_body(
                    api,
                    model,
                    conversation.system_prompt,
                    messages,
                    max_tokens,
                    session=f"tenant-{conversation.tenant}",
                )
                outcome = await send(http, base + path, body, keep_text=not scripted_replies)
                reply = outcome.text if outcome.ok else ""
                if scripted_replies:
                    reply = f"Reply {turn} to tenant {conversation.tenant}: noted, " + text[:80]
                messages.append({"role": "assistant", "content": reply})
                if on_done is not None:
                    on_done(outcome)

    await asyncio.gather(*(converse(c) for c in conversations))
