"""The test OTLP receiver itself: real SDK exporters in, flattened spans out."""

from __future__ import annotations

import socket

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from otel_engine.config import ObservabilityConfig
from otel_engine.observability.otlp_export import make_exporter
from otel_engine.observability.tracing import build_resource
from tests.helpers.otlp_receiver import OtlpReceiver


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_receiver_decodes_every_span_field(protocol: str) -> None:
    """Parent, kind, attributes (all value types), events, links, status and resource."""
    with OtlpReceiver(protocol) as receiver:
        config = ObservabilityConfig(otlp_endpoint=receiver.endpoint, otlp_protocol=protocol)
        provider = TracerProvider(resource=build_resource("engine_core", None, "inst-r"))
        provider.add_span_processor(SimpleSpanProcessor(make_exporter(config, "traces")))
        tracer = provider.get_tracer("test")
        with (
            tracer.start_as_current_span("request", kind=SpanKind.SERVER) as parent,
            tracer.start_as_current_span(
                "step",
                attributes={"n": 3, "ratio": 0.5, "ok": True, "reasons": ["stop", "length"]},
                links=[Link(parent.get_span_context(), {"why": "batch"})],
            ) as child,
        ):
            child.add_event("otel_engine.crash", {"rank": 1})
            child.set_status(Status(StatusCode.ERROR, "boom"))
        provider.shutdown()
        spans = {span["name"]: span for span in receiver.spans()}
    request, step = spans["request"], spans["step"]
    assert ("SERVER", None) == (request["kind"], request["parent_span_id"])
    assert request["span_id"] == step["parent_span_id"]
    assert {"n": 3, "ratio": 0.5, "ok": True, "reasons": ["stop", "length"]} == step["attributes"]
    assert [("otel_engine.crash", {"rank": 1})] == [
        (e["name"], e["attributes"]) for e in step["events"]
    ]
    assert [(request["span_id"], {"why": "batch"})] == [
        (link["span_id"], link["attributes"]) for link in step["links"]
    ]
    assert {"code": "ERROR", "message": "boom"} == step["status"]
    assert "inst-r" == step["resource"]["service.instance.id"]


def test_receiver_keeps_raw_bytes() -> None:
    """Raw payloads are kept for byte-level searches (redaction canaries)."""
    with OtlpReceiver("http/protobuf") as receiver:
        config = ObservabilityConfig(otlp_endpoint=receiver.endpoint, otlp_protocol="http/protobuf")
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(make_exporter(config, "traces")))
        provider.get_tracer("test").start_span("marker-span-name").end()
        provider.shutdown()
        assert b"marker-span-name" in b"".join(receiver.raw["traces"])


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_receiver_stops_cleanly(protocol: str) -> None:
    """After the with block the port refuses connections and a second stop is harmless."""
    with OtlpReceiver(protocol) as receiver:
        port = receiver.port
    receiver.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
