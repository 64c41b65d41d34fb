"""Running an admitted request (`JobRunner`): its telemetry started, its engine stream (one
sample, or the merged samples of `n` and `best_of`), and its answer whole or as server-sent
events in its API's shape (rendering.py, responses.py). A failure, a client that went away or
the drain deadline ends the request's telemetry once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from otel_engine.engine.choices import generate_choices, sample_ids
from otel_engine.entrypoints.network.errors import (
    ENGINE_ERRORS,
    INTERNAL,
    APIError,
    from_engine_error,
    internal_error,
)
from otel_engine.entrypoints.network.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    RequestWatch,
)
from otel_engine.entrypoints.openai import responses
from otel_engine.entrypoints.openai.api_kind import ApiKind
from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.openai.outcome import Outcomes, record_failure, record_gone
from otel_engine.entrypoints.openai.rendering import ResponseRenderer, error_event
from otel_engine.entrypoints.openai.request_telemetry import RequestTelemetry
from otel_engine.entrypoints.openai.response_stream import ResponseStream

if TYPE_CHECKING:
    from otel_engine import AsyncLLM, RequestOutput
    from otel_engine.observability.metrics import EngineMetrics

logger = logging.getLogger("otel_engine.api_server")


class JobRunner:
    """Runs one server's admitted requests on its engine and answers them."""

    def __init__(
        self, engine: AsyncLLM, metrics: EngineMetrics, drain_expired: asyncio.Event
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.drain_expired = drain_expired
        self.log_prompts = engine.config.observability.log_prompts
        self.outcomes = Outcomes(metrics, drain_expired, log_prompts=self.log_prompts)
        self.renderer = ResponseRenderer(engine, self.outcomes)

    async def run(
        self, job: Job, stream: bool, request: Request, prompt: str | list[int]
    ) -> Response:
        """Run `job` and answer it (whole, or as events when `stream`)."""
        telemetry = RequestTelemetry(
            self.metrics,
            request_id=job.request_id,
            operation=job.kind.operation,
            request_model=job.request_model,
            response_model=job.model,
            params=job.params,
            num_prompt_tokens=len(job.prompt_ids),
            is_stream=stream,
            num_choices=job.n,
            tool_names=[f.name for f in job.tools.functions] if job.tools else None,
        )
        with telemetry.activate():
            if self.log_prompts:
                logger.info("request.prompt", extra={"prompt": prompt, "stop": job.params.stop})
            return await self._serve(job, telemetry, stream, request)

    async def _serve(
        self, job: Job, telemetry: RequestTelemetry, stream: bool, request: Request
    ) -> Response:
        if job.num_samples == 1:  # the engine's own stream, no merging layer
            outputs = self.engine.generate(job.prompt_ids, job.params, job.request_id)
        else:
            outputs = generate_choices(
                self.engine.generate, job.prompt_ids, job.params, job.request_id, job.num_samples
            )
        watch = RequestWatch(request.receive, self.drain_expired)
        is_streaming = False
        try:
            first = await watch.run(_first(outputs))
            telemetry.first_output(first)
            if stream:
                is_streaming = True
                ids = sample_ids(job.request_id, job.num_samples)
                hold = lambda held: self.engine.hold(ids, held)  # noqa: E731
                if job.kind is ApiKind.RESPONSES:
                    written = ResponseStream(job)
                    events = responses.events(
                        self.outcomes, written, telemetry, outputs, first, request
                    )
                    return EventStreamResponse(
                        events, watch, lambda error: responses.failed_frames(written, error), hold
                    )
                events = self.renderer.events(job, telemetry, outputs, first, request)
                return EventStreamResponse(events, watch, error_event, hold)
            final = await watch.run(_last(outputs, first, telemetry, job))
            if job.kind is ApiKind.RESPONSES:
                return responses.full_response(self.outcomes, job, telemetry, final)
            return self.renderer.full_response(job, telemetry, final)
        except ClientDisconnected:
            record_gone(telemetry, job, request)
            return Response(status_code=499)
        except (*ENGINE_ERRORS, APIError) as exc:
            error = exc if isinstance(exc, APIError) else from_engine_error(exc)
            record_failure(telemetry, job, error, exc)
            raise error from None
        except Exception as exc:
            error = internal_error(exc, request_id=job.request_id)
            record_failure(telemetry, job, error, exc)
            raise error from None
        finally:
            if not is_streaming:
                await outputs.aclose()  # type: ignore[attr-defined]
                watch.close()
                if not telemetry.is_ended:  # cancelled: the connection or the server went away
                    record_gone(telemetry, job, request)


async def _last(
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    telemetry: RequestTelemetry,
    job: Job,
) -> RequestOutput:
    """The final output; `job.num_generated` follows along (an abort counts what was made)."""
    final = first
    job.count(first)
    while not final.finished:
        nxt = await anext(outputs, None)
        if nxt is None:
            break
        final = nxt
        job.count(final)
        telemetry.observe(final)
    return final


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    first = await anext(outputs, None)
    if first is None:
        raise APIError(500, "engine returned no output", type=INTERNAL)
    return first
