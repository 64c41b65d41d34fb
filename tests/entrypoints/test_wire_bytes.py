"""The bytes of each answer shape stay as recorded: completions, chat, chat with tools and
Responses (with and without tools), whole and streamed, from the tiny models at temperature
0, equal `golden/wire.json` once the parts that vary (ids, timestamps, prefix cache hits) are
replaced by names.

The tokens are the tiny models' greedy output, which a kernel build for another CPU level
may tip where two logits nearly tie: the test runs on the level the file was recorded on
(`RECORDED_ON`) and is skipped on others. `OTEL_ENGINE_UPDATE_GOLDEN=1` records the file
again (for a deliberate change of the wire), on this CPU's level."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_engine.model import kernels
from tests.entrypoints.conftest import Served, ServerLoop, serving_model
from tests.helpers.cpu_levels import LEDGER, Coverage, LevelSkipped

pytestmark = pytest.mark.slow  # starts engine processes

GOLDEN = Path(__file__).parent / "golden" / "wire.json"
RECORDED_ON = "avx512bf16"  # the CPU level (kernels.cpu_isa) golden/wire.json comes from
# What differs from run to run: ids drawn at random, the time of creation, cache hits.
RANDOM_PARTS = [
    (re.compile(r"\b(chatcmpl|cmpl|resp)-[0-9a-f]{32}\b"), r"\1-ID"),
    (re.compile(r"\b(msg|fc)_[0-9a-f]{32}\b"), r"\1_ID"),
    (re.compile(r"\bcall_[0-9a-f]{24}\b"), "call_ID"),
    (re.compile(r'"(created|created_at)":\d+'), r'"\1":0'),
    # what the prefix cache holds depends on the requests before, in this test or another
    (re.compile(r'"cached_tokens":\d+'), '"cached_tokens":0'),
    # a model served from a temporary directory is named after it, numbered by the session
    (re.compile(r'"model":"(tiny-llama|tool-model)\d+"'), r'"model":"\1"'),
]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PLAIN = {
    "completion": (
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
    ),
    "chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "temperature": 0}),
    "responses": (
        "/v1/responses",
        {"input": "Say hi", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0},
    ),
}
WITH_TOOLS = {
    "chat_tools": (
        "/v1/chat/completions",
        {
            "messages": ASK,
            "tools": [{"type": "function", "function": WEATHER}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 600,
            "temperature": 0,
        },
    ),
    "responses_tools": (
        "/v1/responses",
        {
            "input": ASK,
            "tools": [{"type": "function", **WEATHER}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 600,
            "temperature": 0,
        },
    ),
}


@pytest.fixture(scope="module")
def tool_served(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    with serving_model(server_loop, tmp_path_factory, "hermes") as served:
        yield served


def _named(text: str) -> str:
    for pattern, name in RANDOM_PARTS:
        text = pattern.sub(name, text)
    return text


def _answers(served: Served, requests: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """Each request's answer body, whole and streamed (chat and completions streams with
    usage), its random parts named."""
    answers = {}
    with served.http() as client:
        for name, (path, body) in requests.items():
            whole = client.post(path, json=body)
            streamed_body = {**body, "stream": True}
            if path != "/v1/responses":
                streamed_body["stream_options"] = {"include_usage": True}
            streamed = client.post(path, json=streamed_body)
            assert (200, 200) == (whole.status_code, streamed.status_code), whole.text
            answers[f"{name} whole"] = _named(whole.text)
            answers[f"{name} streamed"] = _named(streamed.text)
    return answers


def test_every_answer_shape_keeps_its_bytes(served: Served, tool_served: Served) -> None:
    detected = kernels.cpu_isa()
    if detected != RECORDED_ON and not os.environ.get("OTEL_ENGINE_UPDATE_GOLDEN"):
        reason = f"the recorded tokens are greedy output at {RECORDED_ON}; this CPU runs {detected}"
        raise LevelSkipped(reason, RECORDED_ON, Coverage.NATIVE)
    LEDGER.record_ran(RECORDED_ON, Coverage.NATIVE)
    answers = {**_answers(served, PLAIN), **_answers(tool_served, WITH_TOOLS)}

    if os.environ.get("OTEL_ENGINE_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n")
        pytest.skip("recorded golden/wire.json")
    recorded = json.loads(GOLDEN.read_text(encoding="utf-8"))
    for name in recorded:
        assert recorded[name] == answers[name], name
    assert set(recorded) == set(answers)
