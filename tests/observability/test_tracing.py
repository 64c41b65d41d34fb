"""Tracing: per-process providers exported over OTLP, the no-op default, W3C context for IPC."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import otel_engine
from otel_engine.config import ObservabilityConfig
from otel_engine.observability.otlp_export import is_enabled, resolve_protocol
from otel_engine.observability.tracing import (
    build_resource,
    configure_tracing,
    extract_context,
    inject_context,
    link_from,
)
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.observability.conftest import RunPython, json_lines

EXPORT_SCRIPT = """
import json, os
from otel_engine.observability.setup import setup_process
from otel_engine.observability.tracing import get_tracer, shutdown_telemetry

exported = setup_process(role="worker", rank=3)
with get_tracer().start_as_current_span("otel_engine.execute") as span:
    span.add_event("scheduled", {"num_seqs": 2})
print(json.dumps({"exported": exported, "pid": os.getpid()}), flush=True)
assert shutdown_telemetry(10)
"""


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* variable of the test runner leaks into an in-process check."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)


def run_export(run_python: RunPython, receiver: OtlpReceiver, **env: str) -> dict:
    done = run_python(EXPORT_SCRIPT, env={"OTEL_ENGINE_INSTANCE_ID": "engine-abc", **env})
    assert 0 == done.returncode, done.stderr
    json_lines(done.stderr)
    return json.loads(done.stdout)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_the_receiver_with_the_resource(run_python: RunPython, protocol: str) -> None:
    """OTEL_EXPORTER_OTLP_* -> the span arrives with every documented resource attribute."""
    with OtlpReceiver(protocol) as receiver:
        info = run_export(run_python, receiver, **receiver.env())
        spans = receiver.wait_for(lambda r: r.spans())
    assert info["exported"]
    assert ["otel_engine.execute"] == [span["name"] for span in spans]
    assert "scheduled" == spans[0]["events"][0]["name"]
    resource = spans[0]["resource"]
    assert {
        "service.name": "otel-engine",
        "service.version": otel_engine.__version__,
        "service.instance.id": "engine-abc",
        "process.pid": info["pid"],
        "otel_engine.process.role": "worker",
        "otel_engine.worker.rank": 3,
    }.items() <= resource.items()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_flag_endpoint_without_otel_variables(run_python: RunPython, protocol: str) -> None:
    """--otlp-endpoint/--otlp-protocol (as exported to children) work with no OTEL_* set;
    a bare host:port is accepted."""
    with OtlpReceiver(protocol) as receiver:
        endpoint = f"127.0.0.1:{receiver.port}"
        env = {"OTEL_ENGINE_OTLP_ENDPOINT": endpoint, "OTEL_ENGINE_OTLP_PROTOCOL": protocol}
        run_export(run_python, receiver, **env)
        assert receiver.wait_for(lambda r: r.spans())


def test_otel_service_name_and_resource_attributes_win(run_python: RunPython) -> None:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the defaults."""
    with OtlpReceiver("grpc") as receiver:
        env = {
            **receiver.env(),
            "OTEL_SERVICE_NAME": "llm-prod",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=staging",
        }
        run_export(run_python, receiver, **env)
        resource = receiver.wait_for(lambda r: r.spans())[0]["resource"]
    assert ("llm-prod", "staging") == (
        resource["service.name"],
        resource["deployment.environment.name"],
    )


def test_log_records_are_exported_with_span_context(run_python: RunPython) -> None:
    """With otlp_logs, log records reach the receiver tied to the active span, redacted."""
    code = """
import logging
from otel_engine.observability.setup import setup_process
from otel_engine.observability.tracing import get_tracer, shutdown_telemetry
setup_process(role="engine_core")
with get_tracer().start_as_current_span("step") as span:
    print(format(span.get_span_context().trace_id, "032x"), flush=True)
    logging.getLogger("otel_engine.engine").warning(
        "engine.slow_step", extra={"step": 4, "prompt": "CANARY-otlp-log"})
assert shutdown_telemetry(10)
"""
    with OtlpReceiver("grpc") as receiver:
        done = run_python(code, env={**receiver.env(), "OTEL_ENGINE_OTLP_LOGS": "1"})
        assert 0 == done.returncode, done.stderr
        records = receiver.wait_for(
            lambda r: [x for x in r.log_records() if x["body"] == "engine.slow_step"]
        )
        raw = b"".join(receiver.raw["logs"])
    assert 1 == len(records)
    record = records[0]
    assert done.stdout.strip() == record["trace_id"]
    assert ("WARNING", 4, "engine_core") == (
        record["severity_text"],
        record["attributes"]["step"],
        record["attributes"]["role"],
    )
    assert b"CANARY-otlp-log" not in raw


def test_shutdown_is_bounded_when_the_collector_hangs(run_python: RunPython) -> None:
    """A collector that accepts but never answers cannot hold shutdown past its timeout."""
    code = """
import time
from otel_engine.observability.setup import setup_process
from otel_engine.observability.tracing import get_tracer, shutdown_telemetry
setup_process(role="api_server")
get_tracer().start_span("lost").end()
started = time.monotonic()
flushed = shutdown_telemetry(1.0)
print(flushed, round(time.monotonic() - started, 2), flush=True)
"""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        done = run_python(
            code,
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            timeout=60,
        )
    assert 0 == done.returncode, done.stderr
    flushed, seconds = done.stdout.split()
    assert "False" == flushed
    assert float(seconds) < 2.0


def test_no_endpoint_means_no_provider_and_no_thread(clean_otel_env: None) -> None:
    """Without an endpoint nothing is installed: no provider, no exporter thread."""
    threads = set(threading.enumerate())
    provider = trace.get_tracer_provider()
    assert not configure_tracing(role="engine_core", rank=None, config=ObservabilityConfig())
    assert set() == set(threading.enumerate()) - threads
    assert provider is trace.get_tracer_provider()


def test_otel_variables_can_turn_export_off(
    clean_otel_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_SDK_DISABLED and OTEL_TRACES_EXPORTER=none win over a configured endpoint."""
    config = ObservabilityConfig(otlp_endpoint="http://127.0.0.1:4317")
    assert is_enabled(config, "traces")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not is_enabled(config, "traces")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not is_enabled(config, "traces")


def test_protocol_resolution_order(clean_otel_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flag, then the per-signal variable, then the general one, then grpc."""
    assert "grpc" == resolve_protocol(ObservabilityConfig(), "traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert "http/protobuf" == resolve_protocol(ObservabilityConfig(), "traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert "grpc" == resolve_protocol(ObservabilityConfig(), "traces")
    assert "http/protobuf" == resolve_protocol(ObservabilityConfig(), "logs")
    flagged = ObservabilityConfig(otlp_protocol="http/protobuf")
    assert "http/protobuf" == resolve_protocol(flagged, "traces")


def test_unsupported_protocol_is_rejected(
    clean_otel_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """http/json (not supported) fails loudly instead of exporting nothing."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        resolve_protocol(ObservabilityConfig(), "traces")


def test_resource_has_rank_only_for_workers(clean_otel_env: None) -> None:
    """otel_engine.worker.rank is set for workers and absent for the other roles."""
    assert 2 == build_resource("worker", 2, "i").attributes["otel_engine.worker.rank"]
    assert "otel_engine.worker.rank" not in build_resource("engine_core", None, "i").attributes


def test_inject_extract_round_trip() -> None:
    """inject_context() -> extract_context() yields the same span as parent, tracestate kept."""
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        carrier = inject_context()
    expected = span.get_span_context()
    assert carrier["traceparent"].startswith(
        f"00-{expected.trace_id:032x}-{expected.span_id:016x}-"
    )
    carrier["tracestate"] = "vendor=abc"
    context = extract_context(carrier)
    parent = trace.get_current_span(context).get_span_context()
    assert (expected.trace_id, expected.span_id) == (parent.trace_id, parent.span_id)
    assert "abc" == parent.trace_state.get("vendor")
    child = tracer.start_span("step", context=context)
    assert expected.span_id == child.parent.span_id


def test_inject_is_empty_without_a_span() -> None:
    """No active span -> an empty carrier (IPC messages stay small when tracing is off)."""
    assert {} == inject_context()
    assert not trace.get_current_span(extract_context(None)).get_span_context().is_valid


def test_link_from_a_carrier_without_context_is_none() -> None:
    """A step links to each request span of its batch; requests without context give none."""
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("a"):
        carrier = inject_context()
    link = link_from(carrier)

    assert link is not None
    assert int(carrier["traceparent"].split("-")[2], 16) == link.context.span_id
    assert link_from({}) is None
    assert link_from(None) is None
