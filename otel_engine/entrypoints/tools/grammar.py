"""The grammar of an answer with tools: which `tool_choice` is held to one, the JSON schema
of a call, and the answer's JSON beside forced calls under a `response_format`. Each
format writes its own top rules (`ToolFormat.grammar`); every schema goes in through
`json_rule`, so that the grammar bounds (engine/grammar_bounds.py) find each of them."""

from __future__ import annotations

import json
from typing import Any

from otel_engine.engine import grammar_bounds, structured_output
from otel_engine.entrypoints.tools.base import ToolChoice
from otel_engine.entrypoints.tools.format import ToolFormat
from otel_engine.entrypoints.tools.request import Function
from otel_engine.sampling_params import StructuredOutput

# Calls one forced answer may hold (with parallel_tool_calls): a grammar that allowed any
# number would let a model repeat calls until max_tokens.
MAX_PARALLEL_CALLS = 8


def tool_grammar(
    format: ToolFormat,
    functions: list[Function],
    choice: ToolChoice,
    parallel: bool,
    answer_format: StructuredOutput | None = None,
) -> str | None:
    """The Lark grammar of the answer; None: unconstrained (`auto` in a family's format)."""
    most = MAX_PARALLEL_CALLS if parallel else 1
    if choice is ToolChoice.AUTO and answer_format is not None:
        return _with_answer(format.grammar(functions, most, forced=True), answer_format)
    if choice is ToolChoice.AUTO and not format.constrains_auto:
        return None
    return format.grammar(functions, most, forced=choice is not ToolChoice.AUTO)


def json_rule(rule: str, schema: dict[str, Any]) -> str:
    """A Lark rule of an inline JSON schema, with the engine's whitespace bound."""
    return grammar_bounds.json_rule(rule, schema, dict(structured_output.JSON_OPTIONS))


def call_schema(functions: list[Function], key: str) -> dict[str, Any]:
    """One call object to any of `functions`, its arguments under `key`."""
    if len(functions) == 1:
        return _one_call(functions[0], key)
    return {"anyOf": [_one_call(f, key) for f in functions]}


def calls_schema(functions: list[Function], key: str, most: int) -> dict[str, Any]:
    """An array of 1 to `most` call objects."""
    return {"type": "array", "items": call_schema(functions, key), "minItems": 1, "maxItems": most}


def _one_call(function: Function, key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            key: function.parameters or {"type": "object"},
        },
        "required": ["name", key],
        "additionalProperties": False,
    }


def _with_answer(calls: str, answer_format: StructuredOutput) -> str:
    """The forced-calls grammar `calls` with a JSON answer of `answer_format` beside it;
    RequestError (`response_format`) for an answer schema the engine would refuse alone."""
    structured_output.check(answer_format)
    if answer_format.type == "json_schema":
        schema = json.loads(answer_format.json_schema)
    else:
        schema = {"type": "object"}
    renamed = calls.replace("start:", "tool_calls:", 1)
    return "start: answer | tool_calls\n" + json_rule("answer", schema) + renamed
