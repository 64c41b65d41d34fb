"""Bodies of the Responses API (`POST /v1/responses`): the whole response object, or its
server-sent events, from the same engine outputs and tool-call parser as a chat.

A response's `output` is a message item (its text) and one `function_call` item per tool
call, in the order the model wrote them. Streamed, each item is announced
(`response.output_item.added`), filled (`response.output_text.delta`,
`response.function_call_arguments.delta`) and closed (`.done` events), and the response
ends with `response.completed` (`response.incomplete` when max_output_tokens cut it). A
failure mid-stream (the engine died, the request was aborted or failed) ends it with an
`error` event and `response.failed`, whose response carries the error. Every event has a
`sequence_number`. Responses are not stored (`store` is false in every answer).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
from otel_engine.entrypoints.tools.parser import Delta, ToolCall

if TYPE_CHECKING:
    from starlette.requests import Request

    from otel_engine import RequestOutput
    from otel_engine.entrypoints.openai.rendering import Job, ResponseRenderer
    from otel_engine.entrypoints.openai.request_telemetry import RequestTelemetry
    from otel_engine.outputs import CompletionOutput

JSON = "application/json"


@dataclass(slots=True)
class ResponsesEcho:
    """What a response object repeats of its request."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, str]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
        "object": "response",
        "created_at": job.created,
        "status": status,
        "model": job.model,
        "output": output,
        "usage": usage,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "temperature": echo.temperature,
        "top_p": echo.top_p,
        "tools": echo.tools,
        "tool_choice": echo.tool_choice,
        "parallel_tool_calls": echo.parallel_tool_calls,
        "text": echo.text,
        "previous_response_id": None,
        "metadata": echo.metadata,
        "store": False,
        "truncation": "disabled",
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


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if text or status != "in_progress" else [],
    }


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _status(reason: str) -> tuple[str, str | None]:
    """A finish reason as a response's status and incomplete reason."""
    if reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def full_response(
    renderer: ResponseRenderer, job: Job, telemetry: RequestTelemetry, final: RequestOutput
) -> Response:
    """The non-streamed response object."""
    assert job.responses is not None
    job.count(final)
    job.num_cached = int(final.metrics.get("num_cached_tokens", 0))
    completion = final.outputs[0]
    if completion.finish_reason == "abort":
        raise aborted_by_engine()
    reason = completion.finish_reason or "stop"
    output: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    if job.tools is not None:
        parsed = job.tools.parser_for_whole().parse(job.tools.clean(completion.text))
        text, calls = parsed.content, parsed.calls
        reason = renderer._tool_outcome(job, calls, parsed.num_invalid, reason)
        renderer._log_tool_calls(calls)
    else:
        text = completion.text
        renderer._count_invalid_json(job, completion)
    status, incomplete = _status(reason)
    if text or not calls:
        output.append(_message_item(_item_id("msg"), text, status))
    output += [_call_item(_item_id("fc"), call, "completed") for call in calls]
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


def _event(kind: str, sequence: int, **fields: Any) -> bytes:
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


@dataclass(slots=True)
class _Stream:
    """The items of one streamed response as they are written."""

    job: Job
    sequence: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)  # items, in order
    message: dict[str, Any] | None = None  # the open message item
    text: str = ""
    call_items: dict[int, dict[str, Any]] = field(default_factory=dict)  # by call index
    open_call: int | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        frame = _event(kind, self.sequence, **fields)
        self.sequence += 1
        return frame

    def text_delta(self, piece: str) -> list[bytes]:
        frames = self.close_call()
        if self.message is None:
            self.message = _message_item(_item_id("msg"), "", "in_progress")
            self.output.append(self.message)
            index = len(self.output) - 1
            frames.append(
                self.event("response.output_item.added", output_index=index, item=self.message)
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            frames.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.message["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        self.text += piece
        frames.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=self.output.index(self.message),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return frames

    def close_message(self, status: str = "completed") -> list[bytes]:
        message = self.message
        if message is None:
            return []
        self.message = None
        index = self.output.index(message)
        done = _message_item(message["id"], self.text, status)
        self.output[index] = done
        part = done["content"][0]
        return [
            self.event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def call_delta(
        self, index: int, call_id: str | None, name: str | None, piece: str
    ) -> list[bytes]:
        frames: list[bytes] = []
        if call_id is not None:
            frames += self.close_message()
            frames += self.close_call()
            item = {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": call_id,
                "name": name or "",
                "arguments": "",
                "status": "in_progress",
            }
            self.output.append(item)
            self.call_items[index] = item
            self.open_call = index
            frames.append(
                self.event(
                    "response.output_item.added", output_index=len(self.output) - 1, item=dict(item)
                )
            )
        item = self.call_items[index]
        if piece:
            item["arguments"] += piece
            frames.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=piece,
                )
            )
        return frames

    def close_call(self) -> list[bytes]:
        if self.open_call is None:
            return []
        item = self.call_items[self.open_call]
        self.open_call = None
        item["status"] = "completed"
        index = self.output.index(item)
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def feed(self, delta: Delta) -> list[bytes]:
        frames: list[bytes] = []
        if delta.content:
            frames += self.text_delta(delta.content)
        for call in delta.calls:
            frames += self.call_delta(call.index, call.id, call.name, call.arguments)
        return frames


async def events(
    renderer: ResponseRenderer,
    job: Job,
    telemetry: RequestTelemetry,
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    request: Request,
) -> AsyncIterator[bytes]:
    """The response's server-sent events (see the module docstring)."""
    from otel_engine.entrypoints.openai.rendering import record_failure

    assert job.responses is not None
    stream = job.response_stream = _Stream(job)
    try:
        created = response_object(job, job.responses, status="in_progress", output=[])
        yield stream.event("response.created", response=created)
        yield stream.event("response.in_progress", response=created)
        output: RequestOutput | None = first
        while output is not None:
            job.count(output)
            completion = output.outputs[0]
            if completion.finish_reason == "abort":
                raise aborted_by_engine()
            for frame in stream.feed(_delta(job, completion)):
                yield frame
            if output.finished:
                for frame in _completed(stream, renderer, telemetry, output):
                    yield frame
                return
            output = await anext(outputs, None)
            if output is not None:
                telemetry.observe(output)
    except (*ENGINE_ERRORS, APIError) as exc:
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        record_failure(telemetry, job, error, None if isinstance(exc, APIError) else exc)
        for frame in _failed(stream, job, error):
            yield frame
    except Exception as exc:  # a bug here must still end the stream with an error event
        error = internal_error(exc, request_id=job.request_id)
        record_failure(telemetry, job, error, exc)
        for frame in _failed(stream, job, error):
            yield frame
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
        renderer._ended_early(telemetry, job, request)


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
    stream: _Stream, renderer: ResponseRenderer, telemetry: RequestTelemetry, output: RequestOutput
) -> list[bytes]:
    """The last events: the open items closed, then `response.completed`."""
    job = stream.job
    assert job.responses is not None
    completion = output.outputs[0]
    reason = completion.finish_reason or "stop"
    calls: list[ToolCall] = []
    if job.tools is not None:
        parser = job.tools.parser(0)
        calls = parser.calls
        reason = renderer._tool_outcome(job, calls, parser.num_invalid, reason)
        renderer._log_tool_calls(calls)
    else:
        renderer._count_invalid_json(job, completion)
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


def failed_frames(job: Job, error: APIError) -> bytes:
    """An error event and `response.failed`, for a stream cut outside its loop (the drain
    deadline), numbered after the stream's last event."""
    stream = job.response_stream if isinstance(job.response_stream, _Stream) else _Stream(job)
    return b"".join(_failed(stream, job, error))


def _failed(stream: _Stream, job: Job, error: APIError) -> list[bytes]:
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
