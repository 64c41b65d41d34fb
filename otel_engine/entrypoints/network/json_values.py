"""Client JSON values held to what the server can afford to render: objects and arrays nested
at most `MAX_JSON_DEPTH` deep, strings a tokenizer can encode.

Python's JSON encoder, pydantic, chat templates and grammar compilers all recurse into a
value, and a value near the interpreter's recursion limit raises `RecursionError` in whichever
runs first; a lone surrogate (`"\\ud800"`) passes JSON decoding and fails in the tokenizer. So
a value is walked here first, with a stack of its own, and its problem named.
"""

from __future__ import annotations

import re
from typing import Any

from otel_engine.entrypoints.network.limits import MAX_JSON_DEPTH

# In a Python string any surrogate code point is a lone one: JSON's escaped pairs decode to
# the character they encode.
_SURROGATE = re.compile("[\ud800-\udfff]")
TOO_DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays"
LONE_SURROGATE = "a lone surrogate (not valid Unicode)"


def json_value_problem(value: Any, *, check_strings: bool = True) -> str | None:
    """What is wrong with `value` (`TOO_DEEP`, `LONE_SURROGATE`), or None; strings are looked
    at only when `check_strings`."""
    kinds = (dict, list, str) if check_strings else (dict, list)
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if check_strings and _SURROGATE.search(item):
                return LONE_SURROGATE
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth == MAX_JSON_DEPTH:
            return TOO_DEEP
        if isinstance(item, dict):
            if check_strings:
                stack.extend((key, depth) for key in item)
            item = item.values()
        stack.extend((child, depth + 1) for child in item if isinstance(child, kinds))
    return None
