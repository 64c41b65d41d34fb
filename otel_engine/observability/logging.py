"""One log pipeline per process: structlog and every stdlib logger, rendered the same way.

`configure_logging()` puts a single handler on the root logger whose `PipelineFormatter`
renders structlog events and foreign stdlib records (uvicorn, torch, transformers, asyncio,
the OTel SDK, `warnings`) alike: one JSON object per line on **stderr**. stdout stays free
for program output (`generate`'s completions); children inherit the parent's stderr, so
every process's lines end in one stream.

JSON fields: `timestamp` (RFC 3339 UTC), `level`, `event`, `logger`, `role`, `pid`, `rank`
(workers), `request_id` (when bound with `structlog.contextvars.bound_contextvars`),
`trace_id`/`span_id` (whenever an OpenTelemetry span is active), the stdlib `extra={...}`
fields, and a structured `exception` (type, message, frames; never locals). Keys that could
hold prompts, token ids or generated text are dropped unless `log_prompts` is on.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Any, TextIO

import structlog
from opentelemetry import trace

from otel_engine.config import LogFormat, LogLevel
from otel_engine.observability.log_render import (
    EventDict,
    PipelineFormatter,
    Processor,
    remove_meta,
    render_json,
    structure_exception,
)

REDACTED_KEYS = frozenset(
    {
        "prompt",
        "prompts",
        "prompt_token_ids",
        "token_ids",
        "new_token_ids",
        "output_token_ids",
        "text",
        "output",
        "outputs",
        "messages",
        "completion",
        "stop",
    }
)
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}
_HANDLER_MARK = "_otel_engine_handler"
_SHARED: list[Processor] = []
_second_cache: tuple[int, str] = (-1, "")


def add_timestamp(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """`timestamp` in RFC 3339 UTC with microseconds; a stdlib record's own creation time."""
    record = event_dict.get("_record")
    event_dict["timestamp"] = rfc3339(record.created if record is not None else time.time())
    return event_dict


def rfc3339(seconds: float) -> str:
    """`2026-11-30T04:27:50.123456Z`; the date-time part is cached per second."""
    global _second_cache
    whole = int(seconds)
    cached = _second_cache
    if cached[0] != whole:
        cached = _second_cache = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{cached[1]}.{int((seconds - whole) * 1e6):06d}Z"


def add_extra(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """Merge a foreign stdlib record's `extra={...}` fields as top-level keys."""
    record = event_dict.get("_record")
    if record is not None:
        fields = vars(record)
        for key in fields.keys() - _RECORD_KEYS:
            if not key.startswith("_") and key != "color_message":  # uvicorn's ANSI copy
                event_dict.setdefault(key, fields[key])
    return event_dict


def add_trace_context(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """`trace_id`/`span_id` (32/16 lowercase hex) of the active span, if there is one."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


def process_fields(role: str, rank: int | None) -> Processor:
    """A processor that stamps this process's `role`, `pid` and (workers) `rank`."""

    def add_process(logger: Any, method: str, event_dict: EventDict) -> EventDict:
        event_dict["role"] = role
        event_dict["pid"] = os.getpid()
        if rank is not None:
            event_dict["rank"] = rank
        return event_dict

    return add_process


def redact(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """Drop keys that could carry prompts, token ids or generated text (defense in depth)."""
    for key in REDACTED_KEYS.intersection(event_dict):
        del event_dict[key]
    return event_dict


def shared_processors(role: str, rank: int | None, *, log_prompts: bool) -> list[Processor]:
    """The processors every event goes through, structlog-born or stdlib-born."""
    chain: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        add_timestamp,
        add_extra,
        process_fields(role, rank),
        add_trace_context,
    ]
    if not log_prompts:
        chain.append(redact)
    return chain


def _renderer(fmt: LogFormat, stream: Any) -> list[Processor]:
    if fmt == LogFormat.CONSOLE:
        colors = bool(getattr(stream, "isatty", lambda: False)())
        return [
            remove_meta,
            structlog.dev.ConsoleRenderer(
                colors=colors, exception_formatter=structlog.dev.plain_traceback
            ),
        ]
    return [remove_meta, structure_exception, render_json]


def configure_logging(
    *,
    role: str,
    rank: int | None = None,
    fmt: LogFormat = LogFormat.JSON,
    level: LogLevel = LogLevel.INFO,
    log_prompts: bool = False,
    stream: Any = None,
) -> logging.Handler:
    """Route structlog and all stdlib logging of this process through one handler on stderr.

    Replaces the root logger's handlers; returns the installed handler. Safe to call again
    (a later call replaces the earlier configuration).
    """
    if fmt not in {f.value for f in LogFormat}:
        raise ValueError(f"log format must be one of {', '.join(LogFormat)}, got {fmt!r}")
    stream = sys.stderr if stream is None else stream
    global _SHARED
    shared = _SHARED = shared_processors(role, rank, log_prompts=log_prompts)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(PipelineFormatter(shared, _renderer(fmt, stream)))
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if getattr(old, _HANDLER_MARK, False):
            old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    adopt_library_loggers()
    warnings.showwarning = _log_warning
    return handler


def adopt_library_loggers() -> list[str]:
    """Route libraries that print through their own console handlers into the pipeline.

    torch (at import) and transformers (at first use) attach stderr handlers to their loggers
    and stop propagation; those handlers are removed and the loggers propagate to the root
    again (their levels stay). `configure_logging()` runs this; run it again once such a
    library has been imported later (after loading the tokenizer or the model). Returns the
    names of the loggers it changed.
    """
    adopted = []
    for name, candidate in list(logging.root.manager.loggerDict.items()):
        if not isinstance(candidate, logging.Logger):
            continue
        console = [h for h in candidate.handlers if _is_console_handler(h)]
        if not console and not (name.startswith("uvicorn") and candidate.handlers):
            continue
        for old in console or list(candidate.handlers):
            candidate.removeHandler(old)
        if not candidate.handlers:
            candidate.propagate = True
        adopted.append(name)
    return adopted


def _is_console_handler(handler: logging.Handler) -> bool:
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    stream = handler.stream
    if stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__):
        return True
    try:
        return stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):
        return False


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`warnings` go through the pipeline as `python.warning` events."""
    logging.getLogger("py.warnings").warning(
        "python.warning",
        extra={
            "category": category.__name__,
            "warning": str(message),
            "warning_file": filename,
            "warning_line": lineno,
        },
    )


def add_root_handler(handler: logging.Handler, level: str | int | None = None) -> None:
    """Attach another sink (OTLP log export) next to the stream handler on the root logger."""
    setattr(handler, _HANDLER_MARK, True)
    if level is not None:
        handler.setLevel(level)
    logging.getLogger().addHandler(handler)


def current_processors() -> list[Processor]:
    """The shared processors of the last `configure_logging()` (for other sinks)."""
    return list(_SHARED) or shared_processors("unknown", None, log_prompts=False)
