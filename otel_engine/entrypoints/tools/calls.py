"""Tool calls as the parser gives them: whole calls (`ToolCall`), the pieces of one streamed
call (`CallDelta`), what one piece of text yields (`Delta`), a whole answer (`Parsed`), and
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
