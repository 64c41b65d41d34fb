"""The OpenAI-compatible HTTP server: FastAPI app, request guard, uvicorn runner.

The engine is created before the server (so the port opens only when the engine is ready)
and is owned by the caller; the app only uses it. `ApiServer` adds to uvicorn what an
inference server needs: a drain period on SIGTERM (new requests get 503, in-flight ones
finish or get 503 at the deadline) and an exit with code 1 once the engine is dead. Every
HTTP request but the probes gets a SERVER span; `/metrics` serves the `EngineMetrics`
registry, which `run_server` also exports over OTLP when an endpoint is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import resource
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from otel_engine.entrypoints.network.access_log import AccessLogMiddleware
from otel_engine.entrypoints.network.bodies import body_route_class
from otel_engine.entrypoints.network.connections import (
    ConnectionTable,
    protocol_class,
    rate_limited_exception_handler,
)
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
from otel_engine.entrypoints.network.limits import ServerLimits
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
from otel_engine.ipc.roles import ProcessRole
from otel_engine.memory import freeze_startup_objects
from otel_engine.observability.label_sets import HealthState
from otel_engine.observability.metrics import EngineMetrics
from otel_engine.observability.otlp_export import on_export_failure
from otel_engine.observability.otlp_metrics import start_otlp_metrics
from otel_engine.timing import GRACEFUL_HTTP_SHUTDOWN_S

if TYPE_CHECKING:
    from otel_engine import AsyncLLM

logger = logging.getLogger("otel_engine.api_server")

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


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app serving `state.engine`; the engine's lifetime stays with the caller."""
    app = FastAPI(title="otel-engine", docs_url=None, redoc_url=None, **_NO_NATIVE_TELEMETRY)
    app.state.metrics = state.metrics
    install_error_handlers(app)
    serving = state.serving = OpenAIServing(
        state.engine,
        state.metrics,
        state.drain_expired,
        max_prompt_chars=state.limits.prompt_chars(state.engine.max_model_len),
        allow_special_tokens_in_content=state.allow_special_tokens_in_content,
        tool_call_parser=state.tool_call_parser,
    )
    app.router.route_class = body_route_class(serving.bodies)  # bodies off the event loop

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


class ApiServer(uvicorn.Server):
    """uvicorn plus a drain on shutdown and an exit once the engine is dead.

    With `final_scrape_wait` > 0 the exit after an engine death waits (at most that long) for
    one GET /metrics that shows the failure, so a Prometheus that scrapes every 15 s still
    records the dead state and the requests the death failed before the process is gone.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        drain_timeout: float,
        exit_on_engine_death: bool = True,
        final_scrape_wait: float = 0.0,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.connections = ConnectionTable(state.limits, state.metrics)
        config.http = protocol_class(self.connections)
        state.metrics.connections_open.set_function(lambda: len(self.connections.open))
        state.metrics.frontend_requests.set_function(lambda: state.engine.num_tracked)
        self.drain_timeout = drain_timeout
        self.exit_on_engine_death = exit_on_engine_death
        self.final_scrape_wait = final_scrape_wait
        self.exit_code = 0
        self._exit_deadline = 0.0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        freeze_startup_objects()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(rate_limited_exception_handler(self.connections.log))
        await super().startup(sockets)
        if self.started:
            self.state.update_health()
            logger.info("server.listening", extra={"address": _address(self, sockets)})

    async def on_tick(self, counter: int) -> bool:
        if self.state.engine.is_dead and self.exit_code == 0:
            error = self.state.engine.dead_error
            logger.error(
                "server.engine_dead",
                extra={
                    "cause_type": error.cause_type if error else None,
                    "failed_process": error.failed_process if error else None,
                },
            )
            self.state.metrics.set_health(HealthState.DEAD)
            self.exit_code = 1
            self._exit_deadline = time.monotonic() + self.final_scrape_wait
            if self.final_scrape_wait > 0 and self.exit_on_engine_death:
                logger.info("server.final_scrape_wait", extra={"timeout_s": self.final_scrape_wait})
        if self.exit_code and self.exit_on_engine_death and not self.should_exit:
            self.should_exit = self.state.is_dead_scraped or time.monotonic() >= self._exit_deadline
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutdown.begin", extra={"num_in_flight": self.state.num_in_flight})
        await self.state.drain(self.drain_timeout)
        await super().shutdown(sockets)
        if self.state.serving is not None:
            self.state.serving.close()


def _address(server: uvicorn.Server, sockets: list[socket.socket] | None) -> str:
    for sock in sockets or [s for srv in server.servers for s in (srv.sockets or ())]:
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}"
    return ""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (but do not listen) early, so a busy port fails before the engine starts."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def make_server(
    engine: AsyncLLM,
    *,
    api_key: str | None = None,
    drain_timeout: float | None = None,
    exit_on_engine_death: bool = True,
    final_scrape_wait: float = 0.0,
    limits: ServerLimits | None = None,
    allow_special_tokens_in_content: bool = False,
    tool_call_parser: str = "auto",
    vllm_metric_names: bool = False,
) -> ApiServer:
    """An `ApiServer` for `engine`, ready to `run(sockets=[bind_socket(...)])`.

    With `exit_on_engine_death=False` the server stays up answering 503 after the engine
    died (an embedding host program decides what to do); `exit_code` is 1 either way.
    """
    metrics = EngineMetrics(
        model_name=engine.model_name, process_metrics=True, vllm_names=vllm_metric_names
    )
    metrics.set_fast_paths(engine.fast_paths)
    metrics.set_memory_bandwidth(engine.memory_bandwidth)
    cache = engine.config.cache
    metrics.set_cache_config(
        block_size=cache.block_size,
        num_blocks=engine.num_kv_blocks,
        prefix_caching=cache.enable_prefix_caching,
    )
    on_export_failure(metrics.on_export_failure)
    limits = limits or ServerLimits()
    state = ServerState(
        engine=engine,
        api_key=api_key,
        limits=limits,
        metrics=metrics,
        allow_special_tokens_in_content=allow_special_tokens_in_content,
        tool_call_parser=tool_call_parser,
    )
    timeout = engine.config.timeouts.shutdown_timeout if drain_timeout is None else drain_timeout
    config = uvicorn.Config(
        build_app(state),
        log_config=None,
        access_log=False,  # access_log.py writes it, without query strings, rate-limited
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_HTTP_SHUTDOWN_S,
        timeout_keep_alive=limits.keep_alive_timeout,
    )
    return ApiServer(
        config,
        state,
        drain_timeout=timeout,
        exit_on_engine_death=exit_on_engine_death,
        final_scrape_wait=final_scrape_wait,
    )


# Descriptors the process needs besides client connections (IPC, logs, pipes, the listener).
RESERVED_FDS = 256


def fit_connection_limit(limits: ServerLimits) -> ServerLimits:
    """Raise this process's descriptor limit to its hard limit, and lower the connection
    limit (with a warning) if even that cannot hold it: connections are refused with a 503
    before descriptors run out, never by a failing accept()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    room = soft - RESERVED_FDS
    if limits.max_connections <= room:
        return limits
    allowed = max(1, room)
    logger.warning(
        "server.max_connections_lowered",
        extra={"max_connections": allowed, "requested": limits.max_connections, "fd_limit": soft},
    )
    return dataclasses.replace(limits, max_connections=allowed)


def run_server(
    engine: AsyncLLM,
    sock: socket.socket,
    *,
    api_key: str | None = None,
    final_scrape_wait: float = 0.0,
    limits: ServerLimits | None = None,
    allow_special_tokens_in_content: bool = False,
    tool_call_parser: str = "auto",
    vllm_metric_names: bool = False,
) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or until the engine dies (exit code 1)."""
    limits = fit_connection_limit(limits or ServerLimits())
    server = make_server(
        engine,
        api_key=api_key,
        final_scrape_wait=final_scrape_wait,
        limits=limits,
        allow_special_tokens_in_content=allow_special_tokens_in_content,
        tool_call_parser=tool_call_parser,
        vllm_metric_names=vllm_metric_names,
    )
    start_otlp_metrics(
        server.state.metrics.otlp_registry,
        config=engine.config.observability,
        role=ProcessRole.API_SERVER,
        instance_id=engine.config.instance_id,
    )
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it caught once it has shut down; make that a no-op so
        # that the caller can still shut the engine down and exit with the right code.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    return server.exit_code
