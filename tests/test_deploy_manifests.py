"""The Kubernetes manifests in deploy/kubernetes/: core objects parse as the API's models with
no unknown field, the InferencePool and HTTPRoute have the fields their CRDs define, and the
pieces point at each other (what a user applying them needs to work)."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from kvroute.backends.kubernetes import (
    KV_EVENTS_PORTS_ANNOTATION,
    PoolEndpoint,
    endpoints_from_pod,
    parse_pool,
)

DEPLOY = Path(__file__).parent.parent / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
Obj = dict[str, Any]

# The core kinds and the client's model for each.
MODELS = {
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "Service"): "V1Service",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
}


@functools.cache
def _parsed(path: Path) -> str:
    return json.dumps([d for d in yaml.safe_load_all(path.read_text()) if d is not None])


def load(path: Path) -> list[Obj]:
    """The file's objects (a fresh copy each call: tests may change them)."""
    docs: list[Obj] = json.loads(_parsed(path))
    return docs


def everything() -> list[Obj]:
    return [d for path in MANIFESTS for d in load(path)]


def one(kind: str, name: str) -> Obj:
    found = [d for d in everything() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: Obj, name: str) -> Obj:
    containers: list[Obj] = deployment["spec"]["template"]["spec"]["containers"]
    (found,) = [c for c in containers if c["name"] == name]
    return found


def flags(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` and bare ``--flag`` pairs of a command line."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            following = args[i + 1] if i + 1 < len(args) else None
            out[arg] = None if following is None or following.startswith("--") else following
    return out


# The CRDs' fields (inference.networking.k8s.io/v1 InferencePool; gateway.networking.k8s.io/v1
# HTTPRoute and Gateway), as explicit checks: each returns what is wrong.

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")


def _keys(where: str, obj: Any, required: set[str], allowed: set[str]) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{where}: not an object"]
    errors = [f"{where}.{k}: required" for k in sorted(required - obj.keys())]
    errors += [f"{where}.{k}: unknown field" for k in sorted(obj.keys() - allowed - required)]
    return errors


def _port(where: str, value: Any) -> list[str]:
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535
    return [] if ok else [f"{where}: not a port number 1-65535: {value!r}"]


def _name(where: str, value: Any) -> list[str]:
    ok = isinstance(value, str) and 1 <= len(value) <= 253
    return [] if ok else [f"{where}: not a name: {value!r}"]


def _meta(doc: Obj) -> list[str]:
    errors = _keys(
        "metadata", doc.get("metadata"), {"name"}, {"namespace", "labels", "annotations"}
    )
    return errors or _name("metadata.name", doc["metadata"]["name"])


def inference_pool_errors(doc: Obj) -> list[str]:
    errors = _keys("", doc, {"apiVersion", "kind", "metadata", "spec"}, set()) + _meta(doc)
    spec: Any = doc.get("spec")
    errors += _keys("spec", spec, {"selector", "targetPorts"}, {"appProtocol", "endpointPickerRef"})
    if errors:
        return errors
    errors += _keys("spec.selector", spec["selector"], {"matchLabels"}, set())
    labels = spec["selector"].get("matchLabels")
    if not isinstance(labels, dict) or not 1 <= len(labels) <= 64:
        errors.append("spec.selector.matchLabels: 1 to 64 entries")
    else:
        errors += [
            f"spec.selector.matchLabels.{k}: invalid value {v!r}"
            for k, v in labels.items()
            if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v)
        ]
    ports = spec["targetPorts"]
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        errors.append("spec.targetPorts: 1 to 8 entries")
    else:
        for i, entry in enumerate(ports):
            where = f"spec.targetPorts[{i}]"
            errors += _keys(where, entry, {"number"}, set()) or _port(
                f"{where}.number", entry["number"]
            )
        numbers = [p.get("number") for p in ports if isinstance(p, dict)]
        if len(set(map(str, numbers))) != len(numbers):
            errors.append("spec.targetPorts: numbers must be unique")
    if spec.get("appProtocol", "http") not in ("http", "kubernetes.io/h2c"):
        errors.append("spec.appProtocol: http or kubernetes.io/h2c")
    ref = spec.get("endpointPickerRef")
    if ref is not None:
        errors += _keys(
            "spec.endpointPickerRef", ref, {"name"}, {"group", "kind", "port", "failureMode"}
        )
        if not errors:
            errors += _name("spec.endpointPickerRef.name", ref["name"])
            kind = ref.get("kind", "Service")
            if kind == "Service":
                port = ref.get("port")
                errors += _keys("spec.endpointPickerRef.port", port, {"number"}, set()) or _port(
                    "spec.endpointPickerRef.port.number", port["number"]
                )
            if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
                errors.append("spec.endpointPickerRef.failureMode: FailOpen or FailClose")
    return errors


def http_route_errors(doc: Obj) -> list[str]:
    errors = _keys("", doc, {"apiVersion", "kind", "metadata", "spec"}, set()) + _meta(doc)
    spec: Any = doc.get("spec")
    errors += _keys("spec", spec, set(), {"parentRefs", "hostnames", "rules"})
    if errors:
        return errors
    ref_fields = {"group", "kind", "namespace", "sectionName", "port"}
    for i, parent in enumerate(spec.get("parentRefs") or []):
        errors += _keys(f"spec.parentRefs[{i}]", parent, {"name"}, ref_fields)
    rules = spec.get("rules") or []
    if not isinstance(rules, list) or len(rules) > 16:
        return [*errors, "spec.rules: at most 16"]
    for i, rule in enumerate(rules):
        where = f"spec.rules[{i}]"
        errors += _keys(
            where,
            rule,
            set(),
            {
                "name",
                "matches",
                "filters",
                "backendRefs",
                "timeouts",
                "retry",
                "sessionPersistence",
            },
        )
        for j, match in enumerate(rule.get("matches") or []):
            errors += _keys(
                f"{where}.matches[{j}]", match, set(), {"path", "headers", "queryParams", "method"}
            )
            path = match.get("path")
            if path is not None:
                if path.get("type", "PathPrefix") not in (
                    "Exact",
                    "PathPrefix",
                    "RegularExpression",
                ):
                    errors.append(
                        f"{where}.matches[{j}].path.type: Exact, PathPrefix or RegularExpression"
                    )
                if not str(path.get("value", "/")).startswith("/"):
                    errors.append(f"{where}.matches[{j}].path.value: must start with /")
        backends = rule.get("backendRefs") or []
        if len(backends) > 16:
            errors.append(f"{where}.backendRefs: at most 16")
        for j, backend in enumerate(backends):
            errors += _keys(
                f"{where}.backendRefs[{j}]",
                backend,
                {"name"},
                ref_fields - {"sectionName"} | {"weight", "filters"},
            )
            weight = backend.get("weight", 1)
            if not isinstance(weight, int) or not 0 <= weight <= 1_000_000:
                errors.append(f"{where}.backendRefs[{j}].weight: 0 to 1000000")
        for key, value in (rule.get("timeouts") or {}).items():
            if key not in ("request", "backendRequest") or not _DURATION.match(str(value)):
                errors.append(f"{where}.timeouts.{key}: a duration such as 300s")
    return errors


def gateway_errors(doc: Obj) -> list[str]:
    errors = _keys("", doc, {"apiVersion", "kind", "metadata", "spec"}, set()) + _meta(doc)
    spec: Any = doc.get("spec")
    errors += _keys(
        "spec", spec, {"gatewayClassName", "listeners"}, {"addresses", "infrastructure"}
    )
    if errors:
        return errors
    listeners = spec["listeners"]
    if not isinstance(listeners, list) or not 1 <= len(listeners) <= 64:
        return ["spec.listeners: 1 to 64"]
    for i, listener in enumerate(listeners):
        where = f"spec.listeners[{i}]"
        errors += _keys(
            where, listener, {"name", "port", "protocol"}, {"hostname", "tls", "allowedRoutes"}
        )
        errors += _port(f"{where}.port", listener.get("port"))
    return errors


CRD_CHECKS: dict[tuple[str, str], Callable[[Obj], list[str]]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): inference_pool_errors,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): http_route_errors,
    ("gateway.networking.k8s.io/v1", "Gateway"): gateway_errors,
}


@pytest.fixture(scope="module")
async def api() -> AsyncIterator[ApiClient]:
    async with ApiClient() as client:
        yield client


def test_the_files_the_readme_names_are_there() -> None:
    names = {p.name for p in MANIFESTS}
    assert names == {"epp.yaml", "inferencepool.yaml", "httproute.yaml", "vllm.yaml", "nats.yaml"}
    assert all(load(p) for p in MANIFESTS)
    readme = (DEPLOY / "README.md").read_text()
    assert all(name in readme for name in names)
    # It says how far it was tested.
    assert "not against a real cluster" in " ".join(readme.replace("*", "").split())


def test_every_object_is_a_kind_checked_here_in_one_namespace() -> None:
    for doc in everything():
        key = (doc["apiVersion"], doc["kind"])
        assert key in MODELS or key in CRD_CHECKS, key
        assert doc["metadata"].get("namespace") == "default", doc["metadata"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
async def test_core_objects_parse_as_the_api_models_with_no_unknown_field(
    api: ApiClient, path: Path
) -> None:
    for doc in load(path):
        model = MODELS.get((doc["apiVersion"], doc["kind"]))
        if model is None:
            continue
        # The client's own decoding (its models check required fields); a field the model
        # does not know (a typo such as readinesProbe) would not survive the round trip.
        parsed = api.deserialize(cast(Any, SimpleNamespace(data=json.dumps(doc))), model)
        assert api.sanitize_for_serialization(parsed) == doc, f"{path.name}: {doc['kind']}"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_custom_resources_have_the_fields_their_crds_define(path: Path) -> None:
    for doc in load(path):
        check = CRD_CHECKS.get((doc["apiVersion"], doc["kind"]))
        if check is not None:
            assert check(doc) == [], f"{path.name}: {doc['kind']}"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda s: s.update(targetPorts=[]), "spec.targetPorts: 1 to 8"),
        (lambda s: s.update(targetPorts=[{"number": 8000 + i} for i in range(9)]), "1 to 8"),
        (lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]), "unique"),
        (lambda s: s.update(targetPorts=[{"number": 0}]), "targetPorts[0].number"),
        (lambda s: s.update(targetPorts=[{"port": 8000}]), "targetPorts[0].number: required"),
        (lambda s: s["selector"].update(matchLabels={}), "matchLabels: 1 to 64"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Open"), "FailOpen or FailClose"),
        (lambda s: s["endpointPickerRef"].pop("port"), "endpointPickerRef.port: not an object"),
        (lambda s: s["endpointPickerRef"].update(portNumber=9002), "portNumber: unknown"),
        (lambda s: s.update(extensionRef={"name": "epp"}), "spec.extensionRef: unknown"),
    ],
)
def test_the_inference_pool_check_catches_what_the_crd_rejects(
    change: Callable[[Obj], Any], error: str
) -> None:
    pool = copy.deepcopy(one("InferencePool", "vllm-pool"))
    change(pool["spec"])
    assert any(error in e for e in inference_pool_errors(pool)), inference_pool_errors(pool)


def test_the_http_route_check_catches_what_the_crd_rejects() -> None:
    route = copy.deepcopy(one("HTTPRoute", "vllm-route"))
    rule = route["spec"]["rules"][0]
    rule["backendRefs"][0]["weigth"] = 1
    rule["matches"][0]["path"]["type"] = "Prefix"
    rule["timeouts"]["request"] = "5 minutes"
    errors = http_route_errors(route)
    assert len(errors) == 3, errors


def test_the_picker_runs_with_the_pool_ports_tls_tokenizer_and_model() -> None:
    epp = container(one("Deployment", "kvroute-epp"), "epp")
    assert epp["command"] == ["kvroute"] and epp["args"][0] == "epp"
    given = flags(epp["args"])
    assert given == {
        "--pool-name": "vllm-pool",
        "--pool-namespace": "default",
        "--host": "0.0.0.0",
        "--grpc-port": "9002",
        "--health-port": "9003",
        "--metrics-port": "9090",
        "--tls": None,
        "--tokenizer": "/tokenizer",
        "--model": "Qwen/Qwen3-0.6B",
        "--config": "/etc/kvroute/epp.yaml",
    }
    ports = {p["name"]: p["containerPort"] for p in epp["ports"]}
    assert ports == {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}
    # The arguments are ones `kvroute epp` takes, and they make a valid config (the tokenizer
    # directory exists only in the pod: the built-in one stands in for it here).
    from kvroute.cli import build_parser
    from kvroute.epp_cli import epp_config_from_args

    local = {"/tokenizer": "builtin", "/etc/kvroute/epp.yaml": str(_picker_config_file())}
    args = [local.get(a, a) for a in epp["args"]]
    config = epp_config_from_args(build_parser().parse_args(args))
    assert (config.epp.pool_name, config.epp.tls, config.epp.host) == ("vllm-pool", True, "0.0.0.0")
    # The tokenizer directory is mounted where --tokenizer points.
    assert any(m["mountPath"] == "/tokenizer" for m in epp["volumeMounts"])


def _picker_config_file() -> Path:
    """The ConfigMap's epp.yaml, where a test can read it (the pod mounts it)."""
    import tempfile

    data = one("ConfigMap", "kvroute-epp-config")["data"]["epp.yaml"]
    path = Path(tempfile.mkdtemp(prefix="kvroute-manifest-")) / "epp.yaml"
    path.write_text(data)
    return path


def test_several_pickers_share_over_nats_and_stop_one_at_a_time() -> None:
    from kvroute.router.config import load_config

    deployment = one("Deployment", "kvroute-epp")
    assert deployment["spec"]["replicas"] >= 2
    config = load_config(_picker_config_file())
    nats = one("Service", "kvroute-nats")
    url = f"nats://{nats['metadata']['name']}.{nats['metadata']['namespace']}.svc:4222"
    assert {p["port"] for p in nats["spec"]["ports"]} == {4222}
    assert config.epp.ledger_bus == config.tenants.budget_bus == config.warm_start.nats_url == url
    server = container(one("Deployment", "kvroute-nats"), "nats")
    assert "-js" in server["args"]  # the snapshots' object store needs JetStream
    # SIGTERM: unready, then drained, within the pod's grace period.
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= config.epp.unready_delay_s + config.shutdown.drain_timeout_s
    mounts = {m["name"]: m["mountPath"] for m in container(deployment, "epp")["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert mounts["config"] == "/etc/kvroute"
    assert volumes["config"]["configMap"]["name"] == "kvroute-epp-config"
    # A drain never takes the last picker.
    pdb = one("PodDisruptionBudget", "kvroute-epp")
    assert pdb["spec"]["minAvailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_picker_probes_are_grpc_health_on_9003() -> None:
    epp = container(one("Deployment", "kvroute-epp"), "epp")
    assert epp["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}


def test_rbac_lets_the_picker_read_pods_and_pools_and_nothing_more() -> None:
    role = one("Role", "kvroute-epp")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"))
        for verb in ("get", "list", "watch")
    }
    binding = one("RoleBinding", "kvroute-epp")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "kvroute-epp",
    }
    pod_spec = one("Deployment", "kvroute-epp")["spec"]["template"]["spec"]
    account = one("ServiceAccount", pod_spec["serviceAccountName"])
    assert {
        "kind": "ServiceAccount",
        "name": account["metadata"]["name"],
        "namespace": "default",
    } in binding["subjects"]


def test_the_picker_service_speaks_http2_to_the_grpc_port() -> None:
    service = one("Service", "kvroute-epp")
    deployment = one("Deployment", "kvroute-epp")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in container(deployment, "epp")["ports"]}
    by_port = {p["port"]: p for p in service["spec"]["ports"]}
    assert by_port[9002]["appProtocol"] == "http2"
    assert container_ports[by_port[9002]["targetPort"]] == 9002
    assert container_ports[by_port[9090]["targetPort"]] == 9090


def test_pool_route_picker_and_model_servers_point_at_each_other() -> None:
    pool = one("InferencePool", "vllm-pool")
    epp_args = flags(container(one("Deployment", "kvroute-epp"), "epp")["args"])
    assert pool["metadata"]["name"] == epp_args["--pool-name"]
    assert pool["metadata"]["namespace"] == epp_args["--pool-namespace"]

    ref = pool["spec"]["endpointPickerRef"]
    service = one("Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "http2"
    assert ref["failureMode"] == "FailClose"

    vllm = one("Deployment", "vllm")
    pod_labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    served = {p["containerPort"] for p in container(vllm, "vllm")["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= served

    route = one("HTTPRoute", "vllm-route")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm-pool"}
    ]
    gateway = one("Gateway", route["spec"]["parentRefs"][0]["name"])
    assert gateway["spec"]["listeners"]

    # The picker is asked for the model vLLM serves.
    assert container(vllm, "vllm")["args"][0] == epp_args["--model"]


def test_discovery_finds_a_vllm_pod_and_its_kv_events_as_deployed() -> None:
    vllm = one("Deployment", "vllm")
    template = vllm["spec"]["template"]
    server = container(vllm, "vllm")
    events = json.loads(flags(server["args"])["--kv-events-config"] or "")
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # Bound on every interface, on the port the annotation announces.
    assert (
        events["endpoint"]
        == f"tcp://*:{template['metadata']['annotations'][KV_EVENTS_PORTS_ANNOTATION]}"
    )
    assert "--enable-prefix-caching" in server["args"]
    assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}

    # A running pod of this template, as the API server would show it, through discovery.
    pod = {
        "metadata": {**copy.deepcopy(template["metadata"]), "name": "vllm-0"},
        "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    pool = parse_pool(one("InferencePool", "vllm-pool"))
    assert endpoints_from_pod(pod, pool) == (
        PoolEndpoint("vllm-0-rank-0", "10.0.0.7", 8000, ("tcp://10.0.0.7:5557",)),
    )
