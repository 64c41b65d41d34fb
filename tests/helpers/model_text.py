"""Model answers in every tool format for the tool-call parser's fuzz (`answer`): calls
well-formed and broken (cut anywhere, a character dropped, added or changed, a function the
request does not have, arguments that are not an object), with text around them; the pieces
a stream delivers one in (`pieces`); and the property every answer must keep (`problems`).

The property: a streamed call is a call, and the stream says what the whole answer says.
Each call a client reassembles from the stream names one of the tools and has arguments that
parse as an object, and the streamed content, calls and finish reason equal the non-streamed
answer's for the same text and the same finish reason from the engine."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_engine.entrypoints.openai.outcome import tool_finish_reason
from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import TOOL_FORMATS
from otel_engine.entrypoints.tools.parser import ToolCallParser
from otel_engine.outputs import FinishReason

TOOLS = frozenset({"get_weather", "get_time"})
_NAMES: list[Any] = ["get_weather", "get_time", "rm_rf", 7, None]
_NAME_WEIGHTS = [8, 8, 1, 1, 1]
_STRING_PIECES = ["Paris", "é", "日本", "<tool_call>", *' \n"\\}]{,:']
_NOISE = ' {}[]":,\\\n;' + string.ascii_letters[:6] + "0123456789"
_TEXTS = ["", "", "Sure, checking. ", "Let me look that up.\n", "{curly} text ", "[1, 2] "]


@dataclass(slots=True, frozen=True)
class Answer:
    """One answer of the fuzz: the model's text and how the engine ended it."""

    format: ToolFormatName
    text: str
    reason: FinishReason  # LENGTH when the text was cut as max_tokens would cut it


def answer(rng: random.Random, format: ToolFormatName) -> Answer:
    """A model's answer in `format`: calls (some broken), text, or both."""
    text = _BUILDERS[format](rng)
    reason = FinishReason.STOP
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        text, cut = _mutate(rng, text)
        if cut and rng.random() < 0.5:
            reason = FinishReason.LENGTH
    return Answer(format, text, reason)


def pieces(rng: random.Random, text: str) -> list[str]:
    """`text` as a stream delivers it: pieces of 1 to 12 characters, or all at once."""
    if rng.random() < 0.1:
        return [text]
    cuts, at = [], 0
    while at < len(text):
        at += rng.randint(1, 12)
        cuts.append(at)
    return [text[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]


def problems(case: Answer, stream: list[str], json_answer: bool = False) -> list[str]:
    """What breaks the property for this answer streamed in these pieces (none: []), the
    parsers told that the request has a response_format or not (`json_answer`)."""
    whole = ToolCallParser(TOOL_FORMATS[case.format](), TOOLS, json_answer=json_answer).parse(
        case.text
    )
    whole_calls = [(call.name, call.arguments) for call in whole.calls]
    whole_reason = tool_finish_reason(bool(whole.calls), case.reason)
    parser = ToolCallParser(TOOL_FORMATS[case.format](), TOOLS, json_answer=json_answer)
    content, calls, found = "", {}, []
    for delta in [*(parser.feed(piece) for piece in stream), parser.finish()]:
        content += delta.content
        for call in delta.calls:
            if call.index in calls or not call.call.name:
                found.append("a call announced twice or without a name")
            calls[call.index] = [call.call.name, call.call.arguments]
    streamed = [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]
    reason = tool_finish_reason(bool(parser.calls), case.reason)
    if any(not _is_call(name, arguments) for name, arguments in streamed):
        if reason == FinishReason.LENGTH:
            found.append("a streamed call that does not parse, marked incomplete (length)")
        else:
            found.append(f"a streamed call that does not parse, finish_reason {reason}")
    if (content, streamed, reason) != (whole.content, whole_calls, whole_reason):
        found.append("the stream differs from the whole answer")
    return found


def _is_call(name: str | None, arguments: str) -> bool:
    try:
        return name in TOOLS and isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


# ---- the answers -------------------------------------------------------------------------


def _hermes(rng: random.Random) -> str:
    parts = [rng.choice(_TEXTS)]
    for _ in range(rng.randint(0, 3)):
        close = rng.choice(["\n</tool_call>", "</tool_call>", "\n</tool_call>\n", ""])
        parts.append(f"<tool_call>{rng.choice(['', chr(10)])}{_call(rng, 'arguments')}{close}")
    parts.append(rng.choice(_TEXTS))
    return "".join(parts)


def _llama3_json(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return rng.choice(_TEXTS) or "The weather is fine."
    calls = [_call(rng, "parameters") for _ in range(rng.randint(1, 3))]
    prefix = rng.choice(["", "", "<|python_tag|>", " "])
    return prefix + rng.choice(["; ", ";", ";\n"]).join(calls) + rng.choice(["", "", " done."])


def _mistral(rng: random.Random) -> str:
    calls = [_call(rng, "arguments") for _ in range(rng.randint(1, 3))]
    body = calls[0] if len(calls) == 1 and rng.random() < 0.3 else f"[{', '.join(calls)}]"
    return f"{rng.choice(_TEXTS)}[TOOL_CALLS]{rng.choice(['', ' '])}{body}{rng.choice(_TEXTS)}"


def _phi4_mini(rng: random.Random) -> str:
    calls = ", ".join(_call(rng, "arguments") for _ in range(rng.randint(1, 3)))
    return f"{rng.choice(_TEXTS)}functools[{calls}]{rng.choice(_TEXTS)}"


def _generic(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return rng.choice(_TEXTS) or "Paris is sunny."
    calls = ", ".join(_call(rng, "arguments") for _ in range(rng.randint(1, 3)))
    return f'{{"tool_calls": [{calls}]}}'


_BUILDERS: dict[ToolFormatName, Callable[[random.Random], str]] = {
    ToolFormatName.HERMES: _hermes,
    ToolFormatName.LLAMA3_JSON: _llama3_json,
    ToolFormatName.MISTRAL: _mistral,
    ToolFormatName.PHI4_MINI: _phi4_mini,
    ToolFormatName.GENERIC: _generic,
}


def _call(rng: random.Random, key: str) -> str:
    """One call object's text: its name and arguments in any order, arguments of any shape."""
    fields: list[tuple[str, Any]] = []
    name = rng.choices(_NAMES, _NAME_WEIGHTS)[0]
    if name is not None:
        fields.append(("name", name))
    shape = rng.choices(["object", "string", "array", "number", "none"], [12, 2, 1, 1, 1])[0]
    key = rng.choice([key, key, "arguments", "parameters"])
    if shape == "object":
        fields.append((key, _object(rng, 0)))
    elif shape == "string":
        fields.append((key, json.dumps(_object(rng, 0))))
    elif shape == "array":
        fields.append((key, [_value(rng, 1)]))
    elif shape == "number":
        fields.append((key, rng.randint(-5, 5)))
    if rng.random() < 0.1:
        fields.append(("id", "x1"))
    rng.shuffle(fields)
    comma, colon = separators = rng.choice([(", ", ": "), (",", ":")])
    ascii_only = rng.random() < 0.5
    items = [
        json.dumps(k) + colon + json.dumps(v, ensure_ascii=ascii_only, separators=separators)
        for k, v in fields
    ]
    return "{" + comma.join(items) + "}"


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    return {_string(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _value(rng: random.Random, depth: int) -> Any:
    kinds = ["string", "int", "float", "literal"] + (["array", "object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return _string(rng)
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "float":
        return rng.choice([2.5e3, -0.125, 1e-7, 3.0])
    if kind == "literal":
        return rng.choice([True, False, None])
    if kind == "array":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return _object(rng, depth)


def _string(rng: random.Random) -> str:
    return "".join(rng.choice(_STRING_PIECES) for _ in range(rng.randint(0, 4))) or "city"


def _mutate(rng: random.Random, text: str) -> tuple[str, bool]:
    """One change to the text, as a model or max_tokens may make it; True when it cut it."""
    if not text:
        return text, False
    at = rng.randrange(len(text) + 1)
    change = rng.choices(["cut", "drop", "add", "change", "append"], [5, 2, 2, 2, 1])[0]
    if change == "cut":
        return text[:at], True
    if change == "drop":
        return text[:at] + text[at + 1 :], False
    if change == "add":
        return text[:at] + rng.choice(_NOISE) + text[at:], False
    if change == "change":
        return text[:at] + rng.choice(_NOISE) + text[at + 1 :], False
    return text + rng.choice([*_TEXTS, " {", "}", "]"]), False
