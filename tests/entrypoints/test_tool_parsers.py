"""Tool-call parsers on each format's real text: calls and content out of whole answers,
malformed and truncated calls as content with an invalid count (never an exception), the
same calls whether the text arrives at once or in any pieces, and a streamed call only once
it is a call (a short hypothesis run of the fuzz that `python -m tests.fuzz_tool_calls` runs
at full size)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.calls import Parsed
from otel_engine.entrypoints.tools.format import TOOL_FORMATS
from otel_engine.entrypoints.tools.formats import SHIPPED
from otel_engine.entrypoints.tools.formats.mistral import MistralFormat
from otel_engine.entrypoints.tools.parser import ToolCallParser
from otel_engine.outputs import FinishReason
from tests import fuzz_tool_calls
from tests.helpers import model_text
from tests.helpers.paths import REPO_ROOT

TOOLS = {"get_weather", "get_time"}
FUZZ_IN_TESTS = 300  # model answers of the fuzz run here (docs/tools.md states it)
WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"zone": "Europe/Paris", "nested": {"a": [1, 2.5e3, true, null, "x\\"}"]}}'

# format: (answer text, expected content, expected [(name, arguments)])
WELL_FORMED: dict[str, list[tuple[str, str, list[tuple[str, str]]]]] = {
    "hermes": [  # Qwen2.5's own markup, newlines included
        (
            f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
            "",
            [("get_weather", WEATHER)],
        ),
        (
            "Let me check both.\n"
            f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
            f'<tool_call>\n{{"arguments": {TIME}, "name": "get_time"}}\n</tool_call>',
            "Let me check both.\n\n",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        ("No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
        (  # the model stopped before the close tag
            f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n',
            "",
            [("get_weather", WEATHER)],
        ),
        (
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}'
            "\n</tool_call>",
            "",
            [("get_time", '{"zone": "UTC"}')],
        ),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
        (
            f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
            f'{{"name": "get_time", "arguments": {TIME}}}',
            "",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        ("The weather is fine {really}.", "The weather is fine {really}.", []),
        (
            '  {"name": "get_time", "parameters": {}}',
            "",
            [("get_time", "{}")],
        ),
    ],
    "mistral": [
        (
            f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
            f'{{"name": "get_time", "arguments": {TIME}}}]',
            "",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        (
            f'Sure. [TOOL_CALLS]{{"name": "get_weather", "arguments": {WEATHER}}}',
            "Sure. ",
            [("get_weather", WEATHER)],
        ),
        ("[1, 2] is a list, not a call.", "[1, 2] is a list, not a call.", []),
    ],
    "phi4_mini": [
        (
            f'functools[{{"name": "get_weather", "arguments": {WEATHER}}}]',
            "",
            [("get_weather", WEATHER)],
        ),
        ("I use functional tools daily.", "I use functional tools daily.", []),
    ],
    "generic": [
        (
            f'{{"tool_calls": [{{"name": "get_weather", "arguments": {WEATHER}}}, '
            f'{{"name": "get_time", "arguments": {TIME}}}]}}',
            "",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        ("Paris is the capital of France.", "Paris is the capital of France.", []),
    ],
}

# format: (text, expected content, expected calls, expected invalid count)
MALFORMED: dict[str, list[tuple[str, str, list[tuple[str, str]], int]]] = {
    "hermes": [
        (  # not JSON inside the tags
            "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
            "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
            [],
            1,
        ),
        (  # a function the request does not have
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            [],
            1,
        ),
        (  # truncated by max_tokens
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
            [],
            1,
        ),
        (  # arguments that are not an object
            '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call> done',
            '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call> done',
            [],
            1,
        ),
        (  # the second call broken: the first stands, the rest is text
            f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER}}}</tool_call>'
            '<tool_call>{"name": 7}</tool_call>',
            '<tool_call>{"name": 7}</tool_call>',
            [("get_weather", WEATHER)],
            1,
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": }}',
            '{"name": "get_weather", "parameters": {"city": }}',
            [],
            1,
        ),
        ('{"no_name": true}', '{"no_name": true}', [], 1),
        ('<|python_tag|>{"name": "get_weather"', '<|python_tag|>{"name": "get_weather"', [], 1),
    ],
    "mistral": [
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", [], 1),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"a": 1}',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"a": 1}',
            [],
            1,
        ),
    ],
    "phi4_mini": [
        (
            'functools[{"name": "get_weather", "arguments": 3}]',
            'functools[{"name": "get_weather", "arguments": 3}]',
            [],
            1,
        ),
    ],
    "generic": [
        ('{"tool_calls": []}', '{"tool_calls": []}', [], 1),
        (
            '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa',
            '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa',
            [],
            1,
        ),
        ('{"answer": "42"}', '{"answer": "42"}', [], 1),
    ],
}

CASES = [(f, *case) for f, cases in WELL_FORMED.items() for case in cases]
BAD_CASES = [(f, *case) for f, cases in MALFORMED.items() for case in cases]


def _parser(format: str) -> ToolCallParser:
    return ToolCallParser(TOOL_FORMATS[format](), TOOLS)


def parse_tool_calls(format: str, text: str, tool_names: set[str]) -> Parsed:
    return ToolCallParser(TOOL_FORMATS[format](), tool_names).parse(text)


def test_every_shipped_format_has_cases_of_both_kinds() -> None:
    assert set(ToolFormatName) == set(WELL_FORMED) == set(MALFORMED)


def _streamed(format: str, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Content and calls (id, name, arguments) as a client reassembles a stream."""
    parser = _parser(format)
    content, calls = "", {}
    for delta in [*(parser.feed(piece) for piece in pieces), parser.finish()]:
        content += delta.content
        for call in delta.calls:
            assert call.index not in calls, "a call is sent once, whole"
            calls[call.index] = (call.call.id, call.call.name, call.call.arguments)
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("format", "text", "content", "calls"), CASES)
def test_well_formed_calls_are_parsed(
    format: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    parsed = parse_tool_calls(format, text, TOOLS)

    assert (content, calls, 0) == (
        parsed.content,
        [(call.name, call.arguments) for call in parsed.calls],
        parsed.num_invalid,
    )
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)
        assert call.as_openai()["type"] == "function"
    assert len({call.id for call in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize(("format", "text", "content", "calls", "invalid"), BAD_CASES)
def test_malformed_and_truncated_calls_are_content(
    format: str, text: str, content: str, calls: list[tuple[str, str]], invalid: int
) -> None:
    parsed = parse_tool_calls(format, text, TOOLS)

    assert (content, calls, invalid) == (
        parsed.content,
        [(call.name, call.arguments) for call in parsed.calls],
        parsed.num_invalid,
    )


@pytest.mark.parametrize(("format", "text", "content", "calls"), CASES)
def test_one_character_at_a_time_equals_the_whole_text(
    format: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    whole = parse_tool_calls(format, text, TOOLS)

    streamed_content, streamed_calls = _streamed(format, list(text))

    assert whole.content == streamed_content
    assert [(c.name, c.arguments) for c in whole.calls] == [(n, a) for _, n, a in streamed_calls]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_chunking_gives_the_same_calls(data: st.DataObject) -> None:
    format, text, content, calls = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    streamed_content, streamed_calls = _streamed(format, pieces)

    assert content == streamed_content
    assert calls == [(n, a) for _, n, a in streamed_calls]


def test_a_call_is_sent_whole_once_its_object_closes() -> None:
    parser = _parser(ToolFormatName.HERMES)
    head = f'Checking.<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}'
    deltas = [parser.feed(head[i : i + 6]) for i in range(0, len(head), 6)]

    assert [] == [call for delta in deltas for call in delta.calls]
    assert "Checking." == "".join(delta.content for delta in deltas)
    closed = parser.feed("}\n</tool_call>")
    assert [(0, "get_weather", WEATHER)] == [
        (c.index, c.call.name, c.call.arguments) for c in closed.calls
    ]
    assert closed.calls[0].as_openai()["id"] == parser.calls[0].id
    assert "" == closed.content + parser.finish().content


# A call that breaks after its name, in each format whose `auto` is not under a grammar: the
# model stopped, or wrote what is not JSON, after `"name": "get_weather"`.
BROKEN_AFTER_THE_NAME = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": '),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call> ok'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": Paris}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]'),
    ("phi4_mini", 'functools[{"name": "get_weather", "arguments": 3}]'),
]


@pytest.mark.parametrize(("format", "text"), BROKEN_AFTER_THE_NAME)
def test_a_call_that_breaks_after_its_name_is_never_streamed(format: str, text: str) -> None:
    """The stream holds no call, only the text, and ends as the whole answer does (stop)."""
    case = model_text.Answer(ToolFormatName(format), text, FinishReason.STOP)

    streamed_content, streamed_calls = _streamed(format, list(text))

    assert (text, []) == (streamed_content, streamed_calls)
    assert [] == model_text.problems(case, list(text))


def test_the_fuzz_writes_answers_in_every_format() -> None:
    rng = random.Random(1)
    answers = [model_text.answer(rng, format) for format in ToolFormatName for _ in range(50)]

    assert set(ToolFormatName) == {answer.format for answer in answers}
    for format in ToolFormatName:
        parsed = [parse_tool_calls(a.format, a.text, TOOLS) for a in answers if a.format == format]
        assert any(p.calls for p in parsed), f"{format}: no answer with a call"
        assert any(p.num_invalid for p in parsed), f"{format}: no answer with a broken call"


def test_the_docs_state_the_fuzz_sizes() -> None:
    text = " ".join((REPO_ROOT / "docs" / "tools.md").read_text(encoding="utf-8").split())

    assert f"streams {fuzz_tool_calls.CASES:,} seeded model answers" in text
    assert f"the test suite runs {FUZZ_IN_TESTS} of them" in text


@settings(max_examples=FUZZ_IN_TESTS, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(list(ToolFormatName)), st.booleans())
def test_a_streamed_call_always_parses_and_equals_the_whole_answer(
    rng: random.Random, format: ToolFormatName, json_answer: bool
) -> None:
    """Over model answers well-formed and broken, streamed in random pieces to the parser:
    every streamed call parses, and content, calls and finish reason equal the parser's
    whole parse of the same text, with a response_format (`json_answer`) or without."""
    case = model_text.answer(rng, format)
    stream = model_text.pieces(rng, case.text)

    assert [] == model_text.problems(case, stream, json_answer), case


def test_text_that_may_start_a_marker_is_held_back() -> None:
    parser = _parser(ToolFormatName.HERMES)

    assert "Hi " == parser.feed("Hi <tool_").content
    assert "" == parser.feed("c").content
    assert "<tool_cx" == parser.feed("x").content


@given(st.text(max_size=200))
@settings(max_examples=200, deadline=None)
def test_no_text_makes_a_parser_raise(text: str) -> None:
    for format in SHIPPED:
        parsed = ToolCallParser(format(), TOOLS).parse(text)
        if not parsed.calls:
            assert text == parsed.content


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    parsed = parse_tool_calls(
        "mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', TOOLS
    )

    assert len(parsed.calls[0].id) == 9
    assert parsed.calls[0].id.isalnum()
    assert len(MistralFormat.new_call_id()) == 9
