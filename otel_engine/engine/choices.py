"""Several samples of one prompt (`n`, `best_of`): one engine request per sample, merged.

Sample i is the request `{request_id}-{i}`; a request seed gives sample i the seed
`sample_seed(seed, i)`, so the same request returns the same samples. The first sample runs
alone until its first output, so that its prompt's full KV blocks are in the prefix cache
when the others are admitted: they share them and compute only the last, partial block.

The merged stream yields a `RequestOutput` whose `outputs` are the samples that advanced
(each with its `index`), and a last one, `finished`, with every sample's final state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import msgspec

from otel_engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from otel_engine.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15

Generate = Callable[[list[int], SamplingParams, str], AsyncIterator[RequestOutput]]


def sample_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed, derived from the request's (64-bit, deterministic)."""
    if index == 0:
        return seed
    return (seed + index * _GOLDEN + 2**63) % 2**64 - 2**63


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=sample_seed(params.seed, index))


def sample_ids(request_id: str, num_samples: int) -> list[str]:
    """The engine's request ids of a request's samples (one sample: the request's own)."""
    if num_samples == 1:
        return [request_id]
    return [f"{request_id}-{i}" for i in range(num_samples)]


async def generate_choices(
    generate: Generate,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    num_samples: int,
) -> AsyncIterator[RequestOutput]:
    """`num_samples` (> 1) samples of `prompt_ids`, merged (see the module docstring); a
    single sample needs no merging: read the engine's stream itself."""
    streams = [
        generate(prompt_ids, sample_params(params, i), sample_id)
        for i, sample_id in enumerate(sample_ids(request_id, num_samples))
    ]
    latest: dict[int, CompletionOutput] = {}
    metrics: dict[int, dict[str, float]] = {}
    prompt_logprobs: list[TokenLogprobs] | None = None
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, first: RequestOutput | None = None) -> None:
        try:
            if first is not None:
                await queue.put((index, first))
            async for output in streams[index]:
                await queue.put((index, output))
            await queue.put((index, None))
        except BaseException as exc:  # delivered to the consumer, which raises it
            await queue.put((index, exc))

    tasks: list[asyncio.Task[None]] = []
    try:
        first = await anext(streams[0])  # alone: its prompt blocks get cached
        tasks = [asyncio.create_task(pump(0, first))]
        tasks += [asyncio.create_task(pump(i)) for i in range(1, num_samples)]
        running = num_samples
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            changed = [replace(c, index=index) for c in item.outputs]
            latest[index] = changed[-1]
            metrics[index] = item.metrics
            prompt_logprobs = prompt_logprobs or item.prompt_logprobs
            done = len(latest) == num_samples and all(c.finish_reason for c in latest.values())
            yield RequestOutput(
                request_id=request_id,
                prompt_token_ids=item.prompt_token_ids,
                outputs=[latest[i] for i in sorted(latest)] if done else changed,
                finished=done,
                prompt=item.prompt,
                metrics=_merged(metrics) if done else item.metrics,
                prompt_logprobs=prompt_logprobs,
            )
    finally:  # every sample's engine stream is closed (aborted) before this returns
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]


def _merged(metrics: dict[int, dict[str, float]]) -> dict[str, float]:
    """The request's timings: the first sample's (arrival, queue, first token, cached
    prompt tokens), finished when the last sample finished, preemptions of all samples."""
    merged = dict(metrics[0])
    finished = [m["finished_time"] for m in metrics.values() if "finished_time" in m]
    if finished:
        merged["finished_time"] = max(finished)
    for name in ("num_preemptions", "num_draft_tokens", "num_accepted_tokens"):
        merged[name] = sum(m.get(name, 0) for m in metrics.values())
    return merged
