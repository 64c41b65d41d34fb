"""Request bodies are counted, and their nesting bounded, before pydantic validates them
(`bodies.py`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from otel_engine.entrypoints.network.bodies import check_chat_counts, validate
from otel_engine.entrypoints.network.errors import APIError
from otel_engine.entrypoints.network.limits import (
    MAX_CONTENT_PARTS,
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_TOOL_CALLS,
    MESSAGE_OVERHEAD_CHARS,
)
from otel_engine.entrypoints.openai.protocol import ChatCompletionRequest
from otel_engine.entrypoints.openai.responses_request import ResponsesRequest
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


@pytest.mark.parametrize("tool_calls", ["not a list", {"id": "c"}, 7])
def test_content_parts_are_counted_beside_wrongly_typed_tool_calls(tool_calls: object) -> None:
    """A message whose tool_calls has the wrong type still has its content parts counted
    (the wrong type is pydantic's to refuse): too many parts is a 400 by count."""
    parts = [{"type": "text", "text": ""}] * (MAX_CONTENT_PARTS + 1)
    body = _chat([{"role": "assistant", "content": parts, "tool_calls": tool_calls}])

    with pytest.raises(APIError) as caught:
        check_chat_counts(body)

    assert ("messages", "too_many_messages") == (caught.value.param, caught.value.code)


def test_tool_calls_are_counted_beside_wrongly_typed_content() -> None:
    """A message whose content has the wrong type still has its tool calls counted."""
    message = _assistant(MAX_TOOL_CALLS + 1) | {"content": 7}

    with pytest.raises(APIError) as caught:
        check_chat_counts(_chat([message]))

    assert f"at most {MAX_TOOL_CALLS} tool calls" in caught.value.message


def test_bodies_within_the_limits_validate() -> None:
    """The most messages accepted validate as before; malformed shapes are pydantic's to
    answer (a 400 naming the field)."""
    body = _chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}] * MAX_MESSAGES)

    assert MAX_MESSAGES == len(validate(ChatCompletionRequest, body, is_chat=True).messages)
    check_chat_counts(b'{"messages": 7}')
    check_chat_counts(b"not json")


def test_each_message_counts_its_template_overhead() -> None:
    """Empty messages still cost characters of the prompt budget."""
    messages = [{"role": "user", "content": ""}, {"role": "user", "content": "abc", "name": "n"}]

    assert 2 * MESSAGE_OVERHEAD_CHARS + 4 == chat_chars(messages)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_the_app_has_its_chat_bodies_counted(path: str) -> None:
    """The OpenAI app tells the network room which bodies hold chat messages: a chat and a
    /tokenize of MAX_MESSAGES + 1 messages are refused before validation."""
    from starlette.testclient import TestClient

    from otel_engine.entrypoints.network.guard import ServerState
    from otel_engine.entrypoints.openai.app import build_app

    engine = SimpleNamespace(
        add_step_listener=lambda listener: None,
        add_recovery_listener=lambda listener: None,
        config=SimpleNamespace(observability=SimpleNamespace(log_prompts=False)),
        max_model_len=512,
        is_dead=False,
    )
    body = _chat([{"role": "user", "content": ""}] * (MAX_MESSAGES + 1))
    with TestClient(build_app(ServerState(engine=engine))) as client:  # type: ignore[arg-type]
        response = client.post(path, content=body)

    assert (400, "too_many_messages") == (response.status_code, response.json()["error"]["code"])


def _assistant(num_calls: int) -> dict[str, object]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    return {"role": "assistant", "content": "", "tool_calls": [call] * num_calls}


def test_more_tool_calls_than_the_limit_is_400() -> None:
    """The earlier tool calls of all messages together are bounded, each message within its
    own limit of 128."""
    num_messages = MAX_TOOL_CALLS // 128 + 1
    body = _chat([_assistant(128)] * num_messages)

    with pytest.raises(APIError) as caught:
        check_chat_counts(body)

    assert ("messages", "too_many_messages") == (caught.value.param, caught.value.code)
    assert f"at most {MAX_TOOL_CALLS} tool calls" in caught.value.message


def test_the_most_tool_calls_accepted_validate() -> None:
    body = _chat([_assistant(128)] * (MAX_TOOL_CALLS // 128))

    request = validate(ChatCompletionRequest, body)

    assert MAX_TOOL_CALLS == sum(len(m.tool_calls or ()) for m in request.messages)


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def test_a_body_nested_past_the_limit_is_400_naming_its_field() -> None:
    """A field nested one level past MAX_JSON_DEPTH is refused before pydantic walks it."""
    body = {"input": "hi", "reasoning": {"a": _nested(MAX_JSON_DEPTH)}}

    with pytest.raises(APIError) as caught:
        validate(ResponsesRequest, json.dumps(body).encode())

    assert (400, "reasoning", "invalid_value") == (
        caught.value.status,
        caught.value.param,
        caught.value.code,
    )


def test_a_body_nested_at_the_limit_validates() -> None:
    body = {"input": "hi", "reasoning": {"a": _nested(MAX_JSON_DEPTH - 1)}}

    assert "hi" == validate(ResponsesRequest, json.dumps(body).encode()).input


@pytest.mark.parametrize("model", [ChatCompletionRequest, ResponsesRequest])
def test_a_body_past_the_decoders_own_bound_is_400(model: type) -> None:
    """Nesting the JSON decoder itself refuses (RecursionError) is a 400, not invalid JSON
    and not a 500 (the counting decoder meets it first on a chat)."""
    body = b'{"messages": [], "input": "hi", "response_format": ' + b"[" * 5000 + b"]" * 5000 + b"}"

    with pytest.raises(APIError) as caught:
        validate(model, body, is_chat=model is ChatCompletionRequest)

    assert (400, "invalid_value") == (caught.value.status, caught.value.code)


def test_a_history_counts_its_calls_arguments_as_written() -> None:
    """An earlier call costs its name and its arguments' text as the client wrote them."""
    arguments = '{"city":  "Oslo"}'
    message = _assistant(1)
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    **message,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}],
                }
            ]
        }
    )

    messages = request.template_messages()

    assert arguments == messages[0]["tool_calls"][0]["function"]["arguments"]
    assert MESSAGE_OVERHEAD_CHARS + 1 + len(arguments) == chat_chars(messages)


def test_the_docs_state_the_edge_limits() -> None:
    """docs/operations.md ("Hostile clients") states the counts and the nesting the edge
    holds a body to, with the code's numbers."""
    from otel_engine.entrypoints.tools.request import MAX_TOOLS
    from tests.helpers.paths import REPO_ROOT

    text = (REPO_ROOT / "docs" / "operations.md").read_text(encoding="utf-8")

    assert (
        f"at most {MAX_MESSAGES:,} messages, {MAX_CONTENT_PARTS:,} content parts in all and "
        f"{MAX_TOOL_CALLS:,} earlier tool calls in all ({MAX_TOOLS} a message)"
    ) in text
    assert f"hold at most {MAX_CONTENT_PARTS:,} content parts in all" in text
    assert f"nests objects and arrays at most {MAX_JSON_DEPTH} deep" in text
