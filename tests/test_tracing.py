"""OpenTelemetry traces of the request path, received by an in-process OTLP collector.

A real router with fake replicas (which record the headers they get) exports its spans to a
collector in the test: OTLP/HTTP (protobuf) on an aiohttp server, or OTLP/gRPC on a grpc.aio
server. Requests come from the real ``openai`` client, or aiohttp where it is simpler.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from kvroute.router.admission import Admission
from kvroute.router.config import ConfigError, config_from_dict
from kvroute.router.forward import Forwarder
from kvroute.router.pipeline import RequestPipeline
from kvroute.router.runner import app_runner
from kvroute.router.server import Router
from kvroute.router.tracing import traces_url

from .conftest import StartReplica, StartRouter
from .helpers import wait_until

SERVER, CLIENT, INTERNAL = Span.SPAN_KIND_SERVER, Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_INTERNAL
ERROR = Status.STATUS_CODE_ERROR
CHILDREN = ("kvroute.admission", "kvroute.tokenize", "kvroute.route", "kvroute.attempt")


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int
    service: str


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


@dataclass
class Collector:
    """What an in-process OTLP receiver got, span by span."""

    endpoint: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0

    def add(self, request: ExportTraceServiceRequest) -> None:
        self.exports += 1
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            s.name,
                            s.kind,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            _attributes(s.attributes),
                            s.status.code,
                            service,
                        )
                    )

    def of(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    async def trace(self, trace_id: str, count: int) -> list[ReceivedSpan]:
        """The trace's spans once ``count`` have arrived (polled: export is batched)."""
        await wait_until(
            lambda: len(self.of(trace_id)) >= count, 10, f"{count} spans of trace {trace_id}"
        )
        return self.of(trace_id)

    def router_config(self, **options: Any) -> dict[str, Any]:
        # Batches every 50 ms: spans arrive in a test's time.
        return {"otlp_endpoint": self.endpoint, "export_interval_s": 0.05, **options}


# Request the collector before start_router: fixtures tear down in reverse, so the router
# flushes its last spans while the collector still listens.
@pytest.fixture
async def otlp_http() -> AsyncIterator[Collector]:
    """OTLP/HTTP with protobuf bodies, as an OpenTelemetry Collector serves it on :4318."""
    collector = Collector()

    async def export(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        collector.add(ExportTraceServiceRequest.FromString(await request.read()))
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    collector.endpoint = f"http://127.0.0.1:{port}"
    yield collector
    await runner.cleanup()


@pytest.fixture
async def otlp_grpc() -> AsyncIterator[Collector]:
    """OTLP/gRPC's TraceService, as an OpenTelemetry Collector serves it on :4317."""
    collector = Collector()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        async def Export(  # the gRPC method's name
            self, request: ExportTraceServiceRequest, context: Any
        ) -> ExportTraceServiceResponse:
            collector.add(request)
            return ExportTraceServiceResponse()

    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    collector.endpoint = f"http://127.0.0.1:{port}"
    yield collector
    await server.stop(None)


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


def new_trace() -> tuple[str, str]:
    """A client's trace id and span id (hex), as its own tracer would make them."""
    return os.urandom(16).hex(), os.urandom(8).hex()


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), f"span names repeat: {[s.name for s in spans]}"
    return named


def traceparent_parts(header: str) -> tuple[str, str, str, str]:
    version, trace_id, parent_id, flags = header.split("-")
    return version, trace_id, parent_id, flags


def sampled(flags: str) -> bool:
    # Bit 0; the router's own trace ids also set bit 1 (W3C level 2: the id is random).
    return bool(int(flags, 16) & 1)


async def test_a_request_continues_the_clients_trace_and_the_replica_gets_the_attempts_context(
    otlp_http: Collector, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], tracing=otlp_http.router_config())
    trace_id, client_span = new_trace()
    await client_for(r.url).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        prompt_cache_key="conversation-1",
        extra_headers={
            "traceparent": f"00-{trace_id}-{client_span}-01",
            "tracestate": "vendor=opaque",
        },
    )
    spans = by_name(await otlp_http.trace(trace_id, 1 + len(CHILDREN)))
    assert set(spans) == {"POST /v1/chat/completions", *CHILDREN}
    request = spans["POST /v1/chat/completions"]
    assert request.kind == SERVER and request.parent_id == client_span
    assert request.service == "kvroute"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.request.model"] == "tiny"
    assert request.attributes["kvroute.stream"] is False
    assert request.attributes["kvroute.session_source"] == "prompt_cache_key"
    for name in CHILDREN:
        assert spans[name].parent_id == request.span_id, name
    # The steps in order, each inside the request's span.
    starts = [spans[name].start_ns for name in CHILDREN]
    assert starts == sorted(starts)
    assert all(spans[n].end_ns <= request.end_ns for n in CHILDREN)
    assert spans["kvroute.admission"].kind == spans["kvroute.route"].kind == INTERNAL
    route = spans["kvroute.route"].attributes
    assert route["kvroute.policy"] == "kv_aware"
    assert route["kvroute.reason"] == "kv_least_cost"
    assert route["kvroute.replica"] == "a"
    assert route["kvroute.predicted_prefix_tokens"] == 0
    assert route["kvroute.ranked"] == ["a"]
    attempt = spans["kvroute.attempt"]
    assert attempt.kind == CLIENT and attempt.status != ERROR
    assert attempt.attributes["kvroute.replica"] == "a"
    assert attempt.attributes["kvroute.attempt"] == 1
    assert attempt.attributes["kvroute.retry"] is False
    assert attempt.attributes["kvroute.resume"] is False
    assert attempt.attributes["http.response.status_code"] == 200
    assert attempt.attributes["url.full"] == a.url + "/v1/chat/completions"
    # The replica continues the same trace under the attempt, the client's tracestate kept.
    seen = a.seen[-1].headers
    assert traceparent_parts(seen["traceparent"]) == ("00", trace_id, attempt.span_id, "01")
    assert seen["tracestate"] == "vendor=opaque"
    assert len(seen.getall("traceparent")) == 1  # the client's own was not passed on as well


async def test_without_a_traceparent_the_router_starts_the_trace(
    otlp_http: Collector, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], tracing=otlp_http.router_config())
    body = {"model": "tiny", "prompt": "Say hi", "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert b"[DONE]" in await resp.read()
            request_id = resp.headers["X-Request-Id"]
    seen = a.seen[-1].headers
    assert "tracestate" not in seen
    version, trace_id, parent_id, flags = traceparent_parts(seen["traceparent"])
    assert version == "00" and sampled(flags)
    spans = by_name(await otlp_http.trace(trace_id, 1 + len(CHILDREN)))
    request = spans["POST /v1/completions"]
    assert request.parent_id == ""  # the trace's root
    assert request.attributes["kvroute.request_id"] == request_id
    assert request.attributes["kvroute.stream"] is True
    assert spans["kvroute.attempt"].span_id == parent_id


async def test_a_retried_request_has_one_attempt_span_per_replica_each_passed_on(
    otlp_http: Collector, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a, b = await start_replica("a"), await start_replica("b")
    a.fail_with = 500
    r = await start_router(
        [a, b], policy={"name": "round_robin"}, tracing=otlp_http.router_config()
    )
    client = client_for(r.url)
    traces = []
    for _ in range(2):  # round robin: exactly one of the two starts on a, and is retried on b
        trace_id, client_span = new_trace()
        completion = await client.completions.create(
            model="tiny",
            prompt="Say hi",
            max_tokens=2,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        )
        assert completion.choices[0].text == "hello from b"
        traces.append(trace_id)

    def attempts(trace_id: str) -> list[ReceivedSpan]:
        spans = otlp_http.of(trace_id)
        return sorted(
            (s for s in spans if s.name == "kvroute.attempt"),
            key=lambda s: s.attributes["kvroute.attempt"],
        )

    def requests_done() -> bool:  # both requests' spans, the retried one's two attempts too
        roots = [s for t in traces for s in otlp_http.of(t) if s.kind == SERVER]
        return len(roots) == 2 and sum(len(attempts(t)) for t in traces) == 3

    await wait_until(requests_done, 10, "both requests' spans")
    retried = [t for t in traces if len(attempts(t)) == 2]
    assert len(retried) == 1
    trace_id = retried[0]
    first, second = attempts(trace_id)
    assert first.attributes["kvroute.replica"] == "a"
    assert first.attributes["kvroute.attempt"] == 1
    assert first.attributes["kvroute.retry"] is False
    assert first.attributes["http.response.status_code"] == 500
    assert first.attributes["error.type"] == "http_500"
    assert first.status == ERROR
    assert second.attributes["kvroute.replica"] == "b"
    assert second.attributes["kvroute.attempt"] == 2
    assert second.attributes["kvroute.retry"] is True
    assert second.attributes["http.response.status_code"] == 200
    assert second.status != ERROR
    request = next(s for s in otlp_http.of(trace_id) if s.kind == SERVER)
    assert first.parent_id == second.parent_id == request.span_id
    assert request.attributes["http.response.status_code"] == 200
    # Each replica saw its own attempt as the parent.
    [on_a] = [s for s in a.seen if traceparent_parts(s.headers["traceparent"])[1] == trace_id]
    [on_b] = [s for s in b.seen if traceparent_parts(s.headers["traceparent"])[1] == trace_id]
    assert traceparent_parts(on_a.headers["traceparent"])[2] == first.span_id
    assert traceparent_parts(on_b.headers["traceparent"])[2] == second.span_id
    assert r.router.metrics.retries[("retry",)] == 1


async def test_sampling_starts_few_traces_but_follows_the_clients_sampled_flag(
    otlp_http: Collector, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], tracing=otlp_http.router_config(sample_ratio=0.0))
    client = client_for(r.url)
    await client.completions.create(model="tiny", prompt="Say hi", max_tokens=2)
    _, unsampled_trace, _, flags = traceparent_parts(a.seen[-1].headers["traceparent"])
    assert not sampled(flags)  # passed on as not sampled: the replica records nothing either
    # A client's unsampled trace stays unsampled, and stays its trace.
    client_unsampled, client_span = new_trace()
    await client.completions.create(
        model="tiny",
        prompt="Say hi",
        max_tokens=2,
        extra_headers={"traceparent": f"00-{client_unsampled}-{client_span}-00"},
    )
    _, seen_trace, _, flags = traceparent_parts(a.seen[-1].headers["traceparent"])
    assert seen_trace == client_unsampled and not sampled(flags)
    trace_id, client_span = new_trace()
    await client.completions.create(
        model="tiny",
        prompt="Say hi",
        max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
    )
    await otlp_http.trace(trace_id, 1 + len(CHILDREN))
    # Spans are exported in the order they end: the first requests' would have come first.
    assert otlp_http.of(unsampled_trace) == otlp_http.of(client_unsampled) == []


async def test_spans_go_over_otlp_grpc_too(
    otlp_grpc: Collector, start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a], tracing=otlp_grpc.router_config(protocol="grpc"))
    trace_id, client_span = new_trace()
    await client_for(r.url).completions.create(
        model="tiny",
        prompt="Say hi",
        max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
    )
    spans = by_name(await otlp_grpc.trace(trace_id, 1 + len(CHILDREN)))
    assert spans["POST /v1/completions"].parent_id == client_span
    attempt = spans["kvroute.attempt"]
    assert traceparent_parts(a.seen[-1].headers["traceparent"])[2] == attempt.span_id


async def test_the_last_spans_are_exported_when_the_router_stops(
    otlp_http: Collector, start_replica: StartReplica
) -> None:
    a = await start_replica("a")
    # Batches far apart: only the flush on shutdown can send these spans in the test's time.
    config = config_from_dict(
        {
            "replicas": [{"url": a.url, "name": "a"}],
            "tracing": otlp_http.router_config(export_interval_s=3600),
        }
    )
    runner = app_runner(Router(config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        trace_id, client_span = new_trace()
        await client_for(f"http://127.0.0.1:{port}").completions.create(
            model="tiny",
            prompt="Say hi",
            max_tokens=2,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        )
        assert otlp_http.of(trace_id) == []
    finally:
        await runner.cleanup()
    assert len(otlp_http.of(trace_id)) == 1 + len(CHILDREN)


# -- tracing off ----------------------------------------------------------------------------


async def test_with_tracing_off_the_path_is_the_plain_one_and_trace_headers_pass_untouched(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    a = await start_replica("a")
    r = await start_router([a])
    router = r.router
    assert router.tracing is None
    # Exactly the untraced classes: no span is made, not even a no-op one.
    assert type(router.pipeline) is RequestPipeline
    assert type(router.forwarder) is Forwarder
    assert type(router.admission) is Admission
    client = client_for(r.url)
    traceparent = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"
    await client.completions.create(
        model="tiny",
        prompt="Say hi",
        max_tokens=2,
        extra_headers={"traceparent": traceparent, "tracestate": "vendor=opaque"},
    )
    assert a.seen[-1].headers["traceparent"] == traceparent
    assert a.seen[-1].headers["tracestate"] == "vendor=opaque"
    await client.completions.create(model="tiny", prompt="Say hi", max_tokens=2)
    assert "traceparent" not in a.seen[-1].headers
    assert "tracestate" not in a.seen[-1].headers


def test_with_tracing_off_the_router_does_not_import_opentelemetry() -> None:
    code = (
        "import sys\n"
        "from kvroute.router.config import config_from_dict\n"
        "from kvroute.router.server import Router\n"
        "Router(config_from_dict({'replicas': [{'url': 'http://127.0.0.1:9'}]}))\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry')\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- configuration --------------------------------------------------------------------------


def test_tracing_is_off_by_default() -> None:
    tracing = config_from_dict({}).tracing
    assert tracing.otlp_endpoint is None
    assert (tracing.protocol, tracing.service_name, tracing.sample_ratio) == (
        "http/protobuf",
        "kvroute",
        1.0,
    )


@pytest.mark.parametrize(
    ("tracing", "fragment"),
    [
        ({"protocol": "thrift"}, "tracing.protocol: must be one of http/protobuf, grpc"),
        ({"sample_ratio": 1.5}, "tracing.sample_ratio: must be in [0, 1]"),
        ({"export_interval_s": 0}, "tracing.export_interval_s: must be a finite number > 0"),
        ({"service_name": " "}, "tracing.service_name: must not be empty"),
        ({"otlp_endpoint": "collector:4318"}, "tracing.otlp_endpoint: 'collector:4318' is not"),
        ({"otlp_endpoint": "http://c:port"}, "tracing.otlp_endpoint: 'http://c:port' is not a"),
        ({"endpoint": "http://c:4318"}, "tracing.endpoint: unknown key (did you mean 'otlp_"),
    ],
    ids=["protocol", "ratio", "interval", "service", "no-scheme", "bad-port", "unknown-key"],
)
def test_bad_tracing_settings_name_the_key(tracing: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"tracing": tracing})
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("protocol", "module"),
    [
        ("http/protobuf", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
        ("grpc", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
    ],
)
def test_tracing_on_without_opentelemetry_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, protocol: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without it imports
    settings = {"otlp_endpoint": "http://collector:4318", "protocol": protocol}
    with pytest.raises(ConfigError) as err:
        config_from_dict({"tracing": settings})
    message = str(err.value)
    assert message.startswith("tracing.otlp_endpoint: tracing is on but OpenTelemetry")
    assert "pip install 'kvroute[tracing]'" in message
    # Off, the same environment is fine.
    config_from_dict({"tracing": {"protocol": protocol}})


def test_the_traces_url_is_the_collectors_base_url_plus_v1_traces() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://otlp.example/api/traces") == "https://otlp.example/api/traces"
