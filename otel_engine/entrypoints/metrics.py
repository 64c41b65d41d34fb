"""Prometheus metrics of the HTTP API, kept in a private registry (never the global one).

Two servers in one process (tests, an embedding host program) each get their own registry,
so their counters never mix and never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]


class ServerMetrics:
    """Request outcomes and token counts, all named `otel_engine_*`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.request_success = Counter(
            "otel_engine_request_success",
            "Requests that finished, by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            "otel_engine_request_errors",
            "Requests that failed, by error type.",
            ["error_type"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "otel_engine_prompt_tokens",
            "Prompt tokens of admitted requests.",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "otel_engine_generation_tokens",
            "Generated tokens, streamed or returned.",
            registry=self.registry,
        )
        self.requests_in_flight = Gauge(
            "otel_engine_http_requests_in_flight",
            "API requests being served now.",
            registry=self.registry,
        )
        self.engine_healthy = Gauge(
            "otel_engine_engine_healthy",
            "1 while the engine serves, 0 once it is dead.",
            registry=self.registry,
        )
        self.engine_healthy.set(1)

    def record_finished(self, finish_reason: str) -> None:
        self.request_success.labels(finish_reason=finish_reason).inc()

    def record_tokens(self, num_prompt: int, num_generated: int) -> None:
        """Counted once per admitted request, whatever its outcome."""
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)

    def record_error(self, error_type: str) -> None:
        self.request_errors.labels(error_type=error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
