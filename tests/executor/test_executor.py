"""The multiprocess executor's protocol with its workers."""

from __future__ import annotations

import threading

import psutil
import pytest
import zmq

from otel_engine import LLM, EngineDeadError, SamplingParams
from otel_engine.engine.core_client import InprocClient
from otel_engine.executor.executor import MultiprocExecutor
from otel_engine.ipc.codec import Codec
from otel_engine.ipc.messages import ModelOutput, WorkerResponse

REBUILDS = 6
REBUILD_RSS_GROWTH_MIB = 8.0  # measured: +0.5 MiB over 20 rebuilds, from the allocator


def test_a_result_for_another_step_is_a_typed_failure_naming_both_steps(
    tiny_model_dir: str,
) -> None:
    """A worker result for a step the core is not waiting for (a protocol desync) fails
    the engine at once with StepMismatch naming both step ids, instead of being dropped
    while the core waits for a result that never comes."""
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        client = llm._frontend.client
        assert isinstance(client, InprocClient)
        executor = client.core.executor
        assert isinstance(executor, MultiprocExecutor)
        context = zmq.Context()
        stray = context.socket(zmq.PUSH)
        stray.connect(client.ipc_dir.address("worker-out"))
        stray.send(Codec(WorkerResponse).encode(ModelOutput(step_id=999, sampled_token_ids=[1])))
        stray.close(linger=2000)
        context.term()

        with pytest.raises(EngineDeadError) as excinfo:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()

    assert "StepMismatch" == excinfo.value.cause_type
    assert "step 999" in excinfo.value.message
    assert "waiting for step 1" in excinfo.value.message


def test_an_engine_torn_down_and_started_again_leaks_nothing(tiny_model_dir: str) -> None:
    """Tensor parallel in this process (its executor's sockets, monitor thread and worker
    sentinels here), started, used and shut down again and again: the fds and threads of this
    process after the last shutdown are those after the first, its memory about the same."""
    process = psutil.Process()

    def cycle() -> tuple[int, int, float]:
        llm = LLM(tiny_model_dir, tensor_parallel_size=2, num_kv_blocks=64)
        try:
            client = llm._frontend.client
            assert isinstance(client, InprocClient)
            assert isinstance(client.core.executor, MultiprocExecutor)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        finally:
            llm.shutdown()
        return process.num_fds(), threading.active_count(), process.memory_info().rss / 2**20

    cycle()  # the first start imports and caches what every later one reuses
    fds, threads, rss = cycle()
    for _ in range(REBUILDS):
        last = cycle()
    assert (fds, threads) == last[:2]
    assert last[2] - rss < REBUILD_RSS_GROWTH_MIB, f"{rss:.1f} -> {last[2]:.1f} MiB"
