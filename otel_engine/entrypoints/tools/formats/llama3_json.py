"""Llama 3.1-3.3: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"),
optionally after `<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import ToolFormat
from otel_engine.entrypoints.tools.grammar import call_schema, json_rule
from otel_engine.entrypoints.tools.request import Function

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(ToolFormat):
    name = ToolFormatName.LLAMA3_JSON
    template_marks = (_PYTHON_TAG, "ipython")
    argument_key = "parameters"
    special_marker = _PYTHON_TAG
    whole_answer = True
    answer_prefix = _PYTHON_TAG
    separator = ";"

    def grammar(self, functions: list[Function], most: int, forced: bool) -> str:
        many = f' ("; " body){{0,{most - 1}}}' if most > 1 else ""
        return f"start: body{many}\n" + json_rule("body", call_schema(functions, self.argument_key))
