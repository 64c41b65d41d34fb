"""Function tools on the chat endpoints: one server's tool format (`ToolSupport`, chosen once
from the model's chat template or `--tool-call-parser`) and one request's plan (`ToolPlan`):
how the tools and the conversation's earlier calls reach the prompt, the grammar that holds
the answer, and the parsers of its choices.

A template with a format of a family the engine knows renders the tools itself, as
transformers passes them (`tools=`), and the history's calls and results as its messages
carry them (`tool_calls`, role `tool`, `tool_call_id`); otherwise the format's hooks write
them into the messages (format.py). `tool_choice` `required` and a named function are
enforced in every format by a grammar built from the tools' parameter schemas
(llguidance, grammar.py), so their calls always parse and validate; `auto` in a family's own
format is not constrained (the model may answer in text or write a malformed call, which is
counted and returned as text).

The server makes a request's plan in two steps, so that the costly one comes after the
prompt was found to fit the context: `draft` (the choice, the tools' shapes: microseconds per
tool) before the prompt is rendered, `constrain` (each schema checked, the grammar built:
milliseconds per tool) after; `plan` is both at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import otel_engine.entrypoints.tools.formats  # noqa: F401 (registers the shipped formats)
from otel_engine.engine import structured_output
from otel_engine.entrypoints.tools.base import ToolChoice
from otel_engine.entrypoints.tools.format import ToolFormat, detect_format, tool_format
from otel_engine.entrypoints.tools.grammar import tool_grammar
from otel_engine.entrypoints.tools.parser import ToolCallParser
from otel_engine.entrypoints.tools.request import Function, call_arguments, invalid, resolve_choice
from otel_engine.errors import RequestError
from otel_engine.model.tokenizer import TokenizerLike
from otel_engine.sampling_params import StructuredOutput


@dataclass(slots=True)
class ToolPlan:
    """One request's tools: what the template gets, the grammar, the answer's parser."""

    format: ToolFormat
    native: bool  # the chat template renders the tools and the history
    functions: list[Function]
    choice: ToolChoice  # AUTO, REQUIRED or NAMED
    parallel: bool
    named: str | None = None  # the function a NAMED choice names
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
        self.tokenizer = tokenizer
        detected = detect_format(_template_text(tokenizer))
        chosen = detected if parser == "auto" else tool_format(parser)
        self.format = chosen()
        # the template renders tools only in its own family's format
        self.native = chosen is detected and chosen.template_renders
        self._specials = {
            token.content for token in tokenizer.added_tokens_decoder.values() if token.special
        }

    def draft(
        self,
        tools: list[Function] | None,
        tool_choice: str | dict[str, Any] | None,
        parallel: bool,
        answer_format: StructuredOutput | None = None,
    ) -> ToolPlan | None:
        """The request's plan, its grammar not yet made (`constrain`); None when it has no
        tools or `tool_choice` is `none`. With a `response_format` (`answer_format`), `auto`
        answers either calls or JSON of that format; a forced call is a call (the format is
        for the answer after it)."""
        choice, named = resolve_choice(tools, tool_choice)
        if not tools or choice is ToolChoice.NONE:
            return None
        if len({function.name for function in tools}) != len(tools):
            raise invalid("tool function names must be unique")
        for function in tools:
            function.check_shape()
        plan = ToolPlan(self.format, self.native, list(tools), choice, parallel, named=named)
        plan.json_answer = answer_format is not None
        marker = self.format.special_marker
        if marker in self._specials:  # it must reach the parser
            plan.keep_special = marker
            plan.drop = tuple(sorted(self._specials - {marker}, key=len, reverse=True))
        return plan

    def constrain(self, plan: ToolPlan, answer_format: StructuredOutput | None = None) -> None:
        """Check each tool's schema and make the plan's grammar (milliseconds per tool:
        called once the prompt is known to fit)."""
        for function in plan.functions:
            function.check()
        named = plan.named
        functions = [f for f in plan.functions if f.name == named] if named else plan.functions
        grammar = tool_grammar(
            self.format, functions, plan.choice, plan.parallel and not named, answer_format
        )
        if grammar is not None:
            plan.structured = StructuredOutput(
                "tool_calls", grammar=grammar, num_tools=len(plan.functions)
            )
            try:
                structured_output.check(plan.structured)
            except RequestError as error:
                raise RequestError(error.message, code=error.code, param="tools") from None

    def template_tools(self, plan: ToolPlan | None) -> list[dict[str, Any]] | None:
        """The `tools` the chat template gets (None: it renders none)."""
        if plan is None or not self.native:
            return None
        return [function.openai() for function in plan.functions]

    def messages(
        self, messages: list[dict[str, Any]], plan: ToolPlan | None
    ) -> list[dict[str, Any]]:
        """The conversation as the template renders it: earlier calls (their arguments
        decoded, `call_arguments`) and their results in the template's terms, and the tools
        where the template does not take them itself."""
        if self.native:
            return [_decoded(message) for message in messages]
        names = {}  # call id: function name, for the results
        converted: list[dict[str, Any]] = []
        for message in messages:
            calls = message.get("tool_calls")
            if calls:
                for call in calls:
                    names[call.get("id")] = call["function"]["name"]
                entries = [
                    {"name": call["function"]["name"], "arguments": call_arguments(call)}
                    for call in calls
                ]
                text = self.format.write_calls(entries)
                content = message.get("content") or ""
                converted.append(
                    {"role": "assistant", "content": f"{content}\n{text}" if content else text}
                )
            elif message.get("role") == "tool":
                converted.append(self.format.tool_result(message, names))
            else:
                converted.append(message)
        if plan is not None:
            converted = self.format.with_tools(
                converted, plan.functions, plan.choice, plan.json_answer
            )
        return converted


def _decoded(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its calls' arguments as the objects they encode (templates read
    `tool_call.arguments` as an object)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    decoded = [
        {**call, "function": {**call["function"], "arguments": call_arguments(call)}}
        for call in calls
    ]
    return {**message, "tool_calls": decoded}


def _template_text(tokenizer: TokenizerLike) -> str:
    template: str | dict[str, str] | None
    try:
        template = tokenizer.get_chat_template(tools=[{}])
    except (ValueError, AttributeError, TypeError):
        template = tokenizer.chat_template
    if isinstance(template, dict):
        template = "\n".join(str(value) for value in template.values())
    return template if isinstance(template, str) else ""
