"""The OpenAPI document describes the server as it is, and a seeded fuzzer run against it
finds no 5xx and no answer the document does not allow."""

from __future__ import annotations

from typing import Any

import pytest

from otel_engine.entrypoints.openai.fields import MAX_CHOICES
from otel_engine.sampling_params import BOUNDS
from tests.entrypoints.conftest import Served
from tests.helpers.fuzz import run_schemathesis

pytestmark = pytest.mark.slow  # starts servers or engine processes


@pytest.fixture(scope="module")
def document(served: Served) -> dict[str, Any]:
    with served.http() as client:
        return client.get("/openapi.json").json()  # type: ignore[no-any-return]


def _responses(document: dict[str, Any], path: str, method: str) -> dict[str, Any]:
    return document["paths"][path][method]["responses"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_generation_routes_list_their_real_errors(document: dict[str, Any], path: str) -> None:
    """Item 12: 400/401/404/408/413/500/503 with the error body; no 422 (never sent)."""
    responses = _responses(document, path, "post")

    assert {"200", "400", "401", "404", "408", "413", "500", "503"} == set(responses)
    for status in ("400", "401", "404", "408", "413", "500", "503"):
        schema = responses[status]["content"]["application/json"]["schema"]
        assert {"$ref": "#/components/schemas/ErrorResponse"} == schema
    assert "HTTPValidationError" not in document["components"]["schemas"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionResponse"),
        ("/v1/responses", "ResponseObject"),
    ],
)
def test_generation_routes_describe_json_and_event_stream(
    document: dict[str, Any], path: str, body: str
) -> None:
    """Item 12: the 200 is the completion object as JSON, or a stream of events."""
    content = _responses(document, path, "post")["200"]["content"]

    assert {"$ref": f"#/components/schemas/{body}"} == content["application/json"]["schema"]
    assert ["data"] == content["text/event-stream"]["schema"]["required"]
    assert document["components"]["schemas"][body]["required"]


def test_metrics_is_documented_as_text(document: dict[str, Any]) -> None:
    """Item 12: /metrics is Prometheus text, not JSON."""
    assert ["text/plain"] == list(_responses(document, "/metrics", "get")["200"]["content"])


def test_integers_accept_integral_floats_in_the_schema_sense(document: dict[str, Any]) -> None:
    """Item 12: `n` is a JSON Schema integer (the server takes 1.0 as 1: test_hostile)."""
    properties = document["components"]["schemas"]["CompletionRequest"]["properties"]

    assert "integer" == properties["n"]["type"]


BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Request fields held to a sampling field's bound under another name
RENAMED = {
    "max_completion_tokens": "max_tokens",
    "max_output_tokens": "max_tokens",
    "top_logprobs": "logprobs",
}


@pytest.mark.parametrize(
    "schema", ["CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"]
)
def test_the_document_states_the_sampling_bounds(document: dict[str, Any], schema: str) -> None:
    """Every numeric field's minimum and maximum are its `BOUNDS` entry (`n` and `best_of`:
    1 to MAX_CHOICES); no other field states one."""
    properties = document["components"]["schemas"][schema]["properties"]
    stated = {
        name: {key: value for key, value in prop.items() if key in BOUND_KEYWORDS}
        for name, prop in properties.items()
    }
    expected: dict[str, dict[str, float]] = {name: {} for name in properties}
    for name in properties:
        rule = RENAMED.get(name, name)
        if rule in BOUNDS and not (schema == "ChatCompletionRequest" and name == "logprobs"):
            expected[name] = BOUNDS[rule].json_schema()
        if name in ("n", "best_of"):
            expected[name] = {"minimum": 1, "maximum": MAX_CHOICES}

    assert expected == stated
    assert any(stated.values())


def test_fuzzer_finds_no_server_error_and_no_undocumented_answer(served: Served) -> None:
    """Item 12: a short seeded schemathesis run (the full one is `make fuzz`): every answer
    conforms to the document and none is a 5xx."""
    result = run_schemathesis(served.base_url, max_examples=30, seed=20261130, phases="fuzzing")

    assert 0 == result.returncode, result.stdout[-8000:] + result.stderr[-2000:]
