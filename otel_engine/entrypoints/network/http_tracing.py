"""The HTTP server span: one SERVER span per request, following the HTTP conventions.

`HttpTracingMiddleware` is the outermost middleware of the app. The client's W3C
`traceparent`/`tracestate` are the parent; the span is current while the app runs (so the
GenAI span, the log lines and the IPC context of the request join the client's trace) and is
named `{method} {route}` once routing has chosen a route. 5xx responses and exceptions end
it with status ERROR and `error.type`; 4xx leave the status unset (a client's error is not
the server's). Probes (`/health`, `/metrics`) are not traced. With tracing off the
middleware is a plain pass-through.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from otel_engine.entrypoints.network.errors import is_server_error
from otel_engine.observability.tracing import extract_context, get_tracer, is_tracing

UNTRACED_PATHS = frozenset({"/health", "/health/live", "/metrics"})
KNOWN_METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"}
)
_PROPAGATION_HEADERS = (b"traceparent", b"tracestate")


class HttpTracingMiddleware:
    """Wraps every HTTP request but the probes in a SERVER span (when tracing is on)."""

    def __init__(
        self, app: ASGIApp, *, enabled: bool | None = None, tracer: trace.Tracer | None = None
    ) -> None:
        self.app = app
        self.enabled = is_tracing() if enabled is None else enabled
        self.tracer = tracer or get_tracer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in _PROPAGATION_HEADERS
        }
        method = scope["method"]
        span = self.tracer.start_span(
            method if method in KNOWN_METHODS else "HTTP",
            context=extract_context(carrier) if carrier else None,
            kind=SpanKind.SERVER,
            attributes=request_attributes(scope),
        )
        status: list[int] = []
        error_type: str | None = None

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        token = context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.record_exception(exc)
            error_type = type(exc).__qualname__
            if not status:
                status.append(HTTPStatus.INTERNAL_SERVER_ERROR)
            raise
        finally:
            context.detach(token)
            _finish(span, scope, status[0] if status else None, error_type)
            span.end()


def request_attributes(scope: Scope) -> dict[str, Any]:
    """The HTTP semantic-convention attributes known when the request arrives."""
    method = scope["method"]
    attributes: dict[str, Any] = {
        "http.request.method": method if method in KNOWN_METHODS else "_OTHER",
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": scope.get("http_version", "1.1"),
    }
    if method not in KNOWN_METHODS:
        attributes["http.request.method_original"] = method
    host = ""
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1")
        elif name == b"user-agent":
            attributes["user_agent.original"] = value.decode("latin-1")
    server = scope.get("server") or (None, None)
    address, _, port = host.rpartition(":")
    if not port.isdigit():
        address, port = host, ""
    server_address = address.strip("[]") or server[0]
    if server_address:
        attributes["server.address"] = server_address
    if port or server[1] is not None:
        attributes["server.port"] = int(port) if port else server[1]
    client = scope.get("client")
    if client:
        attributes["client.address"] = client[0]
    return attributes


def _finish(span: Any, scope: Scope, status: int | None, error_type: str | None) -> None:
    """Route, status code and, for 5xx or an exception, status ERROR with `error.type`."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        span.set_attribute("http.route", path)
        span.update_name(f"{scope['method']} {path}")
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if is_server_error(status) and error_type is None:
            error_type = str(status)
    if error_type is not None:
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR))
