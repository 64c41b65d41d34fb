"""Graceful shutdown: new requests get 503, in-flight ones finish or get 503 at the deadline."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from otel_engine import AsyncLLM, RequestOutput, SamplingParams
from otel_engine.entrypoints.api_server import make_server
from tests.entrypoints.conftest import Served, ServerLoop

pytestmark = pytest.mark.slow  # starts servers or engine processes

PROMPT = "Pack my box with five dozen liquor jugs."


@pytest.fixture
def slow_engine(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> AsyncLLM:
    """The real engine, with 20 ms between the outputs a client sees (to outlast a drain)."""
    original = engine.generate

    async def slowed(
        prompt: Any, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        outputs = original(prompt, params, request_id)
        try:
            async for output in outputs:
                await asyncio.sleep(0.02)
                yield output
        finally:
            await outputs.aclose()

    monkeypatch.setattr(engine, "generate", slowed)
    return engine


def _start(loop: ServerLoop, engine: AsyncLLM, drain_timeout: float) -> Served:
    server = make_server(engine, drain_timeout=drain_timeout)
    return Served(loop.start(server), engine, server)


def _stream_in_thread(served: Served, max_tokens: int) -> tuple[threading.Thread, list[Any]]:
    """Start one streaming request; wait for its first event; collect the rest in a thread."""
    events: list[Any] = []
    started = threading.Event()
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def run() -> None:
        with served.http() as client, client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    return thread, events


@pytest.fixture
def draining(server_loop: ServerLoop, slow_engine: AsyncLLM) -> Iterator[tuple[Served, Any]]:
    """A server told to shut down while one 100-token stream is in flight (30 s drain)."""
    served = _start(server_loop, slow_engine, drain_timeout=30)
    thread, events = _stream_in_thread(served, max_tokens=100)
    served.server.should_exit = True
    time.sleep(0.3)
    yield served, events
    thread.join(30)
    server_loop.wait(served.server)


def test_in_flight_stream_finishes_during_drain(
    draining: tuple[Served, Any], server_loop: ServerLoop
) -> None:
    """The stream in flight at shutdown runs to its end and gets [DONE]."""
    served, events = draining
    server_loop.wait(served.server)

    assert "data: [DONE]" == events[-1]
    assert "length" == events[-2]["choices"][0]["finish_reason"]


def test_new_request_during_drain_is_503(draining: tuple[Served, Any]) -> None:
    """A request that arrives while the server drains is refused with 503."""
    served, _ = draining
    with served.http() as client:
        response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        health = client.get("/health")

    assert 503 == response.status_code
    assert "shutting_down" == response.json()["error"]["code"]
    assert 503 == health.status_code


def test_stream_past_drain_deadline_gets_503_event(
    server_loop: ServerLoop, slow_engine: AsyncLLM
) -> None:
    """A stream still running at the drain deadline ends with a 503-type error event."""
    served = _start(server_loop, slow_engine, drain_timeout=0.5)
    thread, events = _stream_in_thread(served, max_tokens=400)
    started = time.monotonic()

    served.server.should_exit = True
    thread.join(30)
    server_loop.wait(served.server)

    assert "shutting_down" == events[-1]["error"]["code"]
    assert time.monotonic() - started < 5
    assert 0 == slow_engine.num_in_flight


def test_shutdown_with_nothing_in_flight_is_quick(
    server_loop: ServerLoop, engine: AsyncLLM
) -> None:
    """An idle server stops well within a second and refuses connections afterwards."""
    served = _start(server_loop, engine, drain_timeout=30)
    started = time.monotonic()

    server_loop.stop(served.server)

    assert time.monotonic() - started < 2
    with pytest.raises(httpx.ConnectError), served.http() as client:
        client.get("/health")
