"""The closed sets of tools, as the wire and the command line spell them (stdlib only: the
command line imports this module)."""

from __future__ import annotations

import enum
from typing import Literal


class ToolFormatName(enum.StrEnum):
    """The formats the engine ships (`--tool-call-parser` takes these or `auto`); each is
    one class in formats/."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    PHI4_MINI = "phi4_mini"
    GENERIC = "generic"


class ToolChoice(enum.StrEnum):
    """A request's `tool_choice`: the first three are its wire strings; `NAMED` is one
    function named by an object."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


# A `tool_choice` a request may spell as a string (`NAMED` is an object on the wire).
WireToolChoice = Literal[ToolChoice.NONE, ToolChoice.AUTO, ToolChoice.REQUIRED]
