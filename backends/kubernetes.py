"""Kubernetes discovery for the endpoint picker: an InferencePool's Ready pods as endpoints.

`InferencePoolWatcher` follows one `inference.networking.k8s.io/v1` InferencePool (by name,
in one namespace) and the pods its `spec.selector.matchLabels` selects there. Each Ready pod
(condition `Ready=True`, no `deletionTimestamp`, a `status.podIP`) gives one endpoint per
`spec.targetPorts` entry, named `<pod>-rank-<i>` (`i`: the entry's index) at `podIP:port`. The
optional pod annotation `inference.networking.k8s.io/active-ports: "8000,8001"` keeps only the
listed target ports (ranks keep their index, so names stay stable).

KV events (a kvroute convention, not part of the InferencePool API): the pod annotation
`kvroute.io/kv-events-ports` says where each rank publishes vLLM's KV events over ZMQ.

- One port per `targetPorts` entry, in the same order: `"5557,5567"` -> rank 0 publishes on
  5557, rank 1 on 5567.
- One port with several target ports is a base port: rank `i` publishes on `base + i`, as vLLM
  offsets its `--kv-events-config` endpoint port by the data-parallel rank.
- Endpoints are `tcp://<podIP>:<port>` (IPv6 bracketed), one per rank in `PoolEndpoint.kv_events`.
- Without the annotation (or with one that does not parse) a rank has no KV events, and the
  picker falls back to its own predictions for it.

Data-parallel pods (vLLM ``--data-parallel-size N`` behind one port, a kvroute convention too):
the pod annotation `kvroute.io/data-parallel-size: "N"` makes each target port N routing
endpoints, one per rank (`PoolEndpoint.data_parallel_size`); the picker names the rank in the
`x-data-parallel-rank` header it adds, and hears rank k's KV events on the port's KV-event port
+ k, as vLLM offsets them (give one KV-event port per target port).

Mixed pools (a kvroute convention): the pod annotation `kvroute.io/speed: "0.5"` says the pod is
half as fast as the pool's others (an older GPU); the picker's latency lines for it start
there (`PoolEndpoint.speed`, the router's `replicas[].speed`) until its own answers teach them.

Both watches list first, then watch from the list's `resourceVersion` with bookmarks (which
advance it). A `410 Gone` (the resourceVersion is too old) relists at once; other API errors
relist after an exponential, jittered backoff. Bad input (a pool without target ports, a
malformed annotation) is logged as a warning naming the object and the key, never raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
KV_EVENTS_PORTS_ANNOTATION = "kvroute.io/kv-events-ports"
DATA_PARALLEL_ANNOTATION = "kvroute.io/data-parallel-size"
SPEED_ANNOTATION = "kvroute.io/speed"
MAX_SPEED = 1000.0
MAX_DATA_PARALLEL = 1024
MAX_TARGET_PORTS = 8  # the CRD's limit

LIST_TIMEOUT_S = 30.0
# Server-side watch timeout, randomised so a fleet of pickers does not reconnect in lockstep.
WATCH_TIMEOUT_RANGE_S = (300, 600)
# Beyond the server-side timeout: a read this late means a dead connection.
WATCH_READ_GRACE_S = 30.0
CONNECT_TIMEOUT_S = 10.0
# A watch that held this long (or delivered an event) was healthy: backoff starts over.
HEALTHY_WATCH_S = 1.0

Json = Mapping[str, Any]

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}")
_LABEL_VALUE = re.compile(rf"(?:{_NAME})?")


@dataclass(frozen=True, slots=True)
class PoolEndpoint:
    name: str  # "<pod>-rank-<i>", i the index in spec.targetPorts
    host: str  # the pod IP
    port: int
    # ZMQ endpoints of this rank's KV events, e.g. ("tcp://10.0.0.5:5557",); () when none.
    kv_events: tuple[str, ...] = ()
    # vLLM data-parallel ranks behind this port (kvroute.io/data-parallel-size).
    data_parallel_size: int = 1
    # Its speed against the pool's other pods (kvroute.io/speed): where the picker's latency
    # lines for it start.
    speed: float = 1.0

    @property
    def address(self) -> str:
        """``ip:port``, an IPv6 address bracketed (``[fd00::1]:8000``), as Envoy expects."""
        return f"{bracket_host(self.host)}:{self.port}"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What discovery needs from an InferencePool."""

    name: str
    # Empty when the selector is missing or invalid: the pool then selects no pod.
    match_labels: tuple[tuple[str, str], ...]
    # Position i is rank i; None where the entry is invalid (the other ranks keep their index).
    target_ports: tuple[int | None, ...]

    @property
    def label_selector(self) -> str | None:
        """The API server's labelSelector for the pods, or None when the pool selects nothing."""
        return label_selector(dict(self.match_labels)) if self.match_labels else None


def bracket_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def label_selector(match_labels: Mapping[str, str]) -> str:
    """``matchLabels`` as a label selector string: ``k1=v1,k2=v2``."""
    return ",".join(f"{key}={value}" for key, value in sorted(match_labels.items()))


def selector_matches(match_labels: Mapping[str, str], labels: Any) -> bool:
    """Whether ``labels`` carries every ``matchLabels`` pair. An empty selector matches nothing
    (a pool never takes every pod in the namespace by mistake)."""
    if not match_labels:
        return False
    labels = _mapping(labels)
    return all(labels.get(key) == value for key, value in match_labels.items())


def pod_is_ready(pod: Json) -> bool:
    """Ready as the endpoint picker counts it: condition Ready=True and not being deleted."""
    if _mapping(pod.get("metadata")).get("deletionTimestamp"):
        return False
    conditions = _mapping(pod.get("status")).get("conditions")
    return isinstance(conditions, list) and any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


def parse_port_list(text: str) -> tuple[int, ...]:
    """``"8000, 8001"`` -> ``(8000, 8001)``; ValueError on an empty list, a non-number or a
    port outside 1-65535."""
    ports = []
    for part in text.split(","):
        port = int(part.strip())
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} out of range")
        ports.append(port)
    return tuple(ports)


def parse_pool(obj: Json) -> PoolSpec:
    """An InferencePool object (as the API server returns it) as a `PoolSpec`; what is invalid
    is logged and left out."""
    metadata = _mapping(obj.get("metadata"))
    name = str(metadata.get("name", "?"))
    where = f"{metadata.get('namespace', '?')}/{name}"
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        log.warning("InferencePool %s: no spec; it selects no pod", where)
        return PoolSpec(name, (), ())
    return PoolSpec(name, _parse_match_labels(spec, where), _parse_target_ports(spec, where))


def _parse_match_labels(spec: Json, where: str) -> tuple[tuple[str, str], ...]:
    selector = spec.get("selector")
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels:
        log.warning("InferencePool %s: spec.selector.matchLabels missing or empty", where)
        return ()
    for key, value in labels.items():
        valid = isinstance(key, str) and isinstance(value, str)
        if not (valid and _LABEL_KEY.fullmatch(key) and _LABEL_VALUE.fullmatch(value)):
            # Dropping one pair would select more pods than meant: select none instead.
            log.warning(
                "InferencePool %s: invalid spec.selector.matchLabels entry %r: %r; "
                "it selects no pod",
                where,
                key,
                value,
            )
            return ()
    return tuple(sorted(labels.items()))


def _parse_target_ports(spec: Json, where: str) -> tuple[int | None, ...]:
    entries = spec.get("targetPorts")
    if not isinstance(entries, list) or not entries:
        log.warning("InferencePool %s: spec.targetPorts missing or empty; no endpoints", where)
        return ()
    if len(entries) > MAX_TARGET_PORTS:
        log.warning(
            "InferencePool %s: spec.targetPorts has %d entries (the CRD allows %d)",
            where,
            len(entries),
            MAX_TARGET_PORTS,
        )
    ports: list[int | None] = []
    for index, entry in enumerate(entries):
        number = entry.get("number") if isinstance(entry, dict) else None
        if (
            not isinstance(number, int)
            or isinstance(number, bool)
            or not 1 <= number <= 65535
            or number in ports
        ):
            log.warning(
                "InferencePool %s: spec.targetPorts[%d] %r is not a new port 1-65535; skipped",
                where,
                index,
                entry,
            )
            ports.append(None)
        else:
            ports.append(number)
    return tuple(ports)


def kv_event_endpoints(pod_name: str, host: str, annotation: str, ranks: int) -> tuple[str, ...]:
    """The `kvroute.io/kv-events-ports` annotation as one ZMQ endpoint per rank (see the module
    docstring); () with a warning when it does not parse or fit the pool's ranks."""
    try:
        ports = parse_port_list(annotation)
    except ValueError as e:
        log.warning(
            "pod %s: annotation %s=%r is not a list of ports (%s); no KV events",
            pod_name,
            KV_EVENTS_PORTS_ANNOTATION,
            annotation,
            e,
        )
        return ()
    if len(ports) == 1:
        ports = tuple(ports[0] + rank for rank in range(ranks))
    if len(ports) != ranks or max(ports, default=0) > 65535:
        log.warning(
            "pod %s: annotation %s=%r does not give one port per target port (%d); no KV events",
            pod_name,
            KV_EVENTS_PORTS_ANNOTATION,
            annotation,
            ranks,
        )
        return ()
    return tuple(f"tcp://{bracket_host(host)}:{port}" for port in ports)


def endpoints_from_pod(pod: Json, pool: PoolSpec) -> tuple[PoolEndpoint, ...]:
    """The endpoints one pod gives the pool: none unless it matches the selector and is Ready."""
    metadata = _mapping(pod.get("metadata"))
    name = str(metadata.get("name", "?"))
    if not selector_matches(dict(pool.match_labels), metadata.get("labels")):
        return ()
    if not pod_is_ready(pod):
        return ()
    host = _mapping(pod.get("status")).get("podIP")
    if not isinstance(host, str) or not host:
        return ()
    annotations = _mapping(metadata.get("annotations"))

    active: set[int] | None = None
    text = annotations.get(ACTIVE_PORTS_ANNOTATION)
    if isinstance(text, str) and text.strip():
        try:
            active = set(parse_port_list(text))
        except ValueError as e:
            log.warning(
                "pod %s: annotation %s=%r is not a list of ports (%s); all target ports active",
                name,
                ACTIVE_PORTS_ANNOTATION,
                text,
                e,
            )

    kv: tuple[str, ...] = ()
    text = annotations.get(KV_EVENTS_PORTS_ANNOTATION)
    if isinstance(text, str) and pool.target_ports:
        kv = kv_event_endpoints(name, host, text, len(pool.target_ports))

    ranks = _data_parallel_size(name, annotations.get(DATA_PARALLEL_ANNOTATION))
    speed = _speed(name, annotations.get(SPEED_ANNOTATION))
    return tuple(
        PoolEndpoint(f"{name}-rank-{rank}", host, port, kv[rank : rank + 1], ranks, speed)
        for rank, port in enumerate(pool.target_ports)
        if port is not None and (active is None or port in active)
    )


def _data_parallel_size(pod: str, text: object) -> int:
    """The `kvroute.io/data-parallel-size` annotation; 1 (with a warning) when it is not a
    number of ranks."""
    if text is None:
        return 1
    if isinstance(text, str) and text.strip().isdigit():
        size = int(text)
        if 1 <= size <= MAX_DATA_PARALLEL:
            return size
    log.warning(
        "pod %s: annotation %s=%r is not a number of ranks 1-%d; routed as one rank",
        pod,
        DATA_PARALLEL_ANNOTATION,
        text,
        MAX_DATA_PARALLEL,
    )
    return 1


def _speed(pod: str, text: object) -> float:
    """The `kvroute.io/speed` annotation (the pod's speed against the pool's others: "0.5" on
    a card half as fast); 1 (with a warning) when it is not a number in (0, 1000]."""
    if text is None:
        return 1.0
    try:
        speed = float(text) if isinstance(text, str) else math.nan
    except ValueError:
        speed = math.nan
    if math.isfinite(speed) and 0 < speed <= MAX_SPEED:
        return speed
    log.warning(
        "pod %s: annotation %s=%r is not a speed above 0 and at most %g; taken as 1",
        pod,
        SPEED_ANNOTATION,
        text,
        MAX_SPEED,
    )
    return 1.0


class _StreamError(Exception):
    """A watch line that is not an event (a proxy's error page, say)."""


class InferencePoolWatcher:
    """Keeps `endpoints` equal to the Ready endpoints of one InferencePool.

    ``on_change`` is called on the event loop with the full new set: once when the pool and its
    pods have first been listed (`synced` is then set), then at every change. A missing pool
    leaves `synced` unset until it appears; a deleted one empties the set.
    """

    def __init__(
        self,
        pool: str,
        namespace: str,
        on_change: Callable[[dict[str, PoolEndpoint]], None],
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.pool = pool
        self.namespace = namespace
        self._on_change = on_change
        self._kubeconfig = kubeconfig
        self._context = context
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self.synced = asyncio.Event()
        self.endpoints: dict[str, PoolEndpoint] = {}
        self._where = f"{namespace}/{pool}"
        self._api: client.ApiClient | None = None
        self._core: Any = None
        self._custom: Any = None
        self._spec: PoolSpec | None = None
        self._pods: dict[str, Json] = {}
        self._pod_endpoints: dict[str, tuple[PoolEndpoint, ...]] = {}
        self._pool_task: asyncio.Task[None] | None = None
        self._pod_task: asyncio.Task[None] | None = None
        self._pod_selector: str | None = None
        self._pods_watched = False
        # Bumped whenever the pod watch is replaced, so a cancelled one can never write.
        self._pod_generation = 0
        self._closing: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Load the client configuration and start watching. Raises when no configuration
        can be loaded (the picker cannot work without one)."""
        cfg = client.Configuration()
        if self._kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            # persist_config=False: never write refreshed tokens back into the user's file.
            await config.load_kube_config(
                config_file=self._kubeconfig,
                context=self._context,
                client_configuration=cfg,
                persist_config=False,
            )
        self._api = client.ApiClient(configuration=cfg)
        self._core = client.CoreV1Api(self._api)
        self._custom = client.CustomObjectsApi(self._api)
        self._pool_task = asyncio.create_task(
            self._keep_watching(
                "InferencePool",
                self._list_pool,
                self._custom.list_namespaced_custom_object,
                (POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL),
                {"field_selector": f"metadata.name={self.pool}"},
                self._on_pool_event,
            ),
            name=f"pool-watch {self._where}",
        )

    async def close(self) -> None:
        tasks = [t for t in (self._pool_task, self._pod_task, *self._closing) if t is not None]
        self._pool_task = self._pod_task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._api is not None:
            await self._api.close()
            self._api = None

    # The pool

    async def _list_pool(self) -> str:
        response = await self._custom.list_namespaced_custom_object(
            POOL_GROUP,
            POOL_VERSION,
            self.namespace,
            POOL_PLURAL,
            field_selector=f"metadata.name={self.pool}",
            _preload_content=False,
            _request_timeout=LIST_TIMEOUT_S,
        )
        body = await _read_json(response)
        items = [i for i in body.get("items") or [] if _name_of(i) == self.pool]
        if not items:
            log.warning("InferencePool %s not found; waiting for it", self._where)
        self._set_pool(items[0] if items else None)
        return _list_version(body)

    def _on_pool_event(self, kind: str, obj: Json) -> None:
        if _name_of(obj) != self.pool:  # a server that ignores the field selector
            return
        if kind in ("ADDED", "MODIFIED"):
            self._set_pool(obj)
        elif kind == "DELETED":
            log.warning("InferencePool %s deleted: no endpoints", self._where)
            self._set_pool(None)

    def _set_pool(self, obj: Json | None) -> None:
        spec = parse_pool(obj) if obj is not None else None
        if spec == self._spec:
            return
        self._spec = spec
        selector = spec.label_selector if spec is not None else None
        if spec is None or not self._pods_watched or selector != self._pod_selector:
            self._restart_pods(spec, selector)
        self._pod_endpoints = {
            name: endpoints_from_pod(pod, spec) if spec is not None else ()
            for name, pod in self._pods.items()
        }
        if spec is not None and selector is None:
            self._mark_synced()  # a pool that selects nothing is synced at once (and warned)
        self._publish()

    def _restart_pods(self, spec: PoolSpec | None, selector: str | None) -> None:
        self._pod_generation += 1
        if self._pod_task is not None:
            task = self._pod_task
            task.cancel()
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self._pod_task = None
        self._pod_selector = selector
        self._pods_watched = spec is not None
        if spec is None or selector is None:
            self._pods.clear()
            return
        # The old pods stay until the new list replaces them; endpoints_from_pod drops those
        # the new selector does not match at once.
        generation = self._pod_generation
        self._pod_task = asyncio.create_task(
            self._keep_watching(
                "pods of InferencePool",
                lambda: self._list_pods(selector, generation),
                self._core.list_namespaced_pod,
                (self.namespace,),
                {"label_selector": selector},
                lambda kind, obj: self._on_pod_event(kind, obj, generation),
            ),
            name=f"pod-watch {self._where}",
        )

    # The pods

    async def _list_pods(self, selector: str, generation: int) -> str:
        response = await self._core.list_namespaced_pod(
            self.namespace,
            label_selector=selector,
            _preload_content=False,
            _request_timeout=LIST_TIMEOUT_S,
        )
        body = await _read_json(response)
        version = _list_version(body)
        if generation != self._pod_generation or self._spec is None:
            return version  # replaced while the list was in flight (and cancelled)
        pods: dict[str, Json] = {
            _name_of(p): p for p in body.get("items") or [] if isinstance(p, dict)
        }
        pods.pop("", None)
        self._pods = pods
        self._pod_endpoints = {n: endpoints_from_pod(p, self._spec) for n, p in pods.items()}
        self._mark_synced()
        self._publish()
        return version

    def _on_pod_event(self, kind: str, obj: Json, generation: int) -> None:
        name = _name_of(obj)
        if generation != self._pod_generation or self._spec is None or not name:
            return
        if kind == "DELETED":
            self._pods.pop(name, None)
            self._pod_endpoints.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._pods[name] = obj
            self._pod_endpoints[name] = endpoints_from_pod(obj, self._spec)
        else:
            return
        self._publish()

    # Shared: list, then watch from the list's version, for ever

    async def _keep_watching(
        self,
        what: str,
        list_once: Callable[[], Awaitable[str]],
        list_fn: Callable[..., Any],
        args: tuple[str, ...],
        kwargs: dict[str, Any],
        on_event: Callable[[str, Json], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        # One Watch for the loop's life: making one builds an SSL context (~30 ms on the loop).
        # return_type "object": events keep the API server's JSON, as the lists do here.
        stream = watch.Watch(return_type="object")
        rv: str | None = None
        failures = 0
        try:
            while True:
                seen = 0

                def counted(kind: str, obj: Json) -> None:
                    nonlocal seen
                    seen += 1
                    on_event(kind, obj)

                started: float | None = None
                error: Exception | None = None
                try:
                    if rv is None:
                        rv = await list_once()
                    started = loop.time()
                    rv = await self._watch(stream, list_fn, args, kwargs, rv, counted)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    error = e
                finally:
                    # Releases the response however the stream ended. (The Watch's own client
                    # only decodes events, so the Watch serves the next stream all the same.)
                    await stream.close()
                # A watch that delivered events or held a while was healthy: the backoff
                # starts again from its base.
                healthy = started is not None and (
                    seen > 0 or loop.time() - started >= HEALTHY_WATCH_S
                )
                if healthy:
                    failures = 0
                    if error is None:
                        continue  # the server ended the stream (its timeout): watch on from rv
                failures += 1
                if error is None:
                    log.debug("%s %s: the server ended the watch at once", what, self._where)
                else:
                    rv = None
                    if isinstance(error, ApiException) and error.status == 410:
                        log.info(
                            "%s %s: resourceVersion expired (410 Gone); relisting",
                            what,
                            self._where,
                        )
                        if failures == 1:
                            continue  # routine (the server compacted its history): relist now
                    else:
                        log.warning(
                            "%s %s: %s; relisting after a backoff",
                            what,
                            self._where,
                            _describe(error),
                        )
                await asyncio.sleep(self._delay(failures))
        finally:
            await stream.close()

    async def _watch(
        self,
        stream: watch.Watch,
        list_fn: Callable[..., Any],
        args: tuple[str, ...],
        kwargs: dict[str, Any],
        rv: str,
        on_event: Callable[[str, Json], None],
    ) -> str:
        """Watch from ``rv`` until the server ends the stream; returns the last version seen.
        ERROR events arrive as ApiException (kubernetes_asyncio raises them)."""
        timeout = random.randint(*WATCH_TIMEOUT_RANGE_S)
        events = stream.stream(
            list_fn,
            *args,
            **kwargs,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=(CONNECT_TIMEOUT_S, timeout + WATCH_READ_GRACE_S),
        )
        async for event in events:
            if not isinstance(event, dict):
                raise _StreamError(f"not a watch event: {str(event)[:200]!r}")
            kind = event.get("type")
            obj = event.get("raw_object")
            if not isinstance(kind, str) or not isinstance(obj, dict):
                raise _StreamError(f"malformed watch event: {str(event)[:200]!r}")
            version = _mapping(obj.get("metadata")).get("resourceVersion")
            if isinstance(version, str) and version:
                rv = version
            if kind in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
                on_event(kind, obj)
            else:
                log.warning("%s: unknown watch event type %r", self._where, kind)
        return rv

    def _delay(self, failures: int) -> float:
        delay = min(self._backoff_max_s, self._backoff_base_s * 2.0 ** min(failures - 1, 30))
        return delay * random.uniform(0.5, 1.0)  # jitter: pickers do not retry in lockstep

    def _mark_synced(self) -> None:
        if not self.synced.is_set():
            self.synced.set()
            log.info("InferencePool %s synced", self._where)
            self._publish(force=True)

    def _publish(self, *, force: bool = False) -> None:
        if not self.synced.is_set():
            return  # nothing is published before the first full list
        endpoints = {e.name: e for group in self._pod_endpoints.values() for e in group}
        if endpoints == self.endpoints and not force:
            return
        self.endpoints = endpoints
        log.info("InferencePool %s: %d endpoints", self._where, len(endpoints))
        try:
            self._on_change(dict(endpoints))
        except Exception:
            log.exception("InferencePool %s: on_change failed", self._where)


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is an object, else empty: a wrongly shaped field reads as absent."""
    return value if isinstance(value, dict) else {}


def _describe(e: Exception) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"


def _name_of(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) else ""


def _list_version(body: Json) -> str:
    version = _mapping(body.get("metadata")).get("resourceVersion")
    if not isinstance(version, str) or not version:
        raise _StreamError("list without metadata.resourceVersion")
    return version


async def _read_json(response: Any) -> dict[str, Any]:
    """The body of a raw (``_preload_content=False``) response; ApiException unless 2xx."""
    try:
        raw = await response.read()
        status = int(response.status)
        if not 200 <= status < 300:
            try:
                message = json.loads(raw).get("message", "")
            except (ValueError, AttributeError):
                message = raw[:200].decode(errors="replace")
            raise ApiException(status=status, reason=message or response.reason)
    finally:
        response.release()
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise _StreamError(f"list response is not an object: {str(body)[:200]!r}")
    return body
