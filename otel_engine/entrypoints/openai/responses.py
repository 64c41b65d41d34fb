"""Bodies of the Responses API (`POST /v1/responses`): the whole response object, or its
server-sent events, from the same engine outputs and tool-call parser as a chat.

A response's `output` is a message item (its text) and one `function_call` item per tool
call, in the order the model wrote them. Streamed, each item is announced
(`response.output_item.added`), filled (`response.output_text.delta`,
`response.function_call_arguments.delta`) and closed (`.done` events), and the response
ends with `response.completed` (`response.incomplete` when max_output_tokens cut it). A
failure mid-stream (the engine died, the request was aborted or failed) ends it with an
`error` event and `response.failed`, whose response carries the error. Every event has a
`sequence_number` (`ResponseStream`). Responses are not stored (`store` is false in every
answer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response

from otel_engine.entrypoints.network.errors import (
    ENGINE_ERRORS,
    APIError,
    aborted_by_engine,
    from_engine_error,
    internal_error,
)
from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.openai.outcome import Outcomes, record_failure
from otel_engine.entrypoints.openai.request_telemetry import RequestTelemetry
from otel_engine.entrypoints.openai.response_stream import (
    ResponseStream,
    call_item,
    message_item,
    new_item_id,
)
from otel_engine.entrypoints.tools.parser import Delta, ToolCall
from otel_engine.outputs import FinishReason

if TYPE_CHECKING:
    from starlette.requests import Request

    from otel_engine import RequestOutput
    from otel_engine.entrypoints.openai.response_models import ResponsesEcho
    from otel_engine.outputs import CompletionOutput

JSON = "application/json"


def response_object(
    job: Job,
    echo: ResponsesEcho,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    return {
        "id": job.request_id,
        "object": job.kind.object_name(is_chunk=False),
        "created_at": job.created,
        "status": status,
        "model": job.model,
        "output": output,
        "usage": usage,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        **dict(echo),  # the fields as `ResponsesEcho` declares them, in its order
    }


def responses_usage(job: Job) -> dict[str, Any]:
    usage = job.usage()
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _status(reason: str) -> tuple[str, str | None]:
    """A finish reason as a response's status and incomplete reason."""
    if reason == FinishReason.LENGTH:
        return "incomplete", "max_output_tokens"
    return "completed", None


def full_response(
    outcomes: Outcomes, job: Job, telemetry: RequestTelemetry, final: RequestOutput
) -> Response:
    """The non-streamed response object."""
    assert job.responses is not None
    job.count(final)
    job.num_cached = int(final.metrics.get("num_cached_tokens", 0))
    completion = final.outputs[0]
    if completion.finish_reason == FinishReason.ABORT:
        raise aborted_by_engine()
    reason: FinishReason = completion.finish_reason or FinishReason.STOP
    output: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    if job.tools is not None:
        parsed = job.tools.parser_for_whole().parse(job.tools.clean(completion.text))
        text, calls = parsed.content, parsed.calls
        reason = outcomes.tool_outcome(job, calls, parsed.num_invalid, reason)
        outcomes.log_tool_calls(calls)
    else:
        text = completion.text
        outcomes.count_invalid_json(job, completion)
    status, incomplete = _status(reason)
    if text or not calls:
        output.append(message_item(new_item_id("msg"), text, status))
    output += [call_item(new_item_id("fc"), call, "completed") for call in calls]
    telemetry.tool_calls([[(c.id, c.name) for c in calls]], [reason])
    telemetry.finish(reason, job.num_generated, final.metrics)
    body = response_object(
        job,
        job.responses,
        status=status,
        output=output,
        usage=responses_usage(job),
        incomplete=incomplete,
    )
    return Response(msgspec.json.encode(body), media_type=JSON)


async def events(
    outcomes: Outcomes,
    stream: ResponseStream,
    telemetry: RequestTelemetry,
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    request: Request,
) -> AsyncIterator[bytes]:
    """The response's server-sent events (see the module docstring), written to `stream`."""
    job = stream.job
    assert job.responses is not None
    try:
        created = response_object(job, job.responses, status="in_progress", output=[])
        yield stream.event("response.created", response=created)
        yield stream.event("response.in_progress", response=created)
        output: RequestOutput | None = first
        while output is not None:
            job.count(output)
            completion = output.outputs[0]
            if completion.finish_reason == FinishReason.ABORT:
                raise aborted_by_engine()
            for frame in stream.feed(_delta(job, completion)):
                yield frame
            if output.finished:
                for frame in _completed(stream, outcomes, telemetry, output):
                    yield frame
                return
            output = await anext(outputs, None)
            if output is not None:
                telemetry.observe(output)
    except (*ENGINE_ERRORS, APIError) as exc:
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        record_failure(telemetry, job, error, None if isinstance(exc, APIError) else exc)
        for frame in _failed(stream, error):
            yield frame
    except Exception as exc:  # a bug here must still end the stream with an error event
        error = internal_error(exc, request_id=job.request_id)
        record_failure(telemetry, job, error, exc)
        for frame in _failed(stream, error):
            yield frame
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
        outcomes.ended_early(telemetry, job, request)


def _delta(job: Job, completion: CompletionOutput) -> Delta:
    """What one output adds: through the tool-call parser when the request has tools."""
    if job.tools is None:
        return Delta(content=completion.delta_text)
    parser = job.tools.parser(0)
    delta = parser.feed(job.tools.clean(completion.delta_text))
    if completion.finish_reason is not None:
        tail = parser.finish()
        delta.content += tail.content
        delta.calls += tail.calls
    return delta


def _completed(
    stream: ResponseStream, outcomes: Outcomes, telemetry: RequestTelemetry, output: RequestOutput
) -> list[bytes]:
    """The last events: the open items closed, then `response.completed`."""
    job = stream.job
    assert job.responses is not None
    completion = output.outputs[0]
    reason = completion.finish_reason or FinishReason.STOP
    calls: list[ToolCall] = []
    if job.tools is not None:
        parser = job.tools.parser(0)
        calls = parser.calls
        reason = outcomes.tool_outcome(job, calls, parser.num_invalid, reason)
        outcomes.log_tool_calls(calls)
    else:
        outcomes.count_invalid_json(job, completion)
    status, incomplete = _status(reason)
    frames = stream.close_message(status) + stream.close_call()
    job.num_cached = int(output.metrics.get("num_cached_tokens", 0))
    telemetry.tool_calls([[(c.id, c.name) for c in calls]], [reason])
    telemetry.finish(reason, job.num_generated, output.metrics)
    body = response_object(
        job,
        job.responses,
        status=status,
        output=stream.output,
        usage=responses_usage(job),
        incomplete=incomplete,
    )
    kind = "response.incomplete" if status == "incomplete" else "response.completed"
    frames.append(stream.event(kind, response=body))
    return frames


def failed_frames(stream: ResponseStream, error: APIError) -> bytes:
    """An error event and `response.failed`, for a stream cut outside its loop (the drain
    deadline), numbered after the stream's last event."""
    return b"".join(_failed(stream, error))


def _failed(stream: ResponseStream, error: APIError) -> list[bytes]:
    job = stream.job
    assert job.responses is not None
    detail = error.body()["error"]
    code = str(detail.get("code") or detail.get("type") or "server_error")
    frames = [
        stream.event(
            "error", code=code, message=detail.get("message", ""), param=detail.get("param")
        )
    ]
    failed = response_object(
        job,
        job.responses,
        status="failed",
        output=stream.output,
        usage=responses_usage(job),
        error={"code": code, "message": str(detail.get("message", ""))},
    )
    frames.append(stream.event("response.failed", response=failed))
    return frames
