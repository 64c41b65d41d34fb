"""Function tools on the chat endpoints: the format the model calls tools in, how the tools
and a conversation's earlier calls reach its prompt, the grammar that enforces a call, and
the parser of its answer (parser.py).

The format comes from the model's chat template (or `--tool-call-parser`):
- a template with a tool format of a family the engine knows (hermes, llama3_json, mistral,
  phi4_mini, by their markup) renders the tools itself, as transformers passes them
  (`tools=`; Phi-4-mini's reads them from the system message), and the history's calls
  and results as its messages carry them (`tool_calls`, role `tool`, `tool_call_id`);
- any other template (the default SmolLM2's has no tools) gets the `generic` format: the
  tools are described in a system message (`generic_instructions`), the model answers
  either text that does not start with `{` or one JSON object
  `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, and a grammar holds it to that
  under every `tool_choice` but `none`; earlier calls are rendered as the object the
  model would have written, results as user messages naming their call.

`tool_choice` `required` and a named function are enforced in every format by a grammar
built from the tools' parameter schemas (llguidance), so their calls always parse and
validate; `auto` in a family's own format is not constrained (the model may answer in text
or write a malformed call, which is counted and returned as text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from otel_engine.engine import structured_output
from otel_engine.entrypoints.tools.parser import PARSER_CHOICES, ToolCallParser
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.model.tokenizer import TokenizerLike
from otel_engine.sampling_params import StructuredOutput

MAX_TOOLS = 128  # as OpenAI bounds them
# Calls one forced answer may hold (with parallel_tool_calls): a grammar that allowed any
# number would let a model repeat calls until max_tokens.
MAX_PARALLEL_CALLS = 8
ARGUMENT_KEY = {"llama3_json": "parameters"}  # the rest write "arguments"
# what marks each family's tool format in a chat template
_TEMPLATE_MARKS = (
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
    ("llama3_json", ("<|python_tag|>", "ipython")),
    ("phi4_mini", ("<|tool|>",)),
)
_CALL_MARKERS = {"mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
# free text in the generic format never starts with "{" (a call does)
_GENERIC_TEXT = r"TEXT: /[^{](.|\n)*/"


def _invalid(message: str, param: str = "tools") -> RequestError:
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


@dataclass(slots=True)
class ToolPlan:
    """One request's tools: what the template gets, the grammar, the answer's parser."""

    format: str
    native: bool  # the chat template renders the tools
    functions: list[Function]
    choice: str  # auto, required or named
    parallel: bool
    structured: StructuredOutput | None = None
    keep_special: str | None = None  # a marker that is a special token: kept in the text
    drop: tuple[str, ...] = ()  # the other special tokens' text, dropped from the text
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # by choice, streaming
    json_answer: bool = False  # a response_format: the answer without calls is its JSON

    @property
    def names(self) -> frozenset[str]:
        return frozenset(function.name for function in self.functions)

    def parser(self, index: int = 0) -> ToolCallParser:
        """Choice `index`'s parser (one per choice of a streamed answer)."""
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = ToolCallParser(
                self.format, self.names, json_answer=self.json_answer
            )
        return parser

    def parser_for_whole(self) -> ToolCallParser:
        """A parser for one non-streamed choice."""
        return ToolCallParser(self.format, self.names, json_answer=self.json_answer)

    def clean(self, text: str) -> str:
        """The model's text without special tokens other than the format's marker."""
        for token in self.drop:
            if token in text:
                text = text.replace(token, "")
        return text


class ToolSupport:
    """One server's tool format (chosen once from its tokenizer's chat template)."""

    def __init__(self, tokenizer: TokenizerLike, parser: str = "auto") -> None:
        if parser not in PARSER_CHOICES:
            raise ValueError(f"--tool-call-parser must be one of {PARSER_CHOICES}")
        self.tokenizer = tokenizer
        template = _template_text(tokenizer)
        detected = detect_format(template)
        self.format = detected if parser == "auto" else parser
        # the template renders tools only in its own family's format
        self.native = self.format != "generic" and self.format == detected
        self._specials = {
            token.content for token in tokenizer.added_tokens_decoder.values() if token.special
        }

    # ---- the prompt ----------------------------------------------------------------

    def plan(
        self,
        tools: list[Function] | None,
        tool_choice: str | dict[str, Any] | None,
        parallel: bool,
        answer_format: StructuredOutput | None = None,
    ) -> ToolPlan | None:
        """The request's plan; None when it has no tools or `tool_choice` is `none`. With
        a `response_format` (`answer_format`), `auto` answers either calls or JSON of that
        format; a forced call is a call (the format is for the answer after it)."""
        choice, named = _choice(tools, tool_choice)
        if not tools or choice == "none":
            return None
        if len({function.name for function in tools}) != len(tools):
            raise _invalid("tool function names must be unique")
        functions = [f for f in tools if f.name == named] if named else list(tools)
        for function in tools:
            _check_schema(function)
        plan = ToolPlan(self.format, self.native, list(tools), choice, parallel)
        plan.json_answer = answer_format is not None
        grammar = self._grammar(functions, choice, parallel and not named, answer_format)
        if grammar is not None:
            plan.structured = StructuredOutput("tool_calls", grammar=grammar, num_tools=len(tools))
            try:
                structured_output.check(plan.structured)
            except RequestError as error:
                raise _invalid(error.message) from None
        marker = _CALL_MARKERS.get(self.format)
        if marker in self._specials:  # it must reach the parser
            plan.keep_special = marker
            plan.drop = tuple(sorted(self._specials - {marker}, key=len, reverse=True))
        return plan

    def template_tools(self, plan: ToolPlan | None) -> list[dict[str, Any]] | None:
        """The `tools` the chat template gets (None: its own format has none)."""
        if plan is None or not self.native or self.format == "phi4_mini":
            return None
        return [function.openai() for function in plan.functions]

    def messages(
        self, messages: list[dict[str, Any]], plan: ToolPlan | None
    ) -> list[dict[str, Any]]:
        """The conversation as the template renders it: earlier calls and their results in
        the template's terms, and the tools in a system message where the template does not
        take them itself."""
        if self.native and self.format != "phi4_mini":
            return messages
        names = {}  # call id: function name, for the results
        converted: list[dict[str, Any]] = []
        for message in messages:
            calls = message.get("tool_calls")
            if calls:
                for call in calls:
                    names[call.get("id")] = call["function"]["name"]
                text = self._written_calls(calls)
                content = message.get("content") or ""
                converted.append(
                    {"role": "assistant", "content": f"{content}\n{text}" if content else text}
                )
            elif message.get("role") == "tool" and self.format == "generic":
                call_id = message.get("tool_call_id")
                name = names.get(call_id) or message.get("name") or "a tool"
                converted.append(
                    {
                        "role": "user",
                        "content": f"Result of the call to {name} (id {call_id}):\n"
                        f"{message.get('content') or ''}",
                    }
                )
            else:
                converted.append(message)
        if plan is not None:
            converted = self._with_tools(converted, plan)
        return converted

    def _with_tools(self, messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
        if self.format == "phi4_mini":  # Phi-4-mini's template reads the system message's tools
            tools = json.dumps([f.definition() for f in plan.functions], ensure_ascii=False)
            if messages and messages[0].get("role") == "system":
                return [{**messages[0], "tools": tools}, *messages[1:]]
            return [{"role": "system", "content": "", "tools": tools}, *messages]
        instructions = generic_instructions(plan)
        if messages and messages[0].get("role") in ("system", "developer"):
            first = messages[0]
            content = f"{first.get('content') or ''}\n\n{instructions}".lstrip()
            return [{**first, "content": content}, *messages[1:]]
        return [{"role": "system", "content": instructions}, *messages]

    def _written_calls(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls as this format writes them (for templates that cannot render them)."""
        entries = [
            {"name": call["function"]["name"], "arguments": _arguments(call)} for call in calls
        ]
        if self.format == "phi4_mini":
            return "functools" + json.dumps(entries, ensure_ascii=False)
        return json.dumps({"tool_calls": entries}, ensure_ascii=False)

    # ---- the grammar -------------------------------------------------------------

    def _grammar(  # noqa: PLR0911 (one grammar per format)
        self,
        functions: list[Function],
        choice: str,
        parallel: bool,
        answer_format: StructuredOutput | None = None,
    ) -> str | None:
        """The Lark grammar of the answer; None: unconstrained (`auto` in a family's format)."""
        forced = choice != "auto"
        if not forced and answer_format is not None:
            calls = self._grammar(functions, "required", parallel)
            assert calls is not None
            return _with_answer(calls, answer_format)
        if not forced and self.format != "generic":
            return None
        key = ARGUMENT_KEY.get(self.format, "arguments")
        call = {"anyOf": [_call_schema(f, key) for f in functions]}
        if len(functions) == 1:
            call = _call_schema(functions[0], key)
        most = MAX_PARALLEL_CALLS if parallel else 1
        array = {"type": "array", "items": call, "minItems": 1, "maxItems": most}
        if self.format == "hermes":
            many = f' ("\\n" call){{0,{most - 1}}}' if parallel else ""
            return f'start: call{many}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n' + _json(
                "body", call
            )
        if self.format == "llama3_json":
            many = f' ("; " body){{0,{most - 1}}}' if parallel else ""
            return f"start: body{many}\n" + _json("body", call)
        if self.format == "mistral":
            return 'start: "[TOOL_CALLS]" calls\n' + _json("calls", array)
        if self.format == "phi4_mini":
            return 'start: "functools" calls\n' + _json("calls", array)
        wrapper = {
            "type": "object",
            "properties": {"tool_calls": array},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        start = "start: calls" if forced else f"start: TEXT | calls\n{_GENERIC_TEXT}"
        return f"{start}\n" + _json("calls", wrapper)


def _with_answer(calls: str, answer_format: StructuredOutput) -> str:
    """The forced-calls grammar `calls` with a JSON answer of `answer_format` beside it."""
    if answer_format.type == "json_schema":
        schema = json.loads(answer_format.json_schema)
    else:
        schema = {"type": "object"}
    renamed = calls.replace("start:", "tool_calls:", 1)
    return "start: answer | tool_calls\n" + _json("answer", schema) + renamed


def generic_instructions(plan: ToolPlan) -> str:
    """The system prompt's part that teaches the generic format (see the module docstring)."""
    tools = json.dumps([f.definition() for f in plan.functions], ensure_ascii=False, indent=1)
    lines = [
        "You can call these tools (each is a function with a JSON schema of its arguments):",
        tools,
        "To call tools, answer with only one JSON object, nothing before or after it:",
        '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}',
    ]
    if plan.choice == "auto" and plan.json_answer:
        lines.append("To answer without a tool, write the JSON object the answer must be.")
    elif plan.choice == "auto":
        lines.append('To answer without a tool, write plain text that does not start with "{".')
        lines.append("Once a tool's result is in the conversation, answer the user with it.")
    elif plan.choice == "required":
        lines.append("You must call at least one tool.")
    else:
        lines.append(
            f"You must call the function {plan.functions[0].name}."
            if len(plan.functions) == 1
            else "You must call the function named in the request."
        )
    return "\n".join(lines)


def detect_format(template: str) -> str:
    """The family tool format a chat template teaches, else `generic`."""
    if "tools" not in template:
        return "generic"
    for format, marks in _TEMPLATE_MARKS:
        if any(mark in template for mark in marks):
            return format
    return "generic"


def _template_text(tokenizer: TokenizerLike) -> str:
    template: str | dict[str, str] | None
    try:
        template = tokenizer.get_chat_template(tools=[{}])
    except (ValueError, AttributeError, TypeError):
        template = tokenizer.chat_template
    if isinstance(template, dict):
        template = "\n".join(str(value) for value in template.values())
    return template if isinstance(template, str) else ""


def _choice(
    tools: list[Function] | None, tool_choice: str | dict[str, Any] | None
) -> tuple[str, str | None]:
    """(auto | none | required | named, the named function)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise _invalid("tool_choice must be none, auto, required or a function", "tool_choice")
        if tool_choice == "required" and not tools:
            raise _invalid("tool_choice required needs tools", "tool_choice")
        return tool_choice, None
    name = tool_choice.get("name")
    function = tool_choice.get("function")
    if isinstance(function, dict):
        name = function.get("name")
    if not isinstance(name, str):
        raise _invalid("a named tool_choice needs function.name", "tool_choice")
    if not tools or name not in {f.name for f in tools}:
        raise _invalid(
            f"tool_choice names {name[:64]!r}, which is not among the tools", "tool_choice"
        )
    return "named", name


def _check_schema(function: Function) -> None:
    """A function's parameters pass the limits and checks of a response_format schema."""
    parameters = function.parameters
    if parameters is None:
        return
    if parameters.get("type", "object") != "object":
        raise _invalid(f"the parameters of {function.name!r} must be an object schema")
    text = json.dumps(parameters, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    try:
        structured_output.check(StructuredOutput("json_schema", text))
    except RequestError as error:
        raise _invalid(f"tool {function.name!r}: {error.message}") from None


def _call_schema(function: Function, key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            key: function.parameters or {"type": "object"},
        },
        "required": ["name", key],
        "additionalProperties": False,
    }


def _json(rule: str, schema: dict[str, Any]) -> str:
    """A Lark rule of an inline JSON schema, with the engine's whitespace bound."""
    schema = {**schema, "x-guidance": dict(structured_output.JSON_OPTIONS)}
    return f"{rule}: %json {json.dumps(schema, ensure_ascii=False)}\n"


def _arguments(call: dict[str, Any]) -> Any:
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
        "function": {"name": call["function"]["name"], "arguments": _arguments(call)},
    }
