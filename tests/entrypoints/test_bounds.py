"""Range rules have one home: a value out of its bound is refused at the edge, before any
tokenization, with the message and `param` the Python API raises for the same value."""

from __future__ import annotations

from typing import Any

import pytest

from otel_engine import SamplingParams
from otel_engine.entrypoints.network.errors import APIError
from otel_engine.entrypoints.openai.fields import MAX_CHOICES
from otel_engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from otel_engine.entrypoints.openai.responses_request import ResponsesRequest
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.sampling_params import BOUNDS, Bound
from tests.entrypoints.conftest import Served

# One value outside each bounded field's range, as a client could send it.
OUT_OF_RANGE: dict[str, Any] = {
    "max_tokens": 0,
    "temperature": 5,
    "top_p": 0,
    "top_k": -2,
    "seed": 2**63,
    "presence_penalty": 2.5,
    "frequency_penalty": -3,
    "repetition_penalty": 0.001,
    "min_p": 1.5,
    "min_tokens": -1,
    "logprobs": 21,
}


def _python_error(field: str, value: Any) -> RequestError:
    with pytest.raises(RequestError) as excinfo:
        SamplingParams(**{field: value}).validate()
    return excinfo.value


def test_every_completion_field_in_the_table_has_an_out_of_range_value() -> None:
    """The table above covers every `BOUNDS` field a completion request can send."""
    sent = set(BOUNDS) & set(CompletionRequest.model_fields)

    assert sent == set(OUT_OF_RANGE)


@pytest.mark.parametrize(
    ("bound", "value", "message"),
    [
        (Bound(0, 2), 5.0, "x must be in [0, 2], got 5"),
        (Bound(0, 1, is_low_open=True), 0, "x must be in (0, 1], got 0"),
        (Bound(1), -3, "x must be at least 1, got -3"),
        (Bound(0.01, 100), float("nan"), "x must be in [0.01, 100], got nan"),
        (Bound(1), -(10**30), "x must be at least 1, got a number of more than 20 digits"),
    ],
)
def test_a_bound_names_the_field_its_interval_and_the_value(
    bound: Bound, value: float, message: str
) -> None:
    with pytest.raises(RequestError) as excinfo:
        bound.check("x", value)

    assert (message, "x", ErrorCode.INVALID_VALUE) == (
        excinfo.value.message,
        excinfo.value.param,
        excinfo.value.code,
    )


@pytest.mark.parametrize(("field", "value"), list(OUT_OF_RANGE.items()))
def test_the_edge_check_says_what_the_python_api_says(field: str, value: Any) -> None:
    """`check_bounds` of a parsed body raises the Python API's message and `param`."""
    expected = _python_error(field, value)
    body = CompletionRequest.model_validate({"prompt": "x", field: value})

    with pytest.raises(APIError) as excinfo:
        body.check_bounds()

    assert (expected.message, expected.param) == (excinfo.value.message, excinfo.value.param)


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        (CompletionRequest, {"prompt": "x", "n": 17}, f"n must be in [1, {MAX_CHOICES}], got 17"),
        (CompletionRequest, {"prompt": "x", "best_of": 0}, "best_of must be in [1, 16], got 0"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens must be at least 1, got 0",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs must be in [0, 20], got 21",
        ),
        (ResponsesRequest, {"input": "x", "max_output_tokens": 0}, None),
        (ResponsesRequest, {"input": "x", "temperature": 2.5}, None),
    ],
)
def test_edge_only_and_renamed_fields_use_the_same_words(
    model: type[CompletionRequest], body: dict[str, Any], message: str | None
) -> None:
    """`n`, `best_of` and the other names of a sampling field (chat's
    max_completion_tokens, Responses' max_output_tokens) say it the same way, naming
    themselves."""
    [field] = [name for name in body if name not in ("prompt", "messages", "input", "logprobs")]
    request = model.model_validate(body)

    with pytest.raises(APIError) as excinfo:
        request.check_bounds()

    assert field == excinfo.value.param
    assert excinfo.value.message.startswith(f"{field} must be ")
    if message is not None:
        assert message == excinfo.value.message


@pytest.mark.slow  # starts engine processes
@pytest.mark.parametrize(("field", "value"), list(OUT_OF_RANGE.items()))
def test_http_400_equals_the_python_api_error(served: Served, field: str, value: Any) -> None:
    """The error body's message and param are the RequestError's of
    `SamplingParams(...).validate()` for the same value."""
    expected = _python_error(field, value)

    with served.http() as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", field: value})

    error = answer.json()["error"]
    assert (400, expected.message, expected.param, "invalid_value") == (
        answer.status_code,
        error["message"],
        error["param"],
        error["code"],
    )


@pytest.mark.slow  # starts engine processes
def test_a_bound_is_checked_before_the_prompt_is_looked_at(served: Served) -> None:
    """A prompt far over the character budget with a bad temperature gets the temperature's
    400: the bounds cost no tokenization."""
    body = {"prompt": "x" * 1_000_000, "temperature": 3}

    with served.http() as client:
        answer = client.post("/v1/completions", json=body)
        without = client.post("/v1/completions", json={**body, "temperature": 1})

    assert (400, "temperature") == (answer.status_code, answer.json()["error"]["param"])
    assert (400, "context_length_exceeded") == (
        without.status_code,
        without.json()["error"]["code"],
    )
