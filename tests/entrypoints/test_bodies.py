"""Request bodies are counted before pydantic validates them (`bodies.py`)."""

from __future__ import annotations

import json

import pytest

from otel_engine.entrypoints.network.bodies import check_chat_counts, validate
from otel_engine.entrypoints.network.errors import APIError
from otel_engine.entrypoints.network.limits import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MESSAGE_OVERHEAD_CHARS,
)
from otel_engine.entrypoints.openai.protocol import ChatCompletionRequest
from otel_engine.entrypoints.openai.serving import chat_chars


def _chat(messages: list[dict[str, object]]) -> bytes:
    return json.dumps({"messages": messages, "max_tokens": 4}).encode()


def test_more_messages_than_the_limit_is_400() -> None:
    """MAX_MESSAGES + 1 empty messages: 400 `too_many_messages` naming `messages`."""
    body = _chat([{"role": "user", "content": ""}] * (MAX_MESSAGES + 1))

    with pytest.raises(APIError) as caught:
        check_chat_counts(body)

    assert (400, "messages", "too_many_messages") == (
        caught.value.status,
        caught.value.param,
        caught.value.code,
    )


def test_more_content_parts_than_the_limit_is_400() -> None:
    """The parts of all messages together are bounded too."""
    parts = [{"type": "text", "text": ""}] * (MAX_CONTENT_PARTS // 2 + 1)
    body = _chat([{"role": "user", "content": parts}] * 2)

    with pytest.raises(APIError) as caught:
        check_chat_counts(body)

    assert ("messages", "too_many_messages") == (caught.value.param, caught.value.code)


def test_bodies_within_the_limits_validate() -> None:
    """The most messages accepted validate as before; malformed shapes are pydantic's to
    answer (a 400 naming the field)."""
    body = _chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}] * MAX_MESSAGES)

    assert MAX_MESSAGES == len(validate(ChatCompletionRequest, body).messages)
    check_chat_counts(b'{"messages": 7}')
    check_chat_counts(b"not json")


def test_each_message_counts_its_template_overhead() -> None:
    """Empty messages still cost characters of the prompt budget."""
    messages = [{"role": "user", "content": ""}, {"role": "user", "content": "abc", "name": "n"}]

    assert 2 * MESSAGE_OVERHEAD_CHARS + 4 == chat_chars(messages)
