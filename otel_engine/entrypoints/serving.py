"""The OpenAI completion endpoints: prompt preparation, limits, and response shapes.

Prompts are tokenized here, so that the context limit is checked (and the default
`max_tokens` chosen) before the engine sees the request. Tokenization and chat templates run
in a worker thread, never on the event loop, after a character limit that bounds their cost.
The engine request id is the response id (`cmpl-<hex>`, `chatcmpl-<hex>`), so logs, spans
and the client agree.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import jinja2
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from otel_engine.entrypoints.connections import CLIENT_STALLED_KEY
from otel_engine.entrypoints.errors import (
    INTERNAL,
    APIError,
    aborted_by_engine,
    bad_request,
    draining,
    from_engine_error,
    internal_error,
    is_server_error,
)
from otel_engine.entrypoints.logprobs import LogprobsFormatter
from otel_engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from otel_engine.entrypoints.request_telemetry import RequestTelemetry
from otel_engine.entrypoints.streaming import (
    DONE_EVENT,
    ClientDisconnected,
    EventStreamResponse,
    RequestWatch,
    sse_event,
)
from otel_engine.errors import EngineDeadError, RequestError, RequestFailedError
from otel_engine.ipc.messages import TokenLogprobs
from otel_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from otel_engine import AsyncLLM, RequestOutput
    from otel_engine.observability.metrics import EngineMetrics

logger = logging.getLogger("otel_engine.api_server")

T = TypeVar("T")

DEFAULT_COMPLETION_MAX_TOKENS = 16
CLIENT_STALLED = "client_stalled"
JSON = "application/json"
# An ignored field is logged by name: at most this many names, each cut to this length.
MAX_LOGGED_FIELDS = 16
MAX_FIELD_NAME_CHARS = 64


@dataclass(slots=True)
class _Job:
    """One admitted request: what to run, how to shape its chunks, what to count."""

    request_id: str
    is_chat: bool
    model: str
    request_model: str
    prompt_ids: list[int]
    params: SamplingParams
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    num_generated: int = 0
    num_cached: int = 0  # prompt tokens found in the prefix cache
    # Streaming with logprobs: tokens not yet sent in a chunk (their text may be held back),
    # and where the next token's text starts in the choice's text (completions).
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_offset: int = 0

    def envelope(self, is_chunk: bool, **fields: Any) -> dict[str, Any]:
        if self.is_chat:
            kind = "chat.completion.chunk" if is_chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            **fields,
        }

    def usage(self) -> dict[str, Any]:
        num_prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": self.num_generated,
            "total_tokens": num_prompt + self.num_generated,
            "prompt_tokens_details": {"cached_tokens": self.num_cached},
        }


class OpenAIServing:
    """Turns validated OpenAI requests into engine requests and engine outputs into bodies."""

    def __init__(
        self,
        engine: AsyncLLM,
        metrics: EngineMetrics,
        drain_expired: asyncio.Event,
        max_prompt_chars: int,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.drain_expired = drain_expired
        self.max_prompt_chars = max_prompt_chars
        self.log_prompts = engine.config.observability.log_prompts
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_common(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            prompt_ids = await self._off_loop(self.engine.encode, prompt)
        else:
            prompt_ids = prompt
        job = self._admit(
            body,
            prompt_ids,
            prefix="cmpl",
            default_cap=DEFAULT_COMPLETION_MAX_TOKENS,
            prompt_param="prompt",
        )
        return await self._run(job, body.stream, request, prompt)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_common(body)
        messages = body.template_messages()
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        text = await self._off_loop(self._render_chat, messages)
        prompt_ids = await self._off_loop(self.engine.encode, text, False)
        job = self._admit(
            body, prompt_ids, prefix="chatcmpl", default_cap=None, prompt_param="messages"
        )
        return await self._run(job, body.stream, request, text)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize`: the token ids of a prompt or of rendered chat messages."""
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request(
                "give exactly one of prompt and messages", param="prompt", code="invalid_value"
            )
        if body.prompt is not None:
            self._check_chars(len(body.prompt), "prompt")
            ids = await self._off_loop(self.engine.encode, body.prompt, body.add_special_tokens)
        else:
            messages = [m.to_template_dict() for m in body.messages or ()]
            self._check_chars(sum(len(m["content"]) for m in messages), "messages")
            text = await self._off_loop(self._render_chat, messages, body.add_generation_prompt)
            ids = await self._off_loop(self.engine.encode, text, False)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's `/detokenize`: the text of token ids (special tokens included)."""
        self._check_model(body.model)
        try:
            text = await self._off_loop(self.engine.decode, body.tokens)
        except RequestError as error:
            raise from_engine_error(error) from None
        return {"prompt": text}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(
                404, f"model '{model}' does not exist", param="model", code="model_not_found"
            )

    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_model(body.model)
        body.check_supported()
        ignored = body.ignored_fields()
        if ignored:
            self.metrics.on_ignored_fields(len(ignored))
            logger.warning(
                "request.ignored_fields",
                extra={
                    "fields": [name[:MAX_FIELD_NAME_CHARS] for name in ignored[:MAX_LOGGED_FIELDS]],
                    "num_fields": len(ignored),
                },
            )

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context before spending any work on it."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"the prompt has {num_chars} characters; at most {self.max_prompt_chars} are "
                "accepted (--max-prompt-chars)",
                param=param,
                code="context_length_exceeded",
            )

    async def _off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work in this server's tokenizer thread (one: HF tokenizers are not
        safe to call from two threads at once)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, function, *args)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def _render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template; use /v1/completions",
                param="messages",
                code="unsupported_parameter",
            )
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except (jinja2.TemplateError, ValueError, TypeError) as error:
            raise bad_request(
                f"chat template rejected the messages: {type(error).__name__}",
                param="messages",
                code="invalid_value",
            ) from None
        return str(text)

    def _admit(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        *,
        prefix: str,
        default_cap: int | None,
        prompt_param: str,
    ) -> _Job:
        max_model_len = self.engine.max_model_len
        num_prompt = len(prompt_ids)
        remaining = max_model_len - num_prompt
        requested = body.requested_max_tokens()
        if remaining < 1:
            raise bad_request(
                f"prompt has {num_prompt} tokens, the model's context is {max_model_len}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            max_tokens = remaining if default_cap is None else min(remaining, default_cap)
        elif requested > remaining:
            raise bad_request(
                f"prompt ({num_prompt} tokens) plus max_tokens ({requested}) exceeds the "
                f"model's context of {max_model_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_tokens = requested
        return _Job(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            is_chat=prefix == "chatcmpl",
            model=self.engine.model_name,
            request_model=body.model or self.engine.model_name,
            prompt_ids=prompt_ids,
            params=body.to_sampling_params(max_tokens, self.engine.generation_defaults.values),
            include_usage=body.include_usage,
        )

    async def _run(
        self, job: _Job, stream: bool, request: Request, prompt: str | list[int]
    ) -> Response:
        telemetry = RequestTelemetry(
            self.metrics,
            request_id=job.request_id,
            operation="chat" if job.is_chat else "text_completion",
            request_model=job.request_model,
            response_model=job.model,
            params=job.params,
            num_prompt_tokens=len(job.prompt_ids),
            is_stream=stream,
        )
        with telemetry.activate():
            if self.log_prompts:
                logger.info("request.prompt", extra={"prompt": prompt, "stop": job.params.stop})
            return await self._serve(job, telemetry, stream, request)

    async def _serve(
        self, job: _Job, telemetry: RequestTelemetry, stream: bool, request: Request
    ) -> Response:
        outputs = self.engine.generate(job.prompt_ids, job.params, job.request_id)
        watch = RequestWatch(request.receive, self.drain_expired)
        is_streaming = False
        try:
            first = await watch.run(_first(outputs))
            telemetry.first_output(first)
            if stream:
                is_streaming = True
                events = self._events(job, telemetry, outputs, first, request)
                return EventStreamResponse(events, watch)
            final = await watch.run(_last(outputs, first, telemetry, job))
            return self._full_response(job, telemetry, final)
        except ClientDisconnected:
            _record_gone(telemetry, job, request)
            return Response(status_code=499)
        except (RequestError, RequestFailedError, EngineDeadError, APIError) as exc:
            error = exc if isinstance(exc, APIError) else from_engine_error(exc)
            _record_failure(telemetry, job, error, exc)
            raise error from None
        except Exception as exc:
            error = internal_error(exc, request_id=job.request_id)
            _record_failure(telemetry, job, error, exc)
            raise error from None
        finally:
            if not is_streaming:
                await outputs.aclose()  # type: ignore[attr-defined]
                watch.close()
                if not telemetry.is_ended:  # cancelled: the connection or the server went away
                    _record_gone(telemetry, job, request)

    def _full_response(
        self, job: _Job, telemetry: RequestTelemetry, final: RequestOutput
    ) -> Response:
        completion = final.outputs[0]
        job.num_generated = len(completion.token_ids)
        job.num_cached = int(final.metrics.get("num_cached_tokens", 0))
        reason = completion.finish_reason or "stop"
        if reason == "abort":
            raise aborted_by_engine()
        logprobs = None
        if completion.logprobs is not None:
            logprobs = self._logprobs(job, list(completion.token_ids), list(completion.logprobs))
        if job.is_chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        else:
            choice = {
                "index": 0,
                "text": completion.text,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        telemetry.finish(reason, job.num_generated, final.metrics)
        body = job.envelope(False, choices=[choice], usage=job.usage())
        return Response(msgspec.json.encode(body), media_type=JSON)

    async def _events(
        self,
        job: _Job,
        telemetry: RequestTelemetry,
        outputs: AsyncIterator[RequestOutput],
        first: RequestOutput,
        request: Request,
    ) -> AsyncIterator[bytes]:
        try:
            if job.is_chat:
                yield self._chunk(job, {"role": "assistant", "content": ""}, None)
            output: RequestOutput | None = first
            while output is not None:
                completion = output.outputs[0]
                job.num_generated = len(completion.token_ids)
                reason = completion.finish_reason if output.finished else None
                if reason == "abort":
                    error = aborted_by_engine()
                    _record_failure(telemetry, job, error, None)
                    yield sse_event(error.body())
                    return
                if completion.delta_logprobs:
                    job.pending_ids += completion.delta_token_ids
                    job.pending_logprobs += completion.delta_logprobs
                if completion.delta_text or reason is not None:
                    text = completion.delta_text
                    delta = ({"content": text} if text else {}) if job.is_chat else text
                    yield self._chunk(job, delta, reason, self._pending_logprobs(job))
                if reason is not None:
                    job.num_cached = int(output.metrics.get("num_cached_tokens", 0))
                    telemetry.finish(reason, job.num_generated, output.metrics)
                    break
                output = await anext(outputs, None)
                if output is not None:
                    telemetry.observe(output)
            if job.include_usage:
                yield sse_event(job.envelope(True, choices=[], usage=job.usage()))
            yield DONE_EVENT
        except (RequestError, RequestFailedError, EngineDeadError) as exc:
            error = from_engine_error(exc)
            _record_failure(telemetry, job, error, exc)
            yield sse_event(error.body())
        except Exception as exc:  # a bug here must still end the stream with an error event
            error = internal_error(exc, request_id=job.request_id)
            _record_failure(telemetry, job, error, exc)
            yield sse_event(error.body())
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
            self._ended_early(telemetry, job, request)

    def _ended_early(self, telemetry: RequestTelemetry, job: _Job, request: Request) -> None:
        """A stream that stopped without an outcome: the drain deadline or the client."""
        if telemetry.is_ended:
            return
        if self.drain_expired.is_set():
            _record_failure(telemetry, job, draining(), None)
        else:
            _record_gone(telemetry, job, request)

    @cached_property
    def _formatter(self) -> LogprobsFormatter:
        return LogprobsFormatter(self.engine.tokenizer)

    def _logprobs(
        self, job: _Job, token_ids: list[int], entries: list[TokenLogprobs]
    ) -> dict[str, Any]:
        """The choice's `logprobs` for these tokens, in the endpoint's shape."""
        if job.is_chat:
            return self._formatter.chat(token_ids, entries)
        body, job.text_offset = self._formatter.completion(token_ids, entries, job.text_offset)
        return body

    def _pending_logprobs(self, job: _Job) -> dict[str, Any] | None:
        """A streamed chunk's logprobs: those of the tokens that arrived since the last
        chunk (none asked: None)."""
        if not job.pending_logprobs:
            return None
        body = self._logprobs(job, job.pending_ids, job.pending_logprobs)
        job.pending_ids, job.pending_logprobs = [], []
        return body

    @staticmethod
    def _chunk(
        job: _Job,
        delta: dict[str, str] | str,
        reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if job.is_chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        chunk = job.envelope(True, choices=[choice])
        if job.include_usage:
            chunk["usage"] = None
        return sse_event(chunk)


def _record_gone(telemetry: RequestTelemetry, job: _Job, request: Request) -> None:
    """The client went away: it hung up (aborted), or its connection was closed because it
    stopped reading (client_stalled, see connections.py)."""
    if request.scope.get(CLIENT_STALLED_KEY):
        telemetry.fail(CLIENT_STALLED, status=499, num_generated=job.num_generated)
    else:
        telemetry.abort(job.num_generated)


def _record_failure(
    telemetry: RequestTelemetry, job: _Job, error: APIError, exc: BaseException | None
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
    telemetry.fail(
        error.label,
        status=error.status,
        num_generated=job.num_generated,
        exc=exc if server_error else None,
        span_error_type=(
            type(exc).__qualname__
            if server_error and exc is not None and not isinstance(exc, APIError)
            else None
        ),
    )


async def _last(
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    telemetry: RequestTelemetry,
    job: _Job,
) -> RequestOutput:
    """The final output; `job.num_generated` follows along (an abort counts what was made)."""
    final = first
    job.num_generated = len(first.outputs[0].token_ids)
    while not final.finished:
        nxt = await anext(outputs, None)
        if nxt is None:
            break
        final = nxt
        job.num_generated = len(final.outputs[0].token_ids)
        telemetry.observe(final)
    return final


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    first = await anext(outputs, None)
    if first is None:
        raise APIError(500, "engine returned no output", type=INTERNAL)
    return first
