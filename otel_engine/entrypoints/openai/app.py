"""The FastAPI app: the OpenAI routes (completions, chat, Responses, models, tokenize), the
probes and /metrics, each documented with the answers and errors it really sends
(openapi.py), behind the network room's layers (tracing, access log, internal errors, guard).

The app gives the network room what it needs of the OpenAI surface: which bodies hold chat
messages (counted before validation, bodies.py) and what to close at shutdown.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from otel_engine.entrypoints.network.access_log import AccessLogMiddleware
from otel_engine.entrypoints.network.bodies import BodyParser, body_route_class
from otel_engine.entrypoints.network.errors import (
    InternalErrorMiddleware,
    engine_recovering,
    engine_stalled,
    engine_unavailable,
    error_response,
    install_error_handlers,
)
from otel_engine.entrypoints.network.guard import GuardMiddleware, ServerState
from otel_engine.entrypoints.network.http_tracing import HttpTracingMiddleware
from otel_engine.entrypoints.openai.openapi import (
    CONNECTION_ERRORS,
    GENERATION_ERRORS,
    GUARD_ERRORS,
    errors,
    install_openapi,
    json_or_events,
)
from otel_engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from otel_engine.entrypoints.openai.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    HealthResponse,
    LoadResponse,
    ModelList,
    ResponseObject,
    TokenizeResponse,
)
from otel_engine.entrypoints.openai.responses_request import ResponsesRequest
from otel_engine.entrypoints.openai.serving import OpenAIServing

# The bodies whose chat messages are counted before pydantic sees them.
CHAT_BODIES = (ChatCompletionRequest, TokenizeRequest)

# Recent FastAPI versions trace, meter and log requests by themselves once a provider is set;
# our own middleware does that (with redaction and probes left out), so theirs stays off.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {
        "telemetry": {
            "tracing": False,
            "metrics": False,
            "logs": False,
            "operation_spans": False,
            "auto_configure": False,
        }
    }
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def build_app(
    state: ServerState,
    *,
    allow_special_tokens_in_content: bool = False,
    tool_call_parser: str = "auto",
) -> FastAPI:
    """The FastAPI app serving `state.engine`; the engine's lifetime stays with the caller.
    `allow_special_tokens_in_content`: control tokens in clients' messages render as such
    (engine/chat.py); `tool_call_parser`: the format of tool calls (tools/plan.py)."""
    app = FastAPI(title="otel-engine", docs_url=None, redoc_url=None, **_NO_NATIVE_TELEMETRY)
    app.state.metrics = state.metrics
    app.state.log_budget = state.log_budget  # errors.py: request.failed lines per client
    install_error_handlers(app)
    serving = app.state.serving = OpenAIServing(
        state.engine,
        state.metrics,
        state.drain_expired,
        max_prompt_chars=state.limits.prompt_chars(state.engine.max_model_len),
        allow_special_tokens_in_content=allow_special_tokens_in_content,
        tool_call_parser=tool_call_parser,
    )
    bodies = BodyParser(CHAT_BODIES)
    app.router.route_class = body_route_class(bodies)  # bodies off the event loop
    state.on_shutdown += [serving.close, bodies.close]

    @app.get(
        "/health",
        responses={200: {"model": HealthResponse}, **errors(*CONNECTION_ERRORS)},
    )
    async def health() -> Response:
        # Readiness: 503 while the engine cannot take work now (dead, draining, stalled,
        # or restarting after a failure: then with Retry-After).
        error = state.unavailable()
        if error is None and state.engine.is_recovering:
            error = engine_recovering(state.engine.retry_after_s)
        if error is None and state.engine.is_stalled:
            error = engine_stalled(max(state.engine.stalled_for, state.engine.silent_for))
        if error is not None:
            return error_response(error)
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get(
        "/health/live",
        responses={200: {"model": HealthResponse}, **errors(*CONNECTION_ERRORS)},
    )
    async def live() -> Response:
        # Liveness: 503 only when a restart of the pod is the cure (the engine is dead or
        # stalled); 200 while draining or while the engine restarts in place.
        engine = state.engine
        if engine.is_dead:
            return error_response(engine_unavailable(engine.dead_error))
        if engine.is_stalled:
            return error_response(engine_stalled(max(engine.stalled_for, engine.silent_for)))
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/get_load", response_model=LoadResponse, responses=errors(*CONNECTION_ERRORS))
    async def get_load() -> dict[str, int]:
        # vLLM's router polls this for power_of_two, adding its own count of what it sent
        return {"load": state.num_in_flight}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {"description": "Prometheus text (OpenMetrics when asked for in Accept)."},
            **errors(*CONNECTION_ERRORS),
        },
    )
    async def metrics(request: Request) -> Response:
        state.update_health()
        # Once the engine is dead and every in-flight request has counted its error, this
        # scrape holds the failure; the server may exit after it (--final-scrape-wait).
        is_settled = state.engine.is_dead and not state.num_in_flight
        # Prometheus asks for OpenMetrics, the exposition that carries exemplars (trace ids).
        accept = request.headers.get("accept", "")
        body, content_type = state.metrics.render(
            openmetrics="application/openmetrics-text" in accept
        )
        state.is_dead_scraped = state.is_dead_scraped or is_settled
        return Response(body, media_type=content_type)

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses=errors(*CONNECTION_ERRORS, *GUARD_ERRORS),
    )
    async def models() -> dict[str, object]:
        card = {
            "id": state.engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "otel-engine",
            "max_model_len": state.engine.max_model_len,
            "sampling_defaults": state.engine.generation_defaults.values,
            "fast_paths": state.engine.fast_paths,
            "memory_bandwidth": state.metrics.bandwidth.part(),
        }
        return {"object": "list", "data": [card]}

    generation_errors = errors(*CONNECTION_ERRORS, *GUARD_ERRORS, *GENERATION_ERRORS)

    @app.post(
        "/v1/completions",
        responses={**json_or_events(CompletionResponse, "The completion."), **generation_errors},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post(
        "/v1/chat/completions",
        responses={
            **json_or_events(ChatCompletionResponse, "The chat completion."),
            **generation_errors,
        },
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post(
        "/v1/responses",
        responses={
            **json_or_events(ResponseObject, "The response (not stored)."),
            **generation_errors,
        },
    )
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await serving.responses(body, request)

    token_errors = errors(*CONNECTION_ERRORS, *GUARD_ERRORS, 400, 404, 500)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=token_errors)
    async def tokenize(body: TokenizeRequest) -> dict[str, object]:
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=token_errors)
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        return await serving.detokenize(body)

    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(AccessLogMiddleware, budget=state.log_budget)
    app.add_middleware(HttpTracingMiddleware)
    install_openapi(app)
    return app
