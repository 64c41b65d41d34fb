"""Per-request sampling parameters (the public `SamplingParams`) and their bounds.

`validate()` is the one place that decides whether a set of parameters can be sampled: the
HTTP edge, `LLM.generate` and the engine core (which never trusts its input) all call it, so
that no value can reach the sampler that it cannot represent. The range of each numeric
field is one `Bound` in `BOUNDS`, with one message ("temperature must be in [0, 2], got 5");
the HTTP edge checks its fields against the same table before any tokenization and states
it in the OpenAPI document.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from otel_engine.errors import ErrorCode, RequestError

# Below this a temperature is greedy: dividing float32 logits by less overflows them.
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
# Stop strings are matched on every step's new text; their length bounds that work.
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI bounds them
STRUCTURED_OUTPUT_TYPES = ("json_object", "json_schema", "tool_calls")
MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema's text; its grammar's size is bounded by it
MAX_TOOL_GRAMMAR_BYTES = 256 * 1024  # the grammar of a request's tools (their schemas inside)
# An error message quotes a client's integer only up to this many digits (1e300 is 301).
MAX_SHOWN_DIGITS = 20


@dataclass(frozen=True, slots=True)
class Bound:
    """The interval a number must lie in: `low` and `high` included unless open (`high`
    None: no upper limit). NaN lies in none."""

    low: float
    high: float | None = None
    is_low_open: bool = False
    is_high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if value <= self.low if self.is_low_open else value < self.low:
            return False
        if self.high is None:
            return True
        return value < self.high if self.is_high_open else value <= self.high

    def describe(self) -> str:
        """The interval in words: `in [0, 2]`, `in (0, 1]`, `at least 1`."""
        if self.high is None and not self.is_low_open:
            return f"at least {_number(self.low)}"
        if self.high is None:
            return f"greater than {_number(self.low)}"
        opening = "(" if self.is_low_open else "["
        closing = ")" if self.is_high_open else "]"
        return f"in {opening}{_number(self.low)}, {_number(self.high)}{closing}"

    def check(self, name: str, value: float) -> None:
        """Raise `RequestError` naming `name` unless `value` lies in this interval."""
        if value not in self:
            _invalid(name, f"{name} must be {self.describe()}, got {_number(value)}")

    def json_schema(self) -> dict[str, float]:
        """The interval as JSON Schema keywords (`minimum`, `exclusiveMaximum`, ...)."""
        schema = {"exclusiveMinimum" if self.is_low_open else "minimum": self.low}
        if self.high is not None:
            schema["exclusiveMaximum" if self.is_high_open else "maximum"] = self.high
        return schema


PENALTY = Bound(-2, 2)  # presence and frequency penalties, as OpenAI bounds them
LOGPROBS = Bound(0, MAX_LOGPROBS)
# The range of every numeric field of SamplingParams, by field; `validate` holds each
# (besides, `top_k` at most the vocabulary and `min_tokens` at most `max_tokens`).
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1),
    "temperature": Bound(0, 2),  # as the OpenAI API bounds it
    "top_p": Bound(0, 1, is_low_open=True),
    "top_k": Bound(-1),  # -1 and 0 turn the filter off
    "seed": Bound(-(2**63), 2**63, is_high_open=True),  # 64 bits
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    # The repetition penalty divides (or multiplies) logits: bounded away from 0 and infinity.
    "repetition_penalty": Bound(0.01, 100),
    "min_p": Bound(0, 1),
    "min_tokens": Bound(0),
    "logprobs": LOGPROBS,
    "prompt_logprobs": LOGPROBS,
}


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True):
    """Output constrained by a grammar (`engine/grammars.py` enforces it): any JSON
    object (`json_object`), a value that validates against `json_schema` (its text), or
    `tool_calls`: the llguidance (Lark) `grammar` that entrypoints/tools/plan.py builds from a
    request's `num_tools` tools, text or calls of them in the model's format."""

    type: str
    json_schema: str = ""
    grammar: str = ""
    num_tools: int = 0

    # The schema's and the grammar's text may name anything (property names, tool names
    # and descriptions are the client's): a dump shows their size and a hash, never the text.
    __crash_dump__: ClassVar[dict[str, str]] = {
        "type": "value",
        "json_schema": "digest",
        "grammar": "digest",
        "num_tools": "value",
    }

    def validate(self) -> None:
        param = "tools" if self.type == "tool_calls" else "response_format"
        if self.type not in STRUCTURED_OUTPUT_TYPES:
            _invalid(param, f"response_format type must be one of {STRUCTURED_OUTPUT_TYPES}")
        if self.type == "json_schema" and not self.json_schema:
            _invalid(param, "a json_schema response_format needs a schema")
        if len(self.json_schema.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES:
            _invalid(param, f"the JSON schema must be at most {MAX_SCHEMA_BYTES} bytes")
        if self.type == "tool_calls" and not self.grammar:
            _invalid(param, "a tool_calls grammar is empty")
        if len(self.grammar.encode("utf-8", "surrogatepass")) > MAX_TOOL_GRAMMAR_BYTES:
            _invalid(param, f"the tools' grammar must be at most {MAX_TOOL_GRAMMAR_BYTES} bytes")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one completion. Travels to the engine core as is.

    `temperature` below `GREEDY_TEMPERATURE` (0 included) is greedy. `top_k <= 0` and
    `top_p == 1` disable those filters; the most likely token always survives them.
    `seed` makes sampling reproducible for this request regardless of batching.
    Stop strings are matched on the detokenized text and are not part of the output.

    Logits processing, applied in this order before temperature (also to greedy rows):
    `logit_bias` (token id, value) pairs are added (-100 bans the token); below `min_tokens`
    output tokens, EOS (unless `ignore_eos`) and `stop_token_ids` cannot be sampled;
    `repetition_penalty` (HF/vLLM: a logit of a token seen in the prompt or the output is
    divided by it when positive, multiplied when negative); `frequency_penalty` and
    `presence_penalty` (OpenAI: minus the penalty times the token's count in the output, and
    minus the penalty once it appears). Then a `structured_output` grammar bans every token
    it does not allow next (where the bans above leave none of those, the grammar wins).
    After temperature, `min_p` drops tokens less likely than `min_p` times the most likely
    one.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # report each token's logprob and this many top alternatives
    # Report each prompt token's logprob (from the second on) and this many alternatives;
    # such a request computes its whole prompt (the prefix cache would skip positions).
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None  # JSON, enforced token by token
    num_tools: int = 0  # the request's tools (entrypoints/tools/plan.py): counted in dumps only

    # Crash dumps show limits and flags, never stop strings, stop token ids or the seed.
    __crash_dump__: ClassVar[dict[str, str]] = {
        "max_tokens": "value",
        "temperature": "value",
        "top_p": "value",
        "top_k": "value",
        "seed": "is_set",
        "stop": "count",
        "stop_token_ids": "count",
        "ignore_eos": "value",
        "skip_special_tokens": "value",
        "presence_penalty": "value",
        "frequency_penalty": "value",
        "repetition_penalty": "value",
        "min_p": "value",
        "min_tokens": "value",
        "logit_bias": "count",  # token ids chosen by the client: never which
        "logprobs": "value",
        "prompt_logprobs": "value",
        "structured_output": "nested",
        "num_tools": "value",
    }

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `RequestError` (naming the field) when a value is out of range; with
        `vocab_size`, also when `top_k` or a stop token id exceeds the vocabulary."""
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is not None:
                bound.check(name, value)
        if vocab_size is not None and self.top_k > vocab_size:
            _invalid("top_k", f"top_k must be at most the vocabulary size {vocab_size}")
        if self.min_tokens > self.max_tokens:
            _invalid(
                "min_tokens",
                f"min_tokens must be at most max_tokens ({self.max_tokens}), "
                f"got {shown(self.min_tokens)}",
            )
        self._validate_stops(vocab_size)
        self._validate_logit_bias(vocab_size)
        if self.structured_output is not None:
            self.structured_output.validate()

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            _invalid("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed")
        upper = vocab_size if vocab_size is not None else 2**63
        low, high = LOGIT_BIAS_RANGE
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id < upper:
                _invalid("logit_bias", f"logit_bias token ids must be in [0, {upper})")
            if not low <= bias <= high:
                _invalid("logit_bias", f"logit_bias values must be in [{low:g}, {high:g}]")

    @property
    def has_logits_processing(self) -> bool:
        """Whether sampling must process this request's logits beyond temperature, top-k and
        top-p (the sampler's fast path skips all of it for a batch where no row does)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_p
            or self.min_tokens
            or self.logit_bias
        )

    def _validate_stops(self, vocab_size: int | None) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in self.stop):
            _invalid("stop", "stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            _invalid("stop", f"stop strings must be at most {MAX_STOP_CHARS} characters")
        try:
            "".join(self.stop).encode("utf-8")
        except UnicodeEncodeError:
            _invalid("stop", "stop strings must be valid Unicode (no lone surrogates)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _invalid("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed")
        upper = vocab_size if vocab_size is not None else 2**63
        if any(not 0 <= t < upper for t in self.stop_token_ids):
            _invalid("stop_token_ids", f"stop_token_ids must be in [0, {upper})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class LogitsProcessing(msgspec.Struct, frozen=True, array_like=True):
    """One sampled row's logits processing, as the sampler applies it (`SamplingParams` has
    the definitions), with the token history its penalties need: output ids for any penalty,
    prompt ids for the repetition penalty. `banned_token_ids`: EOS and stop token ids while
    the request is below its `min_tokens`. Travels in `ModelInput.processing`."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: list[tuple[int, float]] = []
    banned_token_ids: list[int] = []
    output_token_ids: list[int] = []
    prompt_token_ids: list[int] = []


def shown(value: int) -> str:
    """`value` as an error message may quote it: its digits, unless there are too many."""
    if abs(value) < 10**MAX_SHOWN_DIGITS:
        return str(value)
    return f"a number of more than {MAX_SHOWN_DIGITS} digits"


def _number(value: float) -> str:
    """A bound or a client's number as a message quotes it: 5.0 as 5, 0.01 as 0.01."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 10**MAX_SHOWN_DIGITS:
        return str(int(value))
    if isinstance(value, int):
        return shown(value)
    return repr(value)


def _invalid(param: str, message: str) -> None:
    raise RequestError(message, code=ErrorCode.INVALID_VALUE, param=param)


# The fields a model's generation config or --override-generation-config may default
# (engine/generation_defaults.py), and the checks that such a default is one a request
# could send itself; here, beside the rules, so that the config layer validates the flag
# at start without reaching into the engine.
DEFAULTABLE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def parse_override(text: str | None) -> dict[str, Any] | None:
    """`--override-generation-config` JSON: an object of known fields with numbers."""
    if text is None:
        return None
    try:
        parsed = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--override-generation-config is not JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    unknown = sorted(set(parsed) - set(DEFAULTABLE_FIELDS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown field(s) {', '.join(unknown)}; "
            f"known: {', '.join(DEFAULTABLE_FIELDS)}"
        )
    for name, value in parsed.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"--override-generation-config: {name} must be a number")
    check_default_values(parsed, "--override-generation-config")
    return parsed


def check_default_values(values: dict[str, Any], source: str) -> None:
    """Raise ValueError naming `source` when a default is out of the range a request's own
    value must be in (the same rules, `SamplingParams.validate`): a default no request
    could send would turn into a 400 for a field the client never sent."""
    for name, value in values.items():
        if name == "top_k" and value != int(value):
            raise ValueError(f"{source}: top_k must be an integer, got {value}")
        try:
            apply_generation_defaults({}, {name: value}).validate()
        except RequestError as error:
            raise ValueError(f"{source}: {error.message}") from None


def apply_generation_defaults(
    given: Mapping[str, Any], defaults: Mapping[str, float]
) -> SamplingParams:
    """The `SamplingParams` of the fields a caller gave, each field of `defaults` it did not
    give taking its value there (`top_k` as an integer). The one rule the server (a
    request's fields), `LLM`, `otel-engine generate` (the flags given) and `replay` apply;
    `defaults` are the model's (`engine/generation_defaults.py`)."""
    fields: dict[str, Any] = {
        name: int(value) if name == "top_k" else float(value)
        for name, value in defaults.items()
        if name not in given
    }
    return SamplingParams(**fields, **given)
