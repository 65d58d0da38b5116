"""OpenTelemetry tracing for the three services: on when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.

`setup(service)` is called once as each service process starts (scheduler, dataplane and each
of its workers, runtime, and the fake MCP server). With the endpoint set it installs the SDK's
tracer provider, named `service` (unless `OTEL_SERVICE_NAME` says otherwise), with a batching
OTLP/HTTP exporter: spans are queued in memory and a background thread sends them, so a span
costs its caller only its making. Without the endpoint (or with `OTEL_SDK_DISABLED=true`)
nothing is installed and `TRACER` stays None: every place that would make a span checks that
first and makes no span object at all, and the SDK and exporter are not even imported.

The W3C `traceparent` is how a span's context crosses a process: an HTTP header (runtime to
dataplane, dataplane to engines), the AdmitRequest's `traceparent` field (dataplane to scheduler,
one per turn on the shared Turns stream), the MCP request's `_meta` (runtime to tool servers, put
there by the `mcp` SDK), and the journal's `spawned` record (a run resumed after a restart).
`parent(traceparent)` and `traceparent_of(span)` convert between the header and a context.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"

# The tracer of this process once `setup` found an endpoint; None: tracing is off.
TRACER: trace.Tracer | None = None

_W3C = TraceContextTextMapPropagator()


def configured() -> bool:
    """Whether the environment asks for traces to be exported."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(os.environ.get(ENDPOINT_ENV) or os.environ.get(TRACES_ENDPOINT_ENV))


def setup(service: str) -> bool:
    """Installs the tracer provider for this process when the environment asks for it; True if it did."""
    global TRACER
    if TRACER is not None or not configured():
        return TRACER is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    # The exporter reads the endpoint (adding /v1/traces), headers and timeout from the OTEL_* variables.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    TRACER = provider.get_tracer("luftpause")
    log.info("tracing: exporting spans of %s over OTLP/HTTP to %s", name,
             os.environ.get(TRACES_ENDPOINT_ENV) or os.environ.get(ENDPOINT_ENV))  # fmt: skip
    return True


def parent(traceparent: str | None) -> Context | None:
    """The context a `traceparent` header value names, or None for none (or one unreadable)."""
    if not traceparent:
        return None
    context = _W3C.extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traceparent_of(span: Span) -> str:
    """The W3C `traceparent` of `span`, for a child in another process; "" for a span without one."""
    c = span.get_span_context()
    if not c.is_valid:
        return ""
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def current_traceparent() -> str:
    """The `traceparent` of the span current in this task; "" when there is none."""
    return traceparent_of(trace.get_current_span())
