"""OTLP exporters from the flags and the standard OTEL_* variables: which protocol, which
endpoint, whether a signal is exported at all, and what could not be exported. Used by traces
(tracing.py), logs (log_export.py) and metrics (otlp_metrics.py); imports nothing of theirs.

Every exporter is wrapped (`_Counted`) so that an export that fails (after the SDK's retries)
is counted per signal (`export_failures`; the api_server shows its own as
`otel_engine_telemetry_export_failures_total{signal}`) and logged once per signal
(`telemetry.export_failed`); the SDK's own warning per retry is let through once per logger
(`RepeatFilter`), so that a collector that is down does not flood the logs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from otel_engine.config import ObservabilityConfig, OtlpProtocol

logger = logging.getLogger(__name__)

SIGNALS = ("traces", "metrics", "logs")
# The SDK's exporter loggers: a warning per retry while the collector is unreachable.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._log_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.sdk._shared_internal",
)

_failures = dict.fromkeys(SIGNALS, 0)
_listeners: list[Callable[[str], None]] = []
_lock = threading.Lock()


def export_failures() -> dict[str, int]:
    """Exports of this process that failed (after the SDK's retries), by signal."""
    with _lock:
        return dict(_failures)


def on_export_failure(listener: Callable[[str], None]) -> None:
    """Call `listener(signal)` on every failed export of this process (the metrics)."""
    _listeners.append(listener)


def _failed(signal: str) -> None:
    with _lock:
        _failures[signal] += 1
        first = _failures[signal] == 1
    if first:
        logger.warning("telemetry.export_failed", extra={"signal": signal})
    for listener in _listeners:
        listener(signal)


class _Counted:
    """An SDK exporter whose failed exports are counted; everything else is the exporter's."""

    def __init__(self, inner: Any, signal: str) -> None:
        self._inner = inner
        self._signal = signal

    def export(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self._inner.export(batch, *args, **kwargs)
        except Exception:
            _failed(self._signal)
            raise
        if getattr(result, "name", "") == "FAILURE":
            _failed(self._signal)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RepeatFilter(logging.Filter):
    """Lets the first record of each logger through and drops the repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in self.seen:
            return False
        self.seen.add(record.name)
        return True


_REPEATS = RepeatFilter()


def quiet_exporter_loggers() -> None:
    """One line per SDK exporter logger per process, however long the collector is down."""
    for name in EXPORTER_LOGGERS:
        exporter_logger = logging.getLogger(name)
        if _REPEATS not in exporter_logger.filters:
            exporter_logger.addFilter(_REPEATS)


def resolve_protocol(config: ObservabilityConfig, signal: str) -> OtlpProtocol:
    """The flag, else `OTEL_EXPORTER_OTLP_{SIGNAL}_PROTOCOL`, else `..._PROTOCOL`, else grpc."""
    protocol = (
        config.otlp_protocol
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or OtlpProtocol.GRPC
    ).strip()
    if protocol not in {p.value for p in OtlpProtocol}:
        raise ValueError(
            f"OTLP protocol must be one of {', '.join(OtlpProtocol)}, got {protocol!r}"
        )
    return OtlpProtocol(protocol)


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


def _flag_endpoint(config: ObservabilityConfig, signal: str, protocol: OtlpProtocol) -> str | None:
    endpoint = config.otlp_endpoint
    if not endpoint:
        return None
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if protocol is OtlpProtocol.GRPC:
        return endpoint
    return f"{endpoint.rstrip('/')}/v1/{signal}"


def make_exporter(config: ObservabilityConfig, signal: str) -> Any:
    """An OTLP exporter for "traces", "logs" or "metrics" (the SDK reads the OTEL_*
    variables), its failed exports counted."""
    quiet_exporter_loggers()
    return _Counted(_make_exporter(config, signal), signal)


def _make_exporter(config: ObservabilityConfig, signal: str) -> Any:
    protocol = resolve_protocol(config, signal)
    endpoint = _flag_endpoint(config, signal, protocol)
    if protocol is OtlpProtocol.GRPC:
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
