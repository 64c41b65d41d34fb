"""The log pipeline: one JSON object per line from structlog, stdlib and library loggers alike."""

from __future__ import annotations

import re
from typing import Any

import pytest

from otel_engine.observability.log_render import structure_exception
from otel_engine.observability.logging import (
    REDACTED_KEYS,
    process_fields,
    redact,
    rfc3339,
    shared_processors,
)
from tests.observability.conftest import RunPython, json_lines

CANARY = "CANARY-7f3a9-prompt-text"
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")

LOGGING_SCRIPT = f"""
import logging, warnings
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from otel_engine.observability.setup import setup_process

setup_process(role="worker", rank=1)
trace.set_tracer_provider(TracerProvider())
tracer = trace.get_tracer("test")
structlog.get_logger("otel_engine.test").info("structlog.event", num_things=3)
logging.getLogger("otel_engine.engine.core_proc").info(
    "engine.ready", extra={{"step": 7, "prompt": "{CANARY}", "text": "{CANARY}"}})
logging.getLogger("uvicorn.error").info("Started server process [%d]", 4242)
logging.getLogger("uvicorn.access").info(
    '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST", "/v1/completions", "1.1", 200)
logging.getLogger("torch").warning("a third-party warning")
warnings.warn("an old api", DeprecationWarning, stacklevel=1)
with tracer.start_as_current_span("request") as span:
    print(format(span.get_span_context().trace_id, "032x"), flush=True)
    with structlog.contextvars.bound_contextvars(request_id="cmpl-42"):
        logging.getLogger("otel_engine.api_server").info("request.done")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("otel_engine.engine.core_proc").exception("engine.failed")
        try:
            try:
                raise KeyError("inner")
            except KeyError as inner:
                raise RuntimeError("outer") from inner
        except RuntimeError:
            structlog.get_logger("otel_engine.test").exception("structlog.failed")
logging.getLogger("otel_engine.test").debug("debug.hidden")
"""


@pytest.fixture(scope="module")
def worker_log(run_python: RunPython) -> tuple[list[dict[str, Any]], str]:
    """The JSON lines a worker-like process wrote, and the trace id of its span."""
    done = run_python(LOGGING_SCRIPT, env={"OTEL_ENGINE_LOG_FORMAT": "json"})
    assert 0 == done.returncode, done.stderr
    return json_lines(done.stderr), done.stdout.strip()


def by_event(records: list[dict[str, Any]], event: str) -> dict[str, Any]:
    matches = [record for record in records if record["event"] == event]
    assert 1 == len(matches), f"{event!r} in {records}"
    return matches[0]


def test_every_line_has_the_common_fields(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """timestamp (RFC 3339 UTC), level, event, logger, role, pid and rank are on every line."""
    records, _ = worker_log
    assert len(records) >= 8
    for record in records:
        assert TIMESTAMP.match(record["timestamp"]), record
        assert record["level"] in ("debug", "info", "warning", "error", "critical")
        assert ("worker", 1) == (record["role"], record["rank"])
        assert isinstance(record["pid"], int)
        assert record["event"]
        assert record["logger"]


def test_stdlib_extra_fields_are_top_level(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """`extra={...}` of a stdlib call becomes top-level keys; structlog kwargs too."""
    records, _ = worker_log
    assert 7 == by_event(records, "engine.ready")["step"]
    assert "otel_engine.engine.core_proc" == by_event(records, "engine.ready")["logger"]
    assert 3 == by_event(records, "structlog.event")["num_things"]


def test_library_loggers_share_the_pipeline(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """uvicorn and third-party loggers come out as the same JSON; a record's positional
    arguments are rendered into its message once, not copied into fields."""
    records, _ = worker_log
    assert "uvicorn.error" == by_event(records, "Started server process [4242]")["logger"]
    assert "warning" == by_event(records, "a third-party warning")["level"]
    access = next(r for r in records if r["logger"] == "uvicorn.access")
    assert '127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200' == access["event"]
    assert {"http_path", "http_method", "positional_args"}.isdisjoint(access)


def test_warnings_are_captured(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """`warnings.warn` becomes a `python.warning` event with its category and text."""
    records, _ = worker_log
    warning = by_event(records, "python.warning")
    assert ("DeprecationWarning", "an old api") == (warning["category"], warning["warning"])


def test_trace_and_request_ids_inside_a_span(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """Lines logged in an active span carry its trace_id/span_id and the bound request_id."""
    records, trace_id = worker_log
    inside = [by_event(records, e) for e in ("request.done", "engine.failed", "structlog.failed")]
    for record in inside:
        assert trace_id == record["trace_id"]
        assert re.fullmatch(r"[0-9a-f]{16}", record["span_id"])
        assert "cmpl-42" == record["request_id"]
    assert "trace_id" not in by_event(records, "structlog.event")


def test_exceptions_are_structured(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """An exception is {type, message, frames[{filename, lineno, name}]}, never locals."""
    records, _ = worker_log
    exception = by_event(records, "engine.failed")["exception"]
    assert ("ValueError", "boom") == (exception["type"], exception["message"])
    assert exception["frames"]
    assert {"filename", "lineno", "name"} == set(exception["frames"][-1])


def test_exception_chain_is_kept(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """`raise ... from ...` keeps its cause under `chain`, for structlog's .exception() too."""
    records, _ = worker_log
    exception = by_event(records, "structlog.failed")["exception"]
    assert "RuntimeError" == exception["type"]
    assert [("KeyError", True)] == [(c["type"], c["is_cause"]) for c in exception["chain"]]


def test_prompt_fields_never_reach_the_log(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """Keys like prompt/text are dropped; the canary appears on no line."""
    records, _ = worker_log
    assert not {"prompt", "text"} & set(by_event(records, "engine.ready"))
    assert not any(CANARY in str(record) for record in records)


def test_level_filters_lines(worker_log: tuple[list[dict[str, Any]], str]) -> None:
    """At the default INFO level, debug lines are not written."""
    records, _ = worker_log
    assert not [r for r in records if r["event"] == "debug.hidden"]


def test_console_format_is_human(run_python: RunPython) -> None:
    """`console` renders readable lines (not JSON) with the event, logger and role."""
    code = (
        "import logging\n"
        "from otel_engine.observability.setup import setup_process\n"
        "setup_process(role='engine_core')\n"
        "logging.getLogger('otel_engine.x').info('engine.ready', extra={'num_kv_blocks': 9})\n"
    )
    done = run_python(code, env={"OTEL_ENGINE_LOG_FORMAT": "console"})
    assert 0 == done.returncode, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert not line.startswith("{")
    for part in ("engine.ready", "otel_engine.x", "num_kv_blocks=9", "role=engine_core"):
        assert part in line


def test_redact_drops_every_listed_key() -> None:
    """The redaction processor removes each key that could carry prompts or outputs."""
    event = dict.fromkeys(REDACTED_KEYS, CANARY) | {"event": "x", "num_tokens": 3}
    assert {"event": "x", "num_tokens": 3} == redact(None, "info", event)


def test_log_prompts_turns_redaction_off() -> None:
    """With log_prompts the redaction processor is not in the chain."""
    assert redact in shared_processors("api_server", None, log_prompts=False)
    assert redact not in shared_processors("api_server", None, log_prompts=True)


def test_rank_only_for_ranked_processes() -> None:
    """`rank` is stamped only when the process has one."""
    assert "rank" not in process_fields("engine_core", None)(None, "info", {})
    assert 0 == process_fields("worker", 0)(None, "info", {})["rank"]


def test_rfc3339_is_utc_with_microseconds() -> None:
    """Timestamps are RFC 3339 in UTC with six fractional digits."""
    assert "2001-09-09T01:46:40.250000Z" == rfc3339(1_000_000_000.25)


def test_exception_instance_is_structured() -> None:
    """`exc_info=<exception>` works like a live exc_info tuple."""
    try:
        raise KeyError("k")
    except KeyError as error:
        caught = error
    event = structure_exception(None, "error", {"exc_info": caught})
    assert "KeyError" == event["exception"]["type"]
    assert "exc_info" not in event
