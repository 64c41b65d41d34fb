"""Greedy output equals transformers' token for token, on every engine shape: in-process,
engine-core process, tensor-parallel workers, and AsyncLLM with concurrent requests.

Nine prompts of 3 to 120 tokens run together on a cache of 40 blocks of 4 tokens (one
request fits, the batch does not) with a 24-token step budget, so every run prefills in
chunks and preempts; each test proves both happened before comparing tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from otel_engine import LLM, AsyncLLM, RequestOutput, SamplingParams
from otel_engine.engine.core_client import InprocClient
from otel_engine.ipc.messages import StepOutputs
from otel_engine.model.fast_paths import Form
from otel_engine.sched.scheduler import Scheduler, SchedulerOutput
from tests.helpers.tiny_model import hf_greedy

pytestmark = pytest.mark.slow  # starts servers or engine processes

MAX_TOKENS = 12
BUDGET = 24
SMALL_CACHE: dict[str, Any] = {
    "block_size": 4,
    "num_kv_blocks": 40,
    "max_num_batched_tokens": BUDGET,
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str, tiny_prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, tiny_prompts, MAX_TOKENS)


def test_setup_forces_chunking_and_preemption(tiny_prompts: list[list[int]]) -> None:
    """The longest request fits the cache alone, the whole batch does not, and prompts are
    longer than the step budget."""
    capacity = SMALL_CACHE["block_size"] * SMALL_CACHE["num_kv_blocks"]
    lengths = [len(p) + MAX_TOKENS for p in tiny_prompts]

    assert len(tiny_prompts) >= 8
    assert max(lengths) <= capacity < sum(lengths)
    assert max(len(p) for p in tiny_prompts) > BUDGET


def inprocess_scheduler(llm: LLM) -> Scheduler:
    """The scheduler of an engine core that runs in this process."""
    client = llm._frontend.client
    assert isinstance(client, InprocClient)
    return client.core.scheduler


def record_schedules(
    scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> list[SchedulerOutput]:
    """Keep every batch the (in-process) scheduler produces."""
    batches: list[SchedulerOutput] = []
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        batches.append(schedule())
        return batches[-1]

    monkeypatch.setattr(scheduler, "schedule", recording)
    return batches


def record_steps(engine: LLM | AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> list[StepOutputs]:
    """Keep every StepOutputs frame the front end receives from the engine core."""
    steps: list[StepOutputs] = []
    outputs = engine._frontend.outputs
    process: Callable[[StepOutputs], Any] = outputs.process

    def recording(step: StepOutputs) -> Any:
        steps.append(step)
        return process(step)

    monkeypatch.setattr(outputs, "process", recording)
    return steps


def assert_chunked_and_preempted(batches: list[SchedulerOutput]) -> None:
    continued = [c for b in batches for c in b.chunks if c.start > 0 and c.num_tokens > 1]
    assert continued, "no prompt was prefilled in more than one chunk"
    assert any(b.preempted_request_ids for b in batches), "no request was preempted"
    assert all(b.num_batched_tokens <= BUDGET for b in batches)


def assert_steps_chunked_and_preempted(steps: list[StepOutputs], prompts: list[list[int]]) -> None:
    """From the frames alone: the budget held in every step (so prompts longer than it were
    chunked) and some request reports a preemption."""
    assert all(0 < s.num_scheduled_tokens <= BUDGET for s in steps if s.step_id > 0)
    assert max(len(p) for p in prompts) > BUDGET
    assert any(u.num_preemptions > 0 for s in steps for u in s.updates), "no request was preempted"


def outputs_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_inprocess_matches_transformers(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    kernels: str,
) -> None:
    """LLM with the engine core in this process (TP=1), on the compiled CPU kernels with
    prepacked weights and on plain torch ops."""
    with LLM(tiny_model_dir, kernels=kernels, **SMALL_CACHE) as llm:
        client = llm._frontend.client
        assert isinstance(client, InprocClient)
        model = client.core.executor.runner.model  # type: ignore[union-attr]
        assert (kernels == "auto") == (Form.PACKED is model.lm_head.form)
        scheduler = inprocess_scheduler(llm)
        batches = record_schedules(scheduler, monkeypatch)

        outputs = llm.generate(tiny_prompts, GREEDY)

        assert_chunked_and_preempted(batches)
        assert scheduler.num_preemptions > 0
    assert reference == outputs_ids(outputs)


def test_multiprocess_matches_transformers(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LLM with the engine core in its own process (TP=1)."""
    with LLM(tiny_model_dir, multiprocess=True, **SMALL_CACHE) as llm:
        steps = record_steps(llm, monkeypatch)

        outputs = llm.generate(tiny_prompts, GREEDY)

    assert_steps_chunked_and_preempted(steps, tiny_prompts)
    assert reference == outputs_ids(outputs)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_tensor_parallel_matches_transformers(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    kernels: str,
) -> None:
    """LLM in-process with two tensor-parallel worker processes, on both kernel paths."""
    with LLM(tiny_model_dir, tensor_parallel_size=2, kernels=kernels, **SMALL_CACHE) as llm:
        scheduler = inprocess_scheduler(llm)
        batches = record_schedules(scheduler, monkeypatch)

        outputs = llm.generate(tiny_prompts, GREEDY)

        assert_chunked_and_preempted(batches)
    assert reference == outputs_ids(outputs)


async def _generate_all(engine: AsyncLLM, prompts: list[list[int]]) -> list[RequestOutput]:
    async def one(index: int, prompt: list[int]) -> RequestOutput:
        last = None
        async for output in engine.generate(prompt, GREEDY, f"parity-{index}"):
            last = output
        assert last is not None
        assert last.finished
        return last

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_async_tensor_parallel_matches_transformers(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AsyncLLM (engine core process, two workers) with all prompts in flight at once."""
    engine = AsyncLLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_CACHE)
    try:
        steps = record_steps(engine, monkeypatch)

        outputs = asyncio.run(_generate_all(engine, tiny_prompts))
    finally:
        engine.shutdown()

    assert_steps_chunked_and_preempted(steps, tiny_prompts)
    assert reference == outputs_ids(outputs)
