"""The admin API never asks less than the client API: with ``auth.api_keys`` set and no
``auth.admin_api_key``, every admin endpoint is closed, even to loopback clients (a sidecar in
the same pod, a request forged through another local service); with the admin key, open to it
(issue 37, item 6)."""

from __future__ import annotations

import aiohttp

from .conftest import StartReplica, StartRouter

CLIENT_KEY = "client-key-0001"
ADMIN_KEY = "admin-key-0001"
ADMIN_CALLS = [
    ("GET", "/admin/replicas"),
    ("GET", "/admin/tenants"),
    ("POST", "/admin/replicas"),
    ("DELETE", "/admin/replicas/a"),
    ("POST", "/admin/replicas/a/unquarantine"),
    ("GET", "/admin/rollout"),
    ("POST", "/admin/rollout/pause"),
    ("GET", "/status/events"),
]


async def test_client_keys_without_an_admin_key_close_the_admin_api(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], auth={"api_keys": [CLIENT_KEY]})
    async with aiohttp.ClientSession() as http:
        for method, path in ADMIN_CALLS:
            for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}):
                async with http.request(method, r.url + path, headers=headers, json={}) as resp:
                    assert resp.status == 403, (method, path, resp.status)
                    error = (await resp.json())["error"]
                    assert "auth.admin_api_key" in error["message"], error
        # Still served: the page itself (it holds no data), probes, and /metrics (open
        # without an admin key, as before: Prometheus scrapes it).
        for path in ("/status", "/health", "/metrics"):
            async with http.get(r.url + path) as resp:
                assert resp.status == 200, path
    assert r.router.replicas["a"].state.healthy  # nothing was changed by the refused calls


async def test_the_admin_key_opens_the_admin_api_and_client_keys_do_not(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], auth={"api_keys": [CLIENT_KEY], "admin_api_key": ADMIN_KEY})
    async with aiohttp.ClientSession() as http:
        for key, status in ((CLIENT_KEY, 401), (ADMIN_KEY, 200)):
            headers = {"Authorization": f"Bearer {key}"}
            for path in ("/admin/replicas", "/admin/tenants", "/status/events"):
                async with http.get(r.url + path, headers=headers) as resp:
                    assert resp.status == status, (key, path)
