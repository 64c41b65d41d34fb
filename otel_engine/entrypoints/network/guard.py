"""What every API request (/v1/..., /tokenize, /detokenize) passes before the app: API key,
availability, body size.

The API key is read from exactly one `Authorization` header whose scheme is `Bearer` in any
case (RFC 9110: schemes are case-insensitive); two headers are refused, not resolved.

`ServerState` is what the guard, the routes and the runner share about one server: the
engine, the metrics (fed by the engine's per-step stats), the number of requests in flight,
the drain state and the health state it implies, and what the app closes at shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from otel_engine.entrypoints.network.access_log import ClientLogBudget, client_address
from otel_engine.entrypoints.network.errors import (
    APIError,
    draining,
    engine_unavailable,
    error_response,
)
from otel_engine.entrypoints.network.limits import ServerLimits
from otel_engine.errors import ErrorCode
from otel_engine.observability.label_sets import HealthState
from otel_engine.observability.metrics import EngineMetrics
from otel_engine.timing import DRAIN_CANCEL_GRACE_S

if TYPE_CHECKING:
    from otel_engine import AsyncLLM
    from otel_engine.ipc.messages import StepOutputs
    from otel_engine.observability.metrics import StepStats

logger = logging.getLogger("otel_engine.api_server")


@dataclass(slots=True)
class ServerState:
    """What the guard, the routes and the runner share about one server."""

    engine: AsyncLLM
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    num_in_flight: int = 0
    is_draining: bool = False
    is_dead_scraped: bool = False  # /metrics was served after the engine died, errors counted
    drain_expired: asyncio.Event = field(default_factory=asyncio.Event)
    # Per-client budget of the lines a request can cause before it is admitted.
    log_budget: ClientLogBudget = field(default_factory=ClientLogBudget)
    # What the app closes once the server has drained (its worker threads), registered by
    # the app as it is built.
    on_shutdown: list[Callable[[], None]] = field(default_factory=list)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.engine.add_step_listener(step_listener(self.metrics))
        self.engine.add_recovery_listener(self.metrics)

    def unavailable(self) -> APIError | None:
        """The 503 every new request gets, or None while the server serves."""
        if self.engine.is_dead:
            self.metrics.set_health(HealthState.DEAD)
            return engine_unavailable(self.engine.dead_error)
        if self.is_draining:
            return draining()
        return None

    def update_health(self) -> HealthState:
        """Set the health gauge from the engine and drain state; returns the state."""
        if self.engine.is_dead:
            state = HealthState.DEAD
        elif self.is_draining:
            state = HealthState.DRAINING
        elif self.engine.is_recovering:
            state = HealthState.RECOVERING
        elif self.engine.is_stalled:
            state = HealthState.STALLED
        else:
            state = HealthState.HEALTHY
        self.metrics.set_health(state)
        return state

    def enter(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.num_in_flight -= 1
        if not self.num_in_flight:
            self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, wait up to `grace_s` for in-flight ones, then end them."""
        self.is_draining = True
        self.update_health()
        if await self._wait_idle(grace_s):
            return
        logger.warning("shutdown.drain_expired", extra={"num_in_flight": self.num_in_flight})
        self.drain_expired.set()
        await self._wait_idle(DRAIN_CANCEL_GRACE_S)

    async def _wait_idle(self, seconds: float) -> bool:
        if not self.num_in_flight:
            return True
        try:
            async with asyncio.timeout(seconds):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


def is_guarded(path: str) -> bool:
    """The API's paths: what the API key protects (/health and /metrics stay open)."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class GuardMiddleware:
    """Checks every API request (`is_guarded`) before the app sees it: API key,
    availability, body size.

    The body is read here (up to the cap) and replayed to the app, so an oversized body is
    refused whether or not it announced its length.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self._api_key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        self.state.enter()
        try:
            error = self._check_headers(scope)
            body = b""
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body, error = await self._read_body(receive)
            if error is not None:
                self.state.metrics.on_request_error(error.label)
                self.state.log_budget.log(
                    logging.INFO,
                    "request.failed",
                    client_address(scope),
                    status=error.status,
                    error_type=error.label,
                )
                await error_response(error)(scope, receive, send)
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.leave()

    def _check_headers(self, scope: Scope) -> APIError | None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self._api_key is not None:
            error = _check_api_key([v for k, v in headers if k == b"authorization"], self._api_key)
            if error is not None:
                return error
        unavailable = self.state.unavailable()
        if unavailable is not None:
            return unavailable
        limit = self.state.limits.max_body_bytes
        length = dict(headers).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit)
        return None

    async def _read_body(self, receive: Receive) -> tuple[bytes, APIError | None]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", APIError(400, "client disconnected", code=ErrorCode.CLIENT_DISCONNECTED)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.state.limits.max_body_bytes:
                return b"", _too_large(self.state.limits.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def step_listener(metrics: EngineMetrics) -> Callable[[StepOutputs], None]:
    """Feeds the engine's per-step stats to `metrics`; holds it weakly (servers come and go
    while an engine lives on)."""
    ref = weakref.ref(metrics)

    def on_step(step: StepOutputs) -> None:
        target = ref()
        if target is not None:
            target.on_step(cast("StepStats", step))  # StepStats declares its fields writable

    return on_step


API_KEY_ENV = "OTEL_ENGINE_API_KEY"


class ApiKeyError(Exception):
    """The API key's source cannot be used (two sources, an unreadable or empty file)."""


def resolve_api_key(flag: str | None, path: str | None, environ: Mapping[str, str]) -> str | None:
    """The server's API key: from `--api-key-file`, else `--api-key` (with a warning: every
    local user can read a command line in /proc), else `$OTEL_ENGINE_API_KEY`; None (or an
    empty value) means no key is required."""
    if flag is not None and path is not None:
        raise ApiKeyError("give --api-key or --api-key-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as file:
                key = file.readline().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ApiKeyError(f"cannot read --api-key-file: {type(error).__name__}") from None
        if not key:
            raise ApiKeyError("--api-key-file is empty")
        return key
    if flag is not None:
        logger.warning(
            "server.api_key_on_command_line",
            extra={"use_instead": f"--api-key-file or ${API_KEY_ENV}"},
        )
        return flag or None
    return environ.get(API_KEY_ENV) or None


def _check_api_key(values: list[bytes], api_key: bytes) -> APIError | None:
    """401 unless there is exactly one `Authorization: Bearer <api_key>` header."""
    if len(values) > 1:
        return APIError(
            401, "more than one Authorization header was sent", code=ErrorCode.INVALID_API_KEY
        )
    scheme, _, token = values[0].strip().partition(b" ") if values else (b"", b"", b"")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), api_key):
        return APIError(401, "invalid or missing API key", code=ErrorCode.INVALID_API_KEY)
    return None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code=ErrorCode.REQUEST_TOO_LARGE)


def _replay(body: bytes, receive: Receive) -> Receive:
    is_sent = False

    async def replayed() -> Message:
        nonlocal is_sent
        if is_sent:
            return await receive()
        is_sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
