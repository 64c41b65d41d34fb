"""The server's OpenAPI document (GET /openapi.json) says what it really answers.

Every route lists the errors it can send, each with the OpenAI-style error body
(`ErrorResponse`): the connection layer's 408 and 503 apply to any request, the guard's
401/413/503 to every /v1 route, validation's 400 and 404 to the generation routes, and 500 to
anything that reaches the engine. FastAPI's default 422 is gone: validation errors are 400s.
Completions and chat completions document their JSON body and their `text/event-stream` form;
`/metrics` is Prometheus text.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from otel_engine.entrypoints.openai.response_models import ErrorResponse

_WHY = {
    400: "Invalid request (the body, a parameter, or a prompt longer than the context).",
    401: "Missing or wrong API key (only when the server has one).",
    404: "Unknown model.",
    408: "The request did not arrive whole within --request-read-timeout.",
    413: "The request body is larger than the limit.",
    500: "The engine failed, or an internal error.",
    503: "Shutting down, the engine is not serving, or too many open connections.",
}
# One server-sent event (the schema of a text/event-stream describes each event before
# OpenAPI 3.2): `data` is a JSON chunk, an error body, or "[DONE]".
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
}
CONNECTION_ERRORS = (408, 503)
GUARD_ERRORS = (401, 413, 503)
GENERATION_ERRORS = (400, 404, 500)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, each with the error body."""
    return {status: {"model": ErrorResponse, "description": _WHY[status]} for status in statuses}


def json_or_events(model: type, description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or server-sent events when the request streams."""
    return {
        200: {
            "model": model,
            "description": description,
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        }
    }


def install_openapi(app: FastAPI) -> None:
    """Generate the document once, without FastAPI's 422 responses and their schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
