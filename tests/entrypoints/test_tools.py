"""The tool plan of a request: the format read from the chat template, the grammar that
enforces `required` and a named function in each format (its calls validate against the
tools' schemas), the conversation's earlier calls as the template needs them, and clear
errors for bad tools."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from otel_engine.engine.structured_output import _byte_tokenizer, grammar_of
from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import TOOL_FORMATS, detect_format, instructions
from otel_engine.entrypoints.tools.parser import ToolCallParser
from otel_engine.entrypoints.tools.plan import Function, ToolSupport
from otel_engine.errors import RequestError
from tests.helpers.tiny_model import HERMES_TOOL_TEMPLATE
from tests.helpers.tool_plans import plan_tools

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = Function("get_weather", "The forecast <b>of a city</b>", PARAMETERS)
TIME = Function("get_time", None, None)

LLAMA3_TEMPLATE = (
    "{%- if tools %}{{ '<|start_header_id|>ipython<|end_header_id|>' }}"
    "{%- for t in tools %}{{ t | tojson }}{%- endfor %}{%- endif %}"
    "{%- for m in messages %}{{ m.role + ': ' + m.content }}{%- endfor %}"
)
MISTRAL_TEMPLATE = "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS][TOOL_CALLS]"
PHI4_TEMPLATE = "{% for m in messages %}{{ m['tools'] if 'tools' in m }}<|tool|>{% endfor %}"
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"


class FakeTokenizer:
    """What ToolSupport reads of a tokenizer: its template and its special tokens."""

    def __init__(self, template: str, specials: tuple[str, ...] = ()) -> None:
        self.chat_template = template

        class Token:
            def __init__(self, content: str) -> None:
                self.content, self.special = content, True

        self.added_tokens_decoder = {i: Token(t) for i, t in enumerate(specials)}

    def get_chat_template(self, tools: Any = None) -> str:
        return self.chat_template


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (HERMES_TOOL_TEMPLATE, "hermes"),
        (LLAMA3_TEMPLATE, "llama3_json"),
        (MISTRAL_TEMPLATE, "mistral"),
        (PHI4_TEMPLATE, "phi4_mini"),
        (CHATML, "generic"),
        ("{{ tools }} and a format the engine does not know", "generic"),
    ],
)
def test_the_format_comes_from_the_chat_template(template: str, expected: str) -> None:
    assert expected == detect_format(template).name


def _generate(grammar: str, text: str) -> bool:
    """Whether llguidance's grammar accepts `text` whole (byte by byte)."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    for byte in text.encode():
        if not matcher.consume_token(byte):
            return False
    return matcher.is_accepting()


WRITTEN = {  # one valid forced answer per format
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    "\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    "phi4_mini": 'functools[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    "generic": '{"tool_calls": [{"name": "get_weather", '
    '"arguments": {"city": "Oslo", "days": 2}}]}',
}


@pytest.mark.parametrize("format", list(ToolFormatName))
def test_required_is_a_grammar_of_valid_calls_in_each_format(format: str) -> None:
    """The forced grammar accepts a valid call as the format writes it, refuses one whose
    arguments break the schema, and what it accepts parses to arguments that validate."""
    support = ToolSupport(FakeTokenizer(CHATML), format)
    plan = plan_tools(support, [WEATHER, TIME], "required", parallel=False)
    assert plan is not None
    assert plan.structured is not None
    grammar = grammar_of(plan.structured)
    good = WRITTEN[format]
    bad = good.replace('"days": 2', '"days": 9')

    assert _generate(grammar, good)
    assert not _generate(grammar, bad)
    assert not _generate(grammar, "I would rather not.")
    parsed = ToolCallParser(TOOL_FORMATS[format](), plan.names).parse(good)
    assert ["get_weather"] == [call.name for call in parsed.calls]
    jsonschema.validate(json.loads(parsed.calls[0].arguments), PARAMETERS)
    assert plan.structured.num_tools == 2


def test_a_named_function_is_the_only_call_allowed() -> None:
    support = ToolSupport(FakeTokenizer(CHATML))
    plan = plan_tools(
        support,
        [WEATHER, TIME],
        {"type": "function", "function": {"name": "get_time"}},
        parallel=True,
    )
    assert plan is not None
    assert plan.structured is not None
    grammar = grammar_of(plan.structured)

    assert _generate(grammar, '{"tool_calls": [{"name": "get_time", "arguments": {}}]}')
    assert not _generate(grammar, WRITTEN["generic"])
    assert not _generate(
        grammar,
        '{"tool_calls": [{"name": "get_time", "arguments": {}}, '
        '{"name": "get_time", "arguments": {}}]}',
    )


def test_generic_auto_allows_text_or_calls_and_native_auto_is_free() -> None:
    generic = plan_tools(ToolSupport(FakeTokenizer(CHATML)), [WEATHER], "auto", parallel=True)
    native = plan_tools(ToolSupport(FakeTokenizer(HERMES_TOOL_TEMPLATE)), [WEATHER], None, True)
    assert generic is not None
    assert generic.structured is not None
    assert native is not None
    grammar = grammar_of(generic.structured)

    assert _generate(grammar, "Paris is sunny today.")
    assert _generate(grammar, WRITTEN["generic"])
    assert not _generate(grammar, '{"answer": 1}')
    assert native.structured is None  # the model's own format, unconstrained
    assert native.native


def test_none_and_no_tools_make_no_plan() -> None:
    support = ToolSupport(FakeTokenizer(CHATML))

    assert plan_tools(support, [WEATHER], "none", parallel=True) is None
    assert plan_tools(support, None, None, parallel=True) is None


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        ([WEATHER, WEATHER], "auto", "tools", "unique"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not among"),
        (None, "required", "tool_choice", "needs tools"),
        ([Function("f", None, {"type": "string"})], "auto", "tools", "object schema"),
        (
            [Function("f", None, {"type": "object", "properties": {"a": {"pattern": "a{9999}"}}})],
            "auto",
            "tools",
            "repeats",
        ),
    ],
)
def test_bad_tools_are_request_errors(
    tools: list[Function] | None, choice: Any, param: str, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as raised:
        plan_tools(ToolSupport(FakeTokenizer(CHATML)), tools, choice, parallel=True)

    assert param == raised.value.param


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"type": "object", "properties": []}, "properties must be an object"),
        ({"type": "object", "properties": {"a": "string"}}, "properties.a must be an object"),
        ({"type": "object", "required": "a"}, "required must be a list"),
        ({"type": "object", "required": [1]}, "required must be a list"),
        ({"type": "object", "properties": {"a": {"type": 7}}}, "properties.a: type must be"),
        ({"type": "object", "properties": {"a": {"type": ["x", {}]}}}, "type must be"),
        ({"type": "object", "properties": {"a": {"properties": 7}}}, "properties must be"),
    ],
)
def test_malformed_parameters_are_refused_by_the_draft(
    parameters: dict[str, Any], words: str
) -> None:
    """The keywords a template iterates (`properties`, `required`, `type`) are checked when
    the plan is drafted, before the template renders: a 400 on `tools`, not a template
    error."""
    with pytest.raises(RequestError, match=words) as raised:
        ToolSupport(FakeTokenizer(CHATML)).draft([Function("f", None, parameters)], "auto", True)

    assert "tools" == raised.value.param


def test_generic_history_renders_calls_as_written_and_results_as_user_turns() -> None:
    support = ToolSupport(FakeTokenizer(CHATML))
    plan = plan_tools(support, [WEATHER], "auto", parallel=True)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]

    messages = support.messages(history, plan)

    assert messages[0]["content"].startswith("Be brief.\n\n")
    assert plan is not None
    assert instructions(plan.functions, plan.choice, plan.json_answer) in messages[0]["content"]
    assert '"get_weather"' in messages[0]["content"]
    written = json.loads(messages[2]["content"])
    assert {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]} == written
    assert messages[3]["role"] == "user"
    assert "get_weather" in messages[3]["content"]
    assert "rain" in messages[3]["content"]


def test_native_history_and_tools_go_to_the_template() -> None:
    support = ToolSupport(FakeTokenizer(HERMES_TOOL_TEMPLATE))
    plan = plan_tools(support, [WEATHER], "auto", parallel=True)
    history = [{"role": "user", "content": "hi"}]

    assert history == support.messages(history, plan)
    assert [WEATHER.openai()] == support.template_tools(plan)


def test_a_special_token_marker_is_kept_and_other_specials_dropped() -> None:
    support = ToolSupport(FakeTokenizer(MISTRAL_TEMPLATE, ("[TOOL_CALLS]", "</s>")))
    plan = plan_tools(support, [WEATHER], "auto", parallel=True)
    assert plan is not None

    assert "[TOOL_CALLS]" == plan.keep_special
    assert "[TOOL_CALLS][]" == plan.clean("[TOOL_CALLS][]</s>")


def test_the_draft_checks_shapes_only_and_constrain_checks_schemas() -> None:
    """A schema llguidance refuses passes the draft (before the prompt is rendered) and is
    refused by `constrain`, which makes the grammar."""
    support = ToolSupport(FakeTokenizer(CHATML))
    costly = Function("f", None, {"type": "object", "properties": {"a": {"pattern": "a{9999}"}}})
    plan = support.draft([costly], "required", parallel=True)
    assert plan is not None
    assert plan.structured is None

    with pytest.raises(RequestError, match="repeats"):
        support.constrain(plan)


def test_constrain_makes_the_grammar_of_a_named_function() -> None:
    support = ToolSupport(FakeTokenizer(CHATML))
    named = {"type": "function", "function": {"name": "get_time"}}
    plan = support.draft([WEATHER, TIME], named, parallel=True)
    assert plan is not None

    support.constrain(plan)

    assert plan.structured is not None
    grammar = grammar_of(plan.structured)
    assert _generate(grammar, '{"tool_calls": [{"name": "get_time", "arguments": {}}]}')
    assert not _generate(grammar, WRITTEN["generic"])


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "description": "\ud800"},
        {"type": "object", "properties": {"\udc00": {}}},
    ],
    ids=["a value", "a key"],
)
def test_parameters_with_a_lone_surrogate_are_refused_by_the_draft(
    parameters: dict[str, Any],
) -> None:
    with pytest.raises(RequestError, match="lone surrogate") as raised:
        ToolSupport(FakeTokenizer(CHATML)).draft([Function("f", None, parameters)], None, True)

    assert "tools" == raised.value.param


def _history(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]}]


@pytest.mark.parametrize("template", [CHATML, HERMES_TOOL_TEMPLATE], ids=["generic", "hermes"])
@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ("[" * 1200, "deeper than 64"),
        ("[" * 900 + "]" * 900, "deeper than 64"),
        ('{"a": ' * 65 + "1" + "}" * 65, "deeper than 64"),
        ('"\\ud800"', "lone surrogate"),
        ('{"k": ["\\udfff"]}', "lone surrogate"),
        ('{"\\ud800": 1}', "lone surrogate"),
    ],
    ids=["unbalanced 1200", "balanced 900", "65 objects", "string", "in a list", "a key"],
)
def test_history_arguments_a_template_cannot_render_are_request_errors(
    template: str, arguments: str, words: str
) -> None:
    """Arguments decoded for the template: nested past MAX_JSON_DEPTH (even past the JSON
    decoder's own bound) or holding a lone surrogate are a 400 naming `messages`."""
    with pytest.raises(RequestError, match=words) as raised:
        ToolSupport(FakeTokenizer(template)).messages(_history(arguments), None)

    assert "messages" == raised.value.param


def test_native_history_arguments_are_decoded_for_the_template() -> None:
    """A template reads `tool_call.arguments` as an object; text that is not JSON stays text."""
    support = ToolSupport(FakeTokenizer(HERMES_TOOL_TEMPLATE))
    history = _history('{"city": "Oslo"}') + _history("not json")

    messages = support.messages(history, None)

    assert {"city": "Oslo"} == messages[0]["tool_calls"][0]["function"]["arguments"]
    assert "not json" == messages[1]["tool_calls"][0]["function"]["arguments"]
    assert '{"city": "Oslo"}' == history[0]["tool_calls"][0]["function"]["arguments"]
