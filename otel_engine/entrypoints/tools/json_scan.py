"""The JSON of a call region, followed one character at a time (`JsonScanner`), so that a
streamed region is known to be calls, or not, as soon as its text shows it (a call object's
end, a name outside the tools, a character JSON does not allow there), and the text held
back while it may be calls is released then.

The scanner keeps a stack of the objects and arrays open, and for each call object (an
object where the format puts calls) its name and the text of its arguments. It does not
decide what a region is or what is sent: its owner (`ToolCallParser`) does, through the
hooks it declares at the end (a call closed, a region ended or broken)."""

from __future__ import annotations

import json

from otel_engine.entrypoints.tools.calls import Delta
from otel_engine.entrypoints.tools.format import ToolFormat

ARGUMENT_KEYS = ("arguments", "parameters")  # what every format may call the arguments
WHITESPACE = " \t\r\n"
_LITERAL_END = ",]} \t\r\n"


class CallObject:
    """A call object being read: its name and the text of its arguments."""

    __slots__ = ("arguments", "name")

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments: str | None = None  # the value's JSON text, once whole


class Frame:
    __slots__ = ("call", "key", "kind", "state", "value_start")

    def __init__(self, kind: str, call: CallObject | None) -> None:
        self.kind = kind  # "obj" or "arr"
        self.state = "key" if kind == "obj" else "value"  # key, colon, value, comma
        self.key: str | None = None  # the key whose value comes next (objects)
        self.call = call  # this object is a call
        self.value_start = -1


class JsonScanner:
    """Reads `text` from `_pos` while a region is open (`_mode == "region"`)."""

    def __init__(self, format: ToolFormat, tool_names: frozenset[str] | set[str]) -> None:
        self.tool_names = frozenset(tool_names)
        self.text = ""
        self._mode = "region"
        self._pos = 0  # characters of `text` read
        self._stack: list[Frame] = []
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._literal_start = -1  # a number, true, false or null being read
        self._value_calls = 0  # calls completed in the current top-level value
        # the format's shape, read once (the loop below runs per character)
        self._separator = format.separator
        self._calls_in_array = format.calls_in_array
        self._wrapper_key = format.wrapper_key

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
        if char in WHITESPACE:
            return True
        stack = self._stack
        if not stack:  # before or between top-level values
            separator = self._separator
            if self._value_calls and not (separator and char in (separator, "{")):
                self._region_done(delta)
                return False
            if char == separator and self._value_calls:
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
            self._stack.append(Frame("obj", CallObject() if self._is_call() else None))
        elif char == "[":
            self._stack.append(Frame("arr", None))
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
        if self._wrapper_key is not None:
            return (
                len(stack) == 2  # noqa: PLR2004 (the wrapper object, then its array)
                and stack[0].key == self._wrapper_key
                and stack[1].kind == "arr"
                and stack[0].kind == "obj"
            )
        return not stack or (self._calls_in_array and len(stack) == 1 and stack[0].kind == "arr")

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
        elif call.arguments is None:  # arguments written as a string holding the object
            frame.value_start = -1
            call.arguments = value

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
            parent.value_start = -1
        if frame.call is not None and not self._complete(frame.call, delta):
            return False
        if parent is not None:
            parent.state = "comma"
            return True
        if not self._value_calls:  # a whole value without a call in it
            self._no_calls(delta)
            return False
        if not self._separator:
            self._pos += 1
            self._region_done(delta)
            return False
        return True

    def _reset_json(self) -> None:
        self._stack.clear()
        self._in_string = False
        self._escape = False
        self._literal_start = -1

    # ---- the owner's hooks -------------------------------------------------------

    def _complete(self, call: CallObject, delta: Delta) -> bool:
        """`call`'s object ended: it is a call (True) or the region broke (False)."""
        raise NotImplementedError

    def _no_calls(self, delta: Delta) -> None:
        """A whole top-level value held no call."""
        raise NotImplementedError

    def _region_done(self, delta: Delta) -> None:
        """The region's JSON is whole (`_pos` is past it)."""
        raise NotImplementedError

    def _give_back(self, delta: Delta) -> None:
        """The region is not (or no longer) calls."""
        raise NotImplementedError
