"""The api_server's spans in-process: the HTTP server span middleware and the GenAI span's
failure paths, recorded by a private tracer provider (the global one stays untouched)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from otel_engine.entrypoints.network.http_tracing import HttpTracingMiddleware
from otel_engine.entrypoints.openai.request_telemetry import RequestTelemetry
from otel_engine.errors import EngineDeadError
from otel_engine.observability.metrics import EngineMetrics
from otel_engine.observability.tracing import inject_context
from otel_engine.outputs import CompletionOutput, RequestOutput
from otel_engine.sampling_params import SamplingParams

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[trace.Tracer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test")
    provider.shutdown()


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def _unavailable(request: Request) -> PlainTextResponse:
    return PlainTextResponse("no", status_code=503)


async def _boom(request: Request) -> PlainTextResponse:
    raise RuntimeError("boom")


APP = Starlette(
    routes=[
        Route("/v1/items/{item_id}", _ok),
        Route("/unavailable", _unavailable),
        Route("/boom", _boom),
        Route("/health", _ok),
    ]
)


def _get(app: Any, path: str, headers: dict[str, str] | None = None) -> int:
    async def call() -> int:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api:8000") as client:
            return (await client.get(path, headers=headers)).status_code

    return asyncio.run(call())


def _one(exporter: InMemorySpanExporter) -> ReadableSpan:
    [span] = exporter.get_finished_spans()
    return span


def test_span_is_named_after_the_route_template(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """`GET /v1/items/{item_id}`, a SERVER span with route, path, status and server address."""
    _get(HttpTracingMiddleware(APP, enabled=True, tracer=tracer), "/v1/items/42")
    span = _one(exporter)

    assert ("GET /v1/items/{item_id}", trace.SpanKind.SERVER) == (span.name, span.kind)
    assert {
        "http.route": "/v1/items/{item_id}",
        "url.path": "/v1/items/42",
        "http.response.status_code": 200,
        "server.address": "api",
        "server.port": 8000,
    }.items() <= dict(span.attributes or {}).items()
    assert StatusCode.UNSET == span.status.status_code


def test_client_traceparent_is_the_parent(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """The client's trace id and span id become the span's trace and parent."""
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    app = HttpTracingMiddleware(APP, enabled=True, tracer=tracer)
    _get(app, "/v1/items/1", {"traceparent": traceparent})
    span = _one(exporter)

    assert span.parent is not None
    assert (CLIENT_TRACE_ID, CLIENT_SPAN_ID) == (
        format(span.context.trace_id, "032x"),
        format(span.parent.span_id, "016x"),
    )


def test_client_error_leaves_status_unset(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """A 404 (no route matched): named after the method only, status UNSET, no error.type."""
    assert 404 == _get(HttpTracingMiddleware(APP, enabled=True, tracer=tracer), "/nope")
    span = _one(exporter)

    assert ("GET", StatusCode.UNSET) == (span.name, span.status.status_code)
    assert "error.type" not in (span.attributes or {})


def test_server_error_response_is_an_error(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """A 503 answer: status ERROR, error.type "503"."""
    _get(HttpTracingMiddleware(APP, enabled=True, tracer=tracer), "/unavailable")
    span = _one(exporter)

    assert StatusCode.ERROR == span.status.status_code
    assert "503" == (span.attributes or {})["error.type"]


def test_exception_is_an_error_named_by_its_class(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """An exception in the app: status ERROR, error.type the class, an `exception` event."""
    assert 500 == _get(HttpTracingMiddleware(APP, enabled=True, tracer=tracer), "/boom")
    span = _one(exporter)

    assert StatusCode.ERROR == span.status.status_code
    assert ("RuntimeError", 500) == (
        (span.attributes or {})["error.type"],
        (span.attributes or {})["http.response.status_code"],
    )
    assert ["exception"] == [event.name for event in span.events]


def test_probes_and_disabled_tracing_make_no_span(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """GET /health is not traced; with tracing off the middleware passes everything through."""
    _get(HttpTracingMiddleware(APP, enabled=True, tracer=tracer), "/health")
    _get(HttpTracingMiddleware(APP, enabled=False, tracer=tracer), "/v1/items/1")

    assert () == tuple(exporter.get_finished_spans())


def _telemetry(tracer: trace.Tracer, metrics: EngineMetrics) -> RequestTelemetry:
    return RequestTelemetry(
        metrics,
        request_id="cmpl-1",
        operation="text_completion",
        request_model="tiny",
        response_model="tiny",
        params=SamplingParams(max_tokens=8, stop=("SECRET-STOP",)),
        num_prompt_tokens=5,
        is_stream=True,
        tracer=tracer,
    )


def test_client_abort_is_error_type_aborted_with_status_unset(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """A client that went away: error.type "aborted", status UNSET, counted as an error."""
    metrics = EngineMetrics()
    _telemetry(tracer, metrics).abort(num_generated=3)
    span = _one(exporter)

    assert ("aborted", StatusCode.UNSET) == (
        (span.attributes or {})["error.type"],
        span.status.status_code,
    )
    assert 1 == metrics.registry.get_sample_value(
        "otel_engine_request_errors_total", {"error_type": "aborted"}
    )
    assert 3 == metrics.registry.get_sample_value("otel_engine_generation_tokens_total")


def test_engine_failure_links_the_request_span_to_the_crash_span(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """Engine death: status ERROR, error.type the cause class, an exception event, and a link
    to the span that `EngineDeadError.crash_context` names."""
    crash_span = tracer.start_span("engine_core.step")
    crash_span.end()
    error = EngineDeadError(
        "the engine failed in worker-1: InjectedFault: boom",
        cause_type="InjectedFault",
        crash_context=inject_context(trace.set_span_in_context(crash_span)),
    )
    telemetry = _telemetry(tracer, EngineMetrics())

    telemetry.fail(
        "engine_dead",
        status=500,
        exc=error,
        span_error_type=error.cause_type,
        crash_context=error.crash_context,
    )
    span = exporter.get_finished_spans()[-1]

    assert (StatusCode.ERROR, "InjectedFault") == (
        span.status.status_code,
        (span.attributes or {})["error.type"],
    )
    assert ["exception"] == [event.name for event in span.events]
    assert [crash_span.get_span_context().span_id] == [link.context.span_id for link in span.links]


def test_preemption_adds_an_event_and_the_span_ends_once(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    """A grown preemption count adds one `preempted` event; a later fail() after finish()
    changes nothing."""
    telemetry = _telemetry(tracer, EngineMetrics())
    output = RequestOutput("cmpl-1", [1, 2, 3, 4, 5], [CompletionOutput(token_ids=[7])], metrics={})
    output.metrics.update(arrival_time=100.0, first_token_time=100.5, num_preemptions=0)
    telemetry.first_output(output)
    output.metrics.update(num_preemptions=1, finished_time=101.0)
    telemetry.observe(output)
    telemetry.finish("length", 2, output.metrics)
    telemetry.fail("engine_dead", status=500)
    span = _one(exporter)

    assert [
        "otel_engine.request.queued",
        "otel_engine.request.first_token",
        "otel_engine.request.preempted",
        "otel_engine.request.finished",
    ] == [event.name for event in span.events]
    assert StatusCode.UNSET == span.status.status_code
    assert "SECRET-STOP" not in repr(span.to_json())
