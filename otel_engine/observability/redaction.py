"""Redaction by allowlist, for crash dumps: an object is dumped only through the
`__crash_dump__ = {field: rule}` policy declared next to its type (`sched/request.py`,
`sampling_params.py`, ...). A field the policy does not name is left out and listed by name
and type under `unlisted_fields`, so a field added later stays redacted until someone
decides otherwise; an object of a type without a policy is redacted whole."""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

MAX_LIST_ITEMS = 256  # block ids and other lists of safe numbers are cut here


# Policies a type declares in `__crash_dump__ = {field: rule}`:
VALUE = "value"  # a number, bool, enum or identifier: dumped as is


COUNT = "count"  # a sequence: only its length (None stays None)


IS_SET = "is_set"  # only whether it holds something


NESTED = "nested"  # another object with its own policy (None stays None)


DIGEST = "digest"  # text: its size in bytes and a short SHA-256, never the text


Rule = str | Callable[[Any], Any]


def dump_object(obj: Any) -> dict[str, Any]:
    """`obj` through its type's `__crash_dump__` allowlist; unknown types are redacted whole."""
    policy: dict[str, Rule] | None = getattr(type(obj), "__crash_dump__", None)
    if policy is None:
        return {"redacted": type(obj).__name__}
    out: dict[str, Any] = {}
    unlisted: dict[str, str] = {}
    for name in _field_names(obj):
        try:
            value = getattr(obj, name)
        except Exception as exc:
            out[name] = {"error": describe_error(exc)}
            continue
        rule = policy.get(name)
        if rule is None:
            unlisted[name] = type(value).__name__
            continue
        out[name] = safe(functools.partial(_apply, rule, value))
    if unlisted:
        out["unlisted_fields"] = unlisted
    return out


def _apply(rule: Rule, value: Any) -> Any:
    if callable(rule):
        return rule(value)
    if rule == VALUE:
        return scalar(value)
    if rule == COUNT:
        return None if value is None else len(value)
    if rule == IS_SET:
        return bool(value) if not isinstance(value, (int, float)) else True
    if rule == NESTED:
        return None if value is None else dump_object(value)
    if rule == DIGEST:
        data = str(value).encode("utf-8", "surrogatepass")
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}
    raise ValueError(f"unknown dump rule {rule!r}")


def scalar(value: Any) -> Any:
    """Numbers, bools, None, enums and short ids as is; lists of numbers cut to a bound."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value[:128]
    if isinstance(value, list | tuple):
        items = [v for v in value[:MAX_LIST_ITEMS] if isinstance(v, int | float)]
        return items if len(value) <= MAX_LIST_ITEMS else {"first": items, "total": len(value)}
    return {"redacted": type(value).__name__}


def _field_names(obj: Any) -> list[str]:
    try:
        return _list_fields(obj)
    except Exception:
        return []


def _list_fields(obj: Any) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    struct_fields = getattr(type(obj), "__struct_fields__", None)
    if struct_fields is not None:
        return list(struct_fields)
    slots: Iterable[str] = getattr(type(obj), "__slots__", ())
    return [s for s in slots if not s.startswith("_")] or [
        k for k in vars(obj) if not k.startswith("_")
    ]


def describe_error(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except Exception:
        return type(exc).__name__


def safe(build: Callable[[], Any]) -> Any:
    """Run one part of the dump; its failure becomes a note, never an exception."""
    try:
        return build()
    except Exception as exc:
        return {"error": describe_error(exc)}
