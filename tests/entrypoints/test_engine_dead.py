"""When the engine dies, every client gets a proper error and the server stops serving.

One engine with an injected worker fault (`OTEL_ENGINE_FAULT=worker:raise:step=40`) serves
two servers: one that stays up answering 503 and one that exits with code 1.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from tests.entrypoints.conftest import Served, ServerLoop

FAULT = "worker:raise:step=40"
PROMPT = "When a worker process dies, the engine core notices."


@dataclass
class Crash:
    """What the clients saw when the engine died under them."""

    loop: ServerLoop
    served: Served
    exiting: Served
    stream_events: list[Any]
    full_response: httpx.Response


async def _stream_then_full(base_url: str, model: str) -> tuple[list[Any], httpx.Response]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60, trust_env=False) as client:
        events: list[Any] = []
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.aiter_lines()
            first = await anext(lines)
            events.append(json.loads(first.removeprefix("data: ")))
            full = asyncio.create_task(client.post("/v1/completions", json=body))
            async for line in lines:
                if line:
                    events.append(
                        line if line == "data: [DONE]" else json.loads(line.removeprefix("data: "))
                    )
        return events, await full


@pytest.fixture(scope="module")
def crash(server_loop: ServerLoop, tiny_model_dir: str) -> Iterator[Crash]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_ENGINE_FAULT", FAULT)
        engine = AsyncLLM(model=tiny_model_dir)
    try:
        staying = make_server(engine, drain_timeout=5, exit_on_engine_death=False)
        exiting = make_server(engine, drain_timeout=5)
        served = Served(server_loop.start(staying), engine, staying)
        exiting_served = Served(server_loop.start(exiting), engine, exiting)
        events, full = asyncio.run(_stream_then_full(served.base_url, served.model))
        yield Crash(server_loop, served, exiting_served, events, full)
        server_loop.stop(staying)
    finally:
        engine.shutdown()


def test_stream_ends_with_error_event(crash: Crash) -> None:
    """The in-flight stream got tokens, then one error event, and no [DONE]."""
    last = crash.stream_events[-1]

    assert "data: [DONE]" not in crash.stream_events
    assert "internal_server_error" == last["error"]["type"]
    assert "choices" in crash.stream_events[0]


def test_in_flight_full_request_gets_500(crash: Crash) -> None:
    """The in-flight non-streaming request got a 500 internal_server_error body."""
    assert 500 == crash.full_response.status_code
    assert "internal_server_error" == crash.full_response.json()["error"]["type"]


def test_error_names_cause_without_traceback(crash: Crash) -> None:
    """The error message names the cause's class and carries no traceback."""
    message = crash.full_response.json()["error"]["message"]

    assert "InjectedFault" in message
    assert "Traceback" not in message


def test_health_is_503_after_death(crash: Crash) -> None:
    """GET /health answers 503 with an error body once the engine is dead."""
    with crash.served.http() as client:
        response = client.get("/health")

    assert 503 == response.status_code
    assert "engine_dead" == response.json()["error"]["code"]


def test_new_requests_are_503_after_death(crash: Crash) -> None:
    """A request that arrives after the death is refused with 503."""
    with crash.served.http() as client:
        response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})

    assert 503 == response.status_code
    assert "engine_dead" == response.json()["error"]["code"]


def test_metrics_show_engine_dead(crash: Crash) -> None:
    """The health state gauge reads `dead` (1) and no longer `healthy` (0)."""
    assert 1 == crash.served.metric("otel_engine_engine_health_state", state="dead")
    assert 0 == crash.served.metric("otel_engine_engine_health_state", state="healthy")


def test_server_exits_with_code_1(crash: Crash) -> None:
    """The default server stops by itself with exit code 1 once the engine is dead."""
    crash.loop.wait(crash.exiting.server, timeout=10)

    with pytest.raises(httpx.ConnectError), crash.exiting.http() as client:
        client.get("/health")

    assert 1 == crash.exiting.server.exit_code
