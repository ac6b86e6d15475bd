"""OpenAI's Files and Batches endpoints over the batch store, as the ``openai`` client calls them.

POST /v1/files (multipart, purpose=batch), GET /v1/files[/{id}[/content]], POST /v1/batches,
GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel. Every refusal is an OpenAI-shaped error
that says what to change; an input file is checked line by line when it is uploaded.
"""

from __future__ import annotations

import json
import logging
import os
import time
import unicodedata
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import BodyPartReader, web

from .. import errors
from ..auth import Auth
from ..client_faults import CLIENT_FAULTS, read_body
from ..config import BatchConfig
from ..pipeline import ModelCatalog
from ..tenants import DEFAULT_TENANT, Tenants
from .model import (
    CANCELLABLE,
    ENDPOINTS,
    FileMeta,
    InvalidFile,
    Job,
    Status,
    check_create,
    parse_input,
)
from .runner import BatchRunner
from .store import BatchStore

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_PAGE = 100
MAX_FILENAME_BYTES = 255  # an uploaded file's name, as most file systems allow


class LaneEndpoints:
    """What the batch lane's HTTP APIs share: the lane's parts, the tenant a request belongs
    to, and their routes, each behind its API's error guard (``guard``)."""

    def __init__(
        self,
        config: BatchConfig,
        store: BatchStore,
        runner: BatchRunner,
        auth: Auth,
        tenants: Tenants | None,
        catalog: ModelCatalog,
    ) -> None:
        self.config = config
        self.store = store
        self.runner = runner
        self.auth = auth
        self.tenants = tenants
        # The models online requests may name: a batch naming any other is refused whole
        # when it comes in, not line by line hours later when its lines run.
        self.catalog = catalog

    def routes(self) -> list[tuple[str, str, Handler]]:
        raise NotImplementedError

    def guard(self, handler: Handler) -> Handler:
        """The handler with its API's errors answered in that API's shape."""
        raise NotImplementedError

    def add_routes(self, routes: web.UrlDispatcher) -> None:
        for method, path, handler in self.routes():
            routes.add_route(method, path, self.guard(handler))

    def _tenant(self, request: web.Request) -> str:
        """Whose files and batches this request may see: its tenant (the API key's, else the
        headers', as for any request), the only one it can read, list or cancel."""
        key_tenant = self.auth.check_client(request)
        if self.tenants is None:
            return DEFAULT_TENANT
        return self.tenants.identify(request.headers, key_tenant)[0]


# A multipart body aiohttp cannot parse (ValueError) or read (a client fault).
_MALFORMED: tuple[type[BaseException], ...] = (ValueError, *CLIENT_FAULTS)


class BatchApi(LaneEndpoints):
    def guard(self, handler: Handler) -> Handler:
        return _guarded(handler)

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("POST", "/v1/files", self.upload),
            ("GET", "/v1/files", self.list_files),
            ("GET", "/v1/files/{file_id}", self.get_file),
            ("GET", "/v1/files/{file_id}/content", self.file_content),
            ("POST", "/v1/batches", self.create),
            ("GET", "/v1/batches", self.list_batches),
            ("GET", "/v1/batches/{batch_id}", self.get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", self.cancel),
        ]

    # -- files -------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        purpose, filename, content = await self._read_upload(request)
        if purpose != "batch":
            raise errors.bad_request(
                f"purpose must be 'batch' (the only files this router keeps), got {purpose!r}",
                "purpose",
            )
        try:
            parse_input(content, self.config.max_lines, self.catalog.known)
        except InvalidFile as exc:
            raise errors.ApiError(
                400, f"The batch input file is not valid: {exc}.", param="file",
                code="invalid_file",
            ) from None  # fmt: skip
        meta = FileMeta(_new_id("file-"), purpose, filename, len(content), time.time(), tenant)
        await self.store.add_file(meta, content)
        return _json(meta.to_openai())

    async def _read_upload(self, request: web.Request) -> tuple[str, str, bytes]:
        if not request.content_type.startswith("multipart/"):
            raise errors.bad_request(
                "Upload a file as multipart/form-data with the fields 'purpose' and 'file'."
            )
        limit = self.config.max_file_bytes
        try:
            return await self._read_parts(request, limit)
        except _MALFORMED as exc:
            # aiohttp's multipart reader on a malformed body, or a part's malformed headers
            # (a control character in a file name, say): the client's fault, not the store's.
            why = getattr(exc, "message", None) or str(exc)
            raise errors.bad_request(f"The multipart body cannot be read: {why}") from None

    async def _read_parts(self, request: web.Request, limit: int) -> tuple[str, str, bytes]:
        purpose, filename, content = None, "", None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode("utf-8", "replace").strip()
            elif part.name == "file":
                filename = file_name(part.filename)
                chunks, size = [], 0
                while chunk := await part.read_chunk(1 << 16):
                    size += len(chunk)
                    if size > limit:
                        raise errors.ApiError(
                            413, f"The file is larger than batch.max_file_bytes ({limit}).",
                            param="file", code="file_too_large",
                        )  # fmt: skip
                    chunks.append(chunk)
                content = b"".join(chunks)
        if purpose is None:
            raise errors.bad_request("The form field 'purpose' is missing.", "purpose")
        if content is None:
            raise errors.bad_request("The form field 'file' is missing.", "file")
        return purpose, filename, content

    async def list_files(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        limit, after = _page(request, default=MAX_PAGE)
        files, more = await self.store.files(limit, after, tenant)
        return _json(_list([f.to_openai() for f in files], more))

    async def get_file(self, request: web.Request) -> web.Response:
        return _json((await self._file(request)).to_openai())

    async def file_content(self, request: web.Request) -> web.Response:
        meta = await self._file(request)
        content = await self.store.file_content(meta.id)
        if content is None:
            raise _not_found("file", meta.id)
        return web.Response(body=content, content_type="application/jsonl")

    async def _file(self, request: web.Request) -> FileMeta:
        file_id = request.match_info["file_id"]
        meta = await self.store.file(file_id, self._tenant(request))
        if meta is None:
            raise _not_found("file", file_id)
        return meta

    # -- batches -----------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        body = await _json_body(request)
        problem = check_create(body)
        if problem is not None:
            param, _, why = problem.partition(": ")
            raise errors.bad_request(f"{param}: {why}", param)
        file_id = body["input_file_id"]
        meta = await self.store.file(file_id, tenant)
        content = await self.store.file_content(file_id)
        if meta is None or content is None:
            raise _not_found("file", file_id, "input_file_id")
        if meta.purpose != "batch":
            raise errors.bad_request(
                f"File {file_id} has purpose {meta.purpose!r}; upload one with purpose=batch.",
                "input_file_id",
            )
        try:
            # Checked at upload; checked again, as the limits or the models served may have
            # changed since (a file outlives a restart with another config).
            lines = parse_input(content, self.config.max_lines, self.catalog.known)
        except InvalidFile as exc:
            raise errors.bad_request(
                f"The batch input file {file_id} is not valid: {exc}.", "input_file_id"
            ) from None
        endpoint = body["endpoint"]
        for line in lines:
            if line.url != endpoint:
                raise errors.bad_request(
                    f"Line {line.line_no} of {file_id} calls {line.url} but the batch's "
                    f"endpoint is {endpoint}: every line must call the batch's endpoint.",
                    "endpoint",
                )
        now = time.time()
        job = Job(
            id=_new_id("batch_"),
            endpoint=endpoint,
            input_file_id=file_id,
            created_at=now,
            expires_at=now + self.config.window_s,
            tenant=tenant,
            metadata=body.get("metadata"),
            total=len(lines),
            pending=len(lines),
            seq=time.time_ns(),
        )
        await self.store.create(job, lines)
        self.runner.wake()
        return _json(job.to_openai())

    async def get_batch(self, request: web.Request) -> web.Response:
        job = await self._job(request.match_info["batch_id"], self._tenant(request))
        return _json(job.to_openai())

    async def list_batches(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        limit, after = _page(request, default=20)
        # Message Batches are Anthropic's (/v1/messages/batches): not listed here.
        jobs, more = await self.store.jobs(limit, after, time.time(), tenant, endpoints=ENDPOINTS)
        return _json(_list([j.to_openai() for j in jobs], more))

    async def cancel(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        batch_id = request.match_info["batch_id"]
        job = await self._job(batch_id, tenant)
        if await self.store.move(batch_id, CANCELLABLE, Status.CANCELLING, time.time()):
            self.runner.cancel(batch_id)  # this router's lines abort now; others' on their tick
            job = await self._job(batch_id, tenant)
        elif job.status not in (Status.CANCELLING, Status.CANCELLED):
            raise errors.ApiError(
                409, f"Batch {batch_id} is {job.status.value} and can no longer be cancelled.",
                param="batch_id", code="batch_not_cancellable",
            )  # fmt: skip
        return _json(job.to_openai())

    async def _job(self, batch_id: str, tenant: str) -> Job:
        job = await self.store.job(batch_id, time.time(), tenant)
        if job is None or job.endpoint not in ENDPOINTS:  # a Message Batch is not one of these
            raise _not_found("batch", batch_id, "batch_id")
        return job


def off_routes(routes: web.UrlDispatcher) -> None:
    """With no batch: section, the batch routes say so instead of a bare 404."""

    async def off(request: web.Request) -> web.Response:
        return errors.ApiError(
            404, "The batch lane is off on this router: add a batch: section to its config.",
            code="batch_disabled",
        ).response()  # fmt: skip

    for path in ("/v1/files", "/v1/files/{tail:.*}", "/v1/batches", "/v1/batches/{tail:.*}"):
        routes.add_route("*", path, off)


def _guarded(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except errors.ApiError as exc:
            return exc.response()
        except Exception as exc:  # the store's database is unreachable, say: never a bare 500
            log.exception("batch API: %s %s failed", request.method, request.path)
            return errors.ApiError(
                503, f"The batch store is unavailable: {exc}", error_type="service_unavailable_error",
                code="batch_store_unavailable",
            ).response()  # fmt: skip

    return guarded


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await read_body(request))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise errors.bad_request("The request body is not valid JSON.") from None


def file_name(given: str | None) -> str:
    """An uploaded file's name as it is kept and shown: its last path component (a name is
    never used as a path, but a client's directories are none of the router's business);
    control characters, or more than MAX_FILENAME_BYTES, are a 400."""
    if not given:
        return "upload.jsonl"
    name = given.replace("\\", "/").rsplit("/", 1)[-1]
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        raise errors.ApiError(
            400, "The file name must not contain control characters.", param="file",
            code="invalid_file_name",
        )  # fmt: skip
    if name in ("", ".", "..") or len(name.encode("utf-8", "surrogatepass")) > MAX_FILENAME_BYTES:
        raise errors.ApiError(
            400, f"The file name must be 1-{MAX_FILENAME_BYTES} bytes, not a directory.",
            param="file", code="invalid_file_name",
        )  # fmt: skip
    return name


def _page(request: web.Request, default: int) -> tuple[int, str | None]:
    raw = request.query.get("limit")
    try:
        limit = int(raw) if raw is not None else default
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise errors.bad_request(f"limit must be an integer from 1 to {MAX_PAGE}.", "limit")
    return limit, request.query.get("after") or None


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _not_found(kind: str, ident: str, param: str | None = None) -> errors.ApiError:
    return errors.ApiError(
        404, f"No {kind} with id {ident!r}.", param=param or f"{kind}_id", code="not_found"
    )


def _new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )
