"""A tool format: how one model family writes tool calls, and everything the engine does
differently for it, in one class (`ToolFormat`); the registry of formats by name.

A format says how its chat template is recognised (`detect`), how a conversation reaches a
template that does not render tools or earlier calls itself (`write_calls`, `tool_result`,
`with_tools`), the grammar of a forced answer (`grammar`), the shape the parser reads
(class attributes, read once per parser: the parser runs per character of every streamed
answer), and its call ids (`new_call_id`). The formats the engine ships are in `formats/`,
registered in the order a template is matched against them; a new family's format is one
class in one file there, registered with `register`.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from otel_engine.entrypoints.tools.base import ToolChoice, ToolFormatName
from otel_engine.entrypoints.tools.calls import openai_call_id
from otel_engine.entrypoints.tools.request import Function


class ToolFormat:
    """One family's tool format. The defaults are those of a family whose template renders
    the tools and the history's calls itself; where it does not, the tools are described
    in a system message and earlier calls written as the generic format's object."""

    name: ClassVar[str]
    template_marks: ClassVar[tuple[str, ...]] = ()  # what shows the format in a template
    template_renders: ClassVar[bool] = True  # its template renders the tools and the history
    constrains_auto: ClassVar[bool] = False  # `auto` is under a grammar too
    argument_key: ClassVar[str] = "arguments"  # what its grammar names a call's arguments
    special_marker: ClassVar[str | None] = None  # a call's marker that may be a special token

    # The parser's shape. A call region starts at `marker` anywhere in the text, or, for a
    # `whole_answer` format, at the answer's first `{` (after `answer_prefix`, if written).
    marker: ClassVar[str] = ""
    whole_answer: ClassVar[bool] = False
    answer_prefix: ClassVar[str] = ""
    close_tag: ClassVar[str] = ""  # written after a region's JSON
    separator: ClassVar[str] = ""  # between a region's values (none: one value a region)
    calls_in_array: ClassVar[bool] = True  # the objects of a top-level array are calls
    wrapper_key: ClassVar[str | None] = None  # calls are the array under this key only

    @classmethod
    def detect(cls, template: str) -> bool:
        """Whether a chat template (one that mentions tools) teaches this format."""
        return any(mark in template for mark in cls.template_marks)

    @staticmethod
    def new_call_id() -> str:
        return openai_call_id()

    def grammar(self, functions: list[Function], most: int, forced: bool) -> str:
        """The Lark grammar of an answer of 1 to `most` calls to `functions`; `forced`
        false only for a format that `constrains_auto`."""
        raise NotImplementedError

    def write_calls(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls (`name`, `arguments`) as an assistant turn's text."""
        return json.dumps({"tool_calls": calls}, ensure_ascii=False)

    def tool_result(self, message: dict[str, Any], names: dict[Any, str]) -> dict[str, Any]:
        """A `tool` message (`names`: call id to function name)."""
        return message

    def with_tools(
        self,
        messages: list[dict[str, Any]],
        functions: list[Function],
        choice: ToolChoice,
        json_answer: bool,
    ) -> list[dict[str, Any]]:
        """The conversation with the tools in it: a system message that teaches them (the
        request's own system or developer message, else a new one first)."""
        text = instructions(functions, choice, json_answer)
        if messages and messages[0].get("role") in ("system", "developer"):
            first = messages[0]
            content = f"{first.get('content') or ''}\n\n{text}".lstrip()
            return [{**first, "content": content}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]


def instructions(functions: list[Function], choice: ToolChoice, json_answer: bool) -> str:
    """The system prompt's part that teaches the tools and the generic format's object."""
    tools = json.dumps([f.definition() for f in functions], ensure_ascii=False, indent=1)
    lines = [
        "You can call these tools (each is a function with a JSON schema of its arguments):",
        tools,
        "To call tools, answer with only one JSON object, nothing before or after it:",
        '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}',
    ]
    if choice is ToolChoice.AUTO and json_answer:
        lines.append("To answer without a tool, write the JSON object the answer must be.")
    elif choice is ToolChoice.AUTO:
        lines.append('To answer without a tool, write plain text that does not start with "{".')
        lines.append("Once a tool's result is in the conversation, answer the user with it.")
    elif choice is ToolChoice.REQUIRED:
        lines.append("You must call at least one tool.")
    else:
        lines.append(
            f"You must call the function {functions[0].name}."
            if len(functions) == 1
            else "You must call the function named in the request."
        )
    return "\n".join(lines)


# name -> format, in the order templates are matched against them
TOOL_FORMATS: dict[str, type[ToolFormat]] = {}


def register(cls: type[ToolFormat]) -> type[ToolFormat]:
    """Add a format to the registry (usable as a class decorator)."""
    if cls.name in TOOL_FORMATS:
        raise ValueError(f"tool format {cls.name!r} is already registered")
    TOOL_FORMATS[cls.name] = cls
    return cls


def tool_format(name: str) -> type[ToolFormat]:
    """The registered format called `name`."""
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool format {name!r}: one of {sorted(TOOL_FORMATS)}") from None


def detect_format(template: str) -> type[ToolFormat]:
    """The first format a chat template teaches; `generic` for one that teaches none."""
    if "tools" in template:
        for cls in TOOL_FORMATS.values():
            if cls.detect(template):
                return cls
    return TOOL_FORMATS[ToolFormatName.GENERIC]
