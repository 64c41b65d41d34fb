"""Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]`. Its template reads the
tools from the system message's `tools` (JSON text) and renders no earlier calls."""

from __future__ import annotations

import json
from typing import Any

from otel_engine.entrypoints.tools.base import ToolChoice, ToolFormatName
from otel_engine.entrypoints.tools.format import ToolFormat
from otel_engine.entrypoints.tools.grammar import calls_schema, json_rule
from otel_engine.entrypoints.tools.request import Function


class Phi4MiniFormat(ToolFormat):
    name = ToolFormatName.PHI4_MINI
    template_marks = ("<|tool|>",)
    template_renders = False
    marker = "functools"

    def grammar(self, functions: list[Function], most: int, forced: bool) -> str:
        array = calls_schema(functions, self.argument_key, most)
        return 'start: "functools" calls\n' + json_rule("calls", array)

    def write_calls(self, calls: list[dict[str, Any]]) -> str:
        return "functools" + json.dumps(calls, ensure_ascii=False)

    def with_tools(
        self,
        messages: list[dict[str, Any]],
        functions: list[Function],
        choice: ToolChoice,
        json_answer: bool,
    ) -> list[dict[str, Any]]:
        tools = json.dumps([f.definition() for f in functions], ensure_ascii=False)
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "tools": tools}, *messages[1:]]
        return [{"role": "system", "content": "", "tools": tools}, *messages]
