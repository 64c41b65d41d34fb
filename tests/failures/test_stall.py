"""A frozen engine core (SIGSTOP: its own step watchdog cannot fire either) is given up by
AsyncLLM's stall watchdog: in-flight requests fail with EngineStalled and the core is killed.
Before that, the server reports the stall: /health 503 `engine_stalled`, health gauge
`stalled`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil
import pytest

from otel_engine import AsyncLLM, EngineDeadError, SamplingParams
from tests.failures.conftest import ProcessWatch, wait_exit
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts servers or engine processes

STEP_TIMEOUT_S = 2.0
STALL_GRACE_S = 5.0  # AsyncLLM waits this long past --step-timeout before giving up
# Seconds of decoding on the long-context tiny model: the core is frozen mid-stream even when
# this test process is starved for a while after the first token.
MAX_TOKENS = 4000


def test_frozen_engine_core_is_given_up_after_the_step_timeout(
    long_context_model_dir: str,
) -> None:
    """SIGSTOP the core mid-stream: the stream ends with EngineDeadError(EngineStalled)
    within --step-timeout plus the grace, and the core process is gone."""
    engine = AsyncLLM(long_context_model_dir, num_kv_blocks=256, step_timeout=STEP_TIMEOUT_S)
    core = psutil.Process(engine._client.core.pid)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def stream_until_error() -> tuple[float, EngineDeadError]:
        outputs = engine.generate("hello world", params, "stalled-1")
        await outputs.__anext__()
        os.kill(core.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            async for _ in outputs:
                pass
        return time.monotonic() - frozen_at, info.value

    try:
        elapsed, error = asyncio.run(asyncio.wait_for(stream_until_error(), 60))
        assert "EngineStalled" == error.cause_type
        assert elapsed < STEP_TIMEOUT_S + STALL_GRACE_S + 5.0
        core.wait(timeout=10)
        assert not core.is_running()
    finally:
        if core.is_running():
            core.kill()
        engine.shutdown()


def test_a_frozen_core_shows_as_stalled_then_dead_on_the_server(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
    long_context_model_dir: str,
) -> None:
    """SIGSTOP the engine core under a stream: past --step-timeout, /health answers 503
    `engine_stalled` and the health gauge says `stalled`; then the engine is given up, the
    stream ends with an `engine_dead` error event naming EngineStalled, and the server exits 1."""
    server, watch = start_server(
        "--step-timeout", str(STEP_TIMEOUT_S), model_dir=long_context_model_dir
    )
    core = watch.find("otel-engine-core")
    events: list[dict[str, Any]] = []
    flowing = threading.Event()

    def stream() -> None:
        body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))
                    flowing.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert flowing.wait(30), server.tail()
    os.kill(core.pid, signal.SIGSTOP)
    try:
        with httpx.Client(base_url=server.base_url, timeout=10, trust_env=False) as client:
            health = _poll_health(client, deadline_s=STEP_TIMEOUT_S + STALL_GRACE_S)
            metrics = client.get("/metrics").text
    finally:
        reader.join(STEP_TIMEOUT_S + STALL_GRACE_S + 30)

    assert health.json()["error"]["code"] == "engine_stalled", health.text
    assert any(
        line.startswith("otel_engine_engine_health_state{")
        and 'state="stalled"' in line
        and line.endswith(" 1.0")
        for line in metrics.splitlines()
    ), metrics
    error = events[-1].get("error")
    assert error is not None, events[-3:]
    assert error["code"] == "engine_dead"
    assert "EngineStalled" in error["message"]
    assert wait_exit(server, timeout=30) == 1
    watch.assert_all_gone(5.0)


def _poll_health(client: httpx.Client, deadline_s: float) -> httpx.Response:
    """The first 503 from /health within `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while True:
        response = client.get("/health")
        if response.status_code == 503 or time.monotonic() > deadline:
            return response
        time.sleep(0.1)
