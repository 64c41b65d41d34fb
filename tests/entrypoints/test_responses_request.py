"""Responses input items become chat messages only when they hold what a chat message may:
encodable strings, text parts whose text is a string, a bounded number of parts
(`responses_request.py`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from otel_engine.entrypoints.network.bodies import validate
from otel_engine.entrypoints.network.errors import APIError
from otel_engine.entrypoints.network.limits import MAX_CONTENT_PARTS
from otel_engine.entrypoints.openai.responses_request import ResponsesRequest


def _messages(items: str) -> list[dict[str, Any]]:
    """The chat messages of a body whose `input` is `items` (JSON text, so that it may hold
    escapes a Python literal could not)."""
    body = '{"max_output_tokens": 4, "input": [' + items + "]}"
    return validate(ResponsesRequest, body.encode()).template_messages()


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ('{"role": "user", "content": "\\ud800"}', "input[0].content"),
        ('{"role": "user", "content": [{"type": "input_text", "text": "a\\udfff"}]}', "content"),
        (
            '{"type": "function_call", "call_id": "\\ud800", "name": "f", "arguments": "{}"}',
            "call_id",
        ),
        ('{"type": "function_call", "call_id": "c", "name": "\\ud800", "arguments": "{}"}', "name"),
        (
            '{"type": "function_call", "call_id": "c", "name": "f", "arguments": "\\ud800"}',
            "arguments",
        ),
        ('{"type": "function_call_output", "call_id": "\\udc00", "output": "x"}', "call_id"),
        ('{"type": "function_call_output", "call_id": "c", "output": "\\udc00"}', "output"),
    ],
    ids=["content", "a part", "call_id", "name", "arguments", "output call_id", "output"],
)
def test_a_lone_surrogate_in_an_item_is_400_naming_input(item: str, field: str) -> None:
    with pytest.raises(APIError) as caught:
        _messages(item)

    error = caught.value
    assert (400, "input", "invalid_value") == (error.status, error.param, error.code)
    assert field in error.message
    assert "lone surrogate" in error.message


def test_text_parts_nested_in_text_parts_are_400() -> None:
    """A part's `text` is a string; parts inside it are not read at any depth."""
    nested = {"type": "input_text", "text": [{"type": "text", "text": "x"}]}
    item = json.dumps({"role": "user", "content": [nested]})

    with pytest.raises(APIError) as caught:
        _messages(item)

    assert ("input", "invalid_value") == (caught.value.param, caught.value.code)


def test_more_content_parts_than_the_limit_is_400() -> None:
    """The parts of all input items together are bounded, as a chat's are."""
    part = {"type": "input_text", "text": ""}
    item = json.dumps({"role": "user", "content": [part] * (MAX_CONTENT_PARTS // 2 + 1)})

    with pytest.raises(APIError) as caught:
        _messages(f"{item}, {item}")

    assert ("input", "too_many_messages") == (caught.value.param, caught.value.code)


def test_items_within_the_rules_become_the_chat() -> None:
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]

    messages = _messages(", ".join(json.dumps(item) for item in items))

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ] == messages
