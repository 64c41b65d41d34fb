"""OTLP exporters from the flags and the standard OTEL_* variables: which protocol, which
endpoint, whether a signal is exported at all. Used by traces (tracing.py), logs
(log_export.py) and metrics (otlp_metrics.py); imports nothing of theirs."""

from __future__ import annotations

import os
from typing import Any

from otel_engine.config import ObservabilityConfig

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"


def resolve_protocol(config: ObservabilityConfig, signal: str) -> str:
    """The flag, else `OTEL_EXPORTER_OTLP_{SIGNAL}_PROTOCOL`, else `..._PROTOCOL`, else grpc."""
    protocol = (
        config.otlp_protocol
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or DEFAULT_PROTOCOL
    ).strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return protocol


def is_enabled(config: ObservabilityConfig, signal: str) -> bool:
    """True when an endpoint is configured for `signal` and no variable turns export off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        config.otlp_endpoint
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _flag_endpoint(config: ObservabilityConfig, signal: str, protocol: str) -> str | None:
    endpoint = config.otlp_endpoint
    if not endpoint:
        return None
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if protocol == "grpc":
        return endpoint
    return f"{endpoint.rstrip('/')}/v1/{signal}"


def make_exporter(config: ObservabilityConfig, signal: str) -> Any:
    """An OTLP exporter for "traces", "logs" or "metrics"; the SDK reads the OTEL_* variables."""
    protocol = resolve_protocol(config, signal)
    endpoint = _flag_endpoint(config, signal, protocol)
    if protocol == "grpc":
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint)
        if signal == "logs":
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

            return OTLPLogExporter(endpoint=endpoint)
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint)
    if signal == "traces":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Span

        return Span(endpoint=endpoint)
    if signal == "logs":
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as Log

        return Log(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Metric

    return Metric(endpoint=endpoint)
