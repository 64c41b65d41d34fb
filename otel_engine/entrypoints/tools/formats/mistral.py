"""Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (or one
object); call ids of 9 letters and digits, as its templates require."""

from __future__ import annotations

import secrets
import string

from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import ToolFormat
from otel_engine.entrypoints.tools.grammar import calls_schema, json_rule
from otel_engine.entrypoints.tools.request import Function

_TOOL_CALLS = "[TOOL_CALLS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralFormat(ToolFormat):
    name = ToolFormatName.MISTRAL
    template_marks = (_TOOL_CALLS, "[AVAILABLE_TOOLS]")
    special_marker = _TOOL_CALLS
    marker = _TOOL_CALLS

    @staticmethod
    def new_call_id() -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def grammar(self, functions: list[Function], most: int, forced: bool) -> str:
        array = calls_schema(functions, self.argument_key, most)
        return 'start: "[TOOL_CALLS]" calls\n' + json_rule("calls", array)
