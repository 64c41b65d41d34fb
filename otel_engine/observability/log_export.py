"""Optional OTLP export of log records (`otlp_logs`), fed by the same processors as stderr.

`start_log_export()` adds an `OtlpLogHandler` to the root logger next to the stderr
handler. Each record goes through this process's shared processors (so redaction, `role`,
`rank` and `request_id` apply), then becomes an OTLP log record: body = `event`, the other
fields as attributes, severity from the stdlib level, and the active span context (trace
and span ids) from the calling thread.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from opentelemetry import context
from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk.resources import Resource

from otel_engine.config import ObservabilityConfig
from otel_engine.observability.log_render import (
    EventDict,
    PipelineFormatter,
    Processor,
    structure_exception,
)
from otel_engine.observability.logging import add_root_handler, current_processors
from otel_engine.observability.otlp_export import make_exporter

_SEVERITY = {
    logging.DEBUG: 5,
    logging.INFO: 9,
    logging.WARNING: 13,
    logging.ERROR: 17,
    logging.CRITICAL: 21,
}
_OWN_LOGGERS = ("opentelemetry", "grpc", "urllib3")
_NOT_ATTRIBUTES = ("timestamp", "level", "trace_id", "span_id")


class OtlpLogHandler(logging.Handler):
    """Sends records to an OTel `LoggerProvider`; the exporters' own loggers are left out."""

    def __init__(self, logger_provider: Any, chain: list[Processor]) -> None:
        super().__init__()
        self._provider = logger_provider
        self._loggers: dict[str, Any] = {}
        self.setFormatter(PipelineFormatter(chain, [self._emit]))
        self.addFilter(lambda record: not record.name.startswith(_OWN_LOGGERS))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.format(record)
        except Exception:
            self.handleError(record)

    def _emit(self, logger: Any, method: str, event_dict: EventDict) -> str:
        record: logging.LogRecord = event_dict.pop("_record")
        event_dict.pop("_from_structlog", None)
        structure_exception(logger, method, event_dict)
        body = str(event_dict.pop("event", ""))
        for key in _NOT_ATTRIBUTES:
            event_dict.pop(key, None)
        otel_logger = self._loggers.get(record.name)
        if otel_logger is None:
            otel_logger = self._loggers[record.name] = self._provider.get_logger(record.name)
        otel_logger.emit(
            timestamp=int(record.created * 1e9),
            context=context.get_current(),
            severity_number=SeverityNumber(_SEVERITY.get(record.levelno, 9)),
            severity_text=record.levelname,
            body=body,
            attributes=otlp_attributes(event_dict),
        )
        return ""


def otlp_attributes(event_dict: EventDict) -> dict[str, Any]:
    """Event fields as OTLP attributes: primitives as they are, the rest as JSON text."""
    attributes: dict[str, Any] = {}
    for key, value in event_dict.items():
        if value is None:
            continue
        if key == "exception" and isinstance(value, dict):
            attributes["exception.type"] = value.get("type", "")
            attributes["exception.message"] = value.get("message", "")
            attributes["exception.stacktrace"] = "".join(
                f'  File "{f["filename"]}", line {f["lineno"]}, in {f["name"]}\n'
                for f in value.get("frames", ())
            )
        elif isinstance(value, str | bool | int | float):
            attributes[key] = value
        else:
            attributes[key] = json.dumps(value, default=repr)
    return attributes


def start_log_export(config: ObservabilityConfig, resource: Resource) -> tuple[Any, OtlpLogHandler]:
    """A LoggerProvider exporting over OTLP and its handler, attached to the root logger.

    Returns (provider, handler); `close_log_export` flushes and detaches them.
    """
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_log_record_processor(BatchLogRecordProcessor(make_exporter(config, "logs")))
    handler = OtlpLogHandler(provider, current_processors())
    add_root_handler(handler)
    return provider, handler


def close_log_export(provider: Any, handler: logging.Handler, deadline: float) -> None:
    """Detach the handler, then flush and shut the provider down by `deadline` (monotonic)."""
    logging.getLogger().removeHandler(handler)
    provider.force_flush(max(1, int((deadline - time.monotonic()) * 1000)))
    provider.shutdown()
