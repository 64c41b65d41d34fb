"""Failures under the Python API: `AsyncLLM`, `LLM(multiprocess=True)` and `LLM` in-process.

Each row injects one worker fault (`OTEL_ENGINE_FAULT`, on the last rank) either while the
engine loads (the constructor must raise `EngineStartupError`) or at a step while four
requests are in flight (every one must get `EngineDeadError`), and then checks that every
process the engine started is gone within seconds, without calling `shutdown()`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from otel_engine import LLM, AsyncLLM, EngineDeadError, EngineStartupError, SamplingParams
from tests.failures.conftest import ProcessWatch
from tests.helpers.paths import REPO_ROOT

pytestmark = pytest.mark.slow  # starts servers or engine processes

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
PARAMS = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
# Late enough that every request has had a step of its own before the fault, even when the
# four arrive over two or three steps (a step of the tiny model takes about a millisecond).
FAULT_STEP = 8
RAISE_LIMIT_S = 30.0
STARTUP_LIMIT_S = 10.0  # "within seconds", with slack for TP=2 start-up on 2 shared cores

ROWS = [
    pytest.param("async", 1, id="AsyncLLM-tp1"),
    pytest.param("async", 2, id="AsyncLLM-tp2"),
    pytest.param("llm_mp", 1, id="LLM-multiprocess-tp1"),
    pytest.param("llm_mp", 2, id="LLM-multiprocess-tp2"),
    pytest.param("llm_inproc", 1, id="LLM-inprocess-tp1"),
    pytest.param("llm_inproc", 2, id="LLM-inprocess-tp2"),
]


def _start(api: str, model_dir: str, tp: int) -> Any:
    options: dict[str, Any] = {"tensor_parallel_size": tp, "num_kv_blocks": 128}
    if api == "async":
        return AsyncLLM(model_dir, **options)
    return LLM(model_dir, multiprocess=api == "llm_mp", **options)


async def _consume(
    engine: AsyncLLM, prompt: list[int], request_id: str, is_stream: bool
) -> tuple[int, BaseException | None]:
    """Read one request to its end: every output (streaming) or only the last."""
    num_outputs = 0
    try:
        async for output in engine.generate(prompt, PARAMS, request_id):
            num_outputs += 1 if is_stream or output.finished else 0
    except Exception as error:
        return num_outputs, error
    return num_outputs, None


async def _crowd(engine: AsyncLLM) -> list[tuple[int, BaseException | None]]:
    requests = [
        _consume(engine, prompt, f"req-{index}", is_stream=index % 2 == 0)
        for index, prompt in enumerate(PROMPTS)
    ]
    async with asyncio.timeout(RAISE_LIMIT_S):
        return await asyncio.gather(*requests)


def _dead_process(tp: int) -> set[str]:
    """Where a worker fault on the last rank is reported: the rank, or the core at TP=1."""
    return {f"otel-worker-{tp - 1}"} if tp > 1 else {"engine_core", "otel-worker-0"}


@pytest.mark.parametrize(("api", "tp"), ROWS)
def test_startup_failure_raises_and_reaps(
    api: str, tp: int, tiny_model_dir: str, children: ProcessWatch, fault: Callable[[str], None]
) -> None:
    """A worker raising while it loads: the constructor raises EngineStartupError naming the
    cause and the failing rank, within seconds, and leaves no process behind."""
    fault(f"worker:raise:phase=load:rank={tp - 1}")
    started = time.monotonic()

    with pytest.raises(EngineStartupError) as info:
        _start(api, tiny_model_dir, tp)

    elapsed = time.monotonic() - started
    print(f"startup failure raised after {elapsed:.2f} s")
    assert "InjectedFault" == info.value.cause_type
    assert "InjectedFault" in str(info.value)
    if tp > 1:
        assert f"otel-worker-{tp - 1}" == info.value.failed_process
    assert "Traceback" in info.value.traceback
    children.assert_all_gone()
    assert elapsed < STARTUP_LIMIT_S


@pytest.mark.parametrize(("api", "tp"), ROWS)
def test_runtime_failure_fails_every_request_and_reaps(
    api: str, tp: int, tiny_model_dir: str, children: ProcessWatch, fault: Callable[[str], None]
) -> None:
    """A worker raising at step 8 with four requests in flight: every request gets
    EngineDeadError naming the cause, and every process is gone without shutdown()."""
    fault(f"worker:raise:rank={tp - 1}:step={FAULT_STEP}")
    engine = _start(api, tiny_model_dir, tp)
    try:
        if tp > 1:
            children.sample()
            assert {f"otel-worker-{r}" for r in range(tp)} <= children.titles()
        if api == "async":
            results = asyncio.run(_crowd(engine))
            errors = [error for _, error in results]
            assert all(n >= 1 for n, _ in results[::2]), "streams saw no output before the fault"
        else:
            with pytest.raises(EngineDeadError) as info:
                engine.generate(PROMPTS, PARAMS)
            errors = [info.value]
        for error in errors:
            assert isinstance(error, EngineDeadError), repr(error)
            assert "InjectedFault" == error.cause_type
            assert error.failed_process in _dead_process(tp)
            assert "InjectedFault" in str(error)
        children.assert_all_gone()
    finally:
        engine.shutdown()


def test_async_llm_in_a_non_main_thread_gets_engine_dead(
    tiny_model_dir: str, children: ProcessWatch, fault: Callable[[str], None]
) -> None:
    """AsyncLLM created and driven in its own thread's event loop: a worker fault reaches
    every request there as EngineDeadError (no signal handler involved)."""
    fault(f"worker:raise:step={FAULT_STEP}")
    outcome: dict[str, Any] = {}

    def host() -> None:
        try:
            engine = AsyncLLM(tiny_model_dir, num_kv_blocks=128)
            try:
                outcome["results"] = asyncio.run(_crowd(engine))
            finally:
                engine.shutdown()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=host, name="embedded-host")
    thread.start()
    thread.join(60)

    assert not thread.is_alive(), "the embedded engine hung"
    assert "error" not in outcome, repr(outcome.get("error"))
    for _, error in outcome["results"]:
        assert isinstance(error, EngineDeadError), repr(error)
        assert "InjectedFault" == error.cause_type
    children.assert_all_gone()


def test_inprocess_hang_ends_with_step_timeout(
    tiny_model_dir: str, fault: Callable[[str], None]
) -> None:
    """In-process LLM (TP=1, no engine-core process): a step that hangs ends, like the
    server, with EngineDeadError StepTimeout after --step-timeout (not a wait forever)."""
    fault("worker:hang:step=2")
    engine = LLM(tiny_model_dir, step_timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            engine.generate(PROMPTS, PARAMS)
        elapsed = time.monotonic() - started
    finally:
        engine.shutdown()

    assert "StepTimeout" == info.value.cause_type
    assert "engine_core" == info.value.failed_process
    assert 1.0 <= elapsed < 5.0


# An in-process LLM whose own process dies of the fault: nothing can report it but stderr.
SEGFAULT_DRIVER = """
import sys
from otel_engine import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=64)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True))
print("not reached")
"""


def test_inprocess_segfault_writes_the_signal_and_stack_to_stderr(tiny_model_dir: str) -> None:
    """In-process LLM (TP=1, the model in the caller's process): a SIGSEGV in native code
    kills the interpreter, but first faulthandler writes the fault and the faulting stack,
    down to the frame that made it, to stderr."""
    env = {**os.environ, "OTEL_ENGINE_FAULT": f"worker:segfault:step={FAULT_STEP}"}
    done = subprocess.run(
        [sys.executable, "-c", SEGFAULT_DRIVER, tiny_model_dir],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert -11 == done.returncode, done.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert 'observability/faults.py", line ' in done.stderr
    assert " in maybe_inject" in done.stderr
    assert "not reached" not in done.stdout


def test_inprocess_worker_segfault_is_engine_dead_naming_signal_and_frame(
    tiny_model_dir: str, children: ProcessWatch, fault: Callable[[str], None]
) -> None:
    """In-process LLM at TP=2: rank 1 dying of SIGSEGV is EngineDeadError WorkerDied in
    otel-worker-1, located at the faulting frame; every process is gone."""
    fault(f"worker:segfault:rank=1:step={FAULT_STEP}")
    engine = LLM(tiny_model_dir, tensor_parallel_size=2, num_kv_blocks=128)
    try:
        with pytest.raises(EngineDeadError) as info:
            engine.generate(PROMPTS, PARAMS)
        children.assert_all_gone()
    finally:
        engine.shutdown()

    error = info.value
    assert ("WorkerDied", "otel-worker-1") == (error.cause_type, error.failed_process)
    assert error.location.startswith(
        "died of SIGSEGV in maybe_inject at otel_engine/observability/faults.py:"
    )
