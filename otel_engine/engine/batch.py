"""The engine core's step, flattened into the one message every rank receives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from otel_engine.engine.grammars import RequestGrammar, fill_bitmasks
from otel_engine.ipc.messages import ModelInput, PromptLogprobsChunk
from otel_engine.observability import faults
from otel_engine.sampling_params import LogitsProcessing
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk


@dataclass(slots=True)
class _SampledRows:
    """The sampling fields of a step's sampled rows, row by row."""

    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    output_positions: list[int] = field(default_factory=list)
    processing: list[LogitsProcessing | None] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)
    any_processing: bool = False
    any_logprobs: bool = False
    grammar_rows: list[int] = field(default_factory=list)
    grammars: list[RequestGrammar] = field(default_factory=list)
    grammar_offsets: list[int] = field(default_factory=list)

    def add(self, request: Request, drafts: list[int]) -> None:
        """One row per verified position: as the step after each proposed token would be."""
        params = request.sampling_params
        for offset in range(1 + len(drafts)):
            self.temperatures.append(0.0 if params.is_greedy else params.temperature)
            self.top_ps.append(params.top_p)
            self.top_ks.append(params.top_k)
            self.seeds.append(params.seed)
            self.output_positions.append(request.num_output_tokens + offset)
            row = None
            if params.has_logits_processing:
                row = logits_processing(request, drafts[:offset])
                self.any_processing = True
            self.processing.append(row)
            wanted = -1 if params.logprobs is None else params.logprobs
            self.any_logprobs |= wanted >= 0
            self.num_logprobs.append(wanted)
            if request.grammar is not None:
                self.grammar_rows.append(len(self.temperatures) - 1)
                self.grammars.append(request.grammar)
                self.grammar_offsets.append(offset)


def prepare_model_input(
    step_id: int,
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    trace_context: dict[str, str] | None = None,
) -> ModelInput:
    """Flatten a scheduler output (decodes first: `is_decode`) into the message every rank
    receives."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    sample_indices: list[int] = []
    prompt_logprobs: list[PromptLogprobsChunk] = []
    rows = _SampledRows()
    num_decodes = 0
    for chunk in chunks:
        request = chunk.request
        drafts = chunk.draft_token_ids
        start, end = chunk.start, chunk.start + chunk.num_tokens
        blocks = request.block_ids
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
        tokens = request.token_ids(start, end - len(drafts)) + drafts
        if is_decode(chunk):
            # A decode, and each proposed token it verifies, as one decode sequence per
            # position: the same blocks, one more token of context each (the step writes
            # every position's K/V before any attends). So a verifying step is a decode
            # step, through the same kernels as one without proposals.
            for offset in range(chunk.num_tokens):
                sample_indices.append(len(query_lens))
                query_lens.append(1)
                seq_lens.append(start + offset + 1)
                block_tables.append(blocks)
            num_decodes += chunk.num_tokens
            input_ids += tokens
            positions += range(start, end)
            slot_mapping += slots
            rows.add(request, drafts)
            continue
        input_ids += tokens
        positions += range(start, end)
        slot_mapping += slots
        wanted = request.sampling_params.prompt_logprobs
        if wanted is not None and start < request.num_prompt_tokens - 1:
            last = min(end, request.num_prompt_tokens - 1)  # the last prompt position scored
            after = request.prompt_token_ids[end] if end == last else -1
            index = len(query_lens)
            prompt_logprobs.append(PromptLogprobsChunk(index, wanted, last - start, after))
        query_lens.append(chunk.num_tokens)
        seq_lens.append(end)
        block_tables.append(blocks)
        if chunk.needs_sample:
            sample_indices.append(len(query_lens) - 1)
            rows.add(request, drafts)
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
        temperatures=rows.temperatures,
        top_ps=rows.top_ps,
        top_ks=rows.top_ks,
        seeds=rows.seeds,
        output_positions=rows.output_positions,
        trace_context=trace_context or {},
        processing=rows.processing if rows.any_processing else [],
        num_logprobs=rows.num_logprobs if rows.any_logprobs else [],
        prompt_logprobs=prompt_logprobs,
        grammar_rows=rows.grammar_rows,
        grammar_bitmask=(
            fill_bitmasks(rows.grammars, rows.grammar_offsets) if rows.grammars else b""
        ),
        max_prompt_len=longest_prompt(chunks) if faults.wants_prompt_len() else 0,
    )


def is_decode(chunk: ScheduledChunk) -> bool:
    """One token of the request's own (and any proposed ones after it): a decode step's."""
    return chunk.num_tokens - len(chunk.draft_token_ids) == 1 and chunk.needs_sample


def sequence_chunks(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """For each sequence of `prepare_model_input`'s `ModelInput`, the index of its chunk (a
    decode verifying k proposed tokens is k + 1 sequences)."""
    return [
        index
        for index, chunk in enumerate(chunks)
        for _ in range(chunk.num_tokens if is_decode(chunk) else 1)
    ]


def longest_prompt(chunks: Sequence[ScheduledChunk]) -> int:
    """The longest prompt of the step's requests (the fault injector's `when=prompt_len`)."""
    return max((chunk.request.num_prompt_tokens for chunk in chunks), default=0)


def logits_processing(request: Request, proposed: list[int] | None = None) -> LogitsProcessing:
    """What the sampler needs to process `request`'s logits this step, at the position
    after `proposed` tokens (a verified position of speculative decoding: they count as
    output there)."""
    params = request.sampling_params
    proposed = proposed or []
    banned: list[int] = []
    if request.num_output_tokens + len(proposed) < params.min_tokens:
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
        output_token_ids=request.output_token_ids + proposed if penalized or repeated else [],
        prompt_token_ids=request.prompt_token_ids if repeated else [],
    )
