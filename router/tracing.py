"""OpenTelemetry for the router: a tracer provider with its OTLP exporter, and W3C trace context.

Imported only when ``tracing.otlp_endpoint`` is set (server.py), so the router runs without
OpenTelemetry installed while tracing is off; the spans themselves are made in traced.py.
The provider is the router's own, not OpenTelemetry's global one: several routers in one
process (tests, the demo) each export with their own settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .config import TracingConfig

# The W3C trace-context headers. With tracing on, the client's are replaced on the way to a
# replica by the attempt span's own (the replica's spans then hang under that attempt).
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


class Tracing:
    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider(
            # A client's sampled flag decides for its requests; the ratio for the rest.
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            resource=Resource.create({"service.name": config.service_name}),
            shutdown_on_exit=False,  # close() flushes; an atexit hook per router would pile up
        )
        # Spans are exported from the processor's own thread, off the event loop.
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter or otlp_exporter(config),
                schedule_delay_millis=config.export_interval_s * 1000,
            )
        )
        self.tracer: Tracer = self.provider.get_tracer("kvroute.router")
        self._propagator = TraceContextTextMapPropagator()

    def incoming(self, headers: Mapping[str, str]) -> Context:
        """The client's trace context (traceparent, tracestate), or an empty one."""
        return self._propagator.extract(headers)

    def outgoing(self) -> bytes:
        """Header lines carrying the current span's context to a replica."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        # The propagator writes only a traceparent it made and a tracestate it validated
        # (no CR or LF can reach the header block).
        return "".join(f"{name}: {value}\r\n" for name, value in carrier.items()).encode("latin-1")

    async def close(self) -> None:
        """Export what is left and stop. In a thread: the export may wait on the network (or
        on a collector served by this very event loop, as in the tests)."""
        await asyncio.to_thread(self.provider.shutdown)


def otlp_exporter(config: TracingConfig) -> SpanExporter:
    """The OTLP span exporter for ``config.protocol`` (only that one is imported). Its other
    settings (headers, timeout, compression, certificates) come from the standard
    OTEL_EXPORTER_OTLP_* environment variables."""
    endpoint = config.otlp_endpoint
    assert endpoint is not None
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme == "http")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=traces_url(endpoint))


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces URL: a collector's base URL gets /v1/traces (as with
    OTEL_EXPORTER_OTLP_ENDPOINT); a URL with a path is used as it is."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def without_trace_headers(
    headers: Iterable[tuple[bytes, bytes]],
) -> tuple[tuple[bytes, bytes], ...]:
    return tuple(h for h in headers if h[0].lower() not in TRACE_HEADERS)
