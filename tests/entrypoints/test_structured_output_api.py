"""`response_format` over HTTP with the official client: JSON that validates on both
endpoints, streamed or not, with n > 1; clear 400s for bad schemas; the compile histogram
and the invalid-JSON counter. The tiny random model writes JSON only because of the grammar."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.engine.test_structured_output import BOUNDED, schema_format
from tests.entrypoints.conftest import Served, ServerLoop
from tests.helpers.budgets import REQUEST_TIMEOUT_S

pytestmark = pytest.mark.slow  # starts engine processes

MESSAGES = [{"role": "user", "content": "Describe a fox as JSON."}]


def _schema(tag: str) -> dict[str, Any]:
    """BOUNDED under a property name of its own: a schema no other test compiled."""
    return {**BOUNDED, "properties": {**BOUNDED["properties"], tag: {"type": "boolean"}}}


def test_chat_json_schema_validates_with_n(served: Served) -> None:
    schema = _schema("chat_n")
    chat = served.openai().chat.completions.create(
        model=served.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=250,
        n=2,
        seed=3,
        temperature=1.0,
        response_format=schema_format(schema),  # type: ignore[arg-type]
    )

    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_streamed_completion_json_schema_validates(served: Served) -> None:
    stream = served.openai().completions.create(
        model=served.model,
        prompt="A fox:",
        max_tokens=250,
        temperature=0.0,
        stream=True,
        extra_body={"response_format": schema_format(BOUNDED)},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)

    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), BOUNDED)


def test_json_object_on_chat_is_an_object(served: Served) -> None:
    chat = served.openai().chat.completions.create(
        model=served.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    content = chat.choices[0].message.content or ""

    assert content.lstrip().startswith("{")
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        (schema_format({"type": "string", "pattern": "(("}), "unclosed group"),
        (schema_format({"type": "objekt"}), "objekt"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "JSON object"),
        ({"type": "json_schema", "json_schema": 7}, "must be an object"),
        ({"type": "grammar"}, "type must be"),
    ],
)
def test_bad_response_formats_are_400_naming_the_problem(
    served: Served, response_format: dict[str, Any], words: str
) -> None:
    client = served.openai()
    for create in (
        lambda: client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            response_format=response_format,  # type: ignore[arg-type]
        ),
        lambda: client.completions.create(
            model=served.model,
            prompt="hi",
            max_tokens=4,
            extra_body={"response_format": response_format},
        ),
    ):
        with pytest.raises(openai.BadRequestError) as excinfo:
            create()
        error = excinfo.value.body
        assert isinstance(error, dict)
        assert error["param"] == "response_format"
        assert words in error["message"]


def test_grammars_compile_once_per_schema_and_are_timed(served: Served) -> None:
    schema = _schema("compile_once")
    before = served.metric("otel_engine_grammar_compile_seconds_count")
    for _ in range(3):
        served.openai().completions.create(
            model=served.model,
            prompt="hi",
            max_tokens=250,
            temperature=0.0,
            extra_body={"response_format": schema_format(schema)},
        )

    assert served.metric("otel_engine_grammar_compile_seconds_count") - before == 1


def test_output_cut_by_max_tokens_is_length_and_counted(served: Served) -> None:
    def cut() -> float:
        return served.metric("otel_engine_structured_output_invalid_total", reason="length")

    before = cut()
    completion = served.openai().completions.create(
        model=served.model,
        prompt="hi",
        max_tokens=4,
        extra_body={"response_format": schema_format(BOUNDED)},
    )

    assert completion.choices[0].finish_reason == "length"
    assert cut() - before == 1


# ---- Costly schemas (the grammar-abuse batch, small: bench/grammar_abuse.py has the rest) -


def _core_rss() -> int:
    import psutil

    cores = [p for p in psutil.Process().children(recursive=True) if p.name() == "otel-engine-core"]
    return sum(p.memory_info().rss for p in cores)


def test_a_batch_of_costly_patterns_is_refused_and_others_are_served(served: Served) -> None:
    """Eight concurrent requests of a 42-byte schema whose masks cost tens of ms each and
    tens of MB (`^a{100000}$`, and `^(ab){150000}$`, which once failed with a 500): every
    one is a 400 naming the limit, a 4-token request beside them answers at once, and the
    engine core's memory does not grow."""
    costly = [{"type": "string", "pattern": "^a{100000}$"}] * 6
    costly += [{"type": "string", "pattern": f"^(ab){{{150000 + i}}}$"} for i in range(2)]
    client = served.async_openai()
    before = _core_rss()

    async def abuse(schema: dict[str, Any]) -> Any:
        try:
            await client.completions.create(
                model=served.model,
                prompt="Write the string:",
                max_tokens=50,
                extra_body={"response_format": schema_format(schema)},
            )
        except openai.BadRequestError as error:
            return error.body
        return None

    async def probe() -> float:
        await asyncio.sleep(0.2)
        started = time.perf_counter()
        await client.completions.create(model=served.model, prompt="hi", max_tokens=4)
        return time.perf_counter() - started

    async def run() -> tuple[list[Any], float]:
        *errors, seconds = await asyncio.gather(*(abuse(s) for s in costly), probe())
        return errors, seconds

    errors, probe_seconds = asyncio.run(run())

    for error in errors:
        assert isinstance(error, dict), error
        assert error["param"] == "response_format"
        assert error["code"] == "grammar_limit_exceeded"
        assert "regex_size" in error["message"]
    assert probe_seconds < 5.0
    assert _core_rss() - before < 32 * 2**20


COSTLY_ANSWERS = {
    "a space in the count": {"type": "string", "pattern": "^a{ 100000}$"},
    "repeats in sequence": {"type": "string", "pattern": "^" + "a{2000}" * 50 + "$"},
    "the x flag": {"type": "string", "pattern": "(?x)a{1 0 0 0 0 0}"},
    "a huge minLength": {"type": "string", "minLength": 100000},
    "x-guidance": {"type": "object", "x-guidance": {"whitespace_pattern": "[ ]{0,100000}"}},
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}


def _bad_request(create: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as excinfo:
        create()
    body = excinfo.value.body
    assert isinstance(body, dict)
    return body


@pytest.mark.parametrize("schema", COSTLY_ANSWERS.values(), ids=list(COSTLY_ANSWERS))
def test_costly_answer_schemas_are_400_grammar_limit_exceeded_on_every_path(
    served: Served, schema: dict[str, Any]
) -> None:
    """The probe's bypasses of the old repeat bound: a completion, a chat, and a chat with
    tools under `tool_choice: auto` (where the answer is embedded in the tools grammar)."""
    client = served.openai()
    answer = schema_format(schema)
    for create in (
        lambda: client.completions.create(
            model=served.model, prompt="hi", max_tokens=4, extra_body={"response_format": answer}
        ),
        lambda: client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            response_format=answer,  # type: ignore[arg-type]
        ),
        lambda: client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice="auto",
            response_format=answer,  # type: ignore[arg-type]
        ),
    ):
        error = _bad_request(create)
        assert ("grammar_limit_exceeded", "response_format") == (error["code"], error["param"])


@pytest.fixture(scope="module")
def long_served(server_loop: ServerLoop, long_context_model_dir: str) -> Iterator[Served]:
    """The tiny model with a 4,096-token context: a prompt that holds a costly tool's schema
    fits, so the schema is what gets refused."""
    from otel_engine import AsyncLLM
    from otel_engine.entrypoints.api_server import make_server

    engine = AsyncLLM(model=long_context_model_dir, max_num_seqs=8)
    server = make_server(engine, drain_timeout=5)
    yield Served(server_loop.start(server), engine, server)
    server_loop.stop(server)
    engine.shutdown()


@pytest.mark.parametrize("schema", COSTLY_ANSWERS.values(), ids=list(COSTLY_ANSWERS))
def test_costly_tool_parameters_are_400_grammar_limit_exceeded(
    long_served: Served, schema: dict[str, Any]
) -> None:
    """A tool's schemas are checked once its prompt (the tools written into it) fits the
    context (on the 512-token model the longest of these is refused for its length first)."""
    parameters = {"type": "object", "properties": {"q": schema}, "required": ["q"]}
    if "x-guidance" in schema:
        parameters = {**parameters, "x-guidance": schema["x-guidance"]}
    tool = {"type": "function", "function": {"name": "search", "parameters": parameters}}
    served = long_served
    error = _bad_request(
        lambda: served.openai().chat.completions.create(
            model=served.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            tools=[tool],  # type: ignore[list-item]
            tool_choice="required",
        )
    )

    assert ("grammar_limit_exceeded", "tools") == (error["code"], error["param"])


def test_step_mask_time_is_a_metric(served: Served) -> None:
    """Each step with a grammar row observes its mask time: a slow step says why."""
    before = served.metric("otel_engine_step_grammar_mask_seconds_count")
    served.openai().completions.create(
        model=served.model,
        prompt="hi",
        max_tokens=8,
        extra_body={"response_format": schema_format(_schema("mask_metric"))},
    )

    assert served.metric("otel_engine_step_grammar_mask_seconds_count") - before >= 4
    assert served.metric("otel_engine_step_grammar_mask_seconds_sum") > 0


# ---- The default model (SmolLM2-135M-Instruct): what a user sees --------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "minItems": 1,
            "maxItems": 4,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "country": {"type": "string", "maxLength": 40},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_served(server_loop: ServerLoop) -> Iterator[Served]:
    from otel_engine import AsyncLLM
    from otel_engine.entrypoints.api_server import make_server

    engine = AsyncLLM(max_num_seqs=32)
    server = make_server(engine, drain_timeout=5)
    yield Served(server_loop.start(server), engine, server)
    server_loop.stop(server)
    engine.shutdown()


def test_default_model_answers_twenty_schema_requests_with_valid_json(
    default_served: Served,
) -> None:
    """20 concurrent chat requests with a schema of nested objects, arrays and enums, at
    the model's default sampling: every answer validates."""

    client = default_served.async_openai().with_options(timeout=REQUEST_TIMEOUT_S)

    async def ask(index: int) -> tuple[str | None, str]:
        chat = await client.chat.completions.create(
            model=default_served.model,
            messages=[{"role": "user", "content": f"Invent person number {index} as JSON."}],
            max_tokens=300,
            seed=index,
            response_format=schema_format(PERSON),  # type: ignore[arg-type]
        )
        return chat.choices[0].finish_reason, chat.choices[0].message.content or ""

    async def ask_all() -> list[tuple[str | None, str]]:
        return await asyncio.gather(*(ask(i) for i in range(20)))

    answers = asyncio.run(ask_all())

    for finish_reason, content in answers:
        assert finish_reason == "stop", content
        jsonschema.validate(json.loads(content), PERSON)


def test_default_model_json_object_parses(default_served: Served) -> None:
    chat = default_served.openai(timeout=REQUEST_TIMEOUT_S).chat.completions.create(
        model=default_served.model,
        messages=[
            {
                "role": "user",
                "content": "Give a JSON object with the keys city and country for Paris.",
            }
        ],
        max_tokens=100,
        response_format={"type": "json_object"},
    )

    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
        ("/v1/completions", {"prompt": "A fox:", "max_tokens": 4}),
        ("/v1/responses", {"input": "A fox:", "max_output_tokens": 4}),
    ],
)
def test_a_schema_is_serialized_in_the_tokenizer_thread(
    served: Served, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    """A schema past 64 KB is serialized (its size known) only in the tokenizer thread, never
    on the event loop, and refused with a 400."""
    import threading

    from otel_engine.entrypoints.openai import protocol

    threads: list[str] = []

    def recorded(response_format: Any) -> Any:
        threads.append(threading.current_thread().name)
        return from_response_format(response_format)

    from_response_format = protocol.from_response_format
    monkeypatch.setattr(protocol, "from_response_format", recorded)
    schema = {"type": "object", "description": "x" * (64 * 1024)}
    if path == "/v1/responses":
        body = body | {"text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}
    else:
        body = body | {"response_format": schema_format(schema)}
    response = served.http().post(path, json={"model": served.model} | body)

    assert 400 == response.status_code, response.text
    assert threads
    assert [] == [name for name in threads if not name.startswith("tokenizer")]
