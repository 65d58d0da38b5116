"""OpenTelemetry tracing for the three services: on when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.

`setup(service)` is called once as each service process starts (scheduler, dataplane and each
of its workers, runtime, and the fake MCP server). With an endpoint set (the general one or the
traces one) it installs the SDK's tracer provider, named `service` (unless `OTEL_SERVICE_NAME`
says otherwise), with a batching OTLP exporter: spans are queued in memory and a background
thread sends them, so a span costs its caller only its making. Without the endpoint (or with
`OTEL_SDK_DISABLED=true`) nothing is installed and `TRACER` stays None: every place that would
make a span checks that first and makes no span object at all, and the SDK and exporter are not
even imported.

The variables are the SDK specification's, read as it defines them (`settings`): the protocol
(`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf`, the
default, or `grpc`, a collector's usual port 4317); the endpoint, headers and timeout, general
or per signal, which each exporter reads itself (OTLP/HTTP adds `/v1/traces` to the general
endpoint, gRPC takes it as it is); and the sampler (`OTEL_TRACES_SAMPLER`, `_ARG`), which the
SDK's provider reads. A value the SDK would pass over with a warning (an unknown protocol or
sampler, a ratio that is not one) is refused instead, before anything starts: `setup` exits the
process with a line naming the variable, its value and what it may be, and `luftpause up` checks
the same before it starts any service.

The W3C `traceparent` is how a span's context crosses a process: an HTTP header (runtime to
dataplane, dataplane to engines), the AdmitRequest's `traceparent` field (dataplane to scheduler,
one per turn on the shared Turns stream), the MCP request's `_meta` (runtime to tool servers, put
there by the `mcp` SDK), and the journal's `spawned` record (a run resumed after a restart).
`parent(traceparent)` and `traceparent_of(span)` convert between the header and a context.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
TRACES_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SAMPLER_ENV = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG_ENV = "OTEL_TRACES_SAMPLER_ARG"

PROTOCOLS = ("http/protobuf", "grpc")
"""The OTLP protocols the exporters speak; the specification's default first."""
SAMPLERS = (
    "parentbased_always_on",
    "always_on",
    "always_off",
    "parentbased_always_off",
    "traceidratio",
    "parentbased_traceidratio",
)
"""The samplers the SDK builds from OTEL_TRACES_SAMPLER; the specification's default first."""
RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")

# The tracer of this process once `setup` found an endpoint; None: tracing is off.
TRACER: trace.Tracer | None = None

_W3C = TraceContextTextMapPropagator()


class SettingsError(ValueError):
    """A tracing variable the exporters or the SDK cannot honour; the message names it."""


@dataclass(frozen=True)
class Settings:
    protocol: str
    endpoint: str
    sampler: str
    ratio: float | None
    """The sampler's ratio for the ratio samplers (OTEL_TRACES_SAMPLER_ARG, 1.0 unset), else None."""


def _env(name: str, environ: Mapping[str, str]) -> str:
    return environ.get(name, "").strip()


def settings(environ: Mapping[str, str] | None = None) -> Settings | None:
    """What the tracing variables of `environ` (the process's by default) ask for; None where
    tracing is off (no endpoint, or the SDK disabled). Raises SettingsError for a protocol, a
    sampler or a ratio that cannot be honoured, naming the variable, its value and the choices."""
    env = os.environ if environ is None else environ
    if _env("OTEL_SDK_DISABLED", env).lower() == "true":
        return None
    endpoint = _env(TRACES_ENDPOINT_ENV, env) or _env(ENDPOINT_ENV, env)
    if not endpoint:
        return None
    variable = TRACES_PROTOCOL_ENV if _env(TRACES_PROTOCOL_ENV, env) else PROTOCOL_ENV
    protocol = _env(variable, env) or PROTOCOLS[0]
    if protocol not in PROTOCOLS:
        why = " (the Python OTLP exporters do not speak it)" if protocol == "http/json" else ""
        raise SettingsError(f"{variable}={protocol!r} is not a protocol luftpause can export traces over{why}; "
                            f"use one of {', '.join(PROTOCOLS)}")  # fmt: skip
    sampler = _env(SAMPLER_ENV, env).lower() or SAMPLERS[0]
    if sampler not in SAMPLERS:
        raise SettingsError(
            f"{SAMPLER_ENV}={sampler!r} is not a sampler the SDK builds; use one of {', '.join(SAMPLERS)}"
        )
    ratio = None
    if sampler in RATIO_SAMPLERS:
        arg = _env(SAMPLER_ARG_ENV, env)
        try:
            ratio = float(arg) if arg else 1.0
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise SettingsError(
                f"{SAMPLER_ARG_ENV}={arg!r} is not a ratio for {sampler}: give a number from 0 to 1"
            )
    return Settings(protocol, endpoint, sampler, ratio)


def setup(service: str) -> bool:
    """Installs the tracer provider for this process when the environment asks for it; True if it
    did. Exits the process with the reason where a tracing variable cannot be honoured."""
    global TRACER
    if TRACER is not None:
        return True
    try:
        wanted = settings()
    except SettingsError as e:
        raise SystemExit(f"{service}: tracing: {e}") from None
    if wanted is None:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    exporter: SpanExporter
    if wanted.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    name = os.environ.get("OTEL_SERVICE_NAME") or service
    # The provider builds its sampler from OTEL_TRACES_SAMPLER and _ARG, which `settings` checked;
    # each exporter reads its endpoint, headers and timeout from the OTEL_EXPORTER_OTLP_* variables.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    TRACER = provider.get_tracer("luftpause")
    sampled = wanted.sampler + (f" {wanted.ratio:g}" if wanted.ratio is not None else "")
    log.info("tracing: exporting spans of %s over OTLP %s to %s, sampler %s", name, wanted.protocol,
             wanted.endpoint, sampled)  # fmt: skip
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
