"""How an answer ends, counted and recorded the same way for every shape (rendering.py's
completions and chats, responses.py's Responses): a choice's tool calls by outcome and the
finish reason they give, a structured answer that is not valid JSON, a stream cut short, and
the request's telemetry ended for a failure or a client that went away."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from starlette.requests import Request

from otel_engine.engine import structured_output
from otel_engine.entrypoints.network.connections import CLIENT_STALLED_KEY
from otel_engine.entrypoints.network.errors import APIError, draining, is_server_error
from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.openai.request_telemetry import RequestTelemetry
from otel_engine.entrypoints.tools.parser import ToolCall
from otel_engine.errors import EngineDeadError, ErrorCode, RequestFailedError
from otel_engine.observability.label_sets import ToolCallOutcome
from otel_engine.outputs import FinishReason

if TYPE_CHECKING:
    from otel_engine.observability.metrics import EngineMetrics
    from otel_engine.outputs import CompletionOutput

logger = logging.getLogger("otel_engine.api_server")


class Outcomes:
    """One server's counting and logging of how answers end."""

    def __init__(
        self, metrics: EngineMetrics, drain_expired: asyncio.Event, *, log_prompts: bool
    ) -> None:
        self.metrics = metrics
        self.drain_expired = drain_expired
        self.log_prompts = log_prompts

    def tool_outcome(
        self, job: Job, calls: list[ToolCall], num_invalid: int, reason: FinishReason
    ) -> FinishReason:
        """Count a choice's calls by outcome; its finish reason is tool_calls when it
        stopped after calling."""
        self.metrics.on_tool_calls(ToolCallOutcome.PARSED, len(calls))
        self.metrics.on_tool_calls(ToolCallOutcome.INVALID, num_invalid)
        return tool_finish_reason(bool(calls), reason)

    def log_tool_calls(self, calls: list[ToolCall]) -> None:
        """With --log-prompts, the calls' arguments (client data, like prompts)."""
        if calls and self.log_prompts:
            logger.info(
                "request.tool_calls",
                extra={"tool_calls": [[c.id, c.name, c.arguments] for c in calls]},
            )

    def count_invalid_json(self, job: Job, completion: CompletionOutput) -> None:
        """A structured-output choice that ends without valid JSON is counted, by why."""
        if job.params.structured_output is None:
            return
        reason = structured_output.invalid_json_reason(
            completion.text, completion.finish_reason, completion.stop_reason
        )
        if reason is not None:
            self.metrics.on_structured_output_invalid(reason)

    def ended_early(self, telemetry: RequestTelemetry, job: Job, request: Request) -> None:
        """A stream that stopped without an outcome: the drain deadline or the client."""
        if telemetry.is_ended:
            return
        if self.drain_expired.is_set():
            record_failure(telemetry, job, draining(), None)
        else:
            record_gone(telemetry, job, request)


def tool_finish_reason(has_calls: bool, reason: FinishReason) -> FinishReason:
    """A chat choice's finish reason with tools: tool_calls when it stopped after calling,
    whether it was streamed or not."""
    return FinishReason.TOOL_CALLS if has_calls and reason == FinishReason.STOP else reason


def record_gone(telemetry: RequestTelemetry, job: Job, request: Request) -> None:
    """The client went away: it hung up (aborted), or its connection was closed because it
    stopped reading (client_stalled, see connections.py)."""
    if request.scope.get(CLIENT_STALLED_KEY):
        telemetry.fail(ErrorCode.CLIENT_STALLED, status=499, num_generated=job.num_generated)
    else:
        telemetry.abort(job.num_generated)


def record_failure(
    telemetry: RequestTelemetry, job: Job, error: APIError, exc: BaseException | None
) -> None:
    """End the request's telemetry for `error`; the error handlers will not count it again."""
    error.is_counted = True
    if isinstance(exc, EngineDeadError):
        telemetry.fail(
            error.label,
            status=error.status,
            num_generated=job.num_generated,
            exc=exc,
            span_error_type=exc.cause_type,
            crash_context=exc.crash_context,
        )
        return
    server_error = is_server_error(error.status)
    span_error_type = None
    if isinstance(exc, RequestFailedError) and exc.cause_type:
        span_error_type = exc.cause_type  # a poison: the engine failure it caused
    elif server_error and exc is not None and not isinstance(exc, APIError):
        span_error_type = type(exc).__qualname__
    telemetry.fail(
        error.label,
        status=error.status,
        num_generated=job.num_generated,
        exc=exc if server_error else None,
        span_error_type=span_error_type,
        # a request failed as the poison of two engine failures: a link to the last crash
        crash_context=exc.crash_context if isinstance(exc, RequestFailedError) else None,
    )
