"""Per-process OpenTelemetry: tracer provider, OTLP exporters, W3C context across IPC.

Every process builds its own providers after it starts (never inherited). The resource
says which process it is: `service.name` (default `otel-engine`; `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES` win), `service.version`, `service.instance.id` (one per engine
instance), `process.pid`, `otel_engine.process.role`, `otel_engine.worker.rank`.

Export is OTLP over gRPC (the default) or HTTP/protobuf. The `--otlp-endpoint` flag is a
base URL (HTTP appends `/v1/traces`, `/v1/logs`, `/v1/metrics`); without it the SDK reads
the standard variables itself (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, headers, timeout,
compression, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`). With no endpoint at all no provider is
installed: the API's no-op tracer costs next to nothing and no exporter thread runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.trace import Link
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_engine.config import ObservabilityConfig
from otel_engine.observability.otlp_export import export_failures, is_enabled, make_exporter
from otel_engine.timing import FLUSH_WHEN_FAILING_S
from otel_engine.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "otel-engine"
ROLE_KEY = "otel_engine.process.role"
RANK_KEY = "otel_engine.worker.rank"
TRACER_NAME = "otel_engine"

_W3C = TraceContextTextMapPropagator()
_CLOSERS: list[tuple[str, Callable[[float], None]]] = []
_ATEXIT_REGISTERED = False


def build_resource(role: str, rank: int | None, instance_id: str | None) -> Resource:
    """This process's resource; the OTEL_* variables win over the service.* defaults."""
    defaults: dict[str, Any] = {
        "service.name": DEFAULT_SERVICE_NAME,
        "service.version": __version__,
    }
    if instance_id:
        defaults["service.instance.id"] = instance_id
    own: dict[str, Any] = {"process.pid": os.getpid(), ROLE_KEY: role}
    if rank is not None:
        own[RANK_KEY] = rank
    from_env = OTELResourceDetector().detect().attributes
    return Resource.create({**defaults, **from_env, **own})


def register_closer(name: str, close: Callable[[float], None]) -> None:
    """Run `close(deadline)` in `shutdown_telemetry`; `deadline` is a time.monotonic() value."""
    global _ATEXIT_REGISTERED
    _CLOSERS.append((name, close))
    if not _ATEXIT_REGISTERED:
        _ATEXIT_REGISTERED = True
        atexit.register(shutdown_telemetry)


def configure_tracing(
    *, role: str, rank: int | None, config: ObservabilityConfig, instance_id: str | None = None
) -> bool:
    """Install this process's tracer provider (and OTLP log export when `otlp_logs`).

    Returns True when spans are exported; False leaves the no-op tracer in place.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource: Resource | None = None
    if config.otlp_logs and is_enabled(config, "logs"):
        resource = build_resource(role, rank, instance_id)
        _configure_log_export(config, resource)
    if not is_enabled(config, "traces"):
        return False
    resource = resource or build_resource(role, rank, instance_id)
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(make_exporter(config, "traces")))
    trace.set_tracer_provider(provider)

    def close(deadline: float) -> None:
        provider.force_flush(max(1, int((deadline - time.monotonic()) * 1000)))
        provider.shutdown()

    register_closer("traces", close)
    return True


def _configure_log_export(config: ObservabilityConfig, resource: Resource) -> None:
    from otel_engine.observability.log_export import close_log_export, start_log_export

    provider, handler = start_log_export(config, resource)
    register_closer("logs", lambda deadline: close_log_export(provider, handler, deadline))


def shutdown_telemetry(timeout_s: float = 5.0) -> bool:
    """Flush and shut down every provider and exporter within `timeout_s`; idempotent.

    Returns False if the time ran out (what was left is dropped, never waited on longer).
    """
    closers = list(_CLOSERS)
    _CLOSERS.clear()
    if not closers:
        return True
    if any(export_failures().values()):  # the collector did not take the last exports
        timeout_s = min(timeout_s, FLUSH_WHEN_FAILING_S)
    deadline = time.monotonic() + timeout_s

    def run() -> None:
        for name, close in closers:
            try:
                close(deadline)
            except Exception:
                logger.warning("telemetry.shutdown_failed", extra={"signal": name}, exc_info=True)

    worker = threading.Thread(target=run, name="telemetry-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("telemetry.shutdown_timeout", extra={"timeout_s": timeout_s})
        return False
    return True


def get_tracer(name: str = TRACER_NAME) -> trace.Tracer:
    """A tracer from the current provider (the no-op one until a provider is installed)."""
    return trace.get_tracer(name, __version__)


def inject_context(context: Context | None = None) -> dict[str, str]:
    """W3C `traceparent`/`tracestate` of the current (or given) span, for IPC messages.

    Empty when no valid span is active, so messages stay small when tracing is off.
    """
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=context)
    return carrier


def extract_context(carrier: Mapping[str, str] | None) -> Context:
    """The context a carrier from `inject_context` (or an HTTP request) describes."""
    return _W3C.extract(carrier or {})


def link_from(carrier: Mapping[str, str] | None) -> Link | None:
    """A span link to the span a carrier describes (None if it holds no valid context)."""
    span_context = trace.get_current_span(extract_context(carrier)).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def is_tracing() -> bool:
    """True when this process exports spans (an SDK tracer provider is installed)."""
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(trace.get_tracer_provider(), TracerProvider)
