"""A frozen engine core (SIGSTOP: its own step watchdog cannot fire either) is given up by
AsyncLLM's stall watchdog: in-flight requests fail with EngineStalled and the core is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from otel_engine import AsyncLLM, EngineDeadError, SamplingParams

STEP_TIMEOUT_S = 2.0
STALL_GRACE_S = 5.0  # AsyncLLM waits this long past --step-timeout before giving up


def test_frozen_engine_core_is_given_up_after_the_step_timeout(tiny_model_dir: str) -> None:
    """SIGSTOP the core mid-stream: the stream ends with EngineDeadError(EngineStalled)
    within --step-timeout plus the grace, and the core process is gone."""
    engine = AsyncLLM(tiny_model_dir, num_kv_blocks=128, step_timeout=STEP_TIMEOUT_S)
    core = psutil.Process(engine._client.core.pid)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

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
