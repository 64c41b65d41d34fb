"""Error types that the public API raises.

`EngineDeadError` means the engine cannot serve any more requests (a worker or the engine
core failed); every in-flight and future request gets it. `RequestError` fails one request
only: the engine keeps serving.
"""

from __future__ import annotations

import enum


class FailureCause(enum.StrEnum):
    """Why the engine stopped, when no exception of the failing code names it. On the wire
    (ErrorInfo.type, EngineDeadError.cause_type) the value is a plain string; an exception's
    own class name travels the same way (e.g. "RuntimeError", "InjectedFault")."""

    WORKER_DIED = "WorkerDied"  # a worker process exited without reporting a failure
    ENGINE_CORE_DIED = "EngineCoreDied"  # the engine core process exited without a word
    PROCESS_DIED = "ProcessDied"  # a child died while starting
    STEP_TIMEOUT = "StepTimeout"  # a step ran past --step-timeout
    STEP_MISMATCH = "StepMismatch"  # a worker answered for another step (a protocol bug)
    ENGINE_STALLED = "EngineStalled"  # a frozen engine core, given up by the front end
    STARTUP_TIMEOUT = "StartupTimeout"  # startup ran past --engine-ready-timeout
    ENGINE_SHUTDOWN = "EngineShutdown"  # the engine was shut down by its owner

    @property
    def how(self) -> str:
        """For the crash dump: "died" (no exception), "timeout" (a hang), or "exception"."""
        if self in (FailureCause.WORKER_DIED, FailureCause.ENGINE_CORE_DIED):
            return "died"
        if self is FailureCause.STEP_TIMEOUT:
            return "timeout"
        return "exception"


class ErrorCode(enum.StrEnum):
    """Every machine-readable reason a request can end with: the OpenAI error `code` of
    an HTTP answer, `RequestError.code`, and the `error_type` label of
    `otel_engine_request_errors_total` (docs/observability.md lists them). A closed set:
    a code that is not here is a bug."""

    # The client's request cannot be served (4xx; the engine serves on).
    INVALID_VALUE = "invalid_value"
    INVALID_JSON = "invalid_json"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_PROMPT = "invalid_prompt"
    INVALID_API_KEY = "invalid_api_key"
    REQUEST_TOO_LARGE = "request_too_large"
    TOO_MANY_MESSAGES = "too_many_messages"
    CLIENT_DISCONNECTED = "client_disconnected"  # while it was sending the body
    DUPLICATE_REQUEST = "duplicate_request"
    GRAMMAR_LIMIT_EXCEEDED = "grammar_limit_exceeded"  # a structured request's own budget
    # The request ended early without a server fault.
    ABORTED = "aborted"  # the client went away
    CLIENT_STALLED = "client_stalled"  # the client did not read for --stream-write-timeout
    ABORTED_BY_ENGINE = "aborted_by_engine"
    # The server side.
    ENGINE_DEAD = "engine_dead"
    ENGINE_STALLED = "engine_stalled"
    ENGINE_RECOVERING = "engine_recovering"  # a restart is under way and its queue is full
    ENGINE_FAULT_REQUEST = "engine_fault_request"  # failed the engine twice at its first step
    SHUTTING_DOWN = "shutting_down"
    REQUEST_FAILED = "request_failed"  # one request's output could not be processed
    STRUCTURED_OUTPUT_FAILED = "structured_output_failed"  # its grammar failed in the engine
    # Answers written below the app, to a connection rather than a request (connections.py);
    # they close the connection and reach no request metric.
    INVALID_FRAMING = "invalid_framing"
    REQUEST_TIMEOUT = "request_timeout"
    TOO_MANY_CONNECTIONS = "too_many_connections"


class OtelEngineError(Exception):
    """Base class of every error otel-engine raises on purpose."""


class EngineDeadError(OtelEngineError):
    """The engine is unrecoverable: a process died, raised, or hung.

    `cause_type` names the original exception class (e.g. `RuntimeError`, `WorkerDied`),
    `failed_process` the process that failed (`worker-1`, `engine_core`), so that the HTTP
    layer can name the cause without a traceback.
    """

    def __init__(
        self,
        message: str,
        *,
        cause_type: str = "EngineDeadError",
        failed_process: str = "",
        traceback: str = "",
        crash_context: dict[str, str] | None = None,
        location: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.cause_type = cause_type
        self.failed_process = failed_process
        self.location = location  # `ErrorInfo.location`: safe for clients
        self.traceback = traceback
        self.crash_context = crash_context or {}  # W3C context of the span with the crash


class EngineStartupError(OtelEngineError):
    """A process failed while starting (bad path, bad weights, exception in init).

    `failed_process` names the process that failed (`otel-worker-1`), `cause_type` and
    `cause_message` its original exception, `traceback` the child's formatted traceback.
    """

    def __init__(
        self,
        message: str,
        *,
        failed_process: str = "",
        traceback: str = "",
        cause_type: str = "EngineStartupError",
        cause_message: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.failed_process = failed_process
        self.traceback = traceback
        self.cause_type = cause_type
        self.cause_message = cause_message or message


class RequestError(OtelEngineError):
    """One request cannot be served (invalid parameters, prompt too long); others go on.

    `code` is a short machine-readable reason used by the HTTP layer and the metrics;
    `param` names the offending request field when one is to blame.
    """

    def __init__(
        self, message: str, *, code: str = "invalid_request", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class RequestFailedError(OtelEngineError):
    """One request failed inside the engine for a reason that is not the client's (its
    output could not be processed, or it was in the failing batch of two engine failures:
    `crash_context` is then the W3C context of the span with the last crash, and
    `cause_type` that failure's type, as an engine death's error names its cause); the
    engine keeps serving every other request."""

    def __init__(
        self,
        message: str,
        *,
        code: str = ErrorCode.REQUEST_FAILED,
        crash_context: dict[str, str] | None = None,
        cause_type: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.crash_context = crash_context or {}
        self.cause_type = cause_type


class EngineRecoveringError(OtelEngineError):
    """A new request came while the engine restarts (`--on-engine-failure restart`) and as
    many requests as may wait for it already do: try again in `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
