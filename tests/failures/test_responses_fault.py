"""The engine dying under a streamed Responses request with tools: the client gets an `error`
event and `response.failed` naming the cause, the request's span ends ERROR linked to the
crash, the one crash dump counts the request's tools and never shows their text, the
server exits 1 and leaves no process behind."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.failures.conftest import GONE_LIMIT_S, ProcessWatch, wait_exit
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.procs import ServerProcess
from tests.helpers.tiny_model import write_tiny_tool_model

pytestmark = pytest.mark.slow  # starts servers or engine processes

SECRET = "zebra-umbrella-7731"  # in the tool's description and schema: must not leak
TOOLS = [
    {
        "type": "function",
        "name": "lookup",
        "description": f"Looks up {SECRET}",
        "parameters": {
            "type": "object",
            "properties": {SECRET: {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": [SECRET],
        },
    }
]


def _events(base_url: str) -> list[tuple[str, dict[str, Any]]]:
    body = {
        "input": "Tell me a long story.",
        "tools": TOOLS,
        "max_output_tokens": 100,
        "stream": True,
    }
    events: list[tuple[str, dict[str, Any]]] = []
    with (
        httpx.Client(base_url=base_url, timeout=60, trust_env=False) as client,
        client.stream("POST", "/v1/responses", json=body) as response,
    ):
        assert 200 == response.status_code, response.read()
        kind = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
    return events


def test_engine_death_fails_a_streamed_response_with_its_span_and_one_dump(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]], tmp_path: Path
) -> None:
    dump_dir = tmp_path / "dumps"
    with OtlpReceiver("grpc") as receiver:
        server, watch = start_server(
            "--crash-dump-dir",
            str(dump_dir),
            "--otlp-endpoint",
            receiver.endpoint,
            "--otlp-protocol",
            "grpc",
            fault="engine_core:raise:step=12",
            model_dir=write_tiny_tool_model(tmp_path / "model"),  # a context of 4,096
        )
        events = _events(server.base_url)
        code = wait_exit(server, timeout=60)
        crash = receiver.wait_for(
            lambda r: [
                (s, e) for s in r.spans() for e in s["events"] if e["name"] == "otel_engine.crash"
            ],
            timeout=10,
        )
        spans = receiver.spans()

    kinds = [kind for kind, _ in events]
    assert ["response.created", "response.in_progress"] == kinds[:2]
    assert ["error", "response.failed"] == kinds[-2:], kinds
    error, failed = events[-2][1], events[-1][1]
    assert "InjectedFault" in error["message"]
    assert "failed" == failed["response"]["status"]
    assert "InjectedFault" in failed["response"]["error"]["message"]
    assert [event["sequence_number"] for _, event in events] == list(range(len(events)))
    assert 1 == code, server.tail()
    watch.assert_all_gone(GONE_LIMIT_S)

    assert 1 == len(crash)
    crash_span = crash[0][0]
    requests = [s for s in spans if s["name"].startswith("chat ")]
    assert 1 == len(requests)
    request = requests[0]
    assert "ERROR" in str(request["status"]["code"])
    links = {(link["trace_id"], link["span_id"]) for link in request["links"]}
    assert (crash_span["trace_id"], crash_span["span_id"]) in links
    assert json.loads(request["attributes"]["gen_ai.tool.definitions"]) == [
        {"type": "function", "name": "lookup"}
    ]

    files = sorted(dump_dir.glob("crash-*.json"))
    assert 1 == len(files)
    text = files[0].read_text()
    assert SECRET not in text
    dumped = json.loads(text)["scheduler_output"]["requests"]
    assert [1] == [entry["sampling_params"]["num_tools"] for entry in dumped]
    for span in spans:  # no span carries the tool's text either
        assert SECRET not in json.dumps(span)


def test_a_tool_request_span_names_its_tools_and_calls_never_their_text(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]], tmp_path: Path
) -> None:
    """The GenAI span of a chat with tools: `gen_ai.tool.definitions` (type and name), the
    answer's calls as tool-call parts of `gen_ai.output.messages` (id and name), the
    finish reason tool_calls; no description, schema or argument anywhere."""
    tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    with OtlpReceiver("grpc") as receiver:
        server, _ = start_server(
            "--otlp-endpoint",
            receiver.endpoint,
            "--otlp-protocol",
            "grpc",
            model_dir=write_tiny_tool_model(tmp_path / "model"),
        )
        body = {
            "messages": [{"role": "user", "content": "Look it up."}],
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 300,
            "temperature": 0,
        }
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
            answer = client.post("/v1/chat/completions", json=body).json()
        spans = receiver.wait_for(
            lambda r: [s for s in r.spans() if s["name"].startswith("chat ")], timeout=15
        )
        server.terminate()
        wait_exit(server, timeout=30)

    call = answer["choices"][0]["message"]["tool_calls"][0]
    attributes = spans[0]["attributes"]
    assert ["tool_calls"] == list(attributes["gen_ai.response.finish_reasons"])
    assert [{"type": "function", "name": "lookup"}] == json.loads(
        attributes["gen_ai.tool.definitions"]
    )
    messages = json.loads(attributes["gen_ai.output.messages"])
    assert [{"type": "tool_call", "id": call["id"], "name": "lookup"}] == messages[0]["parts"]
    assert SECRET not in json.dumps(spans)
    assert call["function"]["arguments"] not in json.dumps(spans)
    assert not any(SECRET in line for line in server.lines())
