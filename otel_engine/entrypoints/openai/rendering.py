"""OpenAI response bodies from engine outputs: a whole completion or chat completion, or
its server-sent events chunk by chunk (roles, echoed prompts, held-back text, logprobs,
usage; each event one `data:` frame, `data: [DONE]` last), with the request's telemetry
ended as the response ends (how a choice ends is counted by `outcome.Outcomes`, which the
Responses API's bodies share)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from otel_engine.entrypoints.network.errors import (
    ENGINE_ERRORS,
    APIError,
    aborted_by_engine,
    from_engine_error,
    internal_error,
)
from otel_engine.entrypoints.openai.api_kind import ApiKind
from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.openai.logprobs import LogprobsFormatter
from otel_engine.entrypoints.openai.outcome import Outcomes, record_failure
from otel_engine.entrypoints.openai.request_telemetry import RequestTelemetry
from otel_engine.entrypoints.tools.parser import Parsed
from otel_engine.outputs import FinishReason, TokenLogprobs

if TYPE_CHECKING:
    from otel_engine import AsyncLLM, RequestOutput
    from otel_engine.outputs import CompletionOutput

JSON = "application/json"
DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def error_event(error: APIError) -> bytes:
    """The event that ends a completion's or chat's stream with `error`."""
    return sse_event(error.body())


class ResponseRenderer:
    """Turns one server's engine outputs into OpenAI bodies."""

    def __init__(self, engine: AsyncLLM, outcomes: Outcomes) -> None:
        self._engine = engine  # its tokenizer is read on first use
        self.outcomes = outcomes

    def full_response(
        self, job: Job, telemetry: RequestTelemetry, final: RequestOutput
    ) -> Response:
        job.count(final)
        job.num_cached = int(final.metrics.get("num_cached_tokens", 0))
        if any(c.finish_reason == FinishReason.ABORT for c in final.outputs):
            raise aborted_by_engine()
        samples = final.outputs
        if job.num_samples > job.n:  # best_of: the n samples of highest cumulative logprob
            samples = sorted(samples, key=_cumulative_logprob, reverse=True)[: job.n]
        choices, reasons = [], []
        called: list[list[tuple[str, str]]] = []  # by choice, tool calls (id, name)
        for index, completion in enumerate(samples):
            reason = completion.finish_reason or FinishReason.STOP
            reasons.append(reason)
            self.outcomes.count_invalid_json(job, completion)
            logprobs = echoed = None
            if job.echo is not None:
                echoed = self._echo(job, index, final)
            if job.client_logprobs and completion.logprobs is not None:
                logprobs = self._logprobs(
                    job, index, list(completion.token_ids), list(completion.logprobs)
                )
                if echoed is not None and echoed[1] is not None:
                    logprobs = {k: echoed[1][k] + v for k, v in logprobs.items()}
            text = completion.text if echoed is None else echoed[0] + completion.text
            if job.kind is ApiKind.CHAT and job.tools is not None:
                parsed = job.tools.parser_for_whole().parse(job.tools.clean(text))
                message = self._tool_message(parsed)
                reason = self.outcomes.tool_outcome(job, parsed.calls, parsed.num_invalid, reason)
                reasons[-1] = reason
                called.append([(call.id, call.name) for call in parsed.calls])
                self.outcomes.log_tool_calls(parsed.calls)
                choice = {"index": index, "message": message, "logprobs": logprobs}
            elif job.kind is ApiKind.CHAT:
                message = {"role": "assistant", "content": text}
                choice = {"index": index, "message": message, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs}
            choices.append({**choice, "finish_reason": reason})
        telemetry.tool_calls(called, reasons)
        telemetry.finish(reasons[0], job.num_generated, final.metrics, finish_reasons=reasons)
        body = job.envelope(False, choices=choices, usage=job.usage())
        return Response(msgspec.json.encode(body), media_type=JSON)

    async def events(
        self,
        job: Job,
        telemetry: RequestTelemetry,
        outputs: AsyncIterator[RequestOutput],
        first: RequestOutput,
        request: Request,
    ) -> AsyncIterator[bytes]:
        try:
            for index in range(job.n):  # the chat role, or the completion's echoed prompt
                head = self._head_chunk(job, index, first)
                if head is not None:
                    yield head
            output: RequestOutput | None = first
            reasons: dict[int, FinishReason] = {}  # by choice, as they end
            while output is not None:
                job.count(output)
                if any(c.finish_reason == FinishReason.ABORT for c in output.outputs):
                    error = aborted_by_engine()
                    record_failure(telemetry, job, error, None)
                    yield error_event(error)
                    return
                for completion in output.outputs:
                    chunk = self._choice_chunk(job, completion, reasons)
                    if chunk is not None:
                        yield chunk
                if output.finished:
                    _end_stream(job, telemetry, output, reasons)
                    break
                output = await anext(outputs, None)
                if output is not None:
                    telemetry.observe(output)
            if job.include_usage:
                yield sse_event(job.envelope(True, choices=[], usage=job.usage()))
            yield DONE_EVENT
        except ENGINE_ERRORS as exc:
            error = from_engine_error(exc)
            record_failure(telemetry, job, error, exc)
            yield error_event(error)
        except Exception as exc:  # a bug here must still end the stream with an error event
            error = internal_error(exc, request_id=job.request_id)
            record_failure(telemetry, job, error, exc)
            yield error_event(error)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
            self.outcomes.ended_early(telemetry, job, request)

    def _choice_chunk(
        self, job: Job, completion: CompletionOutput, reasons: dict[int, FinishReason]
    ) -> bytes | None:
        """The chunk of one choice's new text (and logprobs), or its last one; None while
        its text is held back (a stop string may be starting) or after it ended."""
        index, reason = completion.index, completion.finish_reason
        if index in job.finished:
            return None
        if completion.delta_logprobs:
            ids, entries = job.pending.setdefault(index, ([], []))
            ids += completion.delta_token_ids
            entries += completion.delta_logprobs
        if job.kind is ApiKind.CHAT and job.tools is not None:
            return self._tool_chunk(job, completion, reasons)
        if reason is not None:
            job.finished.add(index)
            reasons[index] = reason
            self.outcomes.count_invalid_json(job, completion)
        elif not completion.delta_text:
            return None
        text = completion.delta_text
        delta = ({"content": text} if text else {}) if job.kind is ApiKind.CHAT else text
        return self._chunk(job, delta, reason, index, self._pending_logprobs(job, index))

    def _tool_chunk(
        self, job: Job, completion: CompletionOutput, reasons: dict[int, FinishReason]
    ) -> bytes | None:
        """A streamed chat choice with tools: its text through the choice's parser, which
        holds back what may be a call and sends calls as OpenAI's tool_calls deltas."""
        assert job.tools is not None
        index, reason = completion.index, completion.finish_reason
        parser = job.tools.parser(index)
        parsed = parser.feed(job.tools.clean(completion.delta_text))
        if reason is not None:
            tail = parser.finish()
            parsed.content += tail.content
            parsed.calls += tail.calls
            job.finished.add(index)
            reason = self.outcomes.tool_outcome(job, parser.calls, parser.num_invalid, reason)
            reasons[index] = reason
            job.tool_calls[index] = [(call.id, call.name) for call in parser.calls]
            self.outcomes.log_tool_calls(parser.calls)
        elif not parsed:
            return None
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.calls:
            delta["tool_calls"] = [call.as_openai() for call in parsed.calls]
        return self._chunk(job, delta, reason, index, self._pending_logprobs(job, index))

    @staticmethod
    def _tool_message(parsed: Parsed) -> dict[str, Any]:
        if not parsed.calls:
            return {"role": "assistant", "content": parsed.content}
        return {
            "role": "assistant",
            "content": parsed.content or None,
            "tool_calls": [call.as_openai() for call in parsed.calls],
        }

    @cached_property
    def _formatter(self) -> LogprobsFormatter:
        return LogprobsFormatter(self._engine.tokenizer)

    def _logprobs(
        self, job: Job, index: int, token_ids: list[int], entries: list[TokenLogprobs]
    ) -> dict[str, Any]:
        """Choice `index`'s `logprobs` for these tokens, in the endpoint's shape."""
        if job.kind is ApiKind.CHAT:
            return self._formatter.chat(token_ids, entries)
        offset = job.text_offsets.get(index, 0)
        body, job.text_offsets[index] = self._formatter.completion(token_ids, entries, offset)
        return body

    def _head_chunk(self, job: Job, index: int, first: RequestOutput) -> bytes | None:
        """What a streamed choice starts with: the assistant role (chat), or the echoed
        prompt with its logprobs (completions with `echo`)."""
        if job.kind is ApiKind.CHAT:
            return self._chunk(job, {"role": "assistant", "content": ""}, None, index)
        if job.echo is not None:
            text, logprobs = self._echo(job, index, first)
            return self._chunk(job, text, None, index, logprobs)
        return None

    def _echo(
        self, job: Job, index: int, output: RequestOutput
    ) -> tuple[str, dict[str, Any] | None]:
        """Choice `index`'s echoed prompt: its text and, with logprobs, the prompt tokens'
        (the completion's offsets continue after the prompt's text)."""
        assert job.echo is not None
        job.text_offsets[index] = len(job.echo)
        if not job.client_logprobs or output.prompt_logprobs is None:
            return job.echo, None
        body, _ = self._formatter.prompt(job.prompt_ids, output.prompt_logprobs)
        return job.echo, body

    def _pending_logprobs(self, job: Job, index: int) -> dict[str, Any] | None:
        """A streamed chunk's logprobs: those of choice `index`'s tokens that arrived since
        its last chunk (none asked: None)."""
        ids, entries = job.pending.pop(index, ([], []))
        if not entries:
            return None
        return self._logprobs(job, index, ids, entries)

    @staticmethod
    def _chunk(
        job: Job,
        delta: dict[str, str] | str,
        reason: str | None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if job.kind is ApiKind.CHAT:
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs}
        choice["finish_reason"] = reason
        chunk = job.envelope(True, choices=[choice])
        if job.include_usage:
            chunk["usage"] = None
        return sse_event(chunk)


def _end_stream(
    job: Job, telemetry: RequestTelemetry, output: RequestOutput, reasons: dict[int, FinishReason]
) -> None:
    """A stream's last output: its telemetry ends with every choice's finish reason."""
    job.num_cached = int(output.metrics.get("num_cached_tokens", 0))
    ordered = [reasons[i] for i in sorted(reasons)]
    if job.tools is not None:
        telemetry.tool_calls([job.tool_calls.get(i, []) for i in sorted(reasons)], ordered)
    telemetry.finish(ordered[0], job.num_generated, output.metrics, finish_reasons=ordered)


def _cumulative_logprob(completion: CompletionOutput) -> float:
    return sum(entry.logprob for entry in completion.logprobs or ())
