"""What a request says about tools, checked: its functions (`Function`) and its
`tool_choice` (`ToolChoice`), and an earlier call of its history as templates read it.

A chat template renders the client's JSON values (a function's parameters, an earlier
call's decoded arguments) by recursion, and a tokenizer cannot encode a lone surrogate: each
such value is held to `json_values` before it is rendered (a 400 naming its field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from otel_engine.engine import structured_output
from otel_engine.entrypoints.network.json_values import TOO_DEEP, json_value_problem
from otel_engine.entrypoints.tools.base import ToolChoice
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.sampling_params import StructuredOutput

MAX_TOOLS = 128  # as OpenAI bounds them


def invalid(message: str, param: str = "tools") -> RequestError:
    return RequestError(message, code=ErrorCode.INVALID_VALUE, param=param)


def check_json_value(value: Any, what: str, param: str) -> None:
    """A `RequestError` naming `what` and `param` when `value` nests past `MAX_JSON_DEPTH` or
    holds a lone surrogate (`json_value_problem`)."""
    problem = json_value_problem(value)
    if problem is not None:
        raise invalid(f"{what}: {problem}", param)


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

    def check_shape(self) -> None:
        """The parameters are an object schema that a template can render: a JSON value it
        can walk, with `properties` an object of schemas, `required` a list of names and each
        `type` a name or a list of names (templates iterate these), so a malformed tool is a
        400 on `tools` before rendering (milliseconds at most: the schema checks are
        `check`'s)."""
        parameters = self.parameters
        if parameters is None:
            return
        what = f"the parameters of {self.name!r}"
        if parameters.get("type", "object") != "object":
            raise invalid(f"{what} must be an object schema")
        check_json_value(parameters, what, "tools")
        _check_keywords(parameters, what)
        properties = parameters.get("properties", {})
        for name, schema in properties.items():
            if not isinstance(schema, dict):
                raise invalid(f"{what}: properties.{name[:64]} must be an object schema")
            _check_keywords(schema, f"{what}: properties.{name[:64]}")

    def check(self) -> None:
        """The parameters pass the limits and checks of a response_format schema (after
        `check_shape`)."""
        parameters = self.parameters
        if parameters is None:
            return
        text = json.dumps(parameters, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
        try:
            structured_output.check(StructuredOutput("json_schema", text))
        except RequestError as error:
            message = f"tool {self.name!r}: {error.message}"
            raise RequestError(message, code=error.code, param="tools") from None


def _check_keywords(schema: dict[str, Any], what: str) -> None:
    """`schema`'s `properties`, `required` and `type` have the types templates expect."""
    if not isinstance(schema.get("properties", {}), dict):
        raise invalid(f"{what}: properties must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise invalid(f"{what}: required must be a list of property names")
    kind = schema.get("type", "object")
    kinds = kind if isinstance(kind, list) else [kind]
    if not all(isinstance(k, str) for k in kinds):
        raise invalid(f"{what}: type must be a type name or a list of them")


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


def call_arguments(call: dict[str, Any], param: str = "messages") -> Any:
    """A call's arguments as the object they encode (a template shows them as JSON); text
    that is not JSON stays text. 400 `param` for arguments nested too deep or with a lone
    surrogate (`json_value_problem`)."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
        except RecursionError:  # the decoder's own bound, far past MAX_JSON_DEPTH
            raise invalid(f"tool call arguments: {TOO_DEEP}", param) from None
    check_json_value(arguments, "tool call arguments", param)
    return arguments


def wire_call(call_id: str | None, name: str, arguments: str) -> dict[str, Any]:
    """An earlier call as a request's history holds it, its arguments still the client's
    JSON text (counted as written; `ToolSupport.messages` decodes them for the template)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
