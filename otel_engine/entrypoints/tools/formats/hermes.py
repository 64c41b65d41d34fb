"""Hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number, anywhere in the text."""

from __future__ import annotations

from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import ToolFormat
from otel_engine.entrypoints.tools.grammar import call_schema, json_rule
from otel_engine.entrypoints.tools.request import Function


class HermesFormat(ToolFormat):
    name = ToolFormatName.HERMES
    template_marks = ("<tool_call>",)
    marker = "<tool_call>"
    close_tag = "</tool_call>"
    calls_in_array = False

    def grammar(self, functions: list[Function], most: int, forced: bool) -> str:
        many = f' ("\\n" call){{0,{most - 1}}}' if most > 1 else ""
        return f'start: call{many}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n' + json_rule(
            "body", call_schema(functions, self.argument_key)
        )
