"""The grammar bounds: regexes measured as llguidance's parser reads them (spaces in a count,
repeats in sequence, the x flag), required lengths, a client's x-guidance, llguidance's own
limits as client errors, every bound applied to every grammar a request can produce, and the
documented numbers."""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any

import llguidance
import pytest

from otel_engine.engine import grammar_bounds, grammars, structured_output
from otel_engine.engine.grammar_bounds import (
    MAX_REGEX_SIZE,
    MAX_REQUIRED_LENGTH,
    MIN_LENGTH_WEIGHT,
    GrammarLimit,
    GrammarTooCostly,
    check_schema,
    regex_size,
)
from otel_engine.engine.structured_output import check, from_response_format, is_limit_error
from otel_engine.entrypoints.tools.plan import Function, ToolSupport
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.sampling_params import StructuredOutput
from tests.engine.test_structured_output import BOUNDED, compiler_for, schema_format
from tests.entrypoints.test_tools import CHATML, FakeTokenizer
from tests.helpers.paths import REPO_ROOT
from tests.helpers.tool_plans import plan_tools

SEQUENCE = "^" + "a{2000}" * 50 + "$"  # each repeat under the old per-repeat bound


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("^a{100000}$", 100_002),
        ("^a{ 100000}$", 100_002),  # regex-syntax allows spaces inside the braces
        ("a{100000 }", 100_000),
        ("a{ 3 , 100000 }", 100_000),
        (SEQUENCE, 100_002),  # repeats in sequence add up
        ("(a|bb){3}", 9),  # alternatives add up
        ("((a{10}){10}b){10}", 1010),  # nested repeats multiply
        ("a{2}{3}", 6),
        ("a{3,}", 3),
        ("a{0,}", 1),
        ("a{,5}", 5),
        (r"^\d{4}-\d{2}-\d{2}$", 12),
        (r"\{3000}[{]{5}", 11),  # an escaped brace and a brace in a class are literals
        (r"\p{L}{7}", 7),
        (r"\pL{7}", 8),  # a one-letter property: the repeat is of the letter
        (r"\x41{7}", 7),
        (r"\x{41}{7}", 7),
        ("[]a{]{99}", 99),  # a `]` first in a class is a member
        ("[^]]{4}", 4),
        ("[[:alpha:]]{3}", 3),
        ("[a[b]c{100}]", 1),  # a nested class: its braces are members
        ("(?i)a{5}", 5),  # flags alone open no group
        ("(?P<name>ab){3}", 6),
        ("(?<name>ab){3}", 6),
        ("(?:ab){3}", 6),
        ("a{" + "0" * 5000 + "7}", 7),  # leading zeros past int()'s 4,300 digits
        ("a{" + "0" * 5000 + "," + "0" * 5000 + "}", 0),
        ("a{2," + "0" * 5000 + "12}", 12),
        ("a{" + "9" * 5000 + "}", 1 << 62),  # a count past any bound: the cap
        ("a{3," + "1" * 11 + "}", 1 << 62),
        ("a{1" + "0" * 10 + "}{0}", 0),  # 11 digits: past any bound, times nothing
    ],
)
def test_regex_size_reads_counted_repeats_as_llguidance_does(pattern: str, expected: int) -> None:
    assert expected == regex_size(pattern)


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("(?x)a{1 0 0 0 0 0}", "the x flag"),  # regex-syntax: a{100000}
        ("(?x:a #{\n{100000})", "the x flag"),
        ("(?-x)a", "the x flag"),
        ("a)", "closes no group"),
        ("(a", "unclosed group"),
        ("[a", "unclosed character class"),
    ],
)
def test_a_pattern_that_cannot_be_measured_is_refused(pattern: str, words: str) -> None:
    with pytest.raises(GrammarTooCostly, match=words) as raised:
        regex_size(pattern)
    assert GrammarLimit.REGEX_SIZE == raised.value.limit


@pytest.mark.parametrize(
    "pattern",
    [
        "a{" + " " * 60_000,  # an unclosed count after spaces
        "(?<" * 20_000,  # unclosed names
        "[[" + "[:abc" * 12_000 + "]]",  # ASCII classes that never close
        "\\p{" * 20_000,  # unclosed property names
    ],
)
def test_measuring_a_hostile_pattern_takes_linear_time(pattern: str) -> None:
    """A 60 KB pattern (a schema is at most 64 KiB) is read in well under a second: no
    step of the reading searches back and forth."""
    started = time.perf_counter()
    with contextlib.suppress(GrammarTooCostly):
        regex_size(pattern)
    assert time.perf_counter() - started < 1.0


def _schema(pattern: str, **keywords: Any) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern, **keywords}


def test_every_regex_of_a_schema_counts_towards_one_bound() -> None:
    half = MAX_REGEX_SIZE // 2
    one = _schema(f"a{{{half}}}")
    assert half == check_schema(one)
    many = {"type": "object", "properties": {"x": one, "y": one, "z": one}}
    keys = {"type": "object", "patternProperties": {f"^k{{{half}}}$": {}, f"^j{{{half}}}$": {}}}
    for schema in (many, keys, {"anyOf": [one, one, one]}):
        with pytest.raises(GrammarTooCostly, match=f"more than {MAX_REGEX_SIZE}") as raised:
            check_schema(schema)
        assert GrammarLimit.REGEX_SIZE == raised.value.limit


def test_a_min_length_beside_a_pattern_counts_its_weight() -> None:
    length = MAX_REGEX_SIZE // MIN_LENGTH_WEIGHT
    pattern = regex_size("^a*$")
    within = _schema("^a*$", minLength=length - 1)
    assert pattern + MIN_LENGTH_WEIGHT * (length - 1) == check_schema(within)
    assert pattern == check_schema(_schema("^a*$", maxLength=10**9))  # a maximum costs nothing
    with pytest.raises(GrammarTooCostly, match="regex_size"):
        check_schema(_schema("^a*$", minLength=length + 1))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "minLength": MAX_REQUIRED_LENGTH + 1},
        {"type": "array", "minItems": 10**12},
        {"type": "object", "properties": {"a": {"type": "object", "minProperties": 10**6}}},
        {"type": "array", "contains": {"type": "integer"}, "minContains": 2 * 10**4},
    ],
)
def test_a_schema_requiring_more_than_the_bound_is_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(GrammarTooCostly, match=f"more than {MAX_REQUIRED_LENGTH:,}") as raised:
        check_schema(schema)
    assert GrammarLimit.REQUIRED_LENGTH == raised.value.limit


def test_non_finite_and_negative_required_lengths_pass() -> None:
    """`-Infinity` (Python's json reads it) and negative numbers require nothing."""
    schema = json.loads('{"type": "string", "minLength": -Infinity, "minItems": -1e400}')
    check_schema(schema)
    check_schema({"type": "string", "pattern": "a", "minLength": -(10**30)})


def test_maxima_and_required_lengths_within_the_bound_pass() -> None:
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "minLength": MAX_REQUIRED_LENGTH, "maxLength": 2**40},
            "a": {"type": "array", "minItems": 1, "maxItems": 10**12},
        },
    }
    assert 0 == check_schema(schema)


@pytest.mark.parametrize(
    "options",
    [{"whitespace_pattern": "[ ]{0,100000}"}, {"item_separator": ", "}, {"lenient": True}, {}],
)
def test_a_client_x_guidance_is_refused(options: dict[str, Any]) -> None:
    with pytest.raises(GrammarTooCostly, match="x-guidance is not accepted") as raised:
        check_schema({"type": "object", "x-guidance": options})
    assert GrammarLimit.OPTIONS == raised.value.limit


# ---- Through `check`: the code, the param, and llguidance's own limits -------------------


def _refused(spec: StructuredOutput | None) -> RequestError:
    assert spec is not None
    with pytest.raises(RequestError) as raised:
        check(spec)
    return raised.value


@pytest.mark.parametrize(
    ("schema", "limit"),
    [
        (_schema("^a{ 100000}$"), "regex_size"),
        (_schema(SEQUENCE), "regex_size"),
        (_schema("(?x)a{1 0 0 0 0 0}"), "regex_size"),
        (_schema("a{" + "0" * 5000 + "100000}"), "regex_size"),
        ({"type": "string", "minLength": 100000}, "required_length"),
        ({"type": "object", "x-guidance": {"whitespace_pattern": "[ ]{0,100000}"}}, "options"),
    ],
)
def test_the_probe_s_bypasses_are_400_grammar_limit_exceeded(
    schema: dict[str, Any], limit: str
) -> None:
    error = _refused(from_response_format(schema_format(schema)))

    assert ErrorCode.GRAMMAR_LIMIT_EXCEEDED == error.code
    assert "response_format" == error.param
    assert f"({limit} limit)" in error.message


def test_a_pattern_llguidance_cannot_parse_stays_invalid_value() -> None:
    error = _refused(from_response_format(schema_format(_schema("(("))))
    assert ErrorCode.INVALID_VALUE == error.code
    assert "unclosed group" in error.message


@pytest.mark.parametrize("limits", [{"max_grammar_size": 3}, {"initial_lexer_fuel": 1}])
def test_llguidance_s_own_limits_are_client_errors(
    limits: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar llguidance refuses for one of its limits is grammar_limit_exceeded."""
    starved = llguidance.LLParserLimits(verbose_errors=False, **limits)
    monkeypatch.setattr(structured_output, "LIMITS", starved)
    structured_output._refusal.cache_clear()
    try:
        error = _refused(from_response_format(schema_format(BOUNDED)))
    finally:
        structured_output._refusal.cache_clear()

    assert ErrorCode.GRAMMAR_LIMIT_EXCEEDED == error.code, error.message


@pytest.mark.parametrize(
    "limits",
    [
        {"max_grammar_size": 3},
        {"initial_lexer_fuel": 1},
        {"max_lexer_states": 3},
        {"step_max_items": 2},
        {"step_lexer_fuel": 1},
    ],
)
def test_limit_words_are_llguidance_s(limits: dict[str, int]) -> None:
    """What llguidance says when it reaches each of its limits, building a grammar or
    running it, reads as a limit (`is_limit_error`); a schema error does not."""
    grammar = structured_output.grammar_of(StructuredOutput("json_schema", json.dumps(BOUNDED)))
    starved = llguidance.LLParserLimits(verbose_errors=False, **limits)
    tokenizer = structured_output._byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=starved)
    for byte in b'{"name":"ab","kind":"fox"':
        if matcher.is_error():
            break
        matcher.compute_bitmask()
        matcher.consume_token(byte)

    assert matcher.is_error()
    assert is_limit_error(matcher.get_error())
    assert not is_limit_error("Invalid type: objekt")


# ---- Every grammar a request can produce -----------------------------------------------


def _function(parameters: dict[str, Any], name: str = "lookup") -> Function:
    return Function(name, None, parameters)


@pytest.mark.parametrize("format_name", ["hermes", "generic"])
def test_an_answer_schema_beside_tools_is_bounded_as_alone(format_name: str) -> None:
    """`tool_choice: auto` with a response_format embeds the answer in the tools grammar:
    a costly answer is refused (`response_format`) before that grammar is built."""
    support = ToolSupport(FakeTokenizer(CHATML), format_name)
    answer = from_response_format(schema_format(_schema("^a{100000}$")))
    with pytest.raises(RequestError) as raised:
        plan_tools(support, [_function({})], "auto", False, answer)

    assert ErrorCode.GRAMMAR_LIMIT_EXCEEDED == raised.value.code
    assert "response_format" == raised.value.param


def test_the_tools_grammar_is_measured_across_every_schema_it_embeds() -> None:
    """Each tool within the bound alone, the grammar of all of them is past it."""
    half = _schema(f"^a{{{MAX_REGEX_SIZE // 2}}}$")
    functions = [
        _function({"type": "object", "properties": {"x": half}}, f"f{i}") for i in range(3)
    ]
    for function in functions:
        function.check()
    with pytest.raises(RequestError) as raised:
        plan_tools(ToolSupport(FakeTokenizer(CHATML), "hermes"), functions, "required", False)

    assert ErrorCode.GRAMMAR_LIMIT_EXCEEDED == raised.value.code
    assert "tools" == raised.value.param


def test_the_schemas_a_tools_grammar_embeds_are_read_back() -> None:
    schemas = [{"type": "string", "pattern": "^a{3}$"}, {"enum": ["%json {", "\n"]}]
    grammar = "start: a | b\n" + "".join(
        grammar_bounds.json_rule(rule, schema, {})
        for rule, schema in zip("ab", schemas, strict=True)
    )
    read = [
        {k: v for k, v in s.items() if k != "x-guidance"}
        for s in grammar_bounds.embedded_schemas(grammar)
    ]
    assert schemas == read


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"q": _schema("^a{ 100000}$")}},
        {"type": "object", "x-guidance": {"lenient": True}},
        {"type": "object", "properties": {"q": {"type": "string", "minLength": 10**6}}},
    ],
)
def test_a_tool_s_parameters_are_bounded(parameters: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as raised:
        _function(parameters).check()

    assert ErrorCode.GRAMMAR_LIMIT_EXCEEDED == raised.value.code
    assert "tools" == raised.value.param


def test_the_core_refuses_what_the_front_end_would(tiny_model_dir: str) -> None:
    """A spec that reaches the engine core's compiler without the front end's check is
    refused there, with the same code."""
    compiler = compiler_for(tiny_model_dir)
    spec = from_response_format(schema_format(_schema("^a{ 100000}$")))
    assert spec is not None
    with pytest.raises(RequestError) as raised:
        compiler.submit(spec).result(timeout=60)
    compiler.shutdown()

    assert ErrorCode.GRAMMAR_LIMIT_EXCEEDED == raised.value.code


# ---- In the engine core: a refusal while running, and the step budget ------------------


def test_a_token_its_mask_allowed_but_llguidance_refused_is_a_parser_limit(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llguidance reaching a limit while it lexes a sampled token (here: lexer fuel, as
    `^a{10000}$` once did past the old repeat check) fails the request with a limit (a 400),
    not as an engine bug (a 500)."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(grammars, "check", lambda spec: None)
    monkeypatch.setattr(
        grammars, "LIMITS", llguidance.LLParserLimits(verbose_errors=False, initial_lexer_fuel=5000)
    )
    compiler = compiler_for(tiny_model_dir)
    spec = StructuredOutput("json_schema", json.dumps(_schema("^a{10000}$")))
    grammar = compiler.submit(spec).result(timeout=60)
    [quote] = AutoTokenizer.from_pretrained(tiny_model_dir).encode('"', add_special_tokens=False)
    grammars.fill_bitmasks([grammar])
    assert grammar._allows(quote)

    grammar.accept(quote)
    compiler.shutdown()

    assert GrammarLimit.PARSER == grammar.limit
    assert grammar.error is not None


def test_a_token_outside_its_mask_is_an_engine_bug_not_a_limit(tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    compiler = compiler_for(tiny_model_dir)
    grammar = compiler.submit(StructuredOutput("json_object")).result(timeout=60)
    [letter] = AutoTokenizer.from_pretrained(tiny_model_dir).encode("x", add_special_tokens=False)
    grammars.fill_bitmasks([grammar])
    assert not grammar._allows(letter)

    grammar.accept(letter)
    compiler.shutdown()

    assert grammar.limit is None
    assert grammar.error is not None


def test_the_step_budget_computes_the_longest_waiting_first(tiny_model_dir: str) -> None:
    """With no time to spare, each step computes one mask and the rest wait; the one that
    waited longest comes first, so every request gets its mask in turn."""
    compiler = compiler_for(tiny_model_dir)
    spec = from_response_format(schema_format(BOUNDED))
    assert spec is not None
    waiting = [compiler.submit(spec).result(timeout=60) for _ in range(3)]
    served = []
    for _ in range(3):
        grammars.fill_within(waiting, budget_s=0.0)
        [computed] = [g for g in waiting if g.has_mask]
        served.append(computed)
        assert 0 == computed.num_deferred
        computed.has_mask = False  # as if its token were sampled
    compiler.shutdown()

    assert 3 == len({id(g) for g in served})
    assert [0, 1, 2] == sorted(g.num_deferred for g in waiting)


class _FakeGrammar:
    """What `fill_within` reads of a grammar, with a mask that always takes `cost_s`."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s = cost_s
        self.has_mask = False
        self.error = None
        self.last_mask_s = self.mask_cost_s = self.debt_s = 0.0
        self.num_deferred = 0
        self.num_masks = 0

    @property
    def is_free(self) -> bool:
        return self.has_mask

    def fill(self) -> None:
        self.last_mask_s = self.mask_cost_s = self.cost_s
        self.has_mask = True
        self.num_masks += 1


def _run_steps(fakes: list[_FakeGrammar], num_steps: int) -> None:
    for _ in range(num_steps):
        grammars.fill_within(fakes, budget_s=0.02)  # type: ignore[arg-type]
        for fake in fakes:
            fake.has_mask = False  # its token was sampled


def test_the_step_budget_holds_back_the_costly_grammar_not_the_cheap_ones() -> None:
    """One grammar whose masks take 30 ms among four of 0.1 ms, under a 20 ms budget: each
    has a 4 ms share, so once each has shown its cost (the first step), the costly one gets
    a mask about once per 30 / 4 steps and the cheap ones one every step."""
    costly, *cheap = fakes = [_FakeGrammar(0.03)] + [_FakeGrammar(0.0001) for _ in range(4)]
    _run_steps(fakes, 1)
    for fake in fakes:
        fake.num_masks = 0
    _run_steps(fakes, 75)

    assert [75] * 4 == [fake.num_masks for fake in cheap]
    assert 9 <= costly.num_masks <= 11
    assert all(-0.004 - 1e-9 <= fake.debt_s <= fake.cost_s for fake in fakes)


def test_a_costly_grammar_alone_gets_a_mask_every_step() -> None:
    """The least indebted grammar is always computed: alone, a 30 ms one never waits, and
    owes nothing for it when others come."""
    alone = _FakeGrammar(0.03)
    _run_steps([alone], 20)

    assert 20 == alone.num_masks
    assert 0 == alone.num_deferred
    assert 0.0 == alone.debt_s


def test_grammars_that_fit_the_budget_all_get_a_mask_every_step() -> None:
    """Ten 1 ms grammars and four of 2 ms take 18 ms of a 20 ms budget: the 2 ms ones cost
    more than their share (20 / 14 ms), but the step has room for them, so none waits."""
    fakes = [_FakeGrammar(0.001) for _ in range(10)] + [_FakeGrammar(0.002) for _ in range(4)]
    _run_steps(fakes, 30)

    assert [30] * 14 == [fake.num_masks for fake in fakes]


# ---- The documented numbers are the code's ---------------------------------------------


def _grammar_limits_section() -> str:
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    return " ".join(text.split("- Grammar limits.", 1)[1].split("\n- Cost", 1)[0].split())


def test_the_documented_grammar_limits_are_the_code_s() -> None:
    limits = _grammar_limits_section()
    whitespace = re.search(r"\{0,(\d+)\}", structured_output.JSON_OPTIONS["whitespace_pattern"])
    assert whitespace is not None
    for words in (
        f"at most {MAX_REGEX_SIZE:,} atoms in all",
        f"at {MIN_LENGTH_WEIGHT} atoms a character",
        f"`^a{{ 100000}}$` is {regex_size('^a{ 100000}$'):,} atoms",
        f"`a{{2000}}` fifty times is {regex_size('a{2000}' * 50):,}",
        f"`(a{{100}}){{100}}` is {regex_size('(a{100}){100}'):,}",
        f"at most {MAX_REQUIRED_LENGTH:,} characters",
        f"{grammars.MASK_TIME_BUDGET_S:g} s of mask computation",
        f"{grammars.MATCHER_MEMORY_BUDGET >> 20} MiB of RSS",
        f"the last {grammars.REFUSED_SIZE} such schemas",
        f"until they have taken {grammars.STEP_MASK_BUDGET_S * 1000:g} ms",
        f"past {grammars.KEEP_BYTES >> 20} MiB",
        f"at most {grammars.CACHE_MEMORY_BUDGET >> 20} MiB",
        structured_output.LIMIT_EXCEEDED,
        *(f"`{limit}`" for limit in GrammarLimit),
    ):
        assert words in limits
    assert f"bounded ({whitespace.group(1)} characters)" in (
        " ".join((REPO_ROOT / "docs" / "operations.md").read_text().split())
    )


@pytest.mark.slow
def test_structured_requests_past_the_step_budget_wait_their_turn_and_finish(
    tiny_model_dir: str, tiny_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no mask time to spare, each step computes one mask: the other structured
    requests sit the step out (counted in the history), every one still writes JSON that
    validates, and a plain request of the same batch writes what it writes alone."""
    import jsonschema

    from otel_engine import LLM, SamplingParams

    monkeypatch.setattr(grammars, "STEP_MASK_BUDGET_S", 0.0)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    structured = SamplingParams(
        max_tokens=250,
        temperature=0.0,
        structured_output=from_response_format(schema_format(BOUNDED)),
    )
    with LLM(tiny_model_dir, dtype="float32", crash_history_steps=256) as engine:
        [alone] = engine.generate(tiny_prompts[:1], plain)
        outputs = engine.generate(tiny_prompts[:4], [plain, structured, structured, structured])
        history = engine._frontend.client.core.history.part()  # type: ignore[attr-defined]

    assert alone.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for output in outputs[1:]:
        assert "stop" == output.outputs[0].finish_reason
        jsonschema.validate(json.loads(output.outputs[0].text), BOUNDED)
    deferred = [dict(zip(history["fields"], step, strict=True)) for step in history["steps"]]
    assert max(step["num_grammar_deferred"] for step in deferred) == 2


@pytest.mark.slow
def test_the_step_span_counts_the_batch_that_ran_not_the_requests_that_sat_out(
    tiny_model_dir: str, tiny_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step span's `num_requests` and `num_batched_tokens` are set after deferral: they
    agree with the crash history's step, and its grammar rows and deferred add up."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_engine import LLM, SamplingParams

    monkeypatch.setattr(grammars, "STEP_MASK_BUDGET_S", 0.0)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    structured = SamplingParams(
        max_tokens=20,
        temperature=0.0,
        structured_output=from_response_format(schema_format(BOUNDED)),
    )
    with LLM(tiny_model_dir, dtype="float32", crash_history_steps=256) as engine:
        core = engine._frontend.client.core  # type: ignore[attr-defined]
        core._tracer, core.is_tracing = provider.get_tracer("test"), True
        engine.generate(tiny_prompts[:3], structured)
        history = core.history.part()
    provider.shutdown()

    steps = {
        record["step_id"]: record
        for record in (dict(zip(history["fields"], step, strict=True)) for step in history["steps"])
    }
    spans = [span for span in exporter.get_finished_spans() if span.name == "engine_core.step"]
    deferred = [span for span in spans if span.attributes["otel_engine.step.num_grammar_deferred"]]
    assert deferred
    for span in deferred:
        attributes = span.attributes
        step = steps[attributes["otel_engine.step.id"]]
        assert step["num_requests"] == attributes["otel_engine.step.num_requests"]
        assert step["num_scheduled_tokens"] == attributes["otel_engine.step.num_batched_tokens"]
        assert step["num_grammar_deferred"] == attributes["otel_engine.step.num_grammar_deferred"]
