"""The registry of tool formats: the shipped formats are the closed set `ToolFormatName`,
each name appears in the package only in its own class, and a new format is one class that
needs no other file: a toy format defined here alone is detected from its template, gets a
grammar, and its calls parse whole and streamed."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from typing import Any, ClassVar

import llguidance
import pytest

from otel_engine.engine.structured_output import _byte_tokenizer, grammar_of
from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import TOOL_FORMATS, ToolFormat, register
from otel_engine.entrypoints.tools.formats import SHIPPED
from otel_engine.entrypoints.tools.grammar import calls_schema, json_rule
from otel_engine.entrypoints.tools.plan import Function, ToolSupport
from otel_engine.entrypoints.tools.request import ToolChoice
from tests.helpers.paths import REPO_ROOT
from tests.helpers.tool_plans import plan_tools

PACKAGE = REPO_ROOT / "otel_engine"
FORMATS_DIR = PACKAGE / "entrypoints" / "tools" / "formats"
WEATHER = Function(
    "get_weather",
    None,
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


class ToyFormat(ToolFormat):
    """A made-up family: `CALL:` then a JSON array of calls, then `END`."""

    name: ClassVar[str] = "toy"
    template_marks = ("<<toy tools>>",)
    marker = "CALL:"
    close_tag = "END"

    @staticmethod
    def new_call_id() -> str:
        return "toy_1"

    def grammar(self, functions: list[Function], most: int, forced: bool) -> str:
        array = calls_schema(functions, self.argument_key, most)
        return 'start: "CALL:" calls "END"\n' + json_rule("calls", array)


class _Tokenizer:
    """What ToolSupport reads of a tokenizer."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.added_tokens_decoder: dict[int, Any] = {}

    def get_chat_template(self, tools: Any = None) -> str:
        return self.chat_template


@pytest.fixture
def toy() -> Iterator[type[ToolFormat]]:
    register(ToyFormat)
    yield ToyFormat
    del TOOL_FORMATS[ToyFormat.name]


def _accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return all(matcher.consume_token(byte) for byte in text.encode()) and matcher.is_accepting()


def test_the_shipped_formats_are_the_closed_set() -> None:
    assert set(ToolFormatName) == {f.name for f in SHIPPED}
    assert {f.name: f for f in SHIPPED} == TOOL_FORMATS


def test_a_name_is_registered_once(toy: type[ToolFormat]) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(toy)


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool format 'toy'"):
        ToolSupport(_Tokenizer(""), "toy")


def test_no_format_name_is_a_string_outside_its_own_class() -> None:
    """Each format's behaviour lives in its class: its name is nowhere else a literal in
    the HTTP edge or the command line (the CPU kernels have a "generic" level of their own)."""
    names = set(ToolFormatName)
    homes = {PACKAGE / "entrypoints" / "tools" / "base.py"}  # the enum itself
    found = []
    for path in [PACKAGE / "cli.py", *sorted((PACKAGE / "entrypoints").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Constant) and node.value in names):
                continue
            if path not in homes and path != FORMATS_DIR / f"{node.value}.py":
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.value!r}")
    assert [] == found


def test_a_toy_format_round_trips(toy: type[ToolFormat]) -> None:
    """Detected from its template, held to its grammar, parsed whole and streamed."""
    support = ToolSupport(_Tokenizer("{% if tools %}<<toy tools>>{% endif %}"))
    plan = plan_tools(support, [WEATHER], "required", parallel=True)
    assert plan is not None
    assert plan.structured is not None
    answer = 'Sure. CALL:[{"name": "get_weather", "arguments": {"city": "Oslo"}}]END Done.'
    forced = answer.removeprefix("Sure. ").removesuffix(" Done.")

    assert toy.name == support.format.name
    assert support.native
    assert ToolChoice.REQUIRED == plan.choice
    assert _accepts(grammar_of(plan.structured), forced)
    assert not _accepts(grammar_of(plan.structured), forced.replace('"Oslo"', "7"))
    whole = plan.parser_for_whole().parse(answer)
    assert ("Sure.  Done.", [("toy_1", "get_weather", {"city": "Oslo"})], 0) == (
        whole.content,
        [(c.id, c.name, json.loads(c.arguments)) for c in whole.calls],
        whole.num_invalid,
    )
    streamed = plan.parser(0)
    deltas = [streamed.feed(char) for char in answer] + [streamed.finish()]
    calls = [call for delta in deltas for call in delta.calls]
    assert "Sure.  Done." == "".join(delta.content for delta in deltas)
    assert ("toy_1", "get_weather") == (calls[0].call.id, calls[0].call.name)
    assert {"city": "Oslo"} == json.loads("".join(call.call.arguments for call in calls))


def test_auto_in_a_family_format_is_free(toy: type[ToolFormat]) -> None:
    support = ToolSupport(_Tokenizer("{% if tools %}<<toy tools>>{% endif %}"))
    plan = plan_tools(support, [WEATHER], "auto", parallel=True)

    assert plan is not None
    assert plan.structured is None
    assert [WEATHER.openai()] == support.template_tools(plan)
