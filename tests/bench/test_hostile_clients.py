"""bench/hostile_clients.py's reproductions are what they say: a tool-call history under the
body limit and over the tool-call limit, client mistakes that the edge refuses, tools whose
prompt cannot fit the context. No engine is started."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from otel_engine.entrypoints.network.bodies import check_chat_counts, validate
from otel_engine.entrypoints.network.errors import APIError
from otel_engine.entrypoints.network.limits import (
    CHARS_PER_TOKEN_BOUND,
    MAX_BODY_BYTES,
    MAX_TOOL_CALLS,
)
from otel_engine.entrypoints.openai.protocol import ChatCompletionRequest
from otel_engine.entrypoints.openai.serving import chat_chars

BENCH = Path(__file__).resolve().parents[2] / "bench"
CONTEXT = 4096  # the tiny models the benchmark serves


@pytest.fixture
def hostile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("hostile_clients")


def test_the_history_fits_the_body_limit_and_is_refused_by_its_calls(hostile: ModuleType) -> None:
    body = hostile.tool_history_body()
    messages = json.loads(body)["messages"]

    assert len(body) <= MAX_BODY_BYTES
    assert sum(len(m["tool_calls"]) for m in messages) > 20 * MAX_TOOL_CALLS
    with pytest.raises(APIError, match="tool calls"):
        check_chat_counts(body)


def test_every_client_mistake_is_json_the_edge_reads(hostile: ModuleType) -> None:
    """Each mistake is valid JSON whose body nests within the limit: what makes it wrong is
    inside a string or an item, where the round-three checks look."""
    cases = hostile.mistake_bodies()

    assert len({(name, path) for name, path, _ in cases}) == len(cases)
    for _, _, body in cases:
        json.loads(body)


def test_the_tools_fit_the_characters_but_not_the_context(hostile: ModuleType) -> None:
    """Each many-tools body passes the character budget (so the prompt is rendered) and holds
    distinct schemas; its prompt cannot fit a 4,096-token context (bench/README)."""
    bodies = [validate(ChatCompletionRequest, hostile.many_tools_body(k)) for k in range(2)]
    schemas = [json.dumps(t.function.parameters) for b in bodies for t in b.tools or ()]

    assert len(set(schemas)) == len(schemas) == 256
    for body in bodies:
        chars = chat_chars(body.template_messages(), body.tool_functions())
        assert CONTEXT < chars < CHARS_PER_TOKEN_BOUND * CONTEXT
