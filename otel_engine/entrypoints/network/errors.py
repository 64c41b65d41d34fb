"""HTTP errors, in one place: status codes, OpenAI-style bodies, the mapping from the
engine's exceptions, and the FastAPI exception handlers that answer them.

Every error the HTTP API returns has the body
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
Messages never echo request content (prompts, token ids) and never carry a traceback.
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from otel_engine.entrypoints.network.access_log import ClientLogBudget, client_address
from otel_engine.errors import (
    EngineDeadError,
    EngineRecoveringError,
    ErrorCode,
    RequestError,
    RequestFailedError,
)
from otel_engine.observability.log_limits import RateLimitedLog

logger = logging.getLogger("otel_engine.api_server")
_INTERNAL_ERRORS = RateLimitedLog(logger)

INVALID_REQUEST = "invalid_request_error"
INTERNAL = "internal_server_error"
UNAVAILABLE = "service_unavailable_error"


class APIError(Exception):
    """An error answered to the client as is: HTTP status plus the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # A message may quote the client (a model name): keep it encodable whatever they sent.
        message = message.encode("utf-8", "replace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503 that will pass
        self.is_counted = False  # the request's telemetry already recorded this error

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def label(self) -> str:
        """A bounded label for the errors metric."""
        return self.code or self.type


def is_server_error(status: int) -> bool:
    """5xx: the server's fault (span status ERROR, warning log lines)."""
    return status >= HTTPStatus.INTERNAL_SERVER_ERROR


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_request_error(error: RequestError) -> APIError:
    return APIError(400, error.message, param=error.param, code=error.code)


def from_engine_dead(error: EngineDeadError) -> APIError:
    """500 naming the cause class, the failed process and, for a hung rank, where it hung;
    never the exception's message or traceback."""
    where = f" in {error.failed_process}" if error.failed_process else ""
    location = f": {error.location}" if error.location else ""
    return APIError(
        500,
        f"engine failed: {error.cause_type}{where}{location}",
        type=INTERNAL,
        code=ErrorCode.ENGINE_DEAD,
    )


EngineError = RequestError | RequestFailedError | EngineDeadError | EngineRecoveringError
# What `AsyncLLM.generate` raises for one request: answered by `from_engine_error`.
ENGINE_ERRORS = (RequestError, RequestFailedError, EngineDeadError, EngineRecoveringError)


def from_engine_error(exc: EngineError) -> APIError:
    """What a request answers for an exception the engine raised for it."""
    if isinstance(exc, RequestError):
        return from_request_error(exc)
    if isinstance(exc, RequestFailedError):
        return APIError(500, exc.message, type=INTERNAL, code=exc.code)
    if isinstance(exc, EngineRecoveringError):
        return engine_recovering(exc.retry_after_s)
    return from_engine_dead(exc)


def engine_recovering(retry_after_s: float) -> APIError:
    """503 while the engine restarts (`--on-engine-failure restart`): /health's answer, and
    a new request's when the queue of requests waiting for the restart is full."""
    return APIError(
        503,
        "engine is restarting after a failure; retry shortly",
        type=UNAVAILABLE,
        code=ErrorCode.ENGINE_RECOVERING,
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


def internal_error(exc: BaseException, **log_fields: Any) -> APIError:
    """500 for an unexpected exception (a bug), logged with its traceback at most once a
    second (a client that found the bug can repeat it thousands of times a second; the
    errors metric counts every one)."""
    fields = {"error_type": type(exc).__name__, **log_fields}
    _INTERNAL_ERRORS.log(logging.ERROR, "request.internal_error", exc_info=exc, **fields)
    return APIError(500, f"internal error: {type(exc).__name__}", type=INTERNAL)


def aborted_by_engine() -> APIError:
    """The engine finished the request as aborted without being asked (a bug, or shutdown)."""
    return APIError(
        503, "request was aborted by the engine", type=UNAVAILABLE, code=ErrorCode.ABORTED_BY_ENGINE
    )


def engine_unavailable(error: EngineDeadError | None) -> APIError:
    cause = f": {error.cause_type}" if error is not None else ""
    return APIError(
        503, f"engine is not serving{cause}", type=UNAVAILABLE, code=ErrorCode.ENGINE_DEAD
    )


def engine_stalled(seconds: float) -> APIError:
    """/health while the engine core is stalled: work is pending and no step finished within
    --step-timeout, or the core sent not even a heartbeat for `timing.HEARTBEAT_TIMEOUT_S`."""
    return APIError(
        503,
        f"engine made no progress for {seconds:.0f} s (no step with work pending, or frozen)",
        type=UNAVAILABLE,
        code=ErrorCode.ENGINE_STALLED,
    )


def draining() -> APIError:
    return APIError(503, "server is shutting down", type=UNAVAILABLE, code=ErrorCode.SHUTTING_DOWN)


def error_response(error: APIError) -> Response:
    return Response(
        msgspec.json.encode(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


def from_validation_error(exc: RequestValidationError) -> APIError:
    """400 naming the first offending top-level field (FastAPI would answer 422)."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request("request body is not valid JSON", code=ErrorCode.INVALID_JSON)
    if not loc:
        return bad_request(f"invalid request body: {first.get('msg', 'invalid')}")
    param = str(loc[0])
    if first.get("type") == "missing":
        return bad_request(
            f"missing required parameter '{param}'",
            param=param,
            code=ErrorCode.MISSING_REQUIRED_PARAMETER,
        )
    same_field = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == [param]]
    detail = "invalid type" if len(same_field) > 1 else first.get("msg", "invalid value")
    return bad_request(
        f"invalid value for '{param}': {detail}", param=param, code=ErrorCode.INVALID_VALUE
    )


async def _answer(request: Request, exc: Exception) -> Response:
    """Count and log errors that no request telemetry recorded (raised before admission):
    every one counted; one a client can repeat at will (a 4xx, or a 500 without a code: a
    bug) logged within the client's budget of lines (`ClientLogBudget`, the app's
    `log_budget`), one the server's state causes (a dead engine, a drain) every time."""
    assert isinstance(exc, APIError)
    state = request.app.state
    if not exc.is_counted and request.url.path.startswith("/v1/"):
        metrics = getattr(state, "metrics", None)
        if metrics is not None:
            metrics.on_request_error(exc.label)
        level = logging.WARNING if is_server_error(exc.status) else logging.INFO
        fields = {"status": exc.status, "error_type": exc.label}
        budget: ClientLogBudget | None = getattr(state, "log_budget", None)
        is_repeatable = not is_server_error(exc.status) or exc.code is None
        if budget is None or not is_repeatable:
            logger.log(level, "request.failed", extra=fields)
        else:
            budget.log(level, "request.failed", client_address(request.scope), **fields)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return await _answer(request, from_validation_error(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    error = APIError(
        exc.status_code,
        str(exc.detail),
        type=INTERNAL if is_server_error(exc.status_code) else INVALID_REQUEST,
    )
    response = await _answer(request, error)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return await _answer(request, from_request_error(exc))


async def _engine_dead(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, EngineDeadError)
    return await _answer(request, from_engine_dead(exc))


async def _unexpected(request: Request, exc: Exception) -> Response:
    return await _answer(request, internal_error(exc))


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path of `app` to an OpenAI-style body (unexpected exceptions:
    `InternalErrorMiddleware`, which `build_app` installs)."""
    app.add_exception_handler(APIError, _answer)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)


class InternalErrorMiddleware:
    """An unexpected exception becomes a 500 with an OpenAI-style body, and the connection
    stays usable. (Starlette's own handler for `Exception` re-raises to the server, which
    logs "Exception in ASGI application" and drops the keep-alive connection without
    `Connection: close`, so the client's next request on it fails.) An exception after the
    response started cannot be answered: it goes on to the server, which closes the
    connection, the only signal left."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def watch_start(message: Message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch_start)
        except Exception as exc:
            if is_started:
                raise
            response = await _unexpected(Request(scope, receive), exc)
            await response(scope, receive, send)
