"""Tool calls in a model's text, one parser for every format (`ToolFormat` gives its shape:
formats/ has each one's markup).

`ToolCallParser` reads a choice's text as it is generated (`feed`) and says what it holds:
content (text outside tool calls, held back while a call may be starting) and calls. A call
is sent once its text is known to be a call (its object closed, naming one of the request's
tools, with arguments that parse as an object), whole, in one delta: its id, name and
arguments. A non-streamed choice is the same parser fed the whole text at once (`parse`),
so both give the same content and calls, whatever the text and however it ends. The
arguments are the JSON text the model wrote for them.

A call whose text is not a valid call (malformed JSON, a function that is not among the
request's tools, arguments that are not an object) or that was cut short (max_tokens, a
stop string) is not a call: its text is content and it counts as `invalid`, streamed or not.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from otel_engine.entrypoints.tools.calls import CallDelta, Delta, Parsed, ToolCall
from otel_engine.entrypoints.tools.format import ToolFormat
from otel_engine.entrypoints.tools.json_scan import WHITESPACE, CallObject, JsonScanner


class ToolCallParser(JsonScanner):
    """One choice's text, read incrementally for tool calls in `format`.

    The text alternates between content and regions (the JSON of calls, after a marker or,
    for a whole-answer format, as the whole answer). In a region the scanner (json_scan.py)
    follows the JSON: a call object's end completes the call, which is sent then. A region
    that turns out not to be calls gives its text back to the content, from the end of its
    last complete call.
    """

    def __init__(
        self,
        format: ToolFormat,
        tool_names: frozenset[str] | set[str],
        new_id: Callable[[], str] | None = None,
        *,
        json_answer: bool = False,
    ) -> None:
        super().__init__(format, tool_names)
        self.format = format
        self.new_id = new_id or format.new_call_id
        self.calls: list[ToolCall] = []
        self.num_invalid = 0
        self._content: list[str] = []
        self._marker = format.marker
        self._whole_answer = format.whole_answer  # a call only at the start
        self._prefix = format.answer_prefix
        self._close_tag = format.close_tag
        self._mode = "start" if self._whole_answer else "text"  # start text region close rest
        self._sent_to = 0  # content is sent up to here
        self._resume = 0  # where content restarts if the region breaks
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
        return delta

    def finish(self) -> Delta:
        """The choice ended: held-back text is content; a call left unfinished is invalid."""
        delta = Delta()
        if self._mode == "region" and not self._stack and self._value_calls:
            self._region_done(delta)  # a separated format after its last call
            self._sent_to = len(self.text)  # whitespace between calls
        elif self._mode == "region":
            self._give_back(delta)
        elif self._mode == "close" and not self.text[self._pos :].strip(WHITESPACE):
            self._sent_to = len(self.text)  # a call whose close tag never came: it stands
        self._send_content(len(self.text), delta)
        return delta

    def parse(self, text: str) -> Parsed:
        """A whole choice's text at once (the non-streamed answer)."""
        self.feed(text)
        self.finish()
        return Parsed(self.content, list(self.calls), self.num_invalid)

    @property
    def content(self) -> str:
        return "".join(self._content)

    # ---- outside regions -------------------------------------------------------------

    def _scan_start(self, delta: Delta) -> bool:
        """The answer's first characters: a call, or content to the end."""
        rest = self.text[self._pos :].lstrip(WHITESPACE)
        if not rest:
            return False
        first = len(self.text) - len(rest)
        prefix = self._prefix
        if prefix and prefix.startswith(rest[: len(prefix)]):
            if len(rest) < len(prefix):
                return False  # may still be the prefix
            self._open_region(self._pos, first + len(prefix))
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
        """After a region's JSON: its close tag (a missing one leaves the calls standing)."""
        rest = self.text[self._pos :].lstrip(WHITESPACE)
        close = self._close_tag
        if not rest or (len(rest) < len(close) and close.startswith(rest)):
            return False
        at = len(self.text) - len(rest)
        self._pos = self._sent_to = at + len(close) if rest.startswith(close) else at
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
        self._sent_to = self._pos
        if self._close_tag:
            self._mode = "close"
        else:
            self._mode = "rest" if self._whole_answer else "text"

    def _give_back(self, delta: Delta) -> None:
        """Invalid, and the region's text from the end of its last complete call is
        content."""
        self.num_invalid += 1
        self._sent_to = self._resume
        self._reset_json()
        self._mode = "rest" if self._whole_answer else "text"
        if self._mode == "text" and self._marker:
            # the broken region's text is content; look for the next marker past its own
            self._send_content(self._pos, delta)

    def _no_calls(self, delta: Delta) -> None:
        if self._json_answer:  # the response_format's answer, not a broken call
            self.num_invalid -= 1
        self._give_back(delta)

    # ---- calls -------------------------------------------------------------------

    def _complete(self, call: CallObject, delta: Delta) -> bool:
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
        done = ToolCall(self.new_id(), call.name, arguments)
        delta.calls.append(CallDelta(len(self.calls), done))
        self.calls.append(done)
        self._value_calls += 1
        self._resume = self._pos + 1
        return True
