"""An in-process Kubernetes API server for tests: pods and InferencePools, list and watch.

It speaks what kubernetes_asyncio sends and expects (paths, camelCase query parameters, boolean
parameters spelled ``True``, newline-delimited JSON watch streams) and keeps the API server's
semantics that discovery depends on:

- one resourceVersion counter for every object, as etcd's revision;
- a list answers with ``metadata.resourceVersion``; a watch from version V replays the history
  after V, then streams live changes;
- a label-selector watch turns "stopped matching" into DELETED and "started matching" into ADDED;
- a watch from a version older than the compacted history gets an ERROR event carrying a
  Status with code 410 (or, with ``gone_as_http_status``, an HTTP 410 answer);
- BOOKMARK events (``bookmark()``) to watches that asked for them (allowWatchBookmarks).

Hooks for tests: `put`/`update`/`delete` objects, `compact`, `expire_next_watches` (410 Gone),
`close_watches` (the server ends every stream, as at its timeout), `fail_requests` (HTTP
500s), `hold_lists` (a list waits), `bookmark`, and the request log `requests`.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

PODS = "pods"
POOLS = "inferencepools"
POOL_API_VERSION = "inference.networking.k8s.io/v1"
TOKEN = "kvroute-test-token"

Obj = dict[str, Any]
_KINDS = {PODS: ("v1", "Pod"), POOLS: (POOL_API_VERSION, "InferencePool")}


@dataclass
class Request:
    resource: str
    namespace: str
    query: dict[str, str]
    at: float  # loop time
    status: int = 200  # what the server answered (a watch: its HTTP status)

    @property
    def watch(self) -> bool:
        return _flag(self.query.get("watch"))


@dataclass
class _Change:
    rv: int
    resource: str
    namespace: str
    old: Obj | None
    new: Obj | None  # None: deleted


@dataclass(eq=False)  # hashed by identity: the server keeps a set of open watches
class _Watch:
    resource: str
    namespace: str
    labels: Callable[[Obj], bool]
    fields: Callable[[Obj], bool]
    bookmarks: bool
    queue: asyncio.Queue[Obj | None] = field(default_factory=asyncio.Queue)

    def matches(self, obj: Obj | None) -> bool:
        return obj is not None and self.labels(obj) and self.fields(obj)

    def event_for(self, change: _Change) -> Obj | None:
        """The event this watch sees for a change, as the API server's watch filter does."""
        if change.resource != self.resource or change.namespace != self.namespace:
            return None
        was, now = self.matches(change.old), self.matches(change.new)
        if was and now:
            return {"type": "MODIFIED", "object": change.new}
        if now:
            return {"type": "ADDED", "object": change.new}
        if was:
            # Deleted, or no longer selected: the last state, at the change's version.
            last = copy.deepcopy(change.new if change.new is not None else change.old)
            assert last is not None
            last["metadata"]["resourceVersion"] = str(change.rv)
            return {"type": "DELETED", "object": last}
        return None


class FakeKubeAPI:
    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.rv = 1000
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.history: list[_Change] = []
        self.compacted_rv = 0  # a watch from a version below this gets 410 Gone
        self.gone_as_http_status = False
        self._expire: dict[str | None, int] = {}
        self.requests: list[Request] = []
        self.url = ""
        self.kubeconfig: Path | None = None
        self._fail: dict[str | None, int] = {}
        self._holds: dict[str, asyncio.Event] = {}
        self._watches: set[_Watch] = set()
        self._runner: web.AppRunner | None = None

    # Lifecycle

    async def start(self) -> FakeKubeAPI:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools", self._pools
        )
        # handler_cancellation: a client that hangs up ends its watch here too.
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.close_watches()
        for hold in self._holds.values():
            hold.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for this server (plain HTTP, a bearer token), as kubectl would read."""
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "test", "user": {"token": self.token}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                    "current-context": "test",
                }
            )
        )
        self.kubeconfig = path
        return path

    # Objects

    def put(self, resource: str, obj: Obj) -> Obj:
        """Create or replace an object: ADDED or MODIFIED to the watches it matches."""
        obj = copy.deepcopy(obj)
        api_version, kind = _KINDS[resource]
        obj.setdefault("apiVersion", api_version)
        obj.setdefault("kind", kind)
        metadata = obj.setdefault("metadata", {})
        namespace = metadata.setdefault("namespace", "default")
        key = (resource, namespace, metadata["name"])
        self.rv += 1
        metadata["resourceVersion"] = str(self.rv)
        old = self.objects.get(key)
        metadata["uid"] = old["metadata"]["uid"] if old else f"uid-{self.rv}"
        self.objects[key] = obj
        self._record(_Change(self.rv, resource, namespace, old, obj))
        return obj

    def update(
        self, resource: str, name: str, change: Callable[[Obj], None], namespace: str = "default"
    ) -> Obj:
        obj = copy.deepcopy(self.objects[(resource, namespace, name)])
        change(obj)
        return self.put(resource, obj)

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        old = self.objects.pop((resource, namespace, name))
        self.rv += 1
        self._record(_Change(self.rv, resource, namespace, old, None))

    def _record(self, change: _Change) -> None:
        self.history.append(change)
        for w in self._watches:
            event = w.event_for(change)
            if event is not None:
                w.queue.put_nowait(event)

    # Hooks

    def compact(self) -> None:
        """Forget the history so far: a watch from an older version gets 410 Gone."""
        self.compacted_rv = self.rv
        self.history.clear()

    def close_watches(self) -> None:
        """End every open watch stream (after what was already queued), as at its timeout."""
        for w in self._watches:
            w.queue.put_nowait(None)

    def bookmark(self) -> int:
        """A BOOKMARK at the current version to every watch that asked for bookmarks."""
        for w in self._watches:
            if w.bookmarks:
                api_version, kind = _KINDS[w.resource]
                w.queue.put_nowait(
                    {
                        "type": "BOOKMARK",
                        "object": {
                            "apiVersion": api_version,
                            "kind": kind,
                            "metadata": {"resourceVersion": str(self.rv)},
                        },
                    }
                )
        return self.rv

    def expire_next_watches(self, count: int = 1, resource: str | None = None) -> None:
        """Answer the next ``count`` watches (of ``resource``, or any) with 410 Gone, whatever
        their resourceVersion."""
        self._expire[resource] = count

    def fail_requests(self, count: int, resource: str | None = None) -> None:
        """Answer the next ``count`` requests (for ``resource``, or any) with HTTP 500."""
        self._fail[resource] = count

    def hold_lists(self, resource: str) -> asyncio.Event:
        """Lists of ``resource`` wait until the returned event is set."""
        self._holds[resource] = asyncio.Event()
        return self._holds[resource]

    def open_watches(self, resource: str) -> int:
        return sum(1 for w in self._watches if w.resource == resource)

    def lists(self, resource: str) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and not r.watch]

    def watches(self, resource: str) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and r.watch]

    # Handlers

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, PODS)

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, POOLS)

    async def _serve(self, request: web.Request, resource: str) -> web.StreamResponse:
        namespace = request.match_info["ns"]
        query = dict(request.query)
        log = Request(resource, namespace, query, asyncio.get_running_loop().time())
        self.requests.append(log)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(log, 401, "Unauthorized", "no or wrong bearer token")
        for key in (resource, None):
            if self._fail.get(key, 0) > 0:
                self._fail[key] -= 1
                return _status(log, 500, "InternalError", "injected failure")
        try:
            labels = _label_selector(query.get("labelSelector", ""))
            fields = _field_selector(query.get("fieldSelector", ""))
        except ValueError as e:
            return _status(log, 400, "BadRequest", str(e))
        if not _flag(query.get("watch")):
            if resource in self._holds:
                await self._holds[resource].wait()
            return self._list(resource, namespace, labels, fields)
        return await self._watch(request, log, resource, namespace, labels, fields)

    def _list(
        self,
        resource: str,
        namespace: str,
        labels: Callable[[Obj], bool],
        fields: Callable[[Obj], bool],
    ) -> web.Response:
        api_version, kind = _KINDS[resource]
        items = [
            obj
            for (res, ns, _), obj in sorted(self.objects.items())
            if res == resource and ns == namespace and labels(obj) and fields(obj)
        ]
        body = {
            "apiVersion": api_version,
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }
        return web.json_response(body)

    async def _watch(
        self,
        request: web.Request,
        log: Request,
        resource: str,
        namespace: str,
        labels: Callable[[Obj], bool],
        fields: Callable[[Obj], bool],
    ) -> web.StreamResponse:
        since = query_rv = request.query.get("resourceVersion")
        start = int(since) if since not in (None, "", "0") else None
        expiring = [k for k in (resource, None) if self._expire.get(k, 0) > 0]
        if expiring:
            self._expire[expiring[0]] -= 1
        if expiring or (start is not None and start < self.compacted_rv):
            message = f"too old resource version: {query_rv} ({self.compacted_rv})"
            if self.gone_as_http_status:
                return _status(log, 410, "Expired", message)
            response = await _open_stream(request)
            await _send(
                response, {"type": "ERROR", "object": _status_body(410, "Expired", message)}
            )
            await response.write_eof()
            return response

        w = _Watch(
            resource, namespace, labels, fields, _flag(request.query.get("allowWatchBookmarks"))
        )
        # Registered before anything is awaited: no change can fall between replay and live.
        initial: list[Obj]
        if start is None:
            initial = [
                {"type": "ADDED", "object": obj}
                for (res, ns, _), obj in sorted(self.objects.items())
                if res == resource and ns == namespace and w.matches(obj)
            ]
        else:
            initial = [
                e for c in self.history if c.rv > start and (e := w.event_for(c)) is not None
            ]
        for change in initial:
            w.queue.put_nowait(change)
        self._watches.add(w)
        try:
            response = await _open_stream(request)
            timeout = float(request.query.get("timeoutSeconds") or 3600)
            try:
                async with asyncio.timeout(timeout):
                    while (queued := await w.queue.get()) is not None:
                        await _send(response, queued)
            except TimeoutError:
                pass
            await response.write_eof()
            return response
        finally:
            self._watches.discard(w)


def make_pod(
    name: str,
    ip: str,
    labels: dict[str, str] | None = None,
    *,
    ready: bool = True,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    namespace: str = "default",
) -> Obj:
    metadata: Obj = {
        "name": name,
        "namespace": namespace,
        "labels": labels if labels is not None else {"app": "vllm"},
    }
    if annotations:
        metadata["annotations"] = annotations
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


def make_pool(
    name: str = "vllm-pool",
    match_labels: dict[str, str] | None = None,
    ports: list[int] | None = None,
    namespace: str = "default",
) -> Obj:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {
                "matchLabels": match_labels if match_labels is not None else {"app": "vllm"}
            },
            "targetPorts": [{"number": p} for p in (ports if ports is not None else [8000])],
            "endpointPickerRef": {
                "name": "kvroute-epp",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
    }


def set_ready(ready: bool) -> Callable[[Obj], None]:
    def change(pod: Obj) -> None:
        for condition in pod["status"]["conditions"]:
            if condition["type"] == "Ready":
                condition["status"] = "True" if ready else "False"

    return change


def _flag(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


def _status_body(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _status(log: Request, code: int, reason: str, message: str) -> web.Response:
    log.status = code
    return web.json_response(_status_body(code, reason, message), status=code)


async def _open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, event: Obj) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


def _label_selector(text: str) -> Callable[[Obj], bool]:
    """Equality-based label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "(" in term:
            raise ValueError(f"set-based selector not supported here: {term}")
        if "!=" in term:
            key, value = term.split("!=", 1)
            tests.append(_label_is(key, value, negate=True))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            tests.append(_label_is(key, value, negate=False))
        else:
            tests.append(_label_exists(term.removeprefix("!"), negate=term.startswith("!")))
    return lambda obj: all(t(obj["metadata"].get("labels") or {}) for t in tests)


def _label_is(key: str, value: str, *, negate: bool) -> Callable[[dict[str, str]], bool]:
    return lambda labels: (labels.get(key) == value) != negate


def _label_exists(key: str, *, negate: bool) -> Callable[[dict[str, str]], bool]:
    return lambda labels: (key in labels) != negate


def _field_selector(text: str) -> Callable[[Obj], bool]:
    """The field selectors every resource supports: metadata.name and metadata.namespace."""
    tests: list[Callable[[Obj], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        negate = "!=" in term
        key, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        if key not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f'field label not supported: "{key}"')
        tests.append(_field_is(key.split(".", 1)[1], value, negate=negate))
    return lambda obj: all(t(obj) for t in tests)


def _field_is(attr: str, value: str, *, negate: bool) -> Callable[[Obj], bool]:
    return lambda obj: (obj["metadata"].get(attr) == value) != negate
