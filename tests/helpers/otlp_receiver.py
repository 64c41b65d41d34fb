"""A real OTLP receiver for tests: gRPC (grpcio + the opentelemetry-proto services) or
HTTP/protobuf (http.server), on 127.0.0.1 with a free port.

It keeps every decoded export request and its raw bytes, per signal ("traces", "logs",
"metrics"), and flattens them into plain dicts for assertions:

    with OtlpReceiver("grpc") as receiver:
        env = receiver.env()   # OTEL_EXPORTER_OTLP_* for a child process
        ...
        receiver.wait_for(lambda r: r.spans(), timeout=10)
        span = receiver.spans()[0]   # name, trace_id, span_id, parent_span_id, attributes, ...
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, ClassVar

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SIGNALS: dict[str, tuple[Any, Any]] = {
    "traces": (
        trace_service_pb2.ExportTraceServiceRequest,
        trace_service_pb2.ExportTraceServiceResponse,
    ),
    "logs": (logs_service_pb2.ExportLogsServiceRequest, logs_service_pb2.ExportLogsServiceResponse),
    "metrics": (
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
}
STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}
SPAN_KINDS = {
    0: "UNSPECIFIED",
    1: "INTERNAL",
    2: "SERVER",
    3: "CLIENT",
    4: "PRODUCER",
    5: "CONSUMER",
}


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as a plain Python value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in key_values}


def _hex(data: bytes) -> str | None:
    return data.hex() if data else None


class OtlpReceiver:
    """Receives OTLP over `protocol` ("grpc" or "http/protobuf") until the `with` ends."""

    def __init__(self, protocol: str = "grpc") -> None:
        if protocol not in ("grpc", "http/protobuf"):
            raise ValueError(f"unknown OTLP protocol {protocol!r}")
        self.protocol = protocol
        self.requests: dict[str, list[Any]] = {signal: [] for signal in SIGNALS}
        self.raw: dict[str, list[bytes]] = {signal: [] for signal in SIGNALS}
        self.headers: list[dict[str, str]] = []
        self._changed = threading.Condition()
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        """The base URL an exporter needs (HTTP exporters append /v1/<signal>)."""
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard variables that point an OTel SDK at this receiver."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": self.protocol,
        }

    def record(self, signal: str, raw: bytes, headers: dict[str, str]) -> Any:
        request_type, response_type = SIGNALS[signal]
        message = request_type.FromString(raw)
        with self._changed:
            self.requests[signal].append(message)
            self.raw[signal].append(raw)
            self.headers.append(headers)
            self._changed.notify_all()
        return response_type()

    def wait_for(self, predicate: Callable[[OtlpReceiver], Any], timeout: float = 10.0) -> Any:
        """Wait until `predicate(self)` is truthy; return its last value (falsy on timeout)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = predicate(self)
                remaining = deadline - time.monotonic()
                if result or remaining <= 0:
                    return result
                self._changed.wait(min(remaining, 0.2))

    def spans(self) -> list[dict[str, Any]]:
        """Every span received, flattened, with its resource's attributes."""
        result = []
        for request in list(self.requests["traces"]):
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        result.append(self._span(span, resource, scope_spans.scope.name))
        return result

    @staticmethod
    def _span(span: Any, resource: dict[str, Any], scope: str) -> dict[str, Any]:
        return {
            "name": span.name,
            "kind": SPAN_KINDS.get(span.kind, str(span.kind)),
            "trace_id": span.trace_id.hex(),
            "span_id": span.span_id.hex(),
            "parent_span_id": _hex(span.parent_span_id),
            "trace_state": span.trace_state,
            "start_time_unix_nano": span.start_time_unix_nano,
            "end_time_unix_nano": span.end_time_unix_nano,
            "attributes": attributes(span.attributes),
            "events": [
                {
                    "name": e.name,
                    "time_unix_nano": e.time_unix_nano,
                    "attributes": attributes(e.attributes),
                }
                for e in span.events
            ],
            "links": [
                {
                    "trace_id": link.trace_id.hex(),
                    "span_id": link.span_id.hex(),
                    "attributes": attributes(link.attributes),
                }
                for link in span.links
            ],
            "status": {
                "code": STATUS_CODES.get(span.status.code, str(span.status.code)),
                "message": span.status.message,
            },
            "resource": resource,
            "scope": scope,
        }

    def log_records(self) -> list[dict[str, Any]]:
        """Every log record received, flattened, with its resource's attributes."""
        result = []
        for request in list(self.requests["logs"]):
            for resource_logs in request.resource_logs:
                resource = attributes(resource_logs.resource.attributes)
                for scope_logs in resource_logs.scope_logs:
                    for log in scope_logs.log_records:
                        result.append(
                            {
                                "body": any_value(log.body),
                                "severity_text": log.severity_text,
                                "severity_number": log.severity_number,
                                "trace_id": _hex(log.trace_id),
                                "span_id": _hex(log.span_id),
                                "attributes": attributes(log.attributes),
                                "resource": resource,
                                "scope": scope_logs.scope.name,
                            }
                        )
        return result

    def metrics(self) -> list[dict[str, Any]]:
        """Every metric received (latest export last): name, kind, unit, points, resource."""
        result = []
        for request in list(self.requests["metrics"]):
            for resource_metrics in request.resource_metrics:
                resource = attributes(resource_metrics.resource.attributes)
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        kind = metric.WhichOneof("data")
                        data = getattr(metric, kind)
                        points = [self._point(kind, p) for p in data.data_points]
                        result.append(
                            {
                                "name": metric.name,
                                "kind": kind,
                                "unit": metric.unit,
                                "points": points,
                                "resource": resource,
                            }
                        )
        return result

    @staticmethod
    def _point(kind: str, point: Any) -> dict[str, Any]:
        values = {"attributes": attributes(point.attributes)}
        if kind == "histogram":
            values.update(
                count=point.count,
                sum=point.sum,
                bucket_counts=list(point.bucket_counts),
                explicit_bounds=list(point.explicit_bounds),
            )
        else:
            values["value"] = getattr(point, point.WhichOneof("value"))
        return values

    def __enter__(self) -> OtlpReceiver:
        if self.protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving and join the server threads."""
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            assert self._http_thread is not None
            self._http_thread.join(5)
            self._http = None

    def _start_grpc(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_LogsService(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._grpc = server

    def _start_http(self) -> None:
        receiver = self

        class Handler(_HttpHandler):
            owner = receiver

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._http_thread = threading.Thread(
            target=self._http.serve_forever, name="otlp-http-receiver", daemon=True
        )
        self._http_thread.start()


def _grpc_headers(context: grpc.ServicerContext) -> dict[str, str]:
    return {key: str(value) for key, value in context.invocation_metadata()}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, owner: OtlpReceiver) -> None:
        self.owner = owner

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.owner.record("traces", request.SerializeToString(), _grpc_headers(context))


class _LogsService(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, owner: OtlpReceiver) -> None:
        self.owner = owner

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.owner.record("logs", request.SerializeToString(), _grpc_headers(context))


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, owner: OtlpReceiver) -> None:
        self.owner = owner

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.owner.record("metrics", request.SerializeToString(), _grpc_headers(context))


class _HttpHandler(BaseHTTPRequestHandler):
    owner: OtlpReceiver
    paths: ClassVar[dict[str, str]] = {
        "/v1/traces": "traces",
        "/v1/logs": "logs",
        "/v1/metrics": "metrics",
    }

    def do_POST(self) -> None:
        signal = self.paths.get(self.path)
        if signal is None:
            self.send_error(404)
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        response = self.owner.record(signal, body, dict(self.headers.items()))
        payload = response.SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read the decoded requests, not an access log."""
