"""Rendering of log events: structured exceptions, ordered JSON, and the shared formatter.

`PipelineFormatter` is the one `logging.Formatter` of the pipeline (stderr and OTLP sinks):
it turns structlog events and foreign stdlib records into event dicts and runs a final
processor chain over them (`structure_exception` + `render_json` for JSON lines).
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Callable, MutableMapping
from typing import Any

from structlog.tracebacks import ExceptionDictTransformer

EventDict = MutableMapping[str, Any]
Processor = Callable[[Any, str, EventDict], Any]

_FIRST_KEYS = (
    "timestamp",
    "level",
    "event",
    "logger",
    "role",
    "pid",
    "rank",
    "request_id",
    "trace_id",
    "span_id",
)
_exception_frames = ExceptionDictTransformer(show_locals=False, max_frames=50)
_json = json.JSONEncoder(default=repr)


def structure_exception(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """`exc_info` -> `exception`: {type, message, frames[{filename, lineno, name}], chain}."""
    exc_info = event_dict.pop("exc_info", None)
    stack = event_dict.pop("stack_info", None)
    if stack:
        event_dict["stack"] = stack if isinstance(stack, str) else "".join(traceback.format_stack())
    if not exc_info:
        return event_dict
    if isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    elif not isinstance(exc_info, tuple):
        exc_info = sys.exc_info()
    if exc_info[0] is None:
        return event_dict
    stacks = [
        {
            "type": s["exc_type"],
            "message": s["exc_value"],
            "frames": s["frames"],
            "is_cause": s["is_cause"],
        }
        for s in _exception_frames(exc_info)
    ]
    top = stacks[0]
    del top["is_cause"]
    if len(stacks) > 1:
        top["chain"] = stacks[1:]
    event_dict["exception"] = top
    return event_dict


def render_json(logger: Any, method: str, event_dict: EventDict) -> str:
    """One JSON object, the fixed fields first in a stable order, then the rest as they came."""
    ordered = {key: event_dict.pop(key) for key in _FIRST_KEYS if key in event_dict}
    ordered.update(event_dict)
    return _json.encode(ordered)


class PipelineFormatter(logging.Formatter):
    """Renders structlog events and foreign stdlib records through one processor chain.

    Like `structlog.stdlib.ProcessorFormatter`, without copying each record: structlog events
    arrive through `wrap_for_formatter` with their event dict as `record.msg`; foreign records
    first go through `foreign_chain`. `final` turns the event dict into the output string.
    The record itself is never modified, so several handlers can share it.
    """

    def __init__(self, foreign_chain: list[Processor], final: list[Processor]) -> None:
        super().__init__()
        self.foreign_chain = foreign_chain
        self.final = final

    def event_dict(self, record: logging.LogRecord) -> EventDict:
        msg = record.msg
        if isinstance(msg, dict) and hasattr(record, "_logger"):
            event_dict: EventDict = dict(msg)
            event_dict["_record"] = record
            event_dict["_from_structlog"] = True
            return event_dict
        event_dict = {"event": record.getMessage(), "_record": record, "_from_structlog": False}
        if record.exc_info:
            event_dict["exc_info"] = record.exc_info
        if record.stack_info:
            event_dict["stack_info"] = record.stack_info
        method = record.levelname.lower()
        for processor in self.foreign_chain:
            event_dict = processor(None, method, event_dict)
        return event_dict

    def format(self, record: logging.LogRecord) -> str:
        event_dict: Any = self.event_dict(record)
        method = record.levelname.lower()
        for processor in self.final:
            event_dict = processor(None, method, event_dict)
        return str(event_dict)


def remove_meta(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    event_dict.pop("_record", None)
    event_dict.pop("_from_structlog", None)
    return event_dict
