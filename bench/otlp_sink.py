"""An OTLP/HTTP trace sink for the benchmarks: takes `POST /v1/traces`, counts the spans, keeps nothing.

`luftpause bench proxy_overhead --tracing` points a traced luftpause arm's exporters here, so that
tracing costs what it would against a real collector on loopback, and reads `GET /count` after the
run to show that spans were exported (the arm's figures mean nothing if none were).

    python -m luftpause.bench.otlp_sink --port 4318
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class _Sink(BaseHTTPRequestHandler):
    spans = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (the http.server spelling)
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        with _Sink.lock:
            _Sink.spans += n
        self._answer(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

    def do_GET(self) -> None:  # noqa: N802
        if self.path != "/count":
            self._answer(404, b"only GET /count and POST /v1/traces here", "text/plain")
            return
        self._answer(200, json.dumps({"spans": _Sink.spans}).encode(), "application/json")

    def _answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.bench.otlp_sink", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    ThreadingHTTPServer(("127.0.0.1", args.port), _Sink).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
