"""`AsyncLLM` streaming: deltas that add up, stop strings never streamed in part, concurrent
requests, early close aborting the request in the engine, and request errors."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, cast

import psutil
import pytest

from otel_engine import LLM, AsyncLLM, EngineDeadError, RequestError, RequestOutput, SamplingParams
from otel_engine.config import EngineConfig
from otel_engine.ipc.messages import StepOutputs
from otel_engine.ipc.process import ENGINE_CORE, process_title
from tests.helpers.tiny_model import hf_greedy

pytestmark = pytest.mark.slow  # starts engine core processes


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: an AsyncLLM is bound to the loop of its first request."""
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: str) -> Iterator[AsyncLLM]:
    with AsyncLLM(tiny_model_dir, num_kv_blocks=512) as async_llm:
        yield async_llm


@pytest.fixture
def run(loop: asyncio.AbstractEventLoop) -> Callable[[Any], Any]:
    def run_until_complete(coro: Any) -> Any:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout=60))

    return run_until_complete


def greedy(max_tokens: int = 16, **params: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)


async def collect(
    engine: AsyncLLM, prompt: list[int] | str, params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    return [output async for output in engine.generate(prompt, params, request_id)]


def test_stream_deltas_add_up_to_the_final_output(
    engine: AsyncLLM, run: Callable[[Any], Any], tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> None:
    """One output per token; delta texts and delta ids concatenate to the final text and ids,
    which are transformers' greedy tokens; only the last output is finished."""
    prompt = tiny_prompts[3]

    outputs = run(collect(engine, prompt, greedy(10), "stream-1"))

    final = outputs[-1].outputs[0]
    assert hf_greedy(tiny_model_dir, [prompt], 10)[0] == final.token_ids
    assert 10 == len(outputs)
    assert [False] * 9 + [True] == [o.finished for o in outputs]
    assert final.text == "".join(o.outputs[0].delta_text for o in outputs)
    assert final.token_ids == [t for o in outputs for t in o.outputs[0].delta_token_ids]


def _boundary_stop(outputs: list[RequestOutput]) -> tuple[str, int, int]:
    """A stop string made of the last two characters of one token's text and the first two
    of the next token's: returns (stop, its index in the final text, the output that ends
    with the stop's first half)."""
    texts = [o.outputs[0].text for o in outputs]
    final = texts[-1]
    for k in range(1, len(texts) - 1):
        before, this, after = texts[k - 1], texts[k], texts[k + 1]
        if len(this) - len(before) < 2 or len(after) - len(this) < 2:
            continue
        stop = this[-2:] + after[len(this) : len(this) + 2]
        if "\ufffd" not in stop and stop.strip() and final.find(stop) == len(this) - 2:
            return stop, len(this) - 2, k
    raise AssertionError("no token boundary usable for a stop string")


def test_stream_never_shows_a_partial_stop_string(
    engine: AsyncLLM, run: Callable[[Any], Any], tiny_prompts: list[list[int]]
) -> None:
    """With a stop string spanning two tokens: the text stops before it, finish reason is
    "stop", the first half was held back when it arrived, and every streamed prefix is a
    prefix of the final text (so no delta ever held part of the stop string)."""
    prompt = tiny_prompts[5]
    plain = run(collect(engine, prompt, greedy(24), "stop-plain"))
    stop, index, held_at = _boundary_stop(plain)

    outputs = run(collect(engine, prompt, greedy(24, stop=(stop,)), "stop-1"))

    final = outputs[-1].outputs[0]
    assert plain[-1].outputs[0].text[:index] == final.text
    assert ("stop", stop) == (final.finish_reason, final.stop_reason)
    assert final.text == "".join(o.outputs[0].delta_text for o in outputs)
    assert all(final.text.startswith(o.outputs[0].text) for o in outputs)
    assert plain[held_at].outputs[0].text[:-2] == outputs[held_at].outputs[0].text


def test_concurrent_requests_each_get_their_own_stream(
    engine: AsyncLLM, run: Callable[[Any], Any], tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> None:
    """Four requests in flight together finish with their own lengths and greedy tokens."""
    prompts = tiny_prompts[:4]
    lengths = [3, 9, 6, 12]

    async def all_at_once() -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(
                collect(engine, p, greedy(n), f"conc-{i}")
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
            )
        )

    streams = run(all_at_once())

    expected = hf_greedy(tiny_model_dir, prompts, max(lengths))
    assert lengths == [len(s) for s in streams]
    assert [e[:n] for e, n in zip(expected, lengths, strict=True)] == [
        s[-1].outputs[0].token_ids for s in streams
    ]


def test_closing_the_stream_aborts_the_request(
    engine: AsyncLLM,
    run: Callable[[Any], Any],
    tiny_prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Leaving a stream early aborts its request in the engine: the next request's last step
    reports nothing else running or waiting."""
    steps: list[StepOutputs] = []
    process = engine._frontend.outputs.process

    def recording(step: StepOutputs) -> Any:
        steps.append(step)
        return process(step)

    monkeypatch.setattr(engine._frontend.outputs, "process", recording)

    async def leave_early() -> None:
        stream = cast(
            AsyncGenerator[RequestOutput], engine.generate(tiny_prompts[2], greedy(400), "leaves")
        )
        async with contextlib.aclosing(stream):
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 2:
                    break

    run(leave_early())
    assert 0 == engine.num_in_flight
    outputs = run(collect(engine, tiny_prompts[0], greedy(8), "after-leave"))

    assert outputs[-1].finished
    assert (0, 0) == (steps[-1].num_running, steps[-1].num_waiting)


def test_invalid_request_fails_alone(
    engine: AsyncLLM, run: Callable[[Any], Any], tiny_prompts: list[list[int]]
) -> None:
    """A prompt over the context length raises RequestError; the engine serves the next one."""
    with pytest.raises(RequestError) as info:
        run(collect(engine, tiny_prompts[-1] * 5, greedy(8), "too-long"))

    assert "context_length_exceeded" == info.value.code
    assert run(collect(engine, tiny_prompts[0], greedy(2), "after-too-long"))[-1].finished


def test_duplicate_request_id_is_rejected(
    engine: AsyncLLM, run: Callable[[Any], Any], tiny_prompts: list[list[int]]
) -> None:
    """A second request with the id of one in flight is refused; the first completes."""

    async def twice() -> list[RequestOutput]:
        # Long enough to be still in flight after its first output, however fast the steps.
        first = engine.generate(tiny_prompts[1], greedy(200), "same-id")
        head = await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await collect(engine, tiny_prompts[2], greedy(6), "same-id")
        return [head] + [o async for o in first]

    outputs = run(twice())

    assert 200 == len(outputs[-1].outputs[0].token_ids)


def test_async_llm_needs_an_engine_core_process(tiny_model_dir: str) -> None:
    """multiprocess=False is refused: the streaming engine runs its core in a process."""
    with pytest.raises(ValueError, match="multiprocess"):
        AsyncLLM(tiny_model_dir, multiprocess=False)


def test_multiprocess_has_one_default(tiny_model_dir: str) -> None:
    """The config's default runs the core in the caller's process (`LLM`, `generate`);
    `AsyncLLM`, given that default (as `serve` gives it), runs the core in a process of its
    own and its config, which the crash dump reads, says so."""
    config = EngineConfig.from_kwargs(model=tiny_model_dir, num_kv_blocks=64)
    assert not config.parallel.multiprocess
    assert "multiprocess" not in inspect.signature(LLM).parameters
    engine = AsyncLLM.from_config(config)
    try:
        assert engine.config.parallel.multiprocess
        names = {child.name() for child in psutil.Process().children(recursive=True)}
        assert process_title(ENGINE_CORE) in names
    finally:
        engine.shutdown()


def test_generate_after_shutdown_raises_engine_dead(
    tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> None:
    """A shut-down engine answers new requests with EngineDeadError at once."""
    engine = AsyncLLM(tiny_model_dir, num_kv_blocks=64)
    engine.shutdown()

    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, tiny_prompts[0], greedy(2), "late"))


def test_every_step_reaches_the_step_listeners(
    tiny_model_dir: str, tiny_prompts: list[list[int]], run: Callable[[Any], Any]
) -> None:
    """A 120-token prompt prefilled 16 tokens a step: every one of its steps, the seven that
    only prefill included, sends its frame (step metrics see long prompts)."""
    prompt = tiny_prompts[-1]
    engine = AsyncLLM(tiny_model_dir, max_num_batched_tokens=16, num_kv_blocks=64)
    steps: list[StepOutputs] = []
    engine.add_step_listener(steps.append)

    async def one() -> None:
        async for _ in engine.generate(prompt, greedy(max_tokens=1), "long-prompt"):
            pass

    try:
        run(one())
    finally:
        engine.shutdown()

    real_steps = [s for s in steps if s.step_id > 0]
    assert -(-len(prompt) // 16) == len(real_steps)
    assert [16] * (len(real_steps) - 1) == [s.num_scheduled_tokens for s in real_steps[:-1]]


def test_a_backlog_of_steps_leaves_the_event_loop_room_in_between(
    engine: AsyncLLM, run: Callable[[Any], Any]
) -> None:
    """Steps that piled up while the server was starved (here 40, each taking 3 ms in a
    listener) are handed out in order, but in slices of about `DELIVER_BUDGET_S`: a socket
    callback scheduled behind them runs after a few steps, not after all 40."""
    import time

    from otel_engine.engine.async_llm import DELIVER_BUDGET_S

    seen: list[object] = []

    def slow_listener(step: StepOutputs) -> None:
        if step.step_id > 10_000:  # not a frame of the engine's own
            time.sleep(0.003)
            seen.append(step.step_id)

    async def pile_up() -> None:
        for step_id in range(1, 41):
            engine._hand_over(StepOutputs(step_id=10_000 + step_id, updates=[]))
        asyncio.get_running_loop().call_soon(seen.append, "socket")

    run(collect(engine, [1, 2, 3], greedy(max_tokens=1), "binds-the-loop"))
    engine.add_step_listener(slow_listener)
    try:
        run(pile_up())
        deadline = time.monotonic() + 10
        while len(seen) < 41 and time.monotonic() < deadline:
            run(asyncio.sleep(0.01))
    finally:
        engine._step_listeners.remove(slow_listener)

    steps = [s for s in seen if s != "socket"]
    assert [10_000 + i for i in range(1, 41)] == steps
    assert seen.index("socket") <= 2 * DELIVER_BUDGET_S / 0.003 + 1


def test_a_restart_keeps_one_output_thread_to_join(
    tiny_model_dir: str, tiny_prompts: list[list[int]], run: Callable[[Any], Any]
) -> None:
    """After the engine core is killed and restarted, what shutdown joins is the new
    engine's output thread (and the restart's own, while it runs): the old output thread
    is gone from the list, no ended thread stays in it, and the restarted engine serves."""

    def cores() -> dict[int, psutil.Process]:
        return {
            child.pid: child
            for child in psutil.Process().children(recursive=True)
            if child.name() == process_title(ENGINE_CORE)
        }

    others = cores()  # other tests' engines, left alone
    engine = AsyncLLM(tiny_model_dir, on_engine_failure="restart", num_kv_blocks=64)

    async def scenario() -> list[RequestOutput]:
        await collect(engine, tiny_prompts[0], greedy(2), "before")
        first = engine._output_thread
        (core,) = (proc for pid, proc in cores().items() if pid not in others)
        core.kill()
        core.wait(timeout=10)
        # admitted to the dead engine and carried over, or held until the restart
        outputs = await collect(engine, tiny_prompts[0], greedy(2), "after")
        assert 1 == engine.restarts
        assert first is not None
        assert not first.is_alive()
        assert first not in engine._threads
        return outputs

    try:
        outputs = run(scenario())
        output_threads = [t for t in engine._threads if t.name == "core-output-io"]
        assert [engine._output_thread] == output_threads
        assert 2 == len(outputs[-1].outputs[0].token_ids)
    finally:
        engine.shutdown()
