"""Token sampling on the sampling rank: logits processing (penalties, biases, min-token
masks, min-p), greedy, temperature, top-k, top-p, seeds.

Logits processing is batched over the rows that have any (one scatter per kind, no loop
over the vocabulary) and skipped entirely for a step where no row has any.

Seeded rows draw their noise from a generator seeded by (seed, output position), so the
same seed gives the same tokens whatever else shares the batch or after a preemption.
Unseeded rows draw from one generator seeded by the engine seed (`--seed`), shared by the
whole batch: an engine restarted with the same seed and given the same requests in the
same order samples the same tokens only while each step's batch is the same too, so not
once a structured request sat a step out for its grammar mask (that depends on how long
masks took, wall-clock time); seeded rows stay reproducible by (seed, position) either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from otel_engine.outputs import TokenLogprobs
from otel_engine.sampling_params import LogitsProcessing

_SEED_MIX = 0x9E3779B97F4A7C15
# What a grammar adds to the logit of a token it does not allow: far below any real logit
# (even divided by the largest temperature), and exp() of it minus the row's maximum is 0.
GRAMMAR_BAN = -1e30
_MASK63 = (1 << 63) - 1


class Sampler:
    """Picks one token per row of logits [N, vocab] (float32)."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)  # reseeded for every seeded row
        self.unseeded = torch.Generator(device=device)
        self.unseeded.manual_seed(seed & _MASK63)

    def __call__(
        self,
        logits: torch.Tensor,
        temperatures: list[float],
        top_ps: list[float],
        top_ks: list[int],
        seeds: list[int | None],
        output_positions: list[int],
        processing: list[LogitsProcessing | None] | None = None,
        grammar_rows: list[int] | None = None,
        grammar_bitmask: bytes = b"",
    ) -> list[int]:
        raw = logits
        if processing:
            logits = process_logits(logits, processing)
        if grammar_rows:
            logits = apply_grammar(logits, raw, grammar_rows, grammar_bitmask)
        greedy = logits.max(dim=-1).indices  # the first maximum, like argmax, but faster
        if all(t == 0.0 for t in temperatures):
            return greedy.tolist()
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=self.device)
        logits = logits / temps.unsqueeze(1)
        if processing and any(p is not None and p.min_p > 0 for p in processing):
            logits = _min_p(logits, [p.min_p if p is not None else 0.0 for p in processing])
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = self._filter(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.unseeded)
        for row, seed in enumerate(seeds):
            if seed is not None:
                self.generator.manual_seed(((seed * _SEED_MIX) ^ output_positions[row]) & _MASK63)
                noise[row].exponential_(generator=self.generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        is_greedy = torch.tensor([t == 0.0 for t in temperatures], device=self.device)
        return torch.where(is_greedy, greedy, sampled).tolist()

    def _filter(self, logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        """Mask logits outside each row's top-k and top-p (nucleus) set."""
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=self.device).unsqueeze(0)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=self.device)
        drop = ranks >= ks.unsqueeze(1)
        ps = torch.tensor(top_ps, device=self.device).unsqueeze(1)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= before >= ps
        drop[:, 0] = False  # the most likely token survives any top_p, even one float32 rounds to 0
        sorted_logits.masked_fill_(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def process_logits(logits: torch.Tensor, processing: list[LogitsProcessing | None]) -> torch.Tensor:
    """Logit bias, min-token bans, repetition, frequency and presence penalties (in that
    order, `SamplingParams`' definitions) on the rows that have any; a new tensor."""
    rows = [i for i, p in enumerate(processing) if p is not None]
    if not rows:
        return logits
    device = logits.device
    vocab = logits.shape[-1]
    procs = [p for p in processing if p is not None]
    sub = logits[rows].float()  # a copy: the caller's logits stay as they were
    bias = _pairs(procs, lambda p: [t for t, _ in p.logit_bias], device)
    if bias is not None:
        values = torch.tensor([b for p in procs for _, b in p.logit_bias], device=device)
        sub.index_put_(bias, values, accumulate=True)
    banned = _pairs(procs, lambda p: p.banned_token_ids, device)
    if banned is not None:
        sub.index_put_(banned, torch.tensor(float("-inf"), device=device))
    outputs = _pairs(procs, lambda p: p.output_token_ids, device)
    if outputs is not None:
        counts = torch.zeros_like(sub)
        counts.index_put_(outputs, torch.ones(len(outputs[0]), device=device), accumulate=True)
        repetition = torch.tensor([p.repetition_penalty for p in procs], device=device)
        if bool((repetition != 1.0).any()):
            seen = counts > 0
            prompts = _pairs(procs, lambda p: p.prompt_token_ids, device)
            if prompts is not None:
                seen[prompts] = True
            factor = repetition.unsqueeze(1).expand(-1, vocab)
            penalized = torch.where(sub > 0, sub / factor, sub * factor)
            sub = torch.where(seen, penalized, sub)
        frequency = torch.tensor([p.frequency_penalty for p in procs], device=device)
        presence = torch.tensor([p.presence_penalty for p in procs], device=device)
        sub -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
    out = logits.float().clone()
    out[rows] = sub
    return out


def apply_grammar(
    logits: torch.Tensor, raw: torch.Tensor, rows: list[int], bitmask: bytes
) -> torch.Tensor:
    """Ban, in each row of `rows`, every token its grammar's mask does not allow (one row
    of int32 words per grammar row: bit b of word w allows token 32 w + b) by adding
    `GRAMMAR_BAN` to its logit: exp() of it is exactly 0, so it is never sampled, and adding
    is 5x faster than masked_fill here. Where the processing before (bans, biases) left none
    of the allowed tokens, the row is `raw` masked instead: the grammar wins, and a row never
    ends with nothing to sample."""
    device = logits.device
    vocab = logits.shape[-1]
    # Little-endian int32 words: byte k of a row holds tokens 8k..8k+7, lowest bit first.
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    ban = torch.from_numpy(bits).view(len(rows), -1).to(device=device, dtype=torch.float32)
    if ban.shape[1] < vocab:
        ban = torch.nn.functional.pad(ban, (0, vocab - ban.shape[1]))
    ban = ban[:, :vocab].sub_(1.0).mul_(-GRAMMAR_BAN)  # allowed: 0, else GRAMMAR_BAN
    if len(rows) == logits.shape[0]:  # every row (rows are distinct and in order)
        masked = logits.float() + ban
    else:
        index = torch.tensor(rows, dtype=torch.long, device=device)
        masked = logits.index_select(0, index).float().add_(ban)
    if logits is not raw:  # raw logits are finite: only processing can ban every allowed token
        empty = masked.max(dim=-1).values < GRAMMAR_BAN / 2
        if bool(empty.any()):
            fallback = (raw.float() if len(rows) == raw.shape[0] else raw[index].float()) + ban
            masked = torch.where(empty.unsqueeze(1), fallback, masked)
    if len(rows) == logits.shape[0]:
        return masked
    out = logits.float().clone() if logits is raw else logits
    out[index] = masked
    return out


def _pairs(
    procs: list[LogitsProcessing],
    ids: Callable[[LogitsProcessing], list[int]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token id) index tensors of every id that `ids` gives for each row; None when
    no row has any."""
    row_index: list[int] = []
    token_ids: list[int] = []
    for row, proc in enumerate(procs):
        chosen = ids(proc)
        row_index += [row] * len(chosen)
        token_ids += chosen
    if not token_ids:
        return None
    return (
        torch.tensor(row_index, dtype=torch.long, device=device),
        torch.tensor(token_ids, dtype=torch.long, device=device),
    )


def _min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop each row's tokens less likely than `min_p` times its most likely one."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(
        min_ps, device=logits.device
    ).unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def logprobs_of(
    logits: torch.Tensor, tokens: list[int], num_logprobs: list[int]
) -> list[TokenLogprobs | None]:
    """For each row with `num_logprobs` >= 0: the sampled token's log-probability and the
    row's top `num_logprobs` tokens, from the raw logits (float32 log-softmax over the whole
    vocabulary: before penalties, temperature and truncation, as vLLM reports them)."""
    rows = [i for i, k in enumerate(num_logprobs) if k >= 0]
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    if not rows:
        return result
    device = logits.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], dtype=torch.long, device=device)
    sampled = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = max(num_logprobs[i] for i in rows)
    top_values_list: list[list[float]] = [[] for _ in rows]
    top_ids_list: list[list[int]] = [[] for _ in rows]
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    for position, row in enumerate(rows):
        want = num_logprobs[row]
        result[row] = TokenLogprobs(
            sampled[position], top_ids_list[position][:want], top_values_list[position][:want]
        )
    return result
