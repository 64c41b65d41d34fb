"""What a request says about tools, checked: its functions (`Function`) and its
`tool_choice` (`ToolChoice`), and an earlier call of its history as templates read it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from otel_engine.engine import structured_output
from otel_engine.entrypoints.tools.base import ToolChoice
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.sampling_params import StructuredOutput

MAX_TOOLS = 128  # as OpenAI bounds them


def invalid(message: str, param: str = "tools") -> RequestError:
    return RequestError(message, code=ErrorCode.INVALID_VALUE, param=param)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def definition(self) -> dict[str, Any]:
        """The function as a template or a prompt shows it."""
        entry: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            entry["description"] = self.description
        entry["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return entry

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": self.definition()}

    def check(self) -> None:
        """The parameters pass the limits and checks of a response_format schema."""
        parameters = self.parameters
        if parameters is None:
            return
        if parameters.get("type", "object") != "object":
            raise invalid(f"the parameters of {self.name!r} must be an object schema")
        text = json.dumps(parameters, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
        try:
            structured_output.check(StructuredOutput("json_schema", text))
        except RequestError as error:
            message = f"tool {self.name!r}: {error.message}"
            raise RequestError(message, code=error.code, param="tools") from None


def resolve_choice(
    tools: list[Function] | None, tool_choice: str | dict[str, Any] | None
) -> tuple[ToolChoice, str | None]:
    """The request's choice and, for `NAMED`, the function it names."""
    if tool_choice is None:
        return (ToolChoice.AUTO if tools else ToolChoice.NONE), None
    if isinstance(tool_choice, str):
        if tool_choice not in (ToolChoice.AUTO, ToolChoice.NONE, ToolChoice.REQUIRED):
            raise invalid("tool_choice must be none, auto, required or a function", "tool_choice")
        if tool_choice == ToolChoice.REQUIRED and not tools:
            raise invalid("tool_choice required needs tools", "tool_choice")
        return ToolChoice(tool_choice), None
    name = tool_choice.get("name")
    function = tool_choice.get("function")
    if isinstance(function, dict):
        name = function.get("name")
    if not isinstance(name, str):
        raise invalid("a named tool_choice needs function.name", "tool_choice")
    if not tools or name not in {f.name for f in tools}:
        raise invalid(
            f"tool_choice names {name[:64]!r}, which is not among the tools", "tool_choice"
        )
    return ToolChoice.NAMED, name


def call_arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as the object they encode (a template shows them as JSON)."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as chat templates read it (arguments an object)."""
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": call["function"]["name"], "arguments": call_arguments(call)},
    }
