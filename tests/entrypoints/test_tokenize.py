"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes, behind the same guard as /v1."""

from __future__ import annotations

from typing import Any

import pytest

from tests.entrypoints.conftest import API_KEY, Served

pytestmark = pytest.mark.slow  # starts engine processes

TEXT = "Once upon a time there was a small town by the sea."


def post(served: Served, path: str, body: dict[str, Any], **headers: str) -> Any:
    with served.http() as client:
        return client.post(path, json=body, headers=headers)


def test_tokenize_a_prompt_and_detokenize_it_back(served: Served) -> None:
    """The engine's own token ids, their count and the context length; and back to text."""
    answer = post(served, "/tokenize", {"model": served.model, "prompt": TEXT})
    body = answer.json()

    assert 200 == answer.status_code
    assert served.engine.encode(TEXT) == body["tokens"]
    assert (len(body["tokens"]), served.engine.max_model_len) == (
        body["count"],
        body["max_model_len"],
    )
    back = post(served, "/detokenize", {"tokens": body["tokens"]})
    assert (200, TEXT) == (back.status_code, back.json()["prompt"].strip())


def test_tokenize_chat_messages_as_the_chat_endpoint_would(served: Served) -> None:
    """Messages are rendered with the chat template (generation prompt included) and
    tokenized without adding special tokens again: the chat endpoint's prompt tokens."""
    messages = [{"role": "user", "content": "hi there"}]
    tokens = post(served, "/tokenize", {"messages": messages}).json()["tokens"]
    chat = served.openai().chat.completions.create(
        model=served.model,
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )

    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(tokens)
    without = post(served, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert len(without.json()["tokens"]) < len(tokens)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (
            "/tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            400,
            "prompt",
        ),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_requests_name_the_field(
    served: Served, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    answer = post(served, path, body)

    assert (status, param) == (answer.status_code, answer.json()["error"]["param"])


def test_the_api_key_guards_tokenize(keyed: Served) -> None:
    """Like /v1: 401 without the key, 200 with it."""
    assert 401 == post(keyed, "/tokenize", {"prompt": "a"}).status_code
    answer = post(keyed, "/detokenize", {"tokens": [5]}, authorization=f"Bearer {API_KEY}")
    assert 200 == answer.status_code
