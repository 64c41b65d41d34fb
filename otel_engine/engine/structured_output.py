"""Structured output: `response_format` json_object / json_schema, enforced token by token.

The grammar engine is llguidance (Microsoft's, the Rust core of Guidance; vLLM and SGLang use
it too): one 3 MB wheel without dependencies (xgrammar 0.2 pulls triton and apache-tvm-ffi),
a grammar builds in about a millisecond, each next-token mask is computed lazily (~100 µs on
this CPU for a nested schema; engine/grammar_bounds.py bounds what one schema may cost), and it says
what is wrong with a schema in words a client can act on.

Here, the front end's part (`check`, in its tokenizer thread): the schema is valid for
llguidance and within the grammar bounds (engine/grammar_bounds.py), or the request is a 400
naming the problem; nothing reaches the engine that cannot compile. The engine core's part,
building grammars and their masks each step, is engine/grammars.py.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

import llguidance

from otel_engine.engine import grammar_bounds
from otel_engine.engine.grammar_bounds import GrammarTooCostly
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.observability.label_sets import InvalidJsonReason
from otel_engine.outputs import FinishReason
from otel_engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


PARAM = "response_format"
MAX_ERROR_CHARS = 500  # of llguidance's message in a 400
# JSON as models write it, with whitespace bounded: unbounded whitespace lets a small model
# fill max_tokens with newlines and never close the object.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}
# llguidance's defaults, except that errors stay short (verbose ones quote parser state).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
LIMIT_EXCEEDED = ErrorCode.GRAMMAR_LIMIT_EXCEEDED  # the code of a request failed by a limit


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """The engine's spec for an OpenAI `response_format` (None: plain text); RequestError
    with `param` for a shape that is not one."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise RequestError(
            "response_format type must be text, json_object or json_schema",
            code=ErrorCode.INVALID_VALUE,
            param=PARAM,
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(
            "response_format.json_schema must be an object with a schema",
            code=ErrorCode.INVALID_VALUE,
            param=PARAM,
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError(
            "response_format.json_schema.schema must be a JSON object",
            code=ErrorCode.INVALID_VALUE,
            param=PARAM,
        )
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    structured = StructuredOutput("json_schema", text)
    structured.validate()
    return structured


def grammar_of(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec` (its JSON text)."""
    if spec.type == "tool_calls":
        return str(llguidance.LLMatcher.grammar_from_lark(spec.grammar))
    schema = spec.json_schema if spec.type == "json_schema" else '{"type":"object"}'
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


def check(spec: StructuredOutput) -> None:
    """Raise RequestError (400, `response_format`, or `tools` for a tools grammar) when
    llguidance cannot build `spec`'s grammar (`invalid_value`, its words) or the grammar is
    past the bounds of engine/grammar_bounds.py or llguidance's own limits
    (`grammar_limit_exceeded`). A few milliseconds at most; cached per spec."""
    spec.validate()
    refusal = _refusal(spec)
    if refusal is not None:
        code, message = refusal
        raise RequestError(message, code=code, param=param_of(spec))


def param_of(spec: StructuredOutput) -> str:
    """The request field a spec comes from."""
    return "tools" if spec.type == "tool_calls" else PARAM


@lru_cache(maxsize=64)
def _refusal(spec: StructuredOutput) -> tuple[ErrorCode, str] | None:
    what = "the tools' grammar" if spec.type == "tool_calls" else "JSON schema"
    try:
        grammar = grammar_of(spec)
    except ValueError as invalid:
        return ErrorCode.INVALID_VALUE, f"invalid {what}: {str(invalid)[:MAX_ERROR_CHARS]}"
    # llguidance's words first: a pattern it cannot parse is invalid, not costly
    error = str(llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS))
    if not error:
        try:
            if spec.type == "json_schema":
                grammar_bounds.check_schema(json.loads(spec.json_schema))
            elif spec.type == "tool_calls":
                grammar_bounds.check_lark(spec.grammar)
        except GrammarTooCostly as costly:
            return LIMIT_EXCEEDED, f"{what} past the grammar bounds: {costly}"
        error = _no_value(grammar)
    if not error:
        return None
    code = LIMIT_EXCEEDED if is_limit_error(error) else ErrorCode.INVALID_VALUE
    return code, f"invalid {what}: {error[:MAX_ERROR_CHARS]}"


# How llguidance words a limit it reached (LLParserLimits: fuel, states, items, grammar
# size), as opposed to a grammar it cannot build; tests/engine/test_grammar_bounds.py holds
# each against the library.
_LIMIT_WORDS = ("fuel", "too many", "too big", "precomputation failed")


def is_limit_error(error: str) -> bool:
    """Whether llguidance's `error` says it reached one of its limits."""
    lowered = error.lower()
    return any(words in lowered for words in _LIMIT_WORDS)


class _ByteTokens:
    """A vocabulary of the 256 bytes and an EOS, enough to ask a grammar for its first
    bytes without the model's tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens: ClassVar[list[bytes]] = [bytes([byte]) for byte in range(256)] + [b"<eos>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()), slices=[])


def _no_value(grammar: str) -> str:
    """Why a grammar that builds matches no output at all (a schema that is only a `$ref`
    to itself, a `$defs` loop) or its first mask reaches a limit, or "": its matcher fails
    at the first mask."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=LIMITS)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        return ""
    error = str(matcher.get_error())
    if is_limit_error(error):
        return error
    return "the schema matches no JSON value (a $ref that only refers to itself?)"


def invalid_json_reason(
    text: str, finish_reason: FinishReason | None, stop_reason: object
) -> InvalidJsonReason | None:
    """Why a structured-output choice's text is not valid JSON, or None when it is valid."""
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    if finish_reason == FinishReason.LENGTH:
        return InvalidJsonReason.LENGTH
    if isinstance(stop_reason, str):
        return InvalidJsonReason.STOP_STRING
    return InvalidJsonReason.INVALID
