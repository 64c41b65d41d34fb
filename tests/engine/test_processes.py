"""Process lifecycle of the Python API: every way an engine ends (shutdown, context exit,
garbage collection, a startup error, a worker fault) leaves no child process behind.

Children are found with psutil (recursive children of this test process that appeared
after the baseline) and only those are ever waited on.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from otel_engine import LLM, AsyncLLM, EngineDeadError, EngineStartupError, SamplingParams
from otel_engine.model.loader import prepare_model_dir
from tests.helpers.procs import assert_no_children

pytestmark = pytest.mark.slow  # starts servers or engine processes

Children = Callable[[], list[psutil.Process]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SHUTDOWN_LIMIT_S = 10.0


def _children() -> list[psutil.Process]:
    """Living descendants of this process, except multiprocessing's resource tracker."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def _names(processes: list[psutil.Process]) -> set[str]:
    names = set()
    for process in processes:
        try:
            names.add(process.name())
        except psutil.Error:
            continue
    return names


@pytest.fixture
def new_children() -> Iterator[Children]:
    """A function returning the children that appeared since the test began."""
    baseline = {p.pid for p in _children()}
    seen: dict[int, psutil.Process] = {}

    def current() -> list[psutil.Process]:
        fresh = [p for p in _children() if p.pid not in baseline]
        for process in fresh:
            seen.setdefault(process.pid, process)
        return fresh

    yield current
    assert_no_children(list(seen.values()), timeout=10.0)


def _timed_shutdown(shutdown: Callable[[], None]) -> float:
    started = time.monotonic()
    shutdown()
    return time.monotonic() - started


def test_multiprocess_llm_shutdown_reaps_the_engine_core(
    tiny_model_dir: str, new_children: Children
) -> None:
    """LLM(multiprocess=True).shutdown() ends otel-engine-core promptly."""
    llm = LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64)
    llm.generate([[5, 6, 7]], GREEDY)
    children = new_children()
    assert "otel-engine-core" in _names(children)

    elapsed = _timed_shutdown(llm.shutdown)

    assert elapsed < SHUTDOWN_LIMIT_S
    assert_no_children(children, timeout=5.0)


def test_tensor_parallel_llm_shutdown_reaps_the_workers(
    tiny_model_dir: str, new_children: Children
) -> None:
    """LLM(tensor_parallel_size=2).shutdown() ends both worker processes promptly."""
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, num_kv_blocks=64)
    llm.generate([[5, 6, 7]], GREEDY)
    children = new_children()
    assert {"otel-worker-0", "otel-worker-1"} <= _names(children)

    elapsed = _timed_shutdown(llm.shutdown)

    assert elapsed < SHUTDOWN_LIMIT_S
    assert_no_children(children, timeout=5.0)


def test_async_llm_shutdown_reaps_every_process(
    tiny_model_dir: str, new_children: Children
) -> None:
    """AsyncLLM at TP=2 (engine core and two workers) leaves nothing after shutdown()."""
    engine = AsyncLLM(tiny_model_dir, tensor_parallel_size=2, num_kv_blocks=64)

    async def one() -> None:
        async for _ in engine.generate([5, 6, 7], GREEDY, "only"):
            pass

    asyncio.run(one())
    children = new_children()
    assert {"otel-engine-core", "otel-worker-0", "otel-worker-1"} <= _names(children)

    elapsed = _timed_shutdown(engine.shutdown)

    assert elapsed < SHUTDOWN_LIMIT_S
    assert_no_children(children, timeout=5.0)


def test_context_manager_exit_reaps_children(tiny_model_dir: str, new_children: Children) -> None:
    """Leaving `with LLM(...)` shuts the engine down, even when the block raises."""
    children: list[psutil.Process] = []

    def use_and_fail() -> None:
        with LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64) as llm:
            llm.generate([[5, 6, 7]], GREEDY)
            children.extend(new_children())
            raise KeyError("leave the block with an error")

    with pytest.raises(KeyError):
        use_and_fail()

    assert children
    assert_no_children(children, timeout=5.0)


def test_garbage_collected_llm_reaps_children(tiny_model_dir: str, new_children: Children) -> None:
    """An LLM dropped without shutdown() stops its processes when it is collected."""
    llm = LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64)
    llm.generate([[5, 6, 7]], GREEDY)
    children = new_children()
    assert children

    del llm
    gc.collect()

    assert_no_children(children, timeout=SHUTDOWN_LIMIT_S)


def test_indivisible_tensor_parallel_size_fails_in_process(
    tiny_model_dir: str, new_children: Children
) -> None:
    """TP=3 with 4 query / 2 key-value heads: a startup error naming the flag and heads."""
    with pytest.raises(EngineStartupError, match="tensor-parallel-size 3") as info:
        LLM(tiny_model_dir, tensor_parallel_size=3)

    assert "4 attention heads" in str(info.value)
    assert "2 key/value heads" in str(info.value)
    assert [] == new_children()


def test_indivisible_tensor_parallel_size_fails_in_engine_process(
    tiny_model_dir: str, new_children: Children
) -> None:
    """The same check in the engine core process is a startup error with the same reason."""
    with pytest.raises(EngineStartupError, match="tensor-parallel-size 3") as info:
        LLM(tiny_model_dir, tensor_parallel_size=3, multiprocess=True)

    assert "4 attention heads" in str(info.value)
    assert_no_children(new_children(), timeout=5.0)


def test_default_model_at_tp2_fails_fast(new_children: Children) -> None:
    """SmolLM2 (9 query / 3 key-value heads) at TP=2 fails within seconds, before any worker
    starts (the one-time GGUF conversion is done first, outside the timing)."""
    prepare_model_dir(None)
    started = time.monotonic()

    with pytest.raises(EngineStartupError, match="tensor-parallel-size 2") as info:
        LLM(tensor_parallel_size=2)

    assert time.monotonic() - started < 10.0
    assert "9 attention heads" in str(info.value)
    assert "3 key/value heads" in str(info.value)
    assert [] == new_children()


def test_worker_fault_raises_engine_dead_and_reaps(
    tiny_model_dir: str, new_children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_ENGINE_FAULT=worker:raise:step=2 in the engine core process: generate raises
    EngineDeadError naming the cause type, and the engine core is gone."""
    monkeypatch.setenv("OTEL_ENGINE_FAULT", "worker:raise:step=2")
    llm = LLM(tiny_model_dir, multiprocess=True, num_kv_blocks=64)
    children = new_children()
    assert children

    with pytest.raises(EngineDeadError) as info:
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, temperature=0.0))

    assert "InjectedFault" == info.value.cause_type
    assert "InjectedFault" in str(info.value)
    assert_no_children(children, timeout=5.0)


def test_engine_core_at_tp2_does_not_load_torch(tiny_model_dir: str) -> None:
    """At TP > 1 the engine core runs no model: it schedules and talks to the workers without
    loading torch (measured: 41 MiB of RSS instead of 233)."""
    import psutil

    from otel_engine import LLM, SamplingParams

    with LLM(tiny_model_dir, multiprocess=True, tensor_parallel_size=2, num_kv_blocks=64) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        core = psutil.Process(llm._frontend.client.core.pid)  # type: ignore[union-attr]
        libraries = {m.path for m in core.memory_maps()}

    assert not [path for path in libraries if "libtorch" in path]
