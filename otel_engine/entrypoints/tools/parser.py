"""Tool calls in a model's text, one parser for every format the engine serves.

Formats (`FORMATS`), as the families' chat templates teach them:
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, anywhere in the text;
- `llama3_json` (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`
  (or "arguments"), optionally after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (or one
  object);
- `phi4_mini`: `functools[{"name": ..., "arguments": {...}}, ...]`;
- `generic` (models whose template has no tool format, see plan.py): the whole answer is
  `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`.

`ToolCallParser` reads a choice's text as it is generated (`feed`) and says what it holds:
content (text outside tool calls, held back while a call may be starting) and tool-call
deltas (a call's id and name first, then its arguments in pieces, as OpenAI streams them).
A non-streamed choice is the same parser fed the whole text at once (`parse`), so both
give the same calls. The arguments are the JSON text the model wrote for them.

A call whose text is not a valid call (malformed JSON, a function that is not among the
request's tools, arguments that are not an object) is not a call: its text stays content
and it counts as `invalid`, unless a delta of the call was already streamed. A call cut
short by max_tokens streams the part that was generated; non-streamed, its text is content.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3_json", "mistral", "phi4_mini", "generic")
PARSER_CHOICES = ("auto", *FORMATS)  # --tool-call-parser
ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
_ALPHANUMERIC = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def mistral_call_id() -> str:
    """Mistral's templates require ids of exactly 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: the first one has its id and name, later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, object]:
        delta: dict[str, object] = {"index": self.index}
        function: dict[str, str] = {}
        if self.id is not None:
            delta["id"], delta["type"] = self.id, "function"
            function["name"] = self.name or ""
        function["arguments"] = self.arguments
        delta["function"] = function
        return delta


@dataclass(slots=True)
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(slots=True)
class Parsed:
    content: str
    calls: list[ToolCall]
    num_invalid: int


class _Call:
    """A call object being read: its name and the text of its arguments."""

    __slots__ = ("arguments", "arguments_done", "emitted", "index", "name", "sent", "start")

    def __init__(self, start: int) -> None:
        self.start = start  # where its object starts in the text
        self.index = -1  # its index among the choice's calls, once started
        self.name: str | None = None
        self.arguments: str | None = None  # the value's JSON text, once whole
        self.arguments_done = False
        self.emitted = False  # its first delta went out
        self.sent = 0  # arguments characters sent


class _Frame:
    __slots__ = ("call", "key", "kind", "state", "value_start")

    def __init__(self, kind: str, call: _Call | None) -> None:
        self.kind = kind  # "obj" or "arr"
        self.state = "key" if kind == "obj" else "value"  # key, colon, value, comma
        self.key: str | None = None  # the key whose value comes next (objects)
        self.call = call  # this object is a call
        self.value_start = -1


class ToolCallParser:
    """One choice's text, read incrementally for tool calls in `format`.

    The text alternates between content and regions (the JSON of calls, after a marker or,
    for `llama3_json` and `generic`, as the whole answer). In a region a character scanner
    follows the JSON: a call object's `name` starts the call (its first delta), its
    arguments' characters are sent as they are read, and the object's end completes it. A
    region that turns out not to be calls gives its text back to the content, from the
    end of its last complete call.
    """

    def __init__(
        self,
        format: str,
        tool_names: frozenset[str] | set[str],
        new_id: Callable[[], str] | None = None,
        *,
        json_answer: bool = False,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"unknown tool call format {format!r}")
        self.format = format
        self.tool_names = frozenset(tool_names)
        self.new_id = new_id or (mistral_call_id if format == "mistral" else openai_call_id)
        self.text = ""
        self.calls: list[ToolCall] = []
        self.num_invalid = 0
        self._content: list[str] = []
        self._marker = _MARKERS.get(format, "")
        self._whole_answer = format in ("llama3_json", "generic")  # a call only at the start
        self._mode = "start" if self._whole_answer else "text"  # start text region close rest
        self._pos = 0  # characters of `text` read
        self._sent_to = 0  # content is sent up to here
        self._resume = 0  # where content restarts if the region breaks
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._literal_start = -1  # a number, true, false or null being read
        self._open: list[_Call] = []  # call objects being read
        self._value_calls = 0  # calls completed in the current top-level value
        self._ids: list[str] = []
        self._streaming = True  # a delta sent cannot be taken back
        self._json_answer = json_answer  # a JSON value without calls is the answer

    # ---- public ------------------------------------------------------------------

    def feed(self, new_text: str) -> Delta:
        """Read the choice's next text; what can be sent now."""
        self.text += new_text
        delta = Delta()
        while self._pos < len(self.text):
            progressed = getattr(self, f"_scan_{self._mode}")(delta)
            if not progressed:
                break
        for call in self._open:
            self._flush(call, delta)
        return delta

    def finish(self) -> Delta:
        """The choice ended: held-back text is content; a call left unfinished is invalid."""
        delta = Delta()
        if self._mode == "region" and not self._stack and self._value_calls:
            self._region_done(delta)  # llama3_json after its last call
            self._sent_to = len(self.text)  # whitespace between calls
        elif self._mode == "region":
            self._give_back(delta)
        elif self._mode == "close" and not self.text[self._pos :].strip(_WHITESPACE):
            self._sent_to = len(self.text)  # a call whose close tag never came: it stands
        self._send_content(len(self.text), delta)
        return delta

    def parse(self, text: str) -> Parsed:
        """A whole choice's text at once (the non-streamed answer): a region that breaks
        gives all of its text back, even after a call in it had started."""
        self._streaming = False
        self.feed(text)
        self.finish()
        return Parsed(self.content, list(self.calls), self.num_invalid)

    @property
    def content(self) -> str:
        return "".join(self._content)

    # ---- outside regions -------------------------------------------------------------

    def _scan_start(self, delta: Delta) -> bool:
        """The answer's first characters: a call, or content to the end."""
        rest = self.text[self._pos :].lstrip(_WHITESPACE)
        if not rest:
            return False
        first = len(self.text) - len(rest)
        if self.format == "llama3_json" and _PYTHON_TAG.startswith(rest[: len(_PYTHON_TAG)]):
            if len(rest) < len(_PYTHON_TAG):
                return False  # may still be the tag
            self._open_region(self._pos, first + len(_PYTHON_TAG))
            return True
        if rest[0] == "{":
            self._open_region(self._pos, first)
        else:
            self._mode = "rest"
        return True

    def _scan_rest(self, delta: Delta) -> bool:
        self._pos = len(self.text)
        self._send_content(self._pos, delta)
        return False

    def _scan_text(self, delta: Delta) -> bool:
        text, marker = self.text, self._marker
        found = text.find(marker, max(self._sent_to, self._pos - len(marker) + 1))
        if found >= 0:
            self._send_content(found, delta)
            self._open_region(found, found + len(marker))
            return True
        keep = next(  # a tail that may be the marker's beginning is held back
            (
                n
                for n in range(min(len(marker) - 1, len(text)), 0, -1)
                if marker.startswith(text[-n:])
            ),
            0,
        )
        self._pos = len(text)
        self._send_content(len(text) - keep, delta)
        return False

    def _scan_close(self, delta: Delta) -> bool:
        """After a hermes call's JSON: its close tag (a missing one leaves the call standing)."""
        rest = self.text[self._pos :].lstrip(_WHITESPACE)
        if not rest or (len(rest) < len(_HERMES_CLOSE) and _HERMES_CLOSE.startswith(rest)):
            return False
        at = len(self.text) - len(rest)
        self._pos = self._sent_to = (
            at + len(_HERMES_CLOSE) if rest.startswith(_HERMES_CLOSE) else at
        )
        self._mode = "text"
        return True

    def _send_content(self, end: int, delta: Delta) -> None:
        if end > self._sent_to:
            piece = self.text[self._sent_to : end]
            self._content.append(piece)
            delta.content += piece
        self._sent_to = max(self._sent_to, end)

    # ---- regions ---------------------------------------------------------------------

    def _open_region(self, region_start: int, json_start: int) -> None:
        self._mode = "region"
        self._resume = region_start  # the marker included
        self._pos = self._sent_to = json_start
        self._reset_json()
        self._value_calls = 0

    def _region_done(self, delta: Delta) -> None:
        """The region's JSON is whole (`_pos` is past it)."""
        self._sent_to = self._pos
        if self.format == "hermes":
            self._mode = "close"
        else:
            self._mode = "rest" if self._whole_answer else "text"

    def _give_back(self, delta: Delta) -> None:
        """The region is not (or no longer) calls: invalid, and its text from the end of
        its last complete call is content; a call already streamed is not repeated."""
        self.num_invalid += 1
        self._sent_to = self._resume
        streamed = self._streaming and any(call.emitted for call in self._open)
        if streamed:  # its deltas went out: content resumes after what was read
            self._sent_to = self._pos
        self._reset_json()
        self._mode = "rest" if self._whole_answer else "text"
        if self._mode == "text" and self._marker:
            # the broken region's text is content; look for the next marker past its own
            self._send_content(self._pos, delta)

    def _scan_region(self, delta: Delta) -> bool:
        text = self.text
        while self._pos < len(text) and self._mode == "region":
            char = text[self._pos]
            if self._in_string:
                self._string_char(char, delta)
            elif self._literal_start >= 0 and char not in _LITERAL_END:
                pass
            else:
                if self._literal_start >= 0 and not self._end_literal(delta):
                    return True
                if not self._structural(char, delta):
                    return True
            if self._mode == "region":
                self._pos += 1
        return self._mode != "region"

    def _structural(self, char: str, delta: Delta) -> bool:  # noqa: PLR0911, PLR0912
        """One character outside strings and literals; False when the region ended."""
        if char in _WHITESPACE:
            return True
        stack = self._stack
        if not stack:  # before or between top-level values
            if self._value_calls and not (self.format == "llama3_json" and char in ";{"):
                self._region_done(delta)
                return False
            if char == ";" and self._value_calls:
                return True
            if char not in "{[":
                self._give_back(delta)
                return False
            return self._start_value(char, delta)
        frame = stack[-1]
        if frame.state == "key":
            if char == '"':
                self._start_string()
                return True
            if char == "}" and frame.key is None:
                return self._close(delta)
        elif frame.state == "colon":
            if char == ":":
                frame.state = "value"
                return True
        elif frame.state == "comma":
            if char == ",":
                frame.state = "key" if frame.kind == "obj" else "value"
                frame.key = None
                return True
            if char == ("}" if frame.kind == "obj" else "]"):
                return self._close(delta)
        elif frame.kind == "arr" and char == "]":
            return self._close(delta)
        else:
            return self._start_value(char, delta)
        self._give_back(delta)
        return False

    def _start_value(self, char: str, delta: Delta) -> bool:
        parent = self._stack[-1] if self._stack else None
        if (
            parent is not None
            and parent.call is not None
            and parent.key in ARGUMENT_KEYS
            and parent.call.arguments is None
            and parent.value_start < 0
        ):
            parent.value_start = self._pos
        if char == "{":
            call = _Call(self._pos) if self._is_call() else None
            if call is not None:
                self._open.append(call)
            self._stack.append(_Frame("obj", call))
        elif char == "[":
            self._stack.append(_Frame("arr", None))
        elif char == '"':
            self._start_string()
        elif char in "-0123456789tfn":
            self._literal_start = self._pos
        else:
            self._give_back(delta)
            return False
        return True

    def _is_call(self) -> bool:
        """Whether an object opening here is a call object, by the format's shape."""
        stack = self._stack
        if self.format == "generic":
            return (
                len(stack) == 2  # noqa: PLR2004 (the wrapper object, then its array)
                and stack[0].key == "tool_calls"
                and stack[1].kind == "arr"
                and stack[0].kind == "obj"
            )
        if self.format == "hermes":
            return not stack
        return not stack or (len(stack) == 1 and stack[0].kind == "arr")

    def _start_string(self) -> None:
        self._in_string = True
        self._escape = False
        self._string_start = self._pos

    def _string_char(self, char: str, delta: Delta) -> None:
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            self._string_done(delta)
        elif char < " ":
            self._give_back(delta)  # JSON has no raw control characters in strings

    def _string_done(self, delta: Delta) -> None:
        frame = self._stack[-1] if self._stack else None
        if frame is None:
            self._give_back(delta)
            return
        is_key = frame.kind == "obj" and frame.state == "key"
        call = frame.call
        wanted = is_key or (call is not None and frame.key in ("name", *ARGUMENT_KEYS))
        if not wanted:
            frame.state = "comma"
            return
        try:
            value = json.loads(self.text[self._string_start : self._pos + 1])
        except ValueError:
            self._give_back(delta)
            return
        if is_key:
            frame.key, frame.state = value, "colon"
            return
        assert call is not None
        frame.state = "comma"
        if frame.key == "name":
            if call.name is not None:
                return
            if value not in self.tool_names:
                self._give_back(delta)
                return
            call.name = value
            self._start_call(call, delta)
        elif call.arguments is None:  # arguments written as a string holding the object
            frame.value_start = -1
            call.arguments = value
            call.arguments_done = True

    def _end_literal(self, delta: Delta) -> bool:
        literal = self.text[self._literal_start : self._pos]
        self._literal_start = -1
        frame = self._stack[-1] if self._stack else None
        if literal not in ("true", "false", "null"):
            try:
                float(literal)
                json.loads(literal)
            except ValueError:
                frame = None
        if frame is None or (frame.call is not None and frame.key in ARGUMENT_KEYS):
            self._give_back(delta)  # arguments must be an object
            return False
        frame.state = "comma"
        return True

    def _close(self, delta: Delta) -> bool:
        frame = self._stack.pop()
        parent = self._stack[-1] if self._stack else None
        if parent is not None and parent.call is not None and parent.value_start >= 0:
            call = parent.call
            if frame.kind != "obj":
                self._give_back(delta)  # arguments must be an object
                return False
            call.arguments = self.text[parent.value_start : self._pos + 1]
            call.arguments_done = True
            parent.value_start = -1
        if frame.call is not None and not self._complete(frame.call, delta):
            return False
        if parent is not None:
            parent.state = "comma"
            return True
        if not self._value_calls:  # a whole value without a call in it
            if self._json_answer:  # the response_format's answer, not a broken call
                self.num_invalid -= 1
            self._give_back(delta)
            return False
        if self.format != "llama3_json":
            self._pos += 1
            self._region_done(delta)
            return False
        return True

    # ---- calls -------------------------------------------------------------------

    def _start_call(self, call: _Call, delta: Delta) -> None:
        call.index = len(self._ids)
        self._ids.append(self.new_id())
        call.emitted = True
        delta.calls.append(CallDelta(call.index, self._ids[call.index], call.name))

    def _complete(self, call: _Call, delta: Delta) -> bool:
        if call.name is None:
            self._give_back(delta)
            return False
        arguments = call.arguments if call.arguments is not None else "{}"
        try:
            valid = isinstance(json.loads(arguments), dict)
        except ValueError:
            valid = False
        if not valid:
            self._give_back(delta)
            return False
        call.arguments, call.arguments_done = arguments, True
        self._flush(call, delta)
        self.calls.append(ToolCall(self._ids[call.index], call.name, arguments))
        self._open.remove(call)
        self._value_calls += 1
        self._resume = self._pos + 1
        return True

    def _flush(self, call: _Call, delta: Delta) -> None:
        """Send the call's arguments read so far (all of them once its value ended)."""
        if not call.emitted:
            return
        text = call.arguments if call.arguments_done else self._partial_arguments(call)
        if text is None or len(text) <= call.sent:
            return
        piece, call.sent = text[call.sent :], len(text)
        if delta.calls and delta.calls[-1].index == call.index:
            delta.calls[-1].arguments += piece
        else:
            delta.calls.append(CallDelta(call.index, arguments=piece))

    def _partial_arguments(self, call: _Call) -> str | None:
        for frame in self._stack:
            if frame.call is call and frame.value_start >= 0:
                if self.text[frame.value_start] != "{":
                    return None  # a string: sent whole, when it ends
                return self.text[frame.value_start : self._pos]
        return None

    def _reset_json(self) -> None:
        self._stack.clear()
        self._open.clear()
        self._in_string = False
        self._escape = False
        self._literal_start = -1


_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "phi4_mini": "functools"}
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_LITERAL_END = ",]} \t\r\n"


def parse_tool_calls(format: str, text: str, tool_names: frozenset[str] | set[str]) -> Parsed:
    return ToolCallParser(format, tool_names).parse(text)
