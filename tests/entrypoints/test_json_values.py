"""Client JSON values are walked without recursion for their depth and their strings
(`json_values.py`)."""

from __future__ import annotations

import sys

import pytest

from otel_engine.entrypoints.network.json_values import (
    LONE_SURROGATE,
    TOO_DEEP,
    json_value_problem,
)
from otel_engine.entrypoints.network.limits import MAX_JSON_DEPTH


def _nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def test_a_value_at_the_limit_has_no_problem() -> None:
    assert json_value_problem(_nested(MAX_JSON_DEPTH, "ok")) is None


def test_one_level_past_the_limit_is_too_deep() -> None:
    assert TOO_DEEP == json_value_problem(_nested(MAX_JSON_DEPTH + 1))


def test_a_value_past_the_recursion_limit_is_walked() -> None:
    """The walk keeps its own stack: a value deeper than the interpreter allows recursion
    is named, not a RecursionError."""
    assert TOO_DEEP == json_value_problem(_nested(sys.getrecursionlimit() * 3))


@pytest.mark.parametrize(
    "value",
    ["\ud800", ["ok", "a\udfffb"], {"\udc00": 1}, {"k": [{"k": "\ud83d"}]}],
    ids=["string", "in a list", "a key", "deep"],
)
def test_a_lone_surrogate_anywhere_is_named(value: object) -> None:
    assert LONE_SURROGATE == json_value_problem(value)


def test_strings_are_left_alone_when_asked() -> None:
    """The body's own walk counts depth only (pydantic's fields check their text)."""
    assert json_value_problem({"\ud800": ["\udfff"]}, check_strings=False) is None


def test_a_surrogate_pair_decoded_is_one_character() -> None:
    assert json_value_problem({"emoji": "\U0001f600", "n": 1.5, "b": None}) is None
