"""The Grafana dashboard in deploy/grafana/: one Grafana imports, and every query in it names a
metric that is really exported.

kvroute_* names are checked against a running router's /metrics (and the endpoint picker's
registry), vllm:* names against the emulated replica's /metrics and against vLLM's own list.
Both are compared as series names: a counter is queried as NAME_total, a histogram as
NAME_bucket/_sum/_count, so a query on a histogram's bare name or a counter without _total
fails like any misspelt name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import promql_parser
import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.config import config_from_dict
from kvroute.router.disaggregation import PdMetrics
from kvroute.router.epp.picker import EndpointPicker

from .conftest import Running, StartReplica, StartRouter

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "kvroute.json"

# vLLM's /metrics families (vllm/v1/metrics/loggers.py, PrometheusStatLogger), as shipped in
# vLLM 0.10-0.33, by type. Some exist only in some versions or with some features (LoRA, KV
# connectors, sleep mode); the dashboard must use names from this list.
VLLM_FAMILIES = {
    "gauge": [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
        "vllm:engine_sleep_state",
    ],
    "counter": [
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:gpu_prefix_cache_queries",
        "vllm:gpu_prefix_cache_hits",
        "vllm:external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:prompt_tokens_by_source",
        "vllm:prompt_tokens_cached",
        "vllm:prompt_tokens_cached_by_source",
        "vllm:request_success",
    ],
    "histogram": [
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_max_num_generation_tokens",
        "vllm:request_params_max_tokens",
        "vllm:request_params_n",
        "vllm:iteration_tokens_total",
        "vllm:request_num_preemptions",
        "vllm:request_prefill_kv_computed_tokens",
    ],
}

SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
    "unknown": ("",),
    "info": ("_info",),
}


def series_names(families: Iterable[Metric]) -> set[str]:
    """The names a query can select: each family's series names by its type (an empty family
    has no samples yet, but its series will have these names)."""
    names: set[str] = set()
    for family in families:
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def exported(text: str) -> set[str]:
    return series_names(text_string_to_metric_families(text))


VLLM_REFERENCE = {
    name + suffix
    for kind, names in VLLM_FAMILIES.items()
    for name in names
    for suffix in SUFFIXES[kind]
}

# Grafana's interval variables stand where PromQL wants a duration; the others ($job, ...)
# only inside label matchers' strings.
GRAFANA_INTERVALS = re.compile(r"\$__(?:rate_interval|interval|range)\b")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (parsed: a syntax error fails too)."""
    names = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next(
                (m.value for m in node.matchers.matchers if m.name == "__name__"), None
            )
            assert name, f"a selector without a metric name in {expr!r}"
            names.add(name)

    promql_parser.walk(promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expr)), visit)
    return names


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", text)
        assert match is not None, f"variable {variable['name']}: {text!r} is not label_values"
        yield f"variable ${variable['name']}", match.group(1)


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def unknown_names(dashboard: dict[str, Any], kvroute: set[str], vllm: set[str]) -> list[str]:
    """Every query's metric that neither the router nor vLLM exports, with where it is."""
    problems = []
    for where, expr in queries(dashboard):
        for name in sorted(metric_names(expr)):
            known = kvroute if name.startswith("kvroute_") else vllm
            if not name.startswith(("kvroute_", "vllm:")) or name not in known:
                problems.append(f"{where}: {name}")
    return problems


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


@pytest.fixture
async def kvroute_series(start_replica: StartReplica, start_router: StartRouter) -> set[str]:
    """Series names of a running router's /metrics (after a request) and the picker's."""
    a = await start_replica("a")
    r = await start_router([a])
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "Say hi", "max_tokens": 2}
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
    names = exported(await scrape(r.url))
    picker = EndpointPicker(config_from_dict({"replicas": [{"url": a.url}]}))
    names |= exported(generate_latest(picker.metrics.registry).decode())
    # A router with a prefill/decode pair also exports these (tests/test_pd_router.py).
    pd_metrics = PdMetrics()
    pd_metrics.decided("decode", "split")
    pd_metrics.prefilled("prefill", "ok")
    names |= series_names(pd_metrics.families([]))
    return names


async def test_every_query_names_a_metric_the_router_or_vllm_exports(
    kvroute_series: set[str], replica: Running
) -> None:
    emulated = exported(await scrape(replica.url))
    # The emulated replica speaks vLLM's names: what it exports is on vLLM's list.
    vllm_names = {n for n in emulated if n.startswith("vllm:") and not n.endswith("_created")}
    assert vllm_names <= VLLM_REFERENCE, vllm_names - VLLM_REFERENCE
    # The dashboard's vllm:* names must be both vLLM's and what the emulator shows (so the
    # demo fleet fills every panel).
    assert unknown_names(load(), kvroute_series, emulated & VLLM_REFERENCE) == []


async def test_a_misspelt_or_unsuffixed_name_is_caught(
    kvroute_series: set[str], replica: Running
) -> None:
    vllm = exported(await scrape(replica.url)) & VLLM_REFERENCE
    dashboard = load()
    typos = {
        "kvroute_requests_total": "kvroute_request_total",  # misspelt
        "kvroute_retries_total": "kvroute_retries",  # a counter without _total
        "kvroute_time_to_first_byte_seconds_bucket": "kvroute_time_to_first_byte_seconds",
        "vllm:prefix_cache_hits_total": "vllm:prefix_cache_hit_total",
    }
    for target in (t for p in panels(dashboard) for t in p.get("targets", [])):
        for right, wrong in typos.items():
            target["expr"] = target["expr"].replace(right, wrong)
    reported = {p.rsplit(": ", 1)[1] for p in unknown_names(dashboard, kvroute_series, vllm)}
    assert reported == set(typos.values())


async def test_every_kvroute_metric_has_a_panel(kvroute_series: set[str]) -> None:
    """A metric added to the router without a panel fails here: add it to the dashboard."""
    used = {name for _, expr in queries(load()) for name in metric_names(expr)}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    exported_families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in kvroute_series}
    assert exported_families - families == set()


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        (
            'histogram_quantile(0.99, sum by (le, replica) (rate(a_bucket{job=~"$job"}'
            "[$__rate_interval])))",
            {"a_bucket"},
        ),
        (
            'sum(rate(vllm:x_total{reason="b_total"}[5m])) / sum(rate(c[1h:5m] offset 1d))',
            {"vllm:x_total", "c"},
        ),
        ("(sum(d) or vector(0)) + on (replica) group_left (state) e * 1e3", {"d", "e"}),
        ("max without (instance) (f) > bool 0.5 unless g", {"f", "g"}),
        ('count({__name__="h", job="x"})', {"h"}),
    ],
)
def test_metric_names_are_read_from_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_a_query_that_is_not_promql_fails() -> None:
    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        metric_names("sum(rate(kvroute_requests_total[$__rate_interval])")


def test_the_dashboard_is_one_grafana_imports() -> None:
    dashboard = load()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    # The data source is chosen on import (or later), not baked in.
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    builtin = {"__rate_interval", "__interval", "__range"}
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("description"), f"{panel['title']}: say what it shows"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            for used in re.findall(r"\$(\w+)", target["expr"]):
                assert used in variables or used in builtin, f"{panel['title']}: ${used}"
    # Panels do not overlap.
    cells: set[tuple[int, int]] = set()
    for panel in panels(dashboard):
        g = panel["gridPos"]
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, f"{panel['title']} overlaps another panel"
        cells |= area
