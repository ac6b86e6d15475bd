"""The admin API that changes the fleet while the router serves, and its metrics.

* ``POST /admin/replicas``: ``{"url": ..., "name"?, "kv_events"?, "kv_replay"?,
  "data_parallel_size"?, "pool"?}`` (a data-parallel replica joins as one endpoint per rank)
  registers a static replica (in model pool ``pool``, which a router of several pools needs);
  ``{"launch": true, "pool"?}`` starts one more of a pool's launched replicas (``"wait": false``
  answers 202 at once instead of when it is in rotation; ``pool`` when several pools launch).
* ``DELETE /admin/replicas/{name}``: drains it (router/drain.py), then unregisters it and stops
  its process if the router launched it; ``?drain_timeout_s=`` overrides ``rollout:``.
* ``POST /admin/rollout``: ``{"pool"?, "args"?, "model_path"?, "max_unavailable"?,
  "drain_timeout_s"?, "readiness_timeout_s"?}`` replaces every launched replica of the pool
  (``pool`` when several pools launch; one rollout at a time) (router/rollout.py);
  ``POST /admin/rollout/pause|resume|abort``; ``GET /admin/rollout`` its progress (also the
  ``rollout`` object of ``/admin/replicas``).

Every one needs the admin key (``auth.check_admin``); bad input is a 400 naming the field, a
change this router cannot make a 409 saying why, an unknown replica a 404.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kvroute.backends.handle import ReplicaHandle
from kvroute.backends.launcher import LaunchedFleet
from kvroute.backends.vllm_args import owned_flags_in

from . import errors
from .auth import Auth
from .autoscaling import AutoscaleLoop
from .client_faults import read_body
from .config import Config, ReplicaConfig
from .core import RoutingCore
from .dp_ranks import replica_of
from .drain import Drainer, DrainReport
from .membership import FleetError, FleetMembership
from .rollout import Rollout, RolloutPlan, new_spec
from .upstream_client import UpstreamClient

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AddReplicaBody(msgspec.Struct, forbid_unknown_fields=True):
    url: str | None = None
    name: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    data_parallel_size: int = 1
    speed: float = 1.0
    pool: str | None = None
    launch: bool = False
    wait: bool = True
    readiness_timeout_s: float | None = None


class RolloutBody(msgspec.Struct, forbid_unknown_fields=True):
    pool: str | None = None
    args: list[str] | None = None
    model_path: str | None = None
    max_unavailable: int | None = None
    drain_timeout_s: float | None = None
    readiness_timeout_s: float | None = None


class FleetMetrics:
    """kvroute_fleet_replicas, kvroute_autoscale_actions_total, kvroute_drained_requests_total
    (a ``RouterMetrics`` part; fleet changes need one worker, so there are no peers to merge)."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts
        self.actions: dict[str, int] = {"up": 0, "down": 0}
        self.drained: dict[str, int] = {"finished": 0, "moved": 0, "lost": 0}

    def action(self, action: str, n: int) -> None:
        self.actions[action] += n

    def drain(self, report: DrainReport) -> None:
        for key in self.drained:
            self.drained[key] += getattr(report, key)

    def snapshot(self) -> Any:
        return {}

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        replicas = GaugeMetricFamily(
            "kvroute_fleet_replicas",
            "Replicas by state: serving, starting (launched, not yet in rotation) or draining.",
            labels=["state"],
        )
        for state, n in self._counts().items():
            replicas.add_metric([state], n)
        yield replicas
        actions = CounterMetricFamily(
            "kvroute_autoscale_actions",
            "Autoscaler actions: replicas started (up) and drained (down).",
            labels=["action"],
        )
        for action, n in self.actions.items():
            actions.add_metric([action], n)
        yield actions
        drained = CounterMetricFamily(
            "kvroute_drained_requests",
            "Requests on replicas being drained: finished there, moved to another replica "
            "(resumed or retried), or lost with the replica (could not be moved).",
            labels=["outcome"],
        )
        for outcome, n in self.drained.items():
            drained.add_metric([outcome], n)
        yield drained


class FleetControl:
    def __init__(
        self,
        config: Config,
        core: RoutingCore,
        auth: Auth,
        client: Callable[[], UpstreamClient | None],
        launched: LaunchedFleet | None,
        pool_fleets: Sequence[LaunchedFleet] = (),
    ) -> None:
        self.config = config
        self.auth = auth
        drainer = Drainer(core.clear_cached, client)
        self.membership = FleetMembership(
            core, drainer, launched, workers=config.listen.workers, pool_fleets=pool_fleets
        )
        self.metrics = FleetMetrics(self.membership.counts)
        self.membership.on_drained = self.metrics.drain
        self.rollout: Rollout | None = None
        self.autoscaler: AutoscaleLoop | None = None
        if config.autoscale is not None and launched is not None:
            self.autoscaler = AutoscaleLoop(
                self.membership,
                config.autoscale.settings(),
                drain_timeout_s=config.rollout.drain_timeout_s,
                readiness_timeout_s=config.rollout.readiness_timeout_s,
                busy=lambda: self.rollout is not None and self.rollout.active,
                on_action=self.metrics.action,
            )
        self._background: set[asyncio.Task[object]] = set()

    def add_routes(self, routes: web.UrlDispatcher, expect: Any) -> None:
        guarded = self._guarded
        routes.add_post("/admin/replicas", guarded(self.handle_add), expect_handler=expect)
        routes.add_delete(
            "/admin/replicas/{name}", guarded(self.handle_remove), expect_handler=expect
        )
        routes.add_get("/admin/rollout", guarded(self.handle_progress), expect_handler=expect)
        routes.add_post("/admin/rollout", guarded(self.handle_rollout), expect_handler=expect)
        routes.add_post(
            "/admin/rollout/{action}", guarded(self.handle_rollout_action), expect_handler=expect
        )

    def start(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.start()

    async def close(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.close()
        if self.rollout is not None:
            await self.rollout.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def progress(self) -> dict[str, Any] | None:
        return self.rollout.progress() if self.rollout is not None else None

    def row_fields(self, name: str) -> dict[str, Any]:
        """A replica's fields of /admin/replicas that this part knows."""
        owner = self.membership.core.pools.of_replica(name)
        return {
            "phase": self.membership.phase(name),
            "pool": owner.name if owner is not None else None,
        }

    # -- handlers -----------------------------------------------------------------------

    def _guarded(self, handler: Handler) -> Handler:
        """Admin key, and every refusal as an OpenAI-shaped error (never a 500)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                self.auth.check_admin(request)
                return await handler(request)
            except errors.ApiError as exc:
                return exc.response()
            except FleetError as exc:
                code = {404: "not_found", 409: "conflict"}.get(exc.status, "fleet_change_failed")
                return errors.ApiError(exc.status, str(exc), code=code).response()

        return handle

    async def handle_add(self, request: web.Request) -> web.Response:
        body = await _decode(request, AddReplicaBody)
        membership = self.membership
        if body.launch == (body.url is not None):
            raise errors.bad_request(
                'give either "url" (register a running replica) or "launch": true (start one '
                "more launched replica)"
            )
        if body.url is not None:
            replica = ReplicaConfig(
                url=body.url,
                name=body.name,
                kv_events=body.kv_events,
                kv_replay=body.kv_replay,
                data_parallel_size=body.data_parallel_size,
                speed=body.speed,
            )
            handle = await membership.add_static(replica, body.pool)
            return _json(self._row(handle), 201)
        if body.name or body.kv_events or body.kv_replay:
            raise errors.bad_request(
                "name, kv_events and kv_replay are set by the launcher for launched replicas"
            )
        pool = membership.launched_pool(body.pool)
        timeout_s = _positive(
            body.readiness_timeout_s, self.config.rollout.readiness_timeout_s, "readiness_timeout_s"
        )
        adding = membership.add_launched(timeout_s, pool)
        if not body.wait:
            task: asyncio.Task[object] = asyncio.create_task(adding)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return _json({"status": "starting"}, 202)
        handle = await adding
        return _json(self._row(handle), 201)

    async def handle_remove(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        raw = request.query.get("drain_timeout_s")
        timeout_s = self.config.rollout.drain_timeout_s
        if raw is not None:
            try:
                timeout_s = _positive(float(raw), timeout_s, "drain_timeout_s")
            except ValueError:
                raise errors.bad_request(
                    f"drain_timeout_s: must be a number > 0, got {raw!r}", "drain_timeout_s"
                ) from None
        if self.rollout is not None and self.rollout.active:
            raise FleetError(409, "a rollout is in progress: pause or abort it first")
        report = await self.membership.remove(name, timeout_s)
        return _json({"removed": name, "drain": report.to_dict()})

    async def handle_progress(self, request: web.Request) -> web.Response:
        return _json({"rollout": self.progress()})

    async def handle_rollout(self, request: web.Request) -> web.Response:
        body = await _decode(request, RolloutBody)
        membership = self.membership
        pool = membership.launched_pool(body.pool)
        if self.rollout is not None and self.rollout.active:
            raise FleetError(409, f"a rollout is already {self.rollout.state}")
        defaults = self.config.rollout
        spec = membership.fleets[pool].spec
        if body.args is not None and spec.engine == "vllm":
            owned = owned_flags_in(body.args)
            if owned:
                raise errors.bad_request(
                    f"args: {', '.join(owned)} are set by kvroute from the launch: keys", "args"
                )
        if body.model_path is not None:
            if spec.engine != "vllm":
                raise errors.bad_request(
                    "model_path: only launched vLLM replicas load a model (launch.engine: vllm)",
                    "model_path",
                )
            if not Path(body.model_path).is_dir():
                raise errors.bad_request(
                    f"model_path: {body.model_path} is not a directory", "model_path"
                )
        max_unavailable = body.max_unavailable
        if max_unavailable is None:
            max_unavailable = defaults.max_unavailable
        if max_unavailable < 1:
            raise errors.bad_request("max_unavailable: must be >= 1", "max_unavailable")
        targets = membership.launched_names(pool)
        in_rotation = membership.in_rotation(pool)
        if in_rotation < 2:
            where = f" of pool {pool}" if len(membership.core.pools) > 1 else ""
            raise FleetError(
                409,
                f"{in_rotation} replica{where} in rotation: a rollout replaces one replica while "
                "the others serve, so it needs at least 2 (add one first: POST /admin/replicas)",
            )
        plan = RolloutPlan(
            pool,
            new_spec(spec, body.args, body.model_path),
            # At least one replica keeps serving whatever was asked.
            min(max_unavailable, in_rotation - 1),
            _positive(body.drain_timeout_s, defaults.drain_timeout_s, "drain_timeout_s"),
            _positive(
                body.readiness_timeout_s, defaults.readiness_timeout_s, "readiness_timeout_s"
            ),
        )
        self.rollout = Rollout(plan, targets)
        self.rollout.start(membership)
        return _json({"rollout": self.rollout.progress()}, 202)

    async def handle_rollout_action(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        rollout = self.rollout
        if action not in ("pause", "resume", "abort"):
            raise FleetError(404, f"no rollout action {action!r} (pause, resume or abort)")
        if rollout is None or not rollout.active:
            raise FleetError(409, "no rollout in progress")
        getattr(rollout, action)()
        return _json({"rollout": rollout.progress()})

    def _row(self, handle: ReplicaHandle) -> dict[str, Any]:
        return {
            "name": handle.name,
            "url": handle.base_url,
            # A data-parallel replica's ranks are listed one by one (router/dp_ranks.py).
            "replica": replica_of(handle.name),
            "data_parallel_rank": handle.data_parallel_rank,
            "healthy": handle.state.healthy,
            **self.row_fields(handle.name),
        }


async def _decode(request: web.Request, kind: type[msgspec.Struct]) -> Any:
    raw = await read_body(request)
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise errors.bad_request(f"invalid body: {exc}") from None
    except msgspec.DecodeError:
        raise errors.bad_request("invalid body: not a JSON object") from None


def _positive(value: float | None, default: float, key: str) -> float:
    if value is None:
        return default
    if not (math.isfinite(value) and value > 0):
        raise errors.bad_request(f"{key}: must be a number > 0, got {value}", key)
    return value


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )
