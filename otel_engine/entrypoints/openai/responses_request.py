"""The body of `POST /v1/responses` (`ResponsesRequest`), and its `input` items as the chat
messages a model's template renders.

Input items are free-form JSON to pydantic (`dict[str, object]`), so they are held here to
what a chat message is held to: every string taken from them is valid Unicode, a content part
is a text part whose `text` is a string, and the parts of all items together are at most
`MAX_CONTENT_PARTS`; anything else is a 400 naming `input`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from otel_engine.entrypoints.network.errors import APIError, bad_request
from otel_engine.entrypoints.network.json_values import LONE_SURROGATE
from otel_engine.entrypoints.network.limits import MAX_CONTENT_PARTS, MAX_MESSAGES
from otel_engine.entrypoints.openai.fields import (
    FunctionName,
    Int,
    Strict,
    Text,
    bounded,
    no_surrogates,
    unsupported,
)
from otel_engine.entrypoints.openai.protocol import ChatCompletionRequest
from otel_engine.entrypoints.openai.response_models import ResponsesEcho
from otel_engine.entrypoints.tools.base import ToolChoice, WireToolChoice
from otel_engine.entrypoints.tools.request import MAX_TOOLS, Function, wire_call
from otel_engine.errors import ErrorCode
from otel_engine.sampling_params import SamplingParams

# what a chat's field is called in a Responses request, in its errors
_RESPONSES_PARAMS = {
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "messages": "input",
}


def responses_param(chat_param: str | None) -> str | None:
    """The name of a chat request's field (an error's `param`) in a Responses request."""
    return _RESPONSES_PARAMS.get(chat_param or "", chat_param)


class ResponsesFunctionTool(Strict):
    """A function tool of the Responses API (its fields flat, not under `function`)."""

    type: Text
    name: FunctionName | None = None
    description: Text | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ResponsesTextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(Strict):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(Strict):
    """`POST /v1/responses`: `input` (text, or message and function-call items) and
    `instructions` become a chat for the model's template; the answer is output items.
    Responses are not stored, so `previous_response_id` is refused."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    model: Text | None = None
    input: Text | Annotated[list[dict[str, object]], Field(max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: WireToolChoice | dict[str, object] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[Int | None, bounded("max_tokens")] = None
    temperature: Annotated[float, bounded("temperature")] = 1.0
    top_p: Annotated[float, bounded("top_p")] = 1.0
    text: ResponsesText | None = None
    stream: bool = False
    previous_response_id: Text | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: object | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    seed: Annotated[Int | None, bounded("seed")] = None
    # accepted and without effect here: no reasoning, no truncation of the input
    reasoning: dict[str, object] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise unsupported(
                "previous_response_id",
                "responses are not stored: send the whole conversation as input items",
            )
        if self.background:
            raise unsupported("background", "background responses are not supported")
        if self.conversation is not None:
            raise unsupported("conversation", "conversations are not stored")
        for tool in self.tools or ():
            if tool.type != "function" or tool.name is None:
                raise unsupported("tools", f"only function tools are supported, not {tool.type!r}")

    def ignored_fields(self) -> list[str]:
        return list(self.model_extra or {})

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this one is to the engine: its limits, format and sampling fields
        (those it sent counted as sent); its messages are `template_messages()`."""
        sampled = {n: getattr(self, n) for n in ("temperature", "top_p", "seed")}
        return ChatCompletionRequest.model_construct(
            _fields_set={n for n in sampled if n in self.model_fields_set},
            model=self.model,
            messages=[],
            max_completion_tokens=self.max_output_tokens,
            response_format=self.response_format(),
            stream=self.stream,
            **sampled,
        )

    def echo(self, params: SamplingParams) -> ResponsesEcho:
        """What the response object repeats of this request (`params`: the sampling it got)."""
        return ResponsesEcho(
            instructions=self.instructions,
            max_output_tokens=self.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            tools=[tool.model_dump(by_alias=True, exclude_none=True) for tool in self.tools or ()],
            tool_choice=self.tool_choice if self.tool_choice is not None else ToolChoice.AUTO,
            parallel_tool_calls=self.parallel_tool_calls,
            text=(
                self.text.model_dump(by_alias=True, exclude_none=True)
                if self.text is not None
                else {"format": {"type": "text"}}
            ),
            metadata=dict(self.metadata or {}),
        )

    def response_format(self) -> dict[str, object] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_ or {}},
        }

    def tool_functions(self) -> list[Function] | None:
        if not self.tools:
            return None
        return [Function(t.name or "", t.description, t.parameters) for t in self.tools]

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):  # {"type": "function", "name": ...}
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    def template_messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages (400 `input` for an item that is not
        a message, a function call or its output, or that breaks the rules above)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        reader = _ItemReader()
        for index, item in enumerate(self.input):
            reader.read(item, index, messages)
        if not messages:
            raise bad_request("input is empty", param="input", code=ErrorCode.INVALID_VALUE)
        return messages


_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _invalid(message: str) -> APIError:
    return bad_request(message, param="input", code=ErrorCode.INVALID_VALUE)


def _text(value: object, what: str) -> str:
    """`value` when it is a string a tokenizer can encode; else a 400 naming `what`."""
    if not isinstance(value, str):
        raise _invalid(f"{what} must be a string")
    try:
        return no_surrogates(value)
    except ValueError:
        raise _invalid(f"{what}: {LONE_SURROGATE}") from None


class _ItemReader:
    """Turns input items into chat messages, counting their content parts."""

    def __init__(self) -> None:
        self.num_parts = 0

    def read(self, item: dict[str, object], index: int, messages: list[dict[str, Any]]) -> None:
        """Append one Responses input item to `messages` as the chat template reads it."""
        param = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _invalid(f"{param}.role must be one of {_ROLES}")
            content = self._content(item.get("content", ""), f"{param}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("name", "arguments", "call_id")):
                raise _invalid(f"{param} needs name, arguments and call_id as strings")
            call = wire_call(
                _text(item["call_id"], f"{param}.call_id"),
                _text(item["name"], f"{param}.name"),
                _text(item["arguments"], f"{param}.arguments"),
            )
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _invalid(f"{param} needs a call_id")
            call_id = _text(item["call_id"], f"{param}.call_id")
            output = self._content(item.get("output", ""), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":  # a reasoning item of another server: nothing to render here
            raise unsupported("input", f"input items of type {str(kind)[:32]!r} are not supported")

    def _content(self, value: object, what: str) -> str:
        """Text, or a list of text parts whose `text` is a string, as one string."""
        if isinstance(value, str):
            return _text(value, what)
        if not isinstance(value, list):
            raise _invalid(f"{what} must be text or text parts")
        self.num_parts += len(value)
        if self.num_parts > MAX_CONTENT_PARTS:
            raise bad_request(
                f"a request has at most {MAX_CONTENT_PARTS} content parts in its input items",
                param="input",
                code=ErrorCode.TOO_MANY_MESSAGES,
            )
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                kind = str(kind)[:32]
                raise unsupported("input", f"only text content parts are supported, not {kind!r}")
            texts.append(_text(part.get("text", ""), f"{what} text part's text"))
        return "".join(texts)
