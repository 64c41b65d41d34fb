"""Every client error gets its status and an OpenAI-style body, and the server keeps serving."""

from __future__ import annotations

import socket
from typing import Any

import openai
import pytest

from otel_engine.entrypoints.network.limits import MAX_BODY_BYTES
from tests.entrypoints.conftest import API_KEY, Served

PROMPT = "Once upon a time"


def _error(response: Any) -> dict[str, Any]:
    body = response.json()
    assert {"error"} == set(body)
    assert {"message", "type", "param", "code"} == set(body["error"])
    assert isinstance(body["error"]["message"], str)
    return body["error"]


def _post(served: Served, path: str, **kwargs: Any) -> Any:
    with served.http() as client:
        return client.post(path, **kwargs)


def _completion(served: Served, **fields: Any) -> Any:
    return _post(served, "/v1/completions", json={"prompt": PROMPT, **fields})


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "", '"just a string"'])
def test_malformed_json_is_400(served: Served, content: str) -> None:
    """A body that is not a JSON object is a 400 invalid_request_error (not FastAPI's 422)."""
    response = _post(
        served, "/v1/completions", content=content, headers={"content-type": "application/json"}
    )

    assert 400 == response.status_code
    assert "invalid_request_error" == _error(response)["type"]


def test_missing_field_is_400_naming_it(served: Served) -> None:
    """A missing required field is a 400 whose param names the field."""
    response = _post(served, "/v1/chat/completions", json={"model": served.model})

    assert 400 == response.status_code
    assert "messages" == _error(response)["param"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "5"), ("temperature", "hot"), ("prompt", 5), ("stop", 3), ("stream", "yes")],
)
def test_wrong_type_is_400(served: Served, field: str, value: object) -> None:
    """A field of the wrong type is a 400 whose param names the field."""
    response = _completion(served, **{field: value})

    assert 400 == response.status_code
    assert field == _error(response)["param"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -2),
    ],
)
def test_out_of_range_sampling_param_is_400(served: Served, field: str, value: float) -> None:
    """Sampling parameters out of range are a 400 naming the parameter."""
    response = _completion(served, **{field: value})

    assert 400 == response.status_code
    assert field == _error(response)["param"]


def test_max_tokens_over_context_is_400(served: Served) -> None:
    """max_tokens beyond the remaining context is a 400 context_length_exceeded."""
    response = _completion(served, max_tokens=served.engine.max_model_len)

    assert 400 == response.status_code
    assert "context_length_exceeded" == _error(response)["code"]


def test_prompt_over_context_is_400(served: Served) -> None:
    """A prompt as long as the context is a 400 context_length_exceeded."""
    response = _completion(served, prompt=[5] * served.engine.max_model_len)

    assert 400 == response.status_code
    assert "context_length_exceeded" == _error(response)["code"]


def test_prompt_token_id_out_of_vocab_is_400(served: Served) -> None:
    """A token id outside the vocabulary is refused before it reaches the model."""
    response = _completion(served, prompt=[1, 2, 10**9])

    assert 400 == response.status_code
    assert "invalid_request_error" == _error(response)["type"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 3, "best_of": 2}, "best_of")],
)
def test_n_and_best_of_out_of_range_are_400(
    served: Served, fields: dict[str, int], param: str
) -> None:
    """n and best_of in 1..16, best_of at least n: else 400 naming the field."""
    response = _completion(served, **fields)

    assert 400 == response.status_code
    assert param == _error(response)["param"]


def test_several_prompts_are_400(served: Served) -> None:
    """A batch of prompts in one request is refused (one prompt per request)."""
    response = _completion(served, prompt=["a", "b"])

    assert 400 == response.status_code
    assert "prompt" == _error(response)["param"]


def test_unknown_model_is_404(served: Served) -> None:
    """A model name other than the served one is a 404 model_not_found."""
    response = _completion(served, model="gpt-nonexistent")

    assert 404 == response.status_code
    assert "model_not_found" == _error(response)["code"]


def test_unknown_model_raises_not_found_in_openai_client(served: Served) -> None:
    """The openai client maps the 404 to NotFoundError."""
    with pytest.raises(openai.NotFoundError):
        served.openai().completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_unknown_route_is_404_with_error_body(served: Served) -> None:
    """Even unknown routes answer with the OpenAI error shape."""
    response = _post(served, "/v1/embeddings", json={})

    assert 404 == response.status_code
    _error(response)


def test_body_over_cap_by_content_length_is_413(served: Served) -> None:
    """A body larger than the cap is refused with 413 by its Content-Length."""
    response = _post(
        served,
        "/v1/completions",
        content=b" " * (MAX_BODY_BYTES + 1),
        headers={"content-type": "application/json"},
    )

    assert 413 == response.status_code
    assert "request_too_large" == _error(response)["code"]


def test_chunked_body_over_cap_is_413(served: Served) -> None:
    """A chunked body (no Content-Length) is refused with 413 once it passes the cap."""

    def chunks() -> Any:
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    response = _post(
        served, "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )

    assert 413 == response.status_code


def test_chat_without_text_content_is_400(served: Served) -> None:
    """Image content parts are refused with a 400 (only text is supported)."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    response = _post(served, "/v1/chat/completions", json={"messages": messages})

    assert 400 == response.status_code
    assert "messages" == _error(response)["param"]


def test_server_keeps_serving_after_errors(served: Served) -> None:
    """After a burst of bad requests a good one still succeeds."""
    for fields in ({"n": 0}, {"max_tokens": -1}, {"model": "x"}, {"prompt": [10**9]}):
        assert _completion(served, **fields).status_code in (400, 404)

    response = _completion(served, max_tokens=3)

    assert 200 == response.status_code


def test_errors_are_counted_by_type(served: Served) -> None:
    """Rejected requests move otel_engine_request_errors_total for their code."""
    before = served.metric("otel_engine_request_errors_total", error_type="model_not_found")

    _completion(served, model="nope")

    assert before + 1 == served.metric(
        "otel_engine_request_errors_total", error_type="model_not_found"
    )


def test_missing_api_key_is_401(keyed: Served) -> None:
    """With --api-key set, a request without a key is a 401."""
    response = _completion(keyed, max_tokens=2)

    assert 401 == response.status_code
    assert "invalid_api_key" == _error(response)["code"]


def test_wrong_api_key_is_401_in_openai_client(keyed: Served) -> None:
    """The openai client with a wrong key gets AuthenticationError."""
    with pytest.raises(openai.AuthenticationError):
        keyed.openai(api_key="wrong").models.list()


def test_right_api_key_is_served(keyed: Served) -> None:
    """The right key is served."""
    result = keyed.openai(api_key=API_KEY).completions.create(
        model=keyed.model, prompt=PROMPT, max_tokens=2
    )

    assert 1 <= result.usage.completion_tokens <= 2


def test_health_needs_no_api_key(keyed: Served) -> None:
    """/health and /metrics stay open for probes and scrapers."""
    with keyed.http() as client:
        assert 200 == client.get("/health").status_code
        assert 200 == client.get("/metrics").status_code


def test_truncated_request_keeps_server_up(served: Served) -> None:
    """A client that sends half a body and disconnects does not disturb the server."""
    host, port = served.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro'
        )

    assert 200 == _completion(served, max_tokens=2).status_code
