"""A small OTLP trace receiver for the tests, over either protocol, decoded with `opentelemetry-proto`.

Over `http/protobuf` (the default) it answers `POST /v1/traces` on a free loopback port in a
thread of its own; over `grpc` it is a real gRPC server of the collector's TraceService
(`Export`), as a collector listens on 4317. Either way it keeps every span it is sent, with the
`service.name` of the resource that sent it; `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT must
say for the services' exporters to reach it (and `env` the variables, the protocol's among them).
"""

from __future__ import annotations

import gzip
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    error: bool


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self, protocol: str = "http/protobuf") -> None:
        self.protocol = protocol
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        receiver = self
        if protocol == "grpc":

            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(
                    self, request: ExportTraceServiceRequest, context: Any
                ) -> ExportTraceServiceResponse:  # noqa: N802 (the service's method)
                    receiver.take(request)
                    return ExportTraceServiceResponse()

            self._grpc = grpc.server(ThreadPoolExecutor(max_workers=4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
            self._grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
            return

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        port = self._grpc_port if self._grpc is not None else self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    @property
    def env(self) -> dict[str, str]:
        """The exporter variables that send a service's spans here, over this receiver's protocol."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": self.protocol}

    def take(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self._lock:
            self.spans.extend(got)

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        if self._grpc is not None:
            self._grpc.start()
        else:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
            return
        self._server.shutdown()
        self._server.server_close()
