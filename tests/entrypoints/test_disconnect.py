"""A client that goes away mid-request gets its request aborted in the engine."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from otel_engine import RequestOutput, SamplingParams
from tests.entrypoints.conftest import Served

PROMPT = "Once upon a time there was a small town by the sea."


@pytest.fixture
def outcomes(served: Served, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """request_id -> 'finished' or 'closed early', recorded around the real engine.generate."""
    recorded: dict[str, str] = {}
    original = served.engine.generate

    async def spy(
        prompt: Any, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        outputs = original(prompt, params, request_id)
        try:
            async for output in outputs:
                if output.finished:
                    recorded[request_id] = "finished"
                yield output
        finally:
            recorded.setdefault(request_id, "closed early")
            await outputs.aclose()

    monkeypatch.setattr(served.engine, "generate", spy)
    return recorded


def _long_body(served: Served, stream: bool) -> dict[str, Any]:
    num_prompt = len(served.engine.encode(PROMPT))
    return {
        "model": served.model,
        "prompt": PROMPT,
        "stream": stream,
        "ignore_eos": True,
        "max_tokens": served.engine.max_model_len - num_prompt,
    }


def _wait_idle(served: Served, outcomes: dict[str, str], timeout: float = 5.0) -> None:
    """Until the engine has nothing in flight and the request's stream has been closed (the
    engine forgets the request a moment before the server's generator finishes closing)."""
    deadline = time.monotonic() + timeout
    while (served.engine.num_in_flight or not outcomes) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_disconnect_mid_stream_aborts_request(served: Served, outcomes: dict[str, str]) -> None:
    """Closing the connection after the first chunk closes the engine stream early; the
    request counts as an error of type `aborted`."""
    before = served.metric("otel_engine_request_errors_total", error_type="aborted")
    with (
        served.http() as client,
        client.stream("POST", "/v1/completions", json=_long_body(served, stream=True)) as response,
    ):
        next(response.iter_lines())

    _wait_idle(served, outcomes)

    assert ["closed early"] == list(outcomes.values())
    assert 0 == served.engine.num_in_flight
    assert before + 1 == served.metric("otel_engine_request_errors_total", error_type="aborted")


def test_disconnect_while_waiting_for_full_response_aborts(
    served: Served, outcomes: dict[str, str]
) -> None:
    """A non-streaming client that hangs up is noticed before its completion is ready."""
    import json

    host, port = served.base_url.removeprefix("http://").split(":")
    body = json.dumps(_long_body(served, stream=False)).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        deadline = time.monotonic() + 5
        while not served.engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.005)

    _wait_idle(served, outcomes)

    assert ["closed early"] == list(outcomes.values())
    assert 0 == served.engine.num_in_flight


def test_server_serves_after_disconnects(served: Served) -> None:
    """After clients hung up, a new request completes normally."""
    result = served.openai().completions.create(
        model=served.model, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
    )

    assert 3 == result.usage.completion_tokens
