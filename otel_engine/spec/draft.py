"""The draft model: a smaller model with the target's tokenizer, run in the engine core, that
proposes each speculating request's next tokens one forward at a time.

Its KV cache has as many blocks as the target's and is indexed by the same block tables: a
request's blocks from the one allocator hold both models' K/V, so nothing else is
allocated, preempted or freed for it. A request's draft K/V is computed lazily: the first
round of a step runs the draft over the request's tokens it has not seen
(`SpecState.num_draft_computed`: the whole prompt the first time, then the tokens the last
step gained) and samples the first proposal; each further round feeds the last proposal
and samples the next, for the requests that still have slots. The draft samples as the
target will at the same output position: greedy rows greedily, seeded rows with the noise
of (seed, position), so that where the two models agree the target's sample equals the
proposal; an unseeded row takes the draft's most likely token.

A failure of the draft model is the engine's failure (a crash dump whose error names the
draft model), as any other in the step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence

import msgspec

from otel_engine.config import Dtype, EngineConfig, Int4Mode, SpeculativeMethod
from otel_engine.engine.batch import prepare_model_input
from otel_engine.executor.model_runner import ModelRunner
from otel_engine.ipc.process import ENGINE_CORE
from otel_engine.model.arch import ModelArch, load_model_arch
from otel_engine.model.limits import EngineLimits
from otel_engine.model.loader import prepare_model_dir
from otel_engine.observability.faults import FaultPhase, maybe_inject
from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk
from otel_engine.spec.cost import StepCost
from otel_engine.spec.speculator import Speculator

logger = logging.getLogger(__name__)


class DraftModelError(RuntimeError):
    """The draft model failed in a step (the engine fails as for any step failure)."""


class DraftSpeculator(Speculator):
    method = SpeculativeMethod.DRAFT

    def __init__(self, config: EngineConfig, target: ModelArch, limits: EngineLimits) -> None:
        spec = config.speculative
        super().__init__(spec)
        assert spec.speculative_model is not None
        self.name = os.path.basename(os.path.normpath(spec.speculative_model))
        model_dir = prepare_model_dir(spec.speculative_model)
        arch = load_model_arch(model_dir)
        if arch.vocab_size != target.vocab_size or set(arch.eos_token_ids) != set(
            target.eos_token_ids
        ):
            raise ValueError(
                f"the draft model {self.name} does not share the model's tokenizer (vocabulary "
                f"{arch.vocab_size} vs {target.vocab_size}, or other end-of-sequence tokens)"
            )
        # One rank in this process, whatever the target's; a lower-bit draft runs its own
        # 4-bit path even where the target's is turned off (`--int4 off`), in the dtype
        # `auto` gives it: a float32 target's draft still takes bfloat16's 4-bit kernels
        # (the default model's draft forward of 4 sequences, on 2 cores: 11 ms, against 17
        # in float32 from the file's blocks).
        draft_config = dataclasses.replace(
            config,
            model=dataclasses.replace(
                config.model,
                model=spec.speculative_model,
                int4=Int4Mode.AUTO,
                dtype=Dtype.AUTO,
            ),
            parallel=dataclasses.replace(config.parallel, tensor_parallel_size=1),
        )
        self.runner = ModelRunner(draft_config, model_dir, limits, is_draft=True)
        self.draft_cost: StepCost = StepCost()
        self.block_size = config.cache.block_size

    def propose(self, chunks: Sequence[ScheduledChunk], step_id: int = 0) -> None:
        speculating = [c for c in chunks if c.num_spec_slots]
        if not speculating:
            return
        proposed: list[list[int]] = [[] for _ in speculating]
        # Round 1: what the draft has not seen of each request, and its first proposal.
        views = []
        for chunk in speculating:
            request = chunk.request
            state = request.spec
            assert state is not None
            views.append(_catch_up(request, state.num_draft_computed, self.max_k))
            state.num_draft_computed = request.num_tokens
        for tokens, token in zip(proposed, self._run(views, step_id), strict=True):
            tokens.append(token)
        # Further rounds: the last proposal in, the next out, while a request has slots.
        for _ in range(1, max(c.num_spec_slots for c in speculating)):
            active = [i for i, c in enumerate(speculating) if len(proposed[i]) < c.num_spec_slots]
            views = []
            for index in active:
                view = _view(speculating[index].request, proposed[index])
                views.append(ScheduledChunk(view, view.num_tokens - 1, 1))
            for index, token in zip(active, self._run(views, step_id), strict=True):
                proposed[index].append(token)
        for chunk, tokens in zip(speculating, proposed, strict=True):
            chunk.draft_token_ids = tokens
            chunk.num_tokens += len(tokens)

    def _run(self, chunks: list[ScheduledChunk], step_id: int) -> list[int]:
        """One forward of the draft over `chunks` in the engine's step `step_id`; each
        chunk's last sampled token. Each forward is timed for the planning (spec/cost.py):
        one of decode sequences only by its sequences, one that prefills by its tokens."""
        step = prepare_model_input(step_id, chunks, self.block_size)
        started = time.monotonic()
        try:
            maybe_inject(
                ENGINE_CORE,
                phase=FaultPhase.DRAFT,
                step=step_id,
                num_requests=len(chunks),
                num_tokens=len(step.input_ids),
            )
            sampled = self.runner.execute(step).sampled_token_ids
        except Exception as exc:
            raise DraftModelError(
                f"the draft model {self.name} failed: {type(exc).__name__}"
            ) from exc
        seconds = time.monotonic() - started
        # Every forward counts in what the step delivered (spec/speculator.py), a prefill
        # too: it pays only if its request goes on proposing, which its batch size's
        # delivery then shows.
        self.step_draft_seconds += seconds
        if step.num_decodes == len(step.query_lens):
            self.draft_cost.observe(step.num_decodes, seconds)
        else:
            self.draft_cost.observe_prefill(len(step.input_ids), seconds)
        last, position = [], 0
        for chunk in chunks:
            position += chunk.num_sample_rows
            last.append(sampled[position - 1])
        return last


def _catch_up(request: Request, computed: int, max_k: int) -> ScheduledChunk:
    """The draft's first forward of a step for `request`: its tokens from `computed` on
    (the draft holds the K/V of those before), sampling the first proposal after them. A
    few output tokens (those the last step gained) go as decode sequences, one per token,
    like a verifying decode (engine/batch.py): the draft's decode kernels, not a prefill;
    a prompt (the request's first proposals) as a prefill chunk."""
    start = min(computed, request.num_tokens - 1)
    count = request.num_tokens - start
    done = start + 1 - request.num_prompt_tokens  # outputs up to the chunk's first token
    if done < 1 or count > max_k + 1:
        return ScheduledChunk(_view(request, []), start, count)
    view = _view(request, [], num_outputs=done)
    rest = request.output_token_ids[done:]
    return ScheduledChunk(view, start, count, len(rest), rest)


def _view(request: Request, proposed: list[int], num_outputs: int | None = None) -> Request:
    """`request` as the draft sees it after `proposed` tokens: they count as output, the
    blocks are the request's, and sampling is the draft's (`_draft_params`); with
    `num_outputs`, only its first that many outputs (the rest go as proposals would)."""
    state = request.spec
    assert state is not None
    if state.draft_params is None:
        state.draft_params = _draft_params(request.sampling_params)
    return Request(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=state.draft_params,
        eos_token_ids=request.eos_token_ids,
        output_token_ids=request.output_token_ids[:num_outputs] + proposed,
        block_ids=request.block_ids,
    )


def _draft_params(params: SamplingParams) -> SamplingParams:
    """How the draft samples for a request: no logprobs of any kind; an unseeded sampled
    request's proposals are the draft's most likely tokens."""
    temperature = params.temperature if params.seed is not None else 0.0
    return msgspec.structs.replace(
        params, logprobs=None, prompt_logprobs=None, temperature=temperature
    )
