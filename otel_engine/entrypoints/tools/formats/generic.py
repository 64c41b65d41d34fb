"""The generic format, for models whose template has no tool format (the default SmolLM2's):
the tools are taught in a system message (`format.instructions`), and the model answers
either text that does not start with `{` or one JSON object
`{"tool_calls": [{"name": ..., "arguments": {...}}]}`, held to that by a grammar under every
`tool_choice` but `none`. Earlier calls are the object the model would have written, their
results user messages naming the call."""

from __future__ import annotations

from typing import Any

from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import ToolFormat
from otel_engine.entrypoints.tools.grammar import calls_schema, json_rule
from otel_engine.entrypoints.tools.request import Function

# free text in the generic format never starts with "{" (a call does)
_TEXT = r"TEXT: /[^{](.|\n)*/"


class GenericFormat(ToolFormat):
    name = ToolFormatName.GENERIC
    template_renders = False
    constrains_auto = True
    whole_answer = True
    calls_in_array = False
    wrapper_key = "tool_calls"

    def grammar(self, functions: list[Function], most: int, forced: bool) -> str:
        wrapper = {
            "type": "object",
            "properties": {"tool_calls": calls_schema(functions, self.argument_key, most)},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        start = "start: calls" if forced else f"start: TEXT | calls\n{_TEXT}"
        return f"{start}\n" + json_rule("calls", wrapper)

    def tool_result(self, message: dict[str, Any], names: dict[Any, str]) -> dict[str, Any]:
        call_id = message.get("tool_call_id")
        name = names.get(call_id) or message.get("name") or "a tool"
        return {
            "role": "user",
            "content": f"Result of the call to {name} (id {call_id}):\n"
            f"{message.get('content') or ''}",
        }
