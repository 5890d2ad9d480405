"""The only module that imports the OpenTelemetry SDK; a process imports it only when `--enable-trace` is on.

`Tracer` is one process's tracer provider: its resource names the process (`srt.component` = tokenizer /
scheduler / detokenizer, `process.pid`), and a `BatchSpanProcessor` hands finished spans to the OTLP exporter
on the SDK's worker thread, so ending a span only appends it to a bounded queue. A collector that is down
or slow costs dropped spans and log lines, never a failed request or a blocked loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from srt.io_struct import TraceContext
from srt.tracing.common import (
    ATTR_COMPONENT,
    PROTOCOL_GRPC,
    SERVICE_NAME,
    exporter_endpoint,
    exporter_protocol,
)

_PROPAGATOR = TraceContextTextMapPropagator()
# Each export gives up after this long unless OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT says otherwise (the SDK's
# default is 10 s): the flush at process exit waits for the export in flight, so a collector that is down
# would otherwise hold up every shutdown by that long.
EXPORT_TIMEOUT_S = 2.0
TIMEOUT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
INSTRUMENTATION_NAME = "srt"


def make_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` asks for (ConfigError for an unknown one)."""
    protocol = exporter_protocol()
    url = exporter_endpoint(endpoint, protocol)
    if protocol == PROTOCOL_GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    timeout = None if any(os.environ.get(k) for k in TIMEOUT_ENVS) else EXPORT_TIMEOUT_S
    return OTLPSpanExporter(endpoint=url, timeout=timeout)


def make_resource(component: str, extra: Mapping[str, str | int] | None = None) -> Resource:
    resource = Resource.create({ATTR_COMPONENT: component, "process.pid": os.getpid(), **(extra or {})})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    return resource


class Tracer:
    """One process's tracer. `processor` replaces the batch processor and its OTLP exporter (tests)."""

    def __init__(
        self,
        component: str,
        endpoint: str = "",
        processor: SpanProcessor | None = None,
        resource_attributes: Mapping[str, str | int] | None = None,
    ):
        self.provider = TracerProvider(resource=make_resource(component, resource_attributes))
        self.provider.add_span_processor(processor or BatchSpanProcessor(make_exporter(endpoint)))
        self._tracer = self.provider.get_tracer(INSTRUMENTATION_NAME)

    # ---- contexts ----
    @staticmethod
    def extract(headers: Mapping[str, str]) -> Context:
        """The caller's trace from its W3C headers (an empty context, hence a new trace, without them)."""
        carrier = {k: headers[k] for k in (TRACEPARENT, TRACESTATE) if headers.get(k)}
        return _PROPAGATOR.extract(carrier)

    @staticmethod
    def parent_of(ctx: TraceContext) -> Context:
        """The context a child process's spans hang under."""
        return _PROPAGATOR.extract({TRACEPARENT: ctx.traceparent, TRACESTATE: ctx.tracestate})

    @staticmethod
    def under(span: Span) -> Context:
        return trace.set_span_in_context(span)

    @staticmethod
    def carry(span: Span, level: int) -> TraceContext | None:
        """What a child process needs to hang its spans under `span`; None when the span is not recorded
        (the caller's trace is not sampled), so children do no work for it either."""
        if not span.is_recording():
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return TraceContext(carrier[TRACEPARENT], carrier.get(TRACESTATE, ""), level)

    # ---- spans ----
    def start(
        self,
        name: str,
        parent: Context | None,
        start_ns: int,
        attributes: Mapping[str, object] | None = None,
        server: bool = False,
    ) -> Span:
        """A span started at `start_ns`; `server` marks the request's entry into this service (the root)."""
        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        span = self._tracer.start_span(name, context=parent, kind=kind, start_time=start_ns)
        if attributes:
            set_attributes(span, attributes)
        return span

    def span(
        self,
        name: str,
        parent: Context | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, object] | None = None,
    ) -> Span:
        """A span whose interval is already known (the stamps were taken while the work ran)."""
        span = self.start(name, parent, start_ns, attributes)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def shutdown(self) -> None:
        self.provider.shutdown()


def set_attributes(span: Span, attributes: Mapping[str, object]) -> None:
    """Set every attribute that has a value (OpenTelemetry refuses None)."""
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


def mark_error(span: Span, message: str) -> None:
    span.set_status(Status(StatusCode.ERROR, message))
