"""Anthropic's Message Batches API over the batch lane, as the ``anthropic`` client calls it.

POST /v1/messages/batches, GET /v1/messages/batches[/{id}], POST /v1/messages/batches/{id}/cancel,
GET /v1/messages/batches/{id}/results (JSONL), DELETE /v1/messages/batches/{id}. A batch is a job
of the lane (``messages_model``): the same store, runner, pacing, tenants and durability as
/v1/batches. Each request's params are checked as POST /v1/messages checks a body, when the
batch is created; every refusal is in Anthropic's error shape and names the request at fault.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from .. import errors
from ..agent_request import parse_messages
from ..client_faults import CLIENT_FAULTS, unreadable
from .api import LaneEndpoints
from .messages_model import (
    ID_PREFIX,
    MESSAGES_ENDPOINT,
    check_request,
    deleted,
    processing_status,
    to_message_batch,
)
from .model import CANCELLABLE, InputLine, Job, Status, model_problem

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BASE = "/v1/messages/batches"
MAX_PAGE = 1000  # Anthropic's largest list page
DEFAULT_PAGE = 20
_CREATE_FIELDS = frozenset({"requests"})


class MessageBatchApi(LaneEndpoints):
    def guard(self, handler: Handler) -> Handler:
        return _guarded(handler)

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("POST", BASE, self.create),
            ("GET", BASE, self.list_batches),
            ("GET", BASE + "/{batch_id}", self.retrieve),
            ("DELETE", BASE + "/{batch_id}", self.delete),
            ("POST", BASE + "/{batch_id}/cancel", self.cancel),
            ("GET", BASE + "/{batch_id}/results", self.results),
        ]

    async def create(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        body = await _json_body(request, self.config.max_file_bytes)
        # Up to max_lines requests, each checked and converted as /v1/messages does: in a
        # thread, so a large batch does not hold the event loop (online traffic) for seconds.
        lines = await asyncio.to_thread(self._lines, body)
        now = time.time()
        job = Job(
            id=ID_PREFIX + os.urandom(12).hex(),
            endpoint=MESSAGES_ENDPOINT,
            input_file_id="",  # its requests came in the body, not in a file
            created_at=now,
            expires_at=now + self.config.window_s,
            tenant=tenant,
            total=len(lines),
            pending=len(lines),
            seq=time.time_ns(),
        )
        await self.store.create(job, lines)
        self.runner.wake()
        return _json(to_message_batch(job, None))

    def _lines(self, body: Any) -> list[InputLine]:
        """The batch's requests as lane lines, each checked as a /v1/messages body."""
        if not isinstance(body, dict):
            raise errors.bad_request("The request body must be a JSON object.")
        unknown = set(body) - _CREATE_FIELDS
        if unknown:
            raise errors.bad_request(f"{', '.join(sorted(unknown))}: unknown field(s)")
        requests = body.get("requests")
        if not isinstance(requests, list) or not requests:
            raise errors.bad_request("requests: required, a non-empty list of {custom_id, params}")
        limit = self.config.max_lines
        if len(requests) > limit:
            raise errors.bad_request(f"requests: more than batch.max_lines ({limit}) requests")
        lines: list[InputLine] = []
        seen: set[str] = set()
        served = self.catalog.known  # one snapshot: this runs in a thread
        for i, item in enumerate(requests):
            problem = check_request(i, item)
            if problem is not None:
                raise errors.bad_request(problem)
            custom_id = item["custom_id"]
            if custom_id in seen:
                raise errors.bad_request(
                    f"requests[{i}].custom_id: {custom_id!r} is used by an earlier request; "
                    "each custom_id must be unique in its batch"
                )
            seen.add(custom_id)
            params = json.dumps(item["params"], separators=(",", ":"), ensure_ascii=False).encode()
            try:
                parsed = parse_messages(params)
            except errors.ApiError as exc:
                where = f"requests[{i}].params" + (f".{exc.param}" if exc.param else "")
                why = exc.message.removeprefix("Invalid request: ")
                raise errors.bad_request(f"Invalid request: {where}: {why}") from None
            problem = model_problem(parsed.model, served)
            if problem is not None:
                raise errors.bad_request(f"Invalid request: requests[{i}].params.model: {problem}")
            lines.append(InputLine(i + 1, custom_id, MESSAGES_ENDPOINT, params))
        return lines

    async def retrieve(self, request: web.Request) -> web.Response:
        job = await self._job(request)
        return _json(to_message_batch(job, _results_url(request, job.id)))

    async def list_batches(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        limit, after, before = _page(request)
        jobs, more = await self.store.jobs(
            limit, after, time.time(), tenant, before=before, endpoints=(MESSAGES_ENDPOINT,)
        )
        data = [to_message_batch(j, _results_url(request, j.id)) for j in jobs]
        return _json(
            {
                "data": data,
                "has_more": more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )

    async def cancel(self, request: web.Request) -> web.Response:
        job = await self._job(request)
        if await self.store.move(job.id, CANCELLABLE, Status.CANCELLING, time.time()):
            self.runner.cancel(job.id)  # this router's requests abort now; others' on their tick
            job = await self._job(request)
        elif job.status not in (Status.CANCELLING, Status.CANCELLED, Status.FINALIZING):
            raise errors.bad_request(f"Message Batch {job.id} has ended: it cannot be canceled.")
        return _json(to_message_batch(job, _results_url(request, job.id)))

    async def results(self, request: web.Request) -> web.Response:
        job = await self._job(request)
        if processing_status(job.status) != "ended":
            raise errors.bad_request(
                f"Message Batch {job.id} has not ended yet: its results are available once "
                "processing_status is 'ended'."
            )
        content = await self.store.file_content(job.output_file_id or "")
        if content is None:
            raise _not_found(job.id)
        return web.Response(body=content, content_type="application/binary")

    async def delete(self, request: web.Request) -> web.Response:
        job = await self._job(request)
        if processing_status(job.status) != "ended":
            raise errors.bad_request(
                f"Message Batch {job.id} has not ended: cancel it first, then delete it."
            )
        if not await self.store.delete(job.id, job.tenant):
            raise _not_found(job.id)
        return _json(deleted(job.id))

    async def _job(self, request: web.Request) -> Job:
        """The request's batch, if it is a Message Batch of the request's tenant."""
        batch_id = request.match_info["batch_id"]
        job = await self.store.job(batch_id, time.time(), self._tenant(request))
        if job is None or job.endpoint != MESSAGES_ENDPOINT:
            raise _not_found(batch_id)
        return job


def off_routes(routes: web.UrlDispatcher) -> None:
    """With no batch: section, the Message Batches routes say so (as /v1/batches does), in
    Anthropic's shape."""

    async def off(request: web.Request) -> web.Response:
        return errors.ApiError(
            404, "The batch lane is off on this router: add a batch: section to its config.",
            code="batch_disabled",
        ).response(errors.ANTHROPIC)  # fmt: skip

    for path in (BASE, BASE + "/{tail:.*}"):
        routes.add_route("*", path, off)


def _guarded(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except errors.ApiError as exc:
            return exc.response(errors.ANTHROPIC)
        except Exception as exc:  # the store's database is unreachable, say: never a bare 500
            log.exception("message batches API: %s %s failed", request.method, request.path)
            return errors.ApiError(503, f"The batch store is unavailable: {exc}").response(
                errors.ANTHROPIC
            )

    return guarded


async def _json_body(request: web.Request, limit: int) -> Any:
    """The body, read up to ``limit`` bytes (batch.max_file_bytes: a batch's requests come in
    its body, as a file's lines come in an upload)."""
    chunks, size = [], 0
    try:
        while chunk := await request.content.read(1 << 16):
            size += len(chunk)
            if size > limit:
                raise errors.ApiError(
                    413, f"The request body is larger than batch.max_file_bytes ({limit})."
                )
            chunks.append(chunk)
    except CLIENT_FAULTS as exc:
        raise unreadable(exc) from None
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise errors.bad_request("The request body is not valid JSON.") from None


def _page(request: web.Request) -> tuple[int, str | None, str | None]:
    raw = request.query.get("limit")
    try:
        limit = int(raw) if raw is not None else DEFAULT_PAGE
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise errors.bad_request(f"limit: must be an integer from 1 to {MAX_PAGE}.")
    after = request.query.get("after_id") or None
    before = request.query.get("before_id") or None
    if after is not None and before is not None:
        raise errors.bad_request("Give after_id or before_id, not both.")
    return limit, after, before


def _results_url(request: web.Request, batch_id: str) -> str:
    """Where the results are, as the client reached this router (a proxy's
    X-Forwarded-Proto and -Host win)."""
    scheme = request.headers.get("X-Forwarded-Proto", request.scheme)
    host = request.headers.get("X-Forwarded-Host", request.host)
    return f"{scheme}://{host}{BASE}/{batch_id}/results"


def _not_found(batch_id: str) -> errors.ApiError:
    return errors.ApiError(404, f"No Message Batch with id {batch_id!r}.", code="not_found")


def _json(obj: object) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")
