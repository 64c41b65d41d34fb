"""What one grammar may cost, measured from its schemas before llguidance builds it.

llguidance's lexer takes derivatives of regular expressions, and a counted repeat costs mask
time and lexer memory in proportion to its count (`^a{100000}$`: 25-50 ms a mask, ~36 MB),
which its own parser limits (`LLParserLimits`: fuel for the expressions a step builds, the
number of lexer states) do not bound. So every regex a grammar holds is measured by its
unrolled size, read as llguidance's regex parser (Rust's regex-syntax) reads it: a counted
repeat `{n}`, `{m,}` (m) or `{m,n}` (n), spaces inside the braces allowed, multiplies what it
repeats, and atoms in sequence or in alternatives add up; the whole grammar, every schema in
it, may unroll to at most MAX_REGEX_SIZE atoms. Where a reading could differ from
regex-syntax's it errs towards more atoms, and what it cannot read (the `x` flag, which makes
whitespace and `#` comments vanish) is refused rather than guessed.

A schema's regexes: `pattern` values and `patternProperties` keys at any depth, and a string's
`minLength` beside its `pattern`, MIN_LENGTH_WEIGHT atoms a character: llguidance intersects
the pattern with `.{min,}` and proves the intersection non-empty at each new lexer state
(`^a*$` with minLength 500: 18 ms for a first mask; 1,000: 39 ms; 2,000: 110 ms), while a
`maxLength` beside it costs nothing measurable.
A schema may require at most MAX_REQUIRED_LENGTH characters, items or properties of a value
(`minLength`, `minItems`, `minProperties`, `minContains`): a cap on the output a schema can
force (a request that cannot meet it writes until its max_tokens). The maxima
(`maxLength`, `maxItems`, `maxProperties`) cost nothing measurable: llguidance counts them
down in its automaton and its grammar. `x-guidance` (llguidance's compile options:
`whitespace_pattern`, `item_separator`, `lenient`, ...) is the engine's to set: a client
schema carrying it is refused.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterator
from typing import Any

MAX_REGEX_SIZE = 4_096  # atoms the regexes of one grammar unroll to, in all
MAX_REQUIRED_LENGTH = 10_000  # characters, items or properties a schema may require of a value
REQUIRED_KEYWORDS = ("minLength", "minItems", "minProperties", "minContains")
MIN_LENGTH_WEIGHT = 8  # atoms a character of a `minLength` beside a `pattern` counts
OPTIONS_KEY = "x-guidance"
_CAP = 1 << 62  # a size past any bound: products stop growing here
MAX_COUNT_DIGITS = 10  # a repeat count longer than this (leading zeros aside) is _CAP


class GrammarLimit(enum.StrEnum):
    """Which bound a grammar went past: the `limit` of a refusal's message and of the
    `structured_output.failed` log line."""

    REGEX_SIZE = "regex_size"  # MAX_REGEX_SIZE, or a regex that cannot be measured
    REQUIRED_LENGTH = "required_length"  # MAX_REQUIRED_LENGTH
    OPTIONS = "options"  # a client's x-guidance
    PARSER = "parser"  # llguidance's own limits stopped the grammar
    MASK_TIME = "mask_time"  # the request's masks took MASK_TIME_BUDGET_S
    MATCHER_MEMORY = "matcher_memory"  # its masks added MATCHER_MEMORY_BUDGET


class GrammarTooCostly(ValueError):
    """A grammar past one of the bounds above; `limit` names it."""

    def __init__(self, limit: GrammarLimit, message: str) -> None:
        super().__init__(f"{message} ({limit} limit)")
        self.limit = limit


def check_schema(schema: Any) -> int:
    """The size `schema`'s regexes unroll to; GrammarTooCostly past a bound, or with a
    client's `x-guidance`."""
    if isinstance(schema, dict) and OPTIONS_KEY in schema:
        raise GrammarTooCostly(
            GrammarLimit.OPTIONS,
            f"{OPTIONS_KEY} is not accepted: the engine sets the grammar's options "
            "(whitespace, separators, leniency)",
        )
    return _bounded(schema_size(schema))


def check_lark(grammar: str) -> int:
    """The size of the regexes in the schemas a tools grammar embeds (`json_rule`'s
    `%json` rules), all together; GrammarTooCostly past a bound."""
    return _bounded(sum(schema_size(schema) for schema in embedded_schemas(grammar)))


def json_rule(rule: str, schema: dict[str, Any], options: dict[str, Any]) -> str:
    """A Lark rule of an inline JSON schema compiled with `options`, on one line (what
    `embedded_schemas` reads back)."""
    schema = {**schema, OPTIONS_KEY: options}
    return f"{rule}: %json {json.dumps(schema, ensure_ascii=False)}\n"


_JSON_RULE = re.compile(r"^\w+: %json (?=\{)", re.MULTILINE)


def embedded_schemas(grammar: str) -> Iterator[Any]:
    """The schemas of `grammar`'s `json_rule` lines (a line that only looks like one, in a
    literal a format wrote, is passed over: every rule `json_rule` wrote is found)."""
    decoder = json.JSONDecoder()
    for rule in _JSON_RULE.finditer(grammar):
        try:
            yield decoder.raw_decode(grammar, rule.end())[0]
        except ValueError:
            continue


def _bounded(size: int) -> int:
    if size > MAX_REGEX_SIZE:
        raise GrammarTooCostly(
            GrammarLimit.REGEX_SIZE,
            f"the schema's regexes unroll to {size} atoms, more than {MAX_REGEX_SIZE} "
            "(a counted repeat multiplies what it repeats; patterns, repeats in sequence "
            f"and {MIN_LENGTH_WEIGHT} a character of a minLength beside a pattern add up)",
        )
    return size


def schema_size(schema: Any) -> int:
    """What `schema`'s regexes unroll to, in all; GrammarTooCostly when a value is
    required past MAX_REQUIRED_LENGTH or a regex cannot be measured. Every object at any
    depth is read as a schema: a value that only looks like one (in `enum` or `examples`)
    counts too, which errs towards more."""
    size = 0
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack += item
        elif isinstance(item, dict):
            size = min(_CAP, size + _node_size(item))
            stack += item.values()
    return size


def _node_size(node: dict[str, Any]) -> int:
    for keyword in REQUIRED_KEYWORDS:
        if _number(node.get(keyword)) > MAX_REQUIRED_LENGTH:
            raise GrammarTooCostly(
                GrammarLimit.REQUIRED_LENGTH,
                f"a {keyword} is more than {MAX_REQUIRED_LENGTH:,}",
            )
    size = 0
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        size += regex_size(pattern) + MIN_LENGTH_WEIGHT * _number(node.get("minLength"))
    properties = node.get("patternProperties")
    if isinstance(properties, dict):
        size += sum(regex_size(key) for key in properties if isinstance(key, str))
    return size


def _number(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return 0
    return int(max(0, min(value, _CAP)))  # -Infinity: 0, not int()'s OverflowError


# regex-syntax's counted repeat: `{` then a decimal, an optional `,` and decimal, each with
# spaces around it, then `}`; any other `{` outside a class is an error there (never a
# literal), so one this does not match is counted as an atom and left to llguidance.
# Possessive quantifiers and bounded names: each match is linear, never a backtracking search.
_REPEAT = re.compile(r"\{\s*+(\d*+)\s*+(?:(,)\s*+(\d*+)\s*+)?\}")
_GROUP_FLAGS = re.compile(r"\(\?([a-zA-Z-]*+)([:)])")  # `(?i)`, `(?s:`, `(?:`
_NAMED_GROUP = re.compile(r"\(\?P?<[^>]{0,64}>")
_ASCII_CLASS = re.compile(r"\[:\^?[a-z]{1,16}:\]")  # `[:alpha:]` inside a class: no nesting
_BRACED_NAME = 64  # the longest `\p{...}` or `\x{...}` read as one escape
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}  # `\x7F`, `\u007F`, `\U0000007F`


class _Frame:
    """A group being read: the atoms of its finished alternatives, of the current one, and
    of the current one's last atom (what a repeat multiplies)."""

    __slots__ = ("done", "last", "sequence")

    def __init__(self) -> None:
        self.done = self.sequence = self.last = 0

    def atom(self, size: int) -> None:
        self.sequence = min(_CAP, self.sequence + size)
        self.last = size

    def repeat(self, count: int) -> None:
        repeated = min(_CAP, self.last * count)
        self.sequence = min(_CAP, self.sequence - self.last + repeated)
        self.last = repeated

    def alternate(self) -> None:
        self.done = min(_CAP, self.done + self.sequence)
        self.sequence = self.last = 0

    @property
    def size(self) -> int:
        return min(_CAP, self.done + self.sequence)


def regex_size(pattern: str) -> int:
    """How many atoms `pattern` unrolls to (see the module docstring); `*`, `+` and `?`
    add nothing (they loop in the automaton instead of unrolling). GrammarTooCostly for
    a pattern this cannot read as regex-syntax does."""
    frames = [_Frame()]
    index = 0
    while index < len(pattern):
        char, frame = pattern[index], frames[-1]
        index += 1
        if char == "\\":
            index = _escape_end(pattern, index - 1)
            frame.atom(1)
        elif char == "[":
            index = _class_end(pattern, index - 1)
            frame.atom(1)
        elif char == "{" and (repeat := _REPEAT.match(pattern, index - 1)):
            frame.repeat(_count(repeat))
            index = repeat.end()
        elif char == "(":
            index = _group_start(pattern, index - 1, frames)
        elif char == ")":
            if len(frames) == 1:
                raise _unreadable("a `)` closes no group")
            frames[-2].atom(frames.pop().size)
        elif char == "|":
            frame.alternate()
        elif char not in "*+?":
            frame.atom(1)
    if len(frames) > 1:
        raise _unreadable("unclosed group")
    return frames[0].size


def _count(repeat: re.Match[str]) -> int:
    low, comma, high = repeat.groups()
    if comma is None:
        return _decimal(low)
    return _decimal(high) if high else max(1, _decimal(low))


def _decimal(digits: str) -> int:
    """A count's value, _CAP past MAX_COUNT_DIGITS digits: `int()` refuses a string of more
    than 4,300 digits, and leading zeros add nothing."""
    digits = digits.lstrip("0")
    return _CAP if len(digits) > MAX_COUNT_DIGITS else int(digits or 0)


def _group_start(pattern: str, index: int, frames: list[_Frame]) -> int:
    """Read the `(` at `index`: a group (a new frame) or flags alone; where reading goes on."""
    flags = _GROUP_FLAGS.match(pattern, index)
    if flags is not None and "x" in flags.group(1):
        raise _unreadable("the x flag (whitespace and # comments ignored)")
    if flags is not None and flags.group(2) == ")":
        return flags.end()
    frames.append(_Frame())
    opening = flags or _NAMED_GROUP.match(pattern, index)
    return index + 1 if opening is None else opening.end()


def _escape_end(pattern: str, index: int) -> int:
    """Where the escape at `index` ends: `\\p{Greek}`, `\\x{10FFFF}`, `\\x7F` or one char."""
    kind = pattern[index + 1 : index + 2]
    if kind in ("p", "P", "x", "u", "U") and pattern.startswith("{", index + 2):
        close = pattern.find("}", index + 3, index + 3 + _BRACED_NAME)
        return index + 3 if close < 0 else close + 1
    return index + 2 + _HEX_DIGITS.get(kind, 0)


def _class_end(pattern: str, index: int) -> int:
    """Where the class opening at `index` ends, as regex-syntax reads it: a `]` first in a
    class (after `^`) is a member, a `[` inside one opens a nested class unless it is an
    ASCII class such as `[:alpha:]`."""
    depth = 0
    while index < len(pattern):
        char = pattern[index]
        ascii_class = _ASCII_CLASS.match(pattern, index) if depth else None
        if ascii_class is not None:
            index = ascii_class.end()
        elif char == "[":
            depth += 1
            index += 2 if pattern.startswith("^", index + 1) else 1
            index += 1 if pattern.startswith("]", index) else 0
        elif char == "\\":
            index = _escape_end(pattern, index)
        elif char == "]":
            depth -= 1
            index += 1
            if not depth:
                return index
        else:
            index += 1
    raise _unreadable("unclosed character class")


def _unreadable(why: str) -> GrammarTooCostly:
    return GrammarTooCostly(GrammarLimit.REGEX_SIZE, f"a pattern cannot be measured: {why}")
