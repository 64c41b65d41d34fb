"""Telemetry of one generation request: its GenAI span, its metrics and its log line.

`RequestTelemetry` starts the span `{gen_ai.operation.name} {gen_ai.request.model}` (kind
INTERNAL) as a child of the HTTP server span, and `activate()` makes it current and binds
`request_id` for structlog while the request is handled, so the engine's `AddRequest` carries
its context and every log line carries `request_id`, `trace_id` and `span_id`. The request
then ends exactly once: `finish()` (a finish reason), `fail()` (an error answered to the
client, an engine failure) or `abort()` (the client went away). Each records the span's
timing events and attributes, the request metrics and one log line. Work is per request and
per output, never per token; prompt and completion text never reach the span or the logs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from structlog.contextvars import bound_contextvars

from otel_engine.entrypoints.network.errors import is_server_error
from otel_engine.errors import ErrorCode
from otel_engine.observability.tracing import get_tracer, link_from
from otel_engine.outputs import FinishReason

if TYPE_CHECKING:
    from otel_engine.observability.metrics import EngineMetrics
    from otel_engine.outputs import RequestOutput
    from otel_engine.sampling_params import SamplingParams

logger = logging.getLogger("otel_engine.api_server")

EVENT_QUEUED = "otel_engine.request.queued"
EVENT_SCHEDULED = "otel_engine.request.scheduled"
EVENT_FIRST_TOKEN = "otel_engine.request.first_token"
EVENT_PREEMPTED = "otel_engine.request.preempted"
EVENT_FINISHED = "otel_engine.request.finished"
ABORTED = ErrorCode.ABORTED


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTelemetry:
    """The GenAI span, metrics and log line of one admitted generation request."""

    __slots__ = (
        "_is_ended",
        "_metrics",
        "is_recording",
        "num_preemptions",
        "num_prompt_tokens",
        "request_id",
        "span",
        "started_at",
        "timings",
    )

    def __init__(
        self,
        metrics: EngineMetrics,
        *,
        request_id: str,
        operation: str,
        request_model: str,
        response_model: str,
        params: SamplingParams,
        num_prompt_tokens: int,
        is_stream: bool,
        num_choices: int = 1,
        tool_names: list[str] | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self._metrics = metrics
        self._is_ended = False
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_preemptions = 0
        self.timings: Mapping[str, float] = {}
        self.started_at = time.time()
        self.span = (tracer or get_tracer()).start_span(
            f"{operation} {request_model}", kind=SpanKind.INTERNAL
        )
        self.is_recording = self.span.is_recording()
        if self.is_recording:
            attributes: dict[str, Any] = {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": request_model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.top_k": params.top_k,
                "gen_ai.response.id": request_id,
                "gen_ai.response.model": response_model,
                "gen_ai.output.type": "text" if params.structured_output is None else "json",
                "gen_ai.usage.input_tokens": num_prompt_tokens,
                "otel_engine.request.stream": is_stream,
            }
            if params.seed is not None:
                attributes["gen_ai.request.seed"] = params.seed
            if num_choices > 1:
                attributes["gen_ai.request.choice.count"] = num_choices
            if tool_names:  # the definitions' required fields only: never their schemas
                definitions = [{"type": "function", "name": name} for name in tool_names]
                attributes["gen_ai.tool.definitions"] = json.dumps(definitions)
                attributes["otel_engine.request.tool_count"] = len(tool_names)
            for name in ("presence_penalty", "frequency_penalty"):
                if getattr(params, name):
                    attributes[f"gen_ai.request.{name}"] = getattr(params, name)
            self.span.set_attributes(attributes)

    @contextmanager
    def activate(self) -> Iterator[None]:
        """The span is current and `request_id` is bound to the logs inside this block."""
        with (
            trace.use_span(
                self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ),
            bound_contextvars(request_id=self.request_id),
        ):
            yield

    def first_output(self, output: RequestOutput) -> None:
        """The request's first output: it was queued, scheduled and produced a token."""
        self.timings = output.metrics
        if not self.is_recording:
            return
        timings = output.metrics
        arrival = timings.get("arrival_time")
        if arrival is None:
            return
        self.span.add_event(EVENT_QUEUED, timestamp=_ns(arrival))
        queue_s = timings.get("queue_time_s")
        if queue_s is not None:
            self.span.add_event(
                EVENT_SCHEDULED,
                {"otel_engine.request.queue_time_s": queue_s},
                timestamp=_ns(arrival + queue_s),
            )
        first_token = timings.get("first_token_time")
        if first_token is not None and output.outputs[0].token_ids:
            self.span.add_event(
                EVENT_FIRST_TOKEN,
                {"otel_engine.request.ttft_s": first_token - arrival},
                timestamp=_ns(first_token),
            )
        self.observe(output)

    def observe(self, output: RequestOutput) -> None:
        """Any later output: one `preempted` event each time the preemption count grows."""
        num = int(output.metrics.get("num_preemptions", 0))
        if num > self.num_preemptions:
            self.num_preemptions = num
            if self.is_recording:
                self.span.add_event(EVENT_PREEMPTED, {"otel_engine.request.num_preemptions": num})

    def finish(
        self,
        finish_reason: FinishReason,
        num_generated: int,
        timings: Mapping[str, float] | None = None,
        *,
        finish_reasons: Sequence[FinishReason] | None = None,
    ) -> None:
        """The request ended normally with `finish_reason` (stop, length); `timings` are the
        last output's `metrics`; `finish_reasons` has one per choice when there are several
        (the metrics count the request once, by the first choice's reason)."""
        if self._is_ended:
            return
        self._is_ended = True
        timings = self.timings if timings is None else timings
        now = time.time()
        arrival = timings.get("arrival_time", self.started_at)
        finished = timings.get("finished_time", now)
        first_token = timings.get("first_token_time") if num_generated else None
        e2e_s = max(0.0, finished - arrival)
        ttft_s = None if first_token is None else max(0.0, first_token - arrival)
        tpot_s = None
        if ttft_s is not None and num_generated > 1:
            tpot_s = max(0.0, e2e_s - ttft_s) / (num_generated - 1)
        queue_s = timings.get("queue_time_s")
        num_cached = int(timings.get("num_cached_tokens", 0))
        num_drafts = int(timings.get("num_draft_tokens", 0))
        num_accepted = int(timings.get("num_accepted_tokens", 0))
        self._metrics.on_request_finished(
            finish_reason=finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=num_generated,
            e2e_s=e2e_s,
            queue_s=queue_s,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            trace_id=(
                format(self.span.get_span_context().trace_id, "032x") if self.is_recording else None
            ),
            num_draft_tokens=num_drafts,
            num_accepted_tokens=num_accepted,
        )
        fields: dict[str, Any] = {
            "finish_reason": finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": num_generated,
            "e2e_s": round(e2e_s, 6),
            "queue_time_s": None if queue_s is None else round(queue_s, 6),
            "ttft_s": None if ttft_s is None else round(ttft_s, 6),
            "tpot_s": None if tpot_s is None else round(tpot_s, 6),
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": num_cached,
        }
        if num_drafts:
            fields.update(_spec_fields(num_drafts, num_accepted, self._metrics.spec.method))
        logger.info("request.finished", extra=self._log_fields(fields))
        if self.is_recording:
            attributes: dict[str, Any] = {
                "gen_ai.response.finish_reasons": finish_reasons or [finish_reason],
                "gen_ai.usage.output_tokens": num_generated,
                "gen_ai.usage.cache_read.input_tokens": num_cached,
                "otel_engine.request.e2e_s": e2e_s,
                "otel_engine.request.num_preemptions": self.num_preemptions,
            }
            for key, value in (("queue_time_s", queue_s), ("ttft_s", ttft_s), ("tpot_s", tpot_s)):
                if value is not None:
                    attributes[f"otel_engine.request.{key}"] = value
            if num_drafts:
                spec = _spec_fields(num_drafts, num_accepted, self._metrics.spec.method)
                attributes.update({f"otel_engine.request.{k}": v for k, v in spec.items()})
            self.span.set_attributes(attributes)
            self.span.add_event(
                EVENT_FINISHED, {"gen_ai.response.finish_reason": finish_reason}, _ns(finished)
            )
        self.span.end()

    def fail(
        self,
        error_type: str,
        *,
        status: int,
        num_generated: int = 0,
        exc: BaseException | None = None,
        span_error_type: str | None = None,
        crash_context: Mapping[str, str] | None = None,
    ) -> None:
        """The request ended in an error answered with HTTP `status`.

        `error_type` is the bounded metric label; `span_error_type` (default: the same) goes
        to the span's `error.type`. Status ERROR for 5xx only. `crash_context` (an engine
        failure) adds a link to the span that recorded the crash.
        """
        if self._is_ended:
            return
        self._is_ended = True
        self._metrics.on_request_error(
            error_type,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=num_generated,
        )
        level = logging.WARNING if is_server_error(status) else logging.INFO
        fields = {
            "error_type": error_type,
            "status": status,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": num_generated,
        }
        if span_error_type and span_error_type != error_type:
            fields["cause_type"] = span_error_type
        logger.log(level, "request.failed", extra=self._log_fields(fields))
        if self.is_recording:
            span = self.span
            span.set_attributes(
                {
                    "error.type": span_error_type or error_type,
                    "gen_ai.usage.output_tokens": num_generated,
                    "otel_engine.request.num_preemptions": self.num_preemptions,
                }
            )
            if exc is not None:
                span.record_exception(exc)
            link = link_from(crash_context) if crash_context else None
            if link is not None:
                span.add_link(link.context, {"otel_engine.link.reason": "engine_crash"})
            if is_server_error(status):
                span.set_status(Status(StatusCode.ERROR, span_error_type or error_type))
        self.span.end()

    def abort(self, num_generated: int = 0) -> None:
        """The client went away before the response was complete (HTTP 499)."""
        self.fail(ABORTED, status=499, num_generated=num_generated)

    def tool_calls(
        self, calls: list[list[tuple[str, str]]], reasons: Sequence[FinishReason]
    ) -> None:
        """The answer's tool calls (per choice: id and function name) as the span's
        `gen_ai.output.messages`, tool-call parts without their arguments (which, like
        prompts, stay out of telemetry)."""
        if not self.is_recording or not any(calls):
            return
        messages = [
            {
                "role": "assistant",
                "parts": [{"type": "tool_call", "id": i, "name": name} for i, name in choice],
                "finish_reason": reason,
            }
            for choice, reason in zip(calls, reasons, strict=False)
        ]
        self.span.set_attribute("gen_ai.output.messages", json.dumps(messages))

    @property
    def is_ended(self) -> bool:
        return self._is_ended

    def _log_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`request_id` and the span's ids, explicit: the line may be logged elsewhere."""
        fields["request_id"] = self.request_id
        context = self.span.get_span_context()
        if context.is_valid:
            fields["trace_id"] = format(context.trace_id, "032x")
            fields["span_id"] = format(context.span_id, "016x")
        return fields


def _spec_fields(num_drafts: int, num_accepted: int, method: str | None) -> dict[str, Any]:
    """A request's speculative decoding, for its log line and span (the names after
    `otel_engine.request.`)."""
    return {
        "spec_method": method or "",
        "spec_proposed_tokens": num_drafts,
        "spec_accepted_tokens": num_accepted,
        "spec_acceptance_rate": round(num_accepted / num_drafts, 4),
    }
