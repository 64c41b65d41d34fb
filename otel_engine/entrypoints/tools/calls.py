"""Tool calls as the parser gives them: whole calls (`ToolCall`), one call as a stream sends
it (`CallDelta`), what one piece of text yields (`Delta`), a whole answer (`Parsed`), and
the call ids OpenAI's clients expect."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


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
    """Call `index` of a streamed choice, sent whole once it is known to be a call: one
    delta with its id, name and arguments (OpenAI's clients join a call's deltas by index,
    so one delta is a whole call to them)."""

    index: int
    call: ToolCall

    def as_openai(self) -> dict[str, object]:
        return {"index": self.index, **self.call.as_openai()}


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
