"""Engine lifecycle edges: no file descriptors left per engine, no request to a dead core."""

from __future__ import annotations

import os
import time

import pytest

from otel_engine import LLM, EngineDeadError, SamplingParams

pytestmark = pytest.mark.slow  # starts servers or engine processes

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_engines_leave_no_file_descriptors_behind(tiny_model_dir: str) -> None:
    """Starting and shutting down multiprocess engines does not grow the fd table
    (pipes, pidfds and sockets of every child are closed)."""
    with LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64) as llm:
        llm.generate(["warm up"], PARAMS)
    before = _num_fds()
    for _ in range(2):
        with LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64) as llm:
            llm.generate(["hello"], PARAMS)
    deadline = time.monotonic() + 3.0  # background threads may still be closing sockets
    while _num_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert before == _num_fds()


def test_generate_after_the_engine_core_died_raises_at_once(tiny_model_dir: str) -> None:
    """Once the engine core process is gone, generate raises EngineDeadError instead of
    blocking on a socket nobody reads."""
    llm = LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64)
    try:
        core = llm._frontend.client.core
        core.kill()
        core.join(5.0)
        with pytest.raises(EngineDeadError):
            llm.generate(["first"], PARAMS)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(["second"], PARAMS)
        assert time.monotonic() - started < 2.0
    finally:
        llm.shutdown()


def test_a_request_that_cannot_be_sent_leaves_no_state(tiny_model_dir: str) -> None:
    """A request registered with the output processor but refused by the transport (the core
    is gone) is removed again: nothing stays in the front end."""
    llm = LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64)
    try:
        frontend = llm._frontend
        frontend.client.core.kill()
        deadline = time.monotonic() + 5
        while frontend.client.is_alive and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)

        with pytest.raises(EngineDeadError):
            frontend.add_request("lost", [1, 2, 3], PARAMS)

        assert {} == frontend.outputs.states
    finally:
        llm.shutdown()
