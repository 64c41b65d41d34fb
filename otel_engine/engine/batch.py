"""The engine core's step, flattened into the one message every rank receives."""

from __future__ import annotations

from collections.abc import Sequence

from otel_engine.engine.grammars import RequestGrammar, fill_bitmasks
from otel_engine.ipc.messages import ModelInput, PromptLogprobsChunk
from otel_engine.observability import faults
from otel_engine.sampling_params import LogitsProcessing
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk


def prepare_model_input(
    step_id: int,
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    trace_context: dict[str, str] | None = None,
) -> ModelInput:
    """Flatten a scheduler output (decodes first) into the message every rank receives."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens, seq_lens, block_tables, sample_indices = [], [], [], []
    temperatures, top_ps, top_ks, seeds, output_positions = [], [], [], [], []
    processing: list[LogitsProcessing | None] = []
    num_logprobs: list[int] = []
    any_processing = any_logprobs = False
    prompt_logprobs: list[PromptLogprobsChunk] = []
    grammar_rows: list[int] = []
    grammars: list[RequestGrammar] = []
    num_decodes = 0
    for index, chunk in enumerate(chunks):
        request = chunk.request
        start, end = chunk.start, chunk.start + chunk.num_tokens
        if chunk.num_tokens == 1 and index == num_decodes:
            num_decodes += 1
        input_ids += request.token_ids(start, end)
        positions += range(start, end)
        blocks = request.block_ids
        slot_mapping += [
            blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
        ]
        query_lens.append(chunk.num_tokens)
        seq_lens.append(end)
        block_tables.append(blocks)
        wanted = request.sampling_params.prompt_logprobs
        if wanted is not None and start < request.num_prompt_tokens - 1:
            last = min(end, request.num_prompt_tokens - 1)  # the last prompt position scored
            after = request.prompt_token_ids[end] if end == last else -1
            prompt_logprobs.append(PromptLogprobsChunk(index, wanted, last - start, after))
        if end == request.num_tokens:
            params = request.sampling_params
            sample_indices.append(index)
            temperatures.append(0.0 if params.is_greedy else params.temperature)
            top_ps.append(params.top_p)
            top_ks.append(params.top_k)
            seeds.append(params.seed)
            output_positions.append(request.num_output_tokens)
            row = logits_processing(request) if params.has_logits_processing else None
            any_processing |= row is not None
            processing.append(row)
            wanted = -1 if params.logprobs is None else params.logprobs
            any_logprobs |= wanted >= 0
            num_logprobs.append(wanted)
            if request.grammar is not None:
                grammar_rows.append(len(sample_indices) - 1)
                grammars.append(request.grammar)
    return ModelInput(
        step_id=step_id,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=block_tables,
        sample_indices=sample_indices,
        temperatures=temperatures,
        top_ps=top_ps,
        top_ks=top_ks,
        seeds=seeds,
        output_positions=output_positions,
        trace_context=trace_context or {},
        processing=processing if any_processing else [],
        num_logprobs=num_logprobs if any_logprobs else [],
        prompt_logprobs=prompt_logprobs,
        grammar_rows=grammar_rows,
        grammar_bitmask=fill_bitmasks(grammars) if grammars else b"",
        max_prompt_len=longest_prompt(chunks) if faults.wants_prompt_len() else 0,
    )


def longest_prompt(chunks: Sequence[ScheduledChunk]) -> int:
    """The longest prompt of the step's requests (the fault injector's `when=prompt_len`)."""
    return max((chunk.request.num_prompt_tokens for chunk in chunks), default=0)


def logits_processing(request: Request) -> LogitsProcessing:
    """What the sampler needs to process `request`'s logits this step."""
    params = request.sampling_params
    banned: list[int] = []
    if request.num_output_tokens < params.min_tokens:
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += request.eos_token_ids
    penalized = params.presence_penalty or params.frequency_penalty
    repeated = params.repetition_penalty != 1.0
    return LogitsProcessing(
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=list(params.logit_bias),
        banned_token_ids=banned,
        output_token_ids=request.output_token_ids if penalized or repeated else [],
        prompt_token_ids=request.prompt_token_ids if repeated else [],
    )
