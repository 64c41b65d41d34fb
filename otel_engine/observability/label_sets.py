"""The closed sets the server's metrics count by, one enum each; the value is the label.

`metrics.EngineMetrics` binds a child per member at start, so that every label exists at 0
before its first event, and has no child for a value outside the set. Finish reasons are
`outputs.FinishReason` and error types `errors.ErrorCode`: they are more than labels.
"""

from __future__ import annotations

import enum


class HealthState(enum.StrEnum):
    """The engine's state as /health and `otel_engine_engine_health_state` show it."""

    STARTING = "starting"
    HEALTHY = "healthy"
    DRAINING = "draining"  # shutting down: no new requests, in-flight ones finish
    STALLED = "stalled"  # work is pending and no step finished within --step-timeout
    RECOVERING = "recovering"  # a new engine is starting after a failure (restart)
    DEAD = "dead"


class ConnectionCloseReason(enum.StrEnum):
    """Why the server closed an HTTP connection (entrypoints/network/connections.py); also
    the suffix of its log event, `http.connection_<reason>`."""

    REFUSED = "refused"  # over --max-connections with none idle to evict
    EVICTED = "evicted"  # idle, closed for a new connection
    REQUEST_TIMEOUT = "request_timeout"  # no whole request within --request-read-timeout
    WRITE_STALLED = "write_stalled"  # the client did not read for --stream-write-timeout
    INVALID_FRAMING = "invalid_framing"  # bytes that are not HTTP/1.1


class InvalidJsonReason(enum.StrEnum):
    """Why a structured-output choice was returned without valid JSON
    (engine/structured_output.invalid_json_reason)."""

    LENGTH = "length"  # max_tokens cut it
    STOP_STRING = "stop_string"  # a stop string cut it
    INVALID = "invalid"  # it ended otherwise: a bug


class ToolCallOutcome(enum.StrEnum):
    """What became of a tool call a model wrote (entrypoints/tools/parser.py)."""

    PARSED = "parsed"  # returned as a tool call
    INVALID = "invalid"  # malformed, truncated or naming no tool of the request: returned as text
