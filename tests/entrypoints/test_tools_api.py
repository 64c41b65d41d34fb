"""Tools over HTTP with the official client, on a tiny model whose template has Qwen2.5's
tool markup (the hermes format) and on the default model (SmolLM2, no tool format: the
generic one): forced calls whose arguments validate against the schema, streamed calls
reassembled by the client's helper equal to the non-streamed ones, a whole round trip
through Chat Completions and Responses, clear 400s, the tool-call counter and the span."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import Served, ServerLoop, serving_model
from tests.helpers.budgets import REQUEST_TIMEOUT_S

pytestmark = pytest.mark.slow  # starts engine processes

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "The weather forecast of a city",
            "parameters": PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module", params=["hermes", "generic"])
def tool_served(
    request: pytest.FixtureRequest,
    server_loop: ServerLoop,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    with serving_model(server_loop, tmp_path_factory, request.param) as served:
        yield served


def _client(served: Served) -> Any:
    """The official client, waiting as long as the test may: the default model answers a
    600-token call at whatever speed this CPU level has."""
    return served.openai(timeout=REQUEST_TIMEOUT_S)


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def _format(served: Served) -> str:
    return served.server.config.app.state.serving._tools.format.name  # type: ignore[no-any-return]


def test_the_format_is_read_from_the_template(tool_served: Served) -> None:
    expected = "generic" if tool_served.engine.config.model.model is None else "hermes"

    assert expected == _format(tool_served)


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
)
def test_forced_calls_parse_and_validate(tool_served: Served, tool_choice: Any) -> None:
    before = tool_served.metric("otel_engine_tool_calls_total", outcome="parsed")
    chat = _client(tool_served).chat.completions.create(
        model=tool_served.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=600,
        temperature=0.0,
    )
    choice = chat.choices[0]
    calls = _calls(choice.message)

    assert "tool_calls" == choice.finish_reason
    assert calls
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    if isinstance(tool_choice, dict):
        assert [("get_time")] == [name for name, _ in calls]
    for call in choice.message.tool_calls or ():
        assert call.id.startswith("call_")
        assert "function" == call.type
    assert before + len(calls) == tool_served.metric(
        "otel_engine_tool_calls_total", outcome="parsed"
    )


def _forced_call(served: Served, **extra: Any) -> dict[str, Any]:
    """A greedy chat whose tool call is forced (`required`), with room for the whole call."""
    return {
        "model": served.model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 600,
        "temperature": 0.0,
        **extra,
    }


def test_streamed_calls_equal_the_non_streamed(tool_served: Served) -> None:
    """The client's stream helper reassembles the same calls as the whole answer, each sent
    whole in one delta once it is a call."""
    client = _client(tool_served)
    options = _forced_call(tool_served)
    whole = client.chat.completions.create(**options)
    with client.chat.completions.stream(**options) as stream:
        chunks = list(stream)
        streamed = stream.get_final_completion()

    assert _calls(whole.choices[0].message) == _calls(streamed.choices[0].message)
    assert "tool_calls" == streamed.choices[0].finish_reason
    deltas = [
        call
        for event in chunks
        if event.type == "chunk"
        for choice in event.chunk.choices
        for call in choice.delta.tool_calls or ()
    ]
    assert _calls(whole.choices[0].message) == [
        (delta.function.name, json.loads(delta.function.arguments or ""))
        for delta in deltas
        if delta.function is not None
    ]
    assert all(delta.id is not None and delta.function is not None for delta in deltas)


def test_a_call_cut_after_its_name_is_text_streamed_or_not(tool_served: Served) -> None:
    """A stop string cuts the forced call after its name: the stream sends no call, only its
    text, and ends as the whole answer does (that text as content, finish_reason stop)."""
    client = _client(tool_served)
    options = _forced_call(tool_served, stop=['"arguments"'])
    whole = client.chat.completions.create(**options).choices[0]
    chunks = list(client.chat.completions.create(**options, stream=True))
    streamed = [choice for chunk in chunks for choice in chunk.choices]

    assert ("stop", None) == (whole.finish_reason, whole.message.tool_calls)
    assert '"name"' in (whole.message.content or "")
    assert [] == [call for choice in streamed for call in choice.delta.tool_calls or ()]
    assert (whole.message.content, "stop") == (
        "".join(choice.delta.content or "" for choice in streamed),
        streamed[-1].finish_reason,
    )


def test_one_call_without_parallel_tool_calls(tool_served: Served) -> None:
    chat = _client(tool_served).chat.completions.create(
        model=tool_served.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=600,
        temperature=0.0,
    )

    assert 1 == len(chat.choices[0].message.tool_calls or ())


def test_a_round_trip_of_call_result_and_answer(tool_served: Served) -> None:
    """The call, its result in the history (rendered by the template or as the generic
    format writes it), and an answer in text once the tools are off."""
    client = _client(tool_served)
    first = client.chat.completions.create(
        model=tool_served.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=600,
        temperature=0.0,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C."},
    ]

    final = client.chat.completions.create(
        model=tool_served.model,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=24,
        temperature=0.0,
    )

    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_responses_with_tools_and_a_round_trip(tool_served: Served) -> None:
    client = _client(tool_served)
    tools: list[Any] = [{"type": "function", **tool["function"]} for tool in TOOLS]
    options: dict[str, Any] = {
        "model": tool_served.model,
        "input": "What will the weather be in Oslo?",
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 600,
        "temperature": 0.0,
    }
    whole = client.responses.create(**options)
    with client.responses.stream(**options) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_response()
    calls = [item for item in whole.output if item.type == "function_call"]

    assert "completed" == whole.status
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert [(c.name, c.arguments) for c in calls] == [
        (i.name, i.arguments) for i in streamed.output if i.type == "function_call"
    ]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.delta" in types
    assert "response.completed" == types[-1]
    answer = client.responses.create(
        model=tool_served.model,
        input=[
            {"role": "user", "content": "What will the weather be in Oslo?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Rain."},
        ],
        instructions="Answer in one sentence.",
        max_output_tokens=16,
        temperature=0.0,
    )
    assert answer.output_text
    assert answer.status in ("completed", "incomplete")


def test_responses_text_streams_and_json_schema(tool_served: Served) -> None:
    client = _client(tool_served)
    stream = client.responses.create(
        model=tool_served.model, input="Say hello.", max_output_tokens=8, stream=True
    )
    events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1]

    assert done.type in ("response.completed", "response.incomplete")
    assert deltas == done.response.output_text  # type: ignore[union-attr]
    structured = client.responses.create(
        model=tool_served.model,
        input="Describe the weather.",
        max_output_tokens=120,
        temperature=0.0,
        text={"format": {"type": "json_schema", "name": "forecast", "schema": PARAMETERS}},
    )
    jsonschema.validate(json.loads(structured.output_text), PARAMETERS)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "array"}},
                    }
                ]
            },
            "tools",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400_and_the_server_serves_on(
    tool_served: Served, body: dict[str, Any], param: str | None
) -> None:
    request = {"model": tool_served.model, "messages": MESSAGES, "tools": TOOLS, **body}
    with tool_served.http() as http:
        refused = http.post("/v1/chat/completions", json=request)
        ok = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})

    assert 400 == refused.status_code, refused.text
    if param is not None:
        assert param == refused.json()["error"]["param"]
    assert 200 == ok.status_code


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "text"),
    ],
)
def test_bad_responses_requests_are_400(
    tool_served: Served, body: dict[str, Any], param: str
) -> None:
    request = {"model": tool_served.model, "input": "hi", **body}
    with tool_served.http() as http:
        refused = http.post("/v1/responses", json=request)

    assert 400 == refused.status_code, refused.text
    assert param == refused.json()["error"]["param"]


def test_invalid_calls_are_text_and_counted(tool_served: Served, tmp_path: Path) -> None:
    """`auto` in the model's own format is unconstrained: whatever the model writes is
    returned (content or calls), never a 500, and the counters move only by outcome."""
    before = {
        o: tool_served.metric("otel_engine_tool_calls_total", outcome=o)
        for o in ("parsed", "invalid")
    }
    chat = _client(tool_served).chat.completions.create(
        model=tool_served.model,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=40,
        temperature=1.0,
        seed=7,
    )
    after = {
        o: tool_served.metric("otel_engine_tool_calls_total", outcome=o)
        for o in ("parsed", "invalid")
    }

    message = chat.choices[0].message
    assert message.content is not None or message.tool_calls
    assert after["parsed"] - before["parsed"] == len(message.tool_calls or ())
    assert after["invalid"] >= before["invalid"]


def test_the_openapi_document_has_responses(tool_served: Served) -> None:
    with httpx.Client(base_url=tool_served.base_url, trust_env=False) as http:
        document = http.get("/openapi.json").json()

    assert "/v1/responses" in document["paths"]
    schemas = document["components"]["schemas"]
    assert "ResponsesRequest" in schemas
    assert "tool_calls" in json.dumps(schemas["ChatChoice"])


def test_client_error_types_are_the_official_clients(tool_served: Served) -> None:
    with pytest.raises(openai.BadRequestError):
        _client(tool_served).responses.create(
            model=tool_served.model, input="x", previous_response_id="resp_1"
        )


def _post_tools(served: Served, num_tools: int, num_fields: int) -> str:
    """A chat of `num_tools` distinct tools, each with `num_fields` described fields: the
    answer's status and error code."""
    tools = []
    for index in range(num_tools):
        names = [f"field_{index}_{k}" for k in range(num_fields)]
        properties = {n: {"type": "string", "description": f"the {n} of it"} for n in names}
        schema = {"type": "object", "properties": properties, "required": names}
        tools.append({"type": "function", "function": {"name": f"f{index}", "parameters": schema}})
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4}
    response = served.http().post("/v1/chat/completions", json=body)
    code = response.json()["error"]["code"] if response.status_code != 200 else None
    return f"{response.status_code} {code}"


def test_tools_past_the_context_are_refused_before_their_schemas_are_checked(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the server's own path (draft, render, context check, constrain): tools that
    make the prompt longer than the context are a 400 with none of their schemas checked
    (`Function.check`), while a chat whose prompt fits has its tool's schema checked once."""
    from otel_engine.entrypoints.tools.request import Function

    checked: list[str] = []
    check = Function.check

    def counted(function: Function) -> None:
        checked.append(function.name)
        check(function)

    monkeypatch.setattr(Function, "check", counted)
    past = [_post_tools(served, 8, 4), *checked]
    checked.clear()
    fits = [_post_tools(served, 1, 0), *checked]

    assert ["400 context_length_exceeded"] == past
    assert ["200 None", "f0"] == fits
