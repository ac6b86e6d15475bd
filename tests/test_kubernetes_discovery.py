"""Kubernetes discovery for the endpoint picker, against an in-test API server (tests/k8s_api.py)
that speaks the list/watch protocol; and the pure helpers, without a server."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvroute.backends.kubernetes import (
    ACTIVE_PORTS_ANNOTATION,
    KV_EVENTS_PORTS_ANNOTATION,
    SPEED_ANNOTATION,
    InferencePoolWatcher,
    PoolEndpoint,
    PoolSpec,
    endpoints_from_pod,
    kv_event_endpoints,
    label_selector,
    parse_pool,
    parse_port_list,
    pod_is_ready,
    selector_matches,
)

from .helpers import wait_until
from .k8s_api import PODS, POOLS, FakeKubeAPI, make_pod, make_pool, set_ready

LOGGER = "kvroute.backends.kubernetes"
SYNC_S = 5.0


@dataclass
class Watched:
    watcher: InferencePoolWatcher
    changes: list[dict[str, PoolEndpoint]] = field(default_factory=list)

    @property
    def names(self) -> set[str]:
        return set(self.watcher.endpoints)

    async def synced(self) -> None:
        await asyncio.wait_for(self.watcher.synced.wait(), SYNC_S)

    async def until(self, names: set[str], what: str = "") -> None:
        await wait_until(lambda: self.names == names, what=what or f"endpoints {sorted(names)}")


StartWatcher = Callable[..., Awaitable[Watched]]


@pytest.fixture
async def k8s(tmp_path: Path) -> AsyncIterator[FakeKubeAPI]:
    api = await FakeKubeAPI().start()
    api.write_kubeconfig(tmp_path / "kubeconfig")
    yield api
    await api.stop()


@pytest.fixture
async def start_watcher(k8s: FakeKubeAPI) -> AsyncIterator[StartWatcher]:
    started: list[InferencePoolWatcher] = []

    async def start(pool: str = "vllm-pool", wait: bool = True, **kwargs: Any) -> Watched:
        changes: list[dict[str, PoolEndpoint]] = []
        kwargs.setdefault("backoff_base_s", 0.02)
        kwargs.setdefault("backoff_max_s", 0.2)
        watcher = InferencePoolWatcher(
            pool, "default", changes.append, kubeconfig=str(k8s.kubeconfig), **kwargs
        )
        started.append(watcher)
        await watcher.start()
        watched = Watched(watcher, changes)
        if wait:
            await watched.synced()
        return watched

    yield start
    for watcher in started:
        await watcher.close()


async def pod_watch_open(k8s: FakeKubeAPI) -> None:
    await wait_until(lambda: k8s.open_watches(PODS) == 1, what="the pod watch to be open")


# Against the in-test API server


async def test_initial_sync_lists_ready_matching_pods_one_endpoint_per_target_port(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool(ports=[8000, 8001]))
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    k8s.put(PODS, make_pod("b", "10.0.0.2"))
    k8s.put(PODS, make_pod("starting", "10.0.0.3", ready=False))
    k8s.put(PODS, make_pod("terminating", "10.0.0.4", deleting=True))
    k8s.put(PODS, make_pod("other-app", "10.0.0.5", labels={"app": "web"}))
    k8s.put(PODS, make_pod("other-ns", "10.0.0.6", namespace="prod"))

    watched = await start_watcher()

    endpoints = watched.watcher.endpoints
    assert sorted(endpoints) == ["a-rank-0", "a-rank-1", "b-rank-0", "b-rank-1"]
    assert endpoints["a-rank-1"] == PoolEndpoint("a-rank-1", "10.0.0.1", 8001, ())
    assert endpoints["b-rank-0"].address == "10.0.0.2:8000"
    # The picker hears the full set once, when synced.
    assert watched.changes == [endpoints]
    # Watches start from the list's version, ask for bookmarks, and carry the kubeconfig's token.
    pod_list = k8s.lists(PODS)[0]
    assert pod_list.query["labelSelector"] == "app=vllm"
    await pod_watch_open(k8s)
    pod_watch = k8s.watches(PODS)[0]
    assert pod_watch.query["resourceVersion"] == str(k8s.rv)
    assert pod_watch.query["allowWatchBookmarks"].lower() == "true"
    assert k8s.lists(POOLS)[0].query["fieldSelector"] == "metadata.name=vllm-pool"
    assert all(r.status == 200 for r in k8s.requests)


async def test_synced_is_set_only_after_the_first_full_list(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    release = k8s.hold_lists(PODS)

    watched = await start_watcher(wait=False)
    await wait_until(lambda: len(k8s.lists(PODS)) == 1, what="the pod list to be asked for")
    assert not watched.watcher.synced.is_set()
    assert watched.watcher.endpoints == {} and watched.changes == []

    release.set()
    await watched.synced()
    assert watched.names == {"a-rank-0"}
    assert watched.changes == [{"a-rank-0": watched.watcher.endpoints["a-rank-0"]}]


async def test_a_missing_pool_is_not_synced_until_it_appears(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    watched = await start_watcher(wait=False)
    await wait_until(lambda: k8s.open_watches(POOLS) == 1, what="the pool watch")
    assert not watched.watcher.synced.is_set()

    k8s.put(POOLS, make_pool())
    await watched.synced()
    assert watched.names == {"a-rank-0"}


async def test_a_pod_that_stops_being_ready_leaves_at_once(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    k8s.put(PODS, make_pod("b", "10.0.0.2"))
    watched = await start_watcher()
    await pod_watch_open(k8s)

    k8s.update(PODS, "a", set_ready(False))
    await watched.until({"b-rank-0"}, "the NotReady pod to leave")
    k8s.update(PODS, "a", set_ready(True))
    await watched.until({"a-rank-0", "b-rank-0"}, "the pod to come back when Ready")
    assert [sorted(c) for c in watched.changes] == [
        ["a-rank-0", "b-rank-0"],
        ["b-rank-0"],
        ["a-rank-0", "b-rank-0"],
    ]


async def test_a_terminating_pod_leaves_before_it_is_deleted(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    k8s.put(PODS, make_pod("b", "10.0.0.2"))
    watched = await start_watcher()
    await pod_watch_open(k8s)

    # Still Ready, but being deleted: the picker must stop sending it new requests now.
    k8s.update(
        PODS, "a", lambda pod: pod["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z")
    )
    await watched.until({"b-rank-0"}, "the terminating pod to leave")


async def test_a_deleted_pod_leaves_and_a_new_pod_joins(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    watched = await start_watcher()
    await pod_watch_open(k8s)

    k8s.delete(PODS, "a")
    await watched.until(set(), "the deleted pod to leave")
    k8s.put(PODS, make_pod("c", "10.0.0.3", ready=False))
    k8s.put(PODS, make_pod("d", "10.0.0.4"))
    await watched.until({"d-rank-0"}, "the new Ready pod to join")
    k8s.update(PODS, "c", set_ready(True))
    await watched.until({"c-rank-0", "d-rank-0"}, "the new pod to join once Ready")


async def test_a_pod_that_loses_the_pool_labels_leaves(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    k8s.put(PODS, make_pod("b", "10.0.0.2"))
    watched = await start_watcher()
    await pod_watch_open(k8s)

    k8s.update(PODS, "a", lambda pod: pod["metadata"].update(labels={"app": "drained"}))
    await watched.until({"b-rank-0"}, "the relabelled pod to leave")


async def test_active_ports_annotation_keeps_only_the_listed_ranks(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool(ports=[8000, 8001, 8002]))
    k8s.put(PODS, make_pod("a", "10.0.0.1", annotations={ACTIVE_PORTS_ANNOTATION: "8000,8002"}))
    k8s.put(PODS, make_pod("b", "10.0.0.2"))
    watched = await start_watcher()

    # Ranks keep their index in targetPorts, so a rank's name does not change with the set.
    assert watched.names == {"a-rank-0", "a-rank-2", "b-rank-0", "b-rank-1", "b-rank-2"}
    assert watched.watcher.endpoints["a-rank-2"].port == 8002

    await pod_watch_open(k8s)
    k8s.update(
        PODS, "b", lambda pod: pod["metadata"].update(annotations={ACTIVE_PORTS_ANNOTATION: "8001"})
    )
    await watched.until({"a-rank-0", "a-rank-2", "b-rank-1"}, "b's inactive ranks to leave")


async def test_kv_events_annotation_gives_each_rank_its_zmq_endpoint(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool(ports=[8000, 8001]))
    k8s.put(PODS, make_pod("base", "10.0.0.1", annotations={KV_EVENTS_PORTS_ANNOTATION: "5557"}))
    k8s.put(
        PODS, make_pod("each", "10.0.0.2", annotations={KV_EVENTS_PORTS_ANNOTATION: "6000, 6100"})
    )
    k8s.put(PODS, make_pod("none", "10.0.0.3"))
    watched = await start_watcher()

    kv = {name: e.kv_events for name, e in watched.watcher.endpoints.items()}
    assert kv == {
        "base-rank-0": ("tcp://10.0.0.1:5557",),
        "base-rank-1": ("tcp://10.0.0.1:5558",),  # base port + rank, as vLLM offsets DP ranks
        "each-rank-0": ("tcp://10.0.0.2:6000",),
        "each-rank-1": ("tcp://10.0.0.2:6100",),
        "none-rank-0": (),
        "none-rank-1": (),
    }


async def test_ipv6_pod_addresses_are_bracketed(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("v6", "fd00::1", annotations={KV_EVENTS_PORTS_ANNOTATION: "5557"}))
    watched = await start_watcher()

    endpoint = watched.watcher.endpoints["v6-rank-0"]
    assert endpoint.host == "fd00::1"
    assert endpoint.address == "[fd00::1]:8000"
    assert endpoint.kv_events == ("tcp://[fd00::1]:5557",)


@pytest.mark.parametrize("as_http_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists_and_no_change_is_lost(
    k8s: FakeKubeAPI, start_watcher: StartWatcher, as_http_status: bool
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    k8s.put(PODS, make_pod("b", "10.0.0.2"))
    watched = await start_watcher()
    await pod_watch_open(k8s)
    lists_before = len(k8s.lists(PODS))
    k8s.gone_as_http_status = as_http_status

    # The watch breaks, changes happen while it is down, and the server forgets their history:
    # the watch cannot resume (410 Gone) and only a new list can show them.
    k8s.close_watches()
    k8s.update(PODS, "a", set_ready(False))
    k8s.put(PODS, make_pod("c", "10.0.0.3"))
    k8s.delete(PODS, "b")
    k8s.compact()

    await watched.until({"c-rank-0"}, "the changes made while the watch was down")
    assert len(k8s.lists(PODS)) == lists_before + 1
    gone = [r for r in k8s.watches(PODS) if r.status == 410] if as_http_status else []
    assert len(gone) == int(as_http_status)
    # And it watches on from the new list's version.
    await pod_watch_open(k8s)
    k8s.put(PODS, make_pod("d", "10.0.0.4"))
    await watched.until({"c-rank-0", "d-rank-0"}, "a change after the relist")


async def test_a_410_on_the_pool_watch_relists_it_without_churning_the_endpoints(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    watched = await start_watcher()
    await wait_until(lambda: k8s.open_watches(POOLS) == 1, what="the pool watch")

    k8s.expire_next_watches(1, resource=POOLS)
    k8s.close_watches()
    await wait_until(lambda: len(k8s.lists(POOLS)) == 2, what="the pool relist")
    await wait_until(lambda: k8s.open_watches(POOLS) == 1, what="the pool watch again")
    # The same pool: the pods are neither relisted nor announced again.
    assert len(k8s.lists(PODS)) == 1
    assert watched.changes == [{"a-rank-0": watched.watcher.endpoints["a-rank-0"]}]
    k8s.update(POOLS, "vllm-pool", lambda p: p["spec"].update(targetPorts=[{"number": 9000}]))
    await watched.until({"a-rank-0"}, "the port change after the relist")
    await wait_until(lambda: watched.watcher.endpoints["a-rank-0"].port == 9000, what="port")


async def test_api_errors_back_off_and_recover(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    watched = await start_watcher(backoff_base_s=0.02, backoff_max_s=0.16)
    await pod_watch_open(k8s)
    before = len(k8s.requests)

    k8s.fail_requests(5, resource=PODS)
    k8s.close_watches()
    k8s.put(PODS, make_pod("b", "10.0.0.2"))  # made during the outage

    await watched.until({"a-rank-0", "b-rank-0"}, "recovery after the 500s")
    failed = [r for r in k8s.requests[before:] if r.resource == PODS and r.status == 500]
    assert len(failed) == 5
    # Exponential backoff: failure n waits at least half (jitter) of base * 2^(n-1), capped.
    gaps = [b.at - a.at for a, b in itertools.pairwise(failed)]
    floors = [0.5 * min(0.16, 0.02 * 2 ** (n - 1)) for n in range(1, 5)]
    assert all(gap >= floor * 0.9 for gap, floor in zip(gaps, floors, strict=True)), gaps
    # The pool watch was not affected: no needless pool relist.
    assert len(k8s.lists(POOLS)) == 1


async def test_bookmarks_advance_the_resource_version(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    watched = await start_watcher()
    await pod_watch_open(k8s)
    for i in range(5):  # churn the pool's watch does not see
        k8s.put(PODS, make_pod(f"web-{i}", f"10.1.0.{i}", labels={"app": "web"}))

    # The bookmark arrives before the stream ends; the history before it is then compacted.
    bookmark = k8s.bookmark()
    k8s.close_watches()
    k8s.compact()

    await wait_until(lambda: len(k8s.watches(PODS)) >= 2, what="the pod watch to resume")
    resumed = k8s.watches(PODS)[1]
    assert resumed.query["resourceVersion"] == str(bookmark)
    assert resumed.status == 200
    assert len(k8s.lists(PODS)) == 1  # resumed from the bookmark, no relist
    assert watched.names == {"a-rank-0"}


async def test_a_pool_selector_change_reselects_pods(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("old", "10.0.0.1"))
    k8s.put(PODS, make_pod("new", "10.0.0.2", labels={"app": "vllm", "model": "qwen"}))
    k8s.put(PODS, make_pod("other", "10.0.0.3", labels={"model": "qwen"}))
    watched = await start_watcher()
    assert watched.names == {"old-rank-0", "new-rank-0"}
    await pod_watch_open(k8s)

    k8s.update(
        POOLS,
        "vllm-pool",
        lambda pool: pool["spec"]["selector"].update(matchLabels={"model": "qwen"}),
    )
    await watched.until({"new-rank-0", "other-rank-0"}, "the pods of the new selector")
    assert k8s.lists(PODS)[-1].query["labelSelector"] == "model=qwen"
    # The set never held a pod of the old selector alongside the new one's.
    assert all("old-rank-0" not in c or "other-rank-0" not in c for c in watched.changes)

    k8s.update(
        POOLS,
        "vllm-pool",
        lambda pool: pool["spec"].update(targetPorts=[{"number": 9000}, {"number": 9001}]),
    )
    await watched.until(
        {"new-rank-0", "new-rank-1", "other-rank-0", "other-rank-1"}, "the new ports"
    )
    assert watched.watcher.endpoints["other-rank-1"].address == "10.0.0.3:9001"


async def test_a_deleted_pool_empties_the_set_and_a_recreated_one_fills_it(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    watched = await start_watcher()
    await wait_until(lambda: k8s.open_watches(POOLS) == 1, what="the pool watch")

    k8s.delete(POOLS, "vllm-pool")
    await watched.until(set(), "the set to empty")
    assert watched.changes[-1] == {}
    await wait_until(lambda: k8s.open_watches(PODS) == 0, what="the pod watch to stop")

    k8s.put(POOLS, make_pool())
    await watched.until({"a-rank-0"}, "the recreated pool's pods")


async def test_bad_input_is_a_warning_naming_the_object_and_key(
    k8s: FakeKubeAPI, start_watcher: StartWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    pool = make_pool()
    pool["spec"]["targetPorts"] = []
    k8s.put(POOLS, pool)
    k8s.put(PODS, make_pod("a", "10.0.0.1", annotations={ACTIVE_PORTS_ANNOTATION: "eighty"}))
    watched = await start_watcher()
    assert watched.names == set()
    assert any("default/vllm-pool" in m and "targetPorts" in m for m in caplog.messages)

    await pod_watch_open(k8s)
    k8s.update(POOLS, "vllm-pool", lambda p: p["spec"].update(targetPorts=[{"number": 8000}]))
    # A malformed annotation is ignored (all target ports stay active), with a warning.
    await watched.until({"a-rank-0"}, "the pod once the pool has a port")
    assert any(
        "pod a" in m and ACTIVE_PORTS_ANNOTATION in m and "'eighty'" in m for m in caplog.messages
    )


async def test_a_failing_on_change_does_not_stop_discovery(
    k8s: FakeKubeAPI, start_watcher: StartWatcher
) -> None:
    k8s.put(POOLS, make_pool())
    watched = await start_watcher()
    await pod_watch_open(k8s)
    calls = 0

    def broken(endpoints: dict[str, PoolEndpoint]) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("picker bug")

    watched.watcher._on_change = broken
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    await watched.until({"a-rank-0"})
    k8s.put(PODS, make_pod("b", "10.0.0.2"))
    await watched.until({"a-rank-0", "b-rank-0"})
    assert calls == 2


async def test_close_ends_the_watches(k8s: FakeKubeAPI, start_watcher: StartWatcher) -> None:
    k8s.put(POOLS, make_pool())
    watched = await start_watcher()
    await pod_watch_open(k8s)
    await watched.watcher.close()
    await wait_until(
        lambda: k8s.open_watches(PODS) + k8s.open_watches(POOLS) == 0,
        what="the server to see both watches end",
    )


async def test_in_cluster_config_is_used_without_a_kubeconfig(
    k8s: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded: list[bool] = []

    def in_cluster(client_configuration: Any, **kwargs: Any) -> None:
        # What the service account's token and the cluster's address would give.
        loaded.append(True)
        client_configuration.host = k8s.url
        client_configuration.api_key = {"BearerToken": f"Bearer {k8s.token}"}

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setattr("kubernetes_asyncio.config.load_incluster_config", in_cluster)
    k8s.put(POOLS, make_pool())
    k8s.put(PODS, make_pod("a", "10.0.0.1"))
    watcher = InferencePoolWatcher("vllm-pool", "default", lambda endpoints: None)
    try:
        await watcher.start()
        await asyncio.wait_for(watcher.synced.wait(), SYNC_S)
        assert loaded == [True]
        assert set(watcher.endpoints) == {"a-rank-0"}
    finally:
        await watcher.close()


# The pure helpers


def pod(ready: bool = True, **metadata: Any) -> dict[str, Any]:
    built = make_pod("p", "10.0.0.9", ready=ready)
    built["metadata"].update(metadata)
    return built


POOL = PoolSpec("vllm-pool", (("app", "vllm"),), (8000, 8001))


def test_selector_matches_needs_every_label_and_an_empty_selector_matches_nothing() -> None:
    assert selector_matches({"app": "vllm"}, {"app": "vllm", "tier": "gpu"})
    assert not selector_matches({"app": "vllm", "tier": "gpu"}, {"app": "vllm"})
    assert not selector_matches({"app": "vllm"}, {"app": "web"})
    assert not selector_matches({"app": "vllm"}, None)
    assert not selector_matches({}, {"app": "vllm"})
    assert label_selector({"tier": "gpu", "app": "vllm"}) == "app=vllm,tier=gpu"


def test_pod_is_ready_needs_the_ready_condition_and_no_deletion() -> None:
    assert pod_is_ready(pod())
    assert not pod_is_ready(pod(ready=False))
    assert not pod_is_ready(pod(deletionTimestamp="2026-01-01T00:00:00Z"))
    assert not pod_is_ready({"metadata": {"name": "p"}})
    assert not pod_is_ready({"metadata": {}, "status": {"conditions": None}})


def test_parse_port_list() -> None:
    assert parse_port_list("8000") == (8000,)
    assert parse_port_list(" 8000, 8001 ") == (8000, 8001)
    for bad in ("", "80a", "8000,,8001", "0", "70000"):
        with pytest.raises(ValueError):
            parse_port_list(bad)


def test_parse_pool_keeps_what_is_valid(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    assert parse_pool(make_pool(ports=[8000, 8001])) == POOL
    assert caplog.messages == []

    odd = make_pool(ports=[8000])
    odd["spec"]["targetPorts"] = [
        {"number": 8000},
        {"number": "x"},
        {"number": 8000},
        {"number": 8002},
    ]
    spec = parse_pool(odd)
    assert spec.target_ports == (8000, None, None, 8002)  # ranks keep their index
    assert sum("targetPorts[" in m for m in caplog.messages) == 2

    caplog.clear()
    assert parse_pool(make_pool(match_labels={"app": "bad value!"})).match_labels == ()
    assert parse_pool(make_pool(match_labels={})).label_selector is None
    assert parse_pool({"metadata": {"name": "x"}}) == PoolSpec("x", (), ())
    assert len(caplog.messages) == 3
    shapeless = parse_pool({"metadata": None, "spec": {"selector": "x", "targetPorts": "8000"}})
    assert shapeless == PoolSpec("?", (), ())


def test_endpoints_from_pod() -> None:
    assert endpoints_from_pod(pod(), POOL) == (
        PoolEndpoint("p-rank-0", "10.0.0.9", 8000),
        PoolEndpoint("p-rank-1", "10.0.0.9", 8001),
    )
    assert endpoints_from_pod(pod(ready=False), POOL) == ()
    assert endpoints_from_pod(pod(labels={"app": "web"}), POOL) == ()
    no_ip = pod()
    del no_ip["status"]["podIP"]
    assert endpoints_from_pod(no_ip, POOL) == ()
    # An invalid targetPorts entry costs its rank only.
    assert [
        e.name for e in endpoints_from_pod(pod(), PoolSpec("x", POOL.match_labels, (None, 8001)))
    ] == ["p-rank-1"]
    active = pod(annotations={ACTIVE_PORTS_ANNOTATION: "8001,9999"})
    assert [e.name for e in endpoints_from_pod(active, POOL)] == ["p-rank-1"]
    # Wrongly shaped objects read as absent fields, never raise.
    assert endpoints_from_pod({"metadata": [], "status": "Running"}, POOL) == ()
    assert endpoints_from_pod(pod(labels=["app"], annotations="x"), POOL) == ()


def test_speed_annotation_tells_the_picker_a_pods_speed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    half = pod(annotations={SPEED_ANNOTATION: "0.5"})
    assert {e.speed for e in endpoints_from_pod(half, POOL)} == {0.5}
    assert {e.speed for e in endpoints_from_pod(pod(), POOL)} == {1.0}
    assert caplog.messages == []
    for bad in ("fast", "0", "-2", "nan", "1e9"):
        endpoints = endpoints_from_pod(pod(annotations={SPEED_ANNOTATION: bad}), POOL)
        assert {e.speed for e in endpoints} == {1.0}  # routed, at the pool's speed
    assert len(caplog.messages) == 5
    assert all("pod p" in m and SPEED_ANNOTATION in m for m in caplog.messages)


def test_kv_event_endpoints(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    assert kv_event_endpoints("p", "10.0.0.9", "5557", 1) == ("tcp://10.0.0.9:5557",)
    assert kv_event_endpoints("p", "10.0.0.9", "5557", 3) == (
        "tcp://10.0.0.9:5557",
        "tcp://10.0.0.9:5558",
        "tcp://10.0.0.9:5559",
    )
    assert kv_event_endpoints("p", "fd00::1", "5557,6000", 2) == (
        "tcp://[fd00::1]:5557",
        "tcp://[fd00::1]:6000",
    )
    assert caplog.messages == []
    assert kv_event_endpoints("p", "10.0.0.9", "5557,5558", 3) == ()  # neither one nor one per rank
    assert kv_event_endpoints("p", "10.0.0.9", "zmq", 1) == ()
    assert kv_event_endpoints("p", "10.0.0.9", "65535", 2) == ()  # rank 1 would be out of range
    assert len(caplog.messages) == 3
    assert all("pod p" in m and KV_EVENTS_PORTS_ANNOTATION in m for m in caplog.messages)


def test_pool_endpoint_address() -> None:
    assert PoolEndpoint("p-rank-0", "10.0.0.9", 8000).address == "10.0.0.9:8000"
    assert PoolEndpoint("p-rank-0", "fd00::1", 8000).address == "[fd00::1]:8000"
