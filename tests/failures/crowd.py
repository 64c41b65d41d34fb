"""A crowd of HTTP clients in flight when the engine fails, half streaming and half not.

`run_crowd` sends every request at once, waits until each streaming client has its first
chunk, then calls `on_flowing` (which may inject a fault from outside), and returns what each
client saw and when (wall clock, so the times compare with the server's log timestamps).
Every client has its own deadline: a request that hangs is recorded as `hung`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPT = "When a worker process dies, the engine core notices within a second."
CLIENT_TIMEOUT_S = 30.0
# As long as the tiny model's context (512) allows after PROMPT (17 tokens): a starved test
# process must not see the requests complete before it injects the fault.
MAX_TOKENS = 480


@dataclass
class ClientResult:
    """What one client saw: its HTTP status, its SSE events or JSON body, and when it ended."""

    is_stream: bool
    status: int | None = None
    events: list[Any] = field(default_factory=list)
    body: Any = None
    ended_at: float | None = None  # time.time() when the error (or the end) arrived
    transport_error: str | None = None
    hung: bool = False

    @property
    def error(self) -> dict[str, Any] | None:
        """The OpenAI error object the client got, from the body or the last SSE event."""
        payload = self.events[-1] if self.is_stream and self.events else self.body
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            return payload["error"]
        return None

    @property
    def completed(self) -> bool:
        """The request ran to its end (a finish_reason arrived): the fault came too late."""
        if self.is_stream:
            return any(_finish_reason(event) is not None for event in self.events)
        return self.status == 200 and _finish_reason(self.body) is not None


def _finish_reason(payload: Any) -> str | None:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    return choices[0].get("finish_reason") if choices else None


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], first: asyncio.Event, result: ClientResult
) -> None:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        result.status = r.status_code
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            result.events.append(data if data == "[DONE]" else json.loads(data))
            first.set()
            if "error" in result.events[-1]:
                result.ended_at = time.time()
    result.ended_at = result.ended_at or time.time()


async def _full(client: httpx.AsyncClient, body: dict[str, Any], result: ClientResult) -> None:
    response = await client.post("/v1/completions", json=body)
    result.ended_at = time.time()
    result.status = response.status_code
    result.body = response.json()


async def _one(
    base_url: str, body: dict[str, Any], result: ClientResult, first: asyncio.Event
) -> None:
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, connect=5.0)
    try:
        async with (
            asyncio.timeout(CLIENT_TIMEOUT_S),
            httpx.AsyncClient(base_url=base_url, timeout=timeout, trust_env=False) as client,
        ):
            if result.is_stream:
                await _stream(client, body, first, result)
            else:
                await _full(client, body, result)
    except TimeoutError:
        result.hung = True
    except httpx.HTTPError as error:
        result.transport_error = f"{type(error).__name__}: {error}"
        result.ended_at = time.time()
    finally:
        first.set()


async def run_crowd(
    base_url: str,
    num_clients: int,
    *,
    max_tokens: int = MAX_TOKENS,
    on_flowing: Callable[[], None] | None = None,
    all_streams: bool = False,
) -> list[ClientResult]:
    """Start `num_clients` requests (even indices stream, or all with `all_streams`); return
    when every one has ended."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    results = [
        ClientResult(is_stream=all_streams or index % 2 == 0) for index in range(num_clients)
    ]
    firsts = [asyncio.Event() for _ in results]
    tasks = [
        asyncio.create_task(_one(base_url, body, result, first))
        for result, first in zip(results, firsts, strict=True)
    ]
    if on_flowing is not None:
        await asyncio.gather(
            *(f.wait() for f, r in zip(firsts, results, strict=True) if r.is_stream)
        )
        await asyncio.sleep(0.2)  # the non-streaming requests were sent with the streams
        on_flowing()
    await asyncio.gather(*tasks)
    return results


def assert_all_failed(results: list[ClientResult], cause: str) -> None:
    """Streams: 200, then an error event naming `cause`, no [DONE]; others: 500 naming it."""
    for index, result in enumerate(results):
        where = f"client {index} ({'stream' if result.is_stream else 'full'})"
        assert not result.completed, (
            f"{where} completed before the fault was injected: the test process was too slow "
            "(starved) to inject it while the requests ran; the fault hit an idle engine"
        )
        assert not result.hung, f"{where} hung"
        assert result.transport_error is None, f"{where}: {result.transport_error}"
        error = result.error
        assert error is not None, f"{where} got no error: status {result.status}, {result.body}"
        assert "internal_server_error" == error["type"], f"{where}: {error}"
        assert "engine_dead" == error["code"], f"{where}: {error}"
        assert cause in error["message"], f"{where}: {error}"
        assert "Traceback" not in error["message"]
        if result.is_stream:
            assert 200 == result.status
            assert "[DONE]" not in result.events
            assert "choices" in result.events[0], f"{where} streamed no token first"
        else:
            assert 500 == result.status, f"{where}: {result.status}"
