"""Paged attention in plain torch: K/V live in fixed-size blocks, read through block tables.

The cache of one layer is two tensors [num_kv_heads, num_blocks, block_size, head_dim];
a token's slot is block_id * block_size + offset. Decode sequences (one query token) are batched
together; prefill chunks run one sequence at a time with a causal mask that accounts for
the tokens already cached. Query heads are grouped over their KV head and multiplied with
plain matmuls (torch's SDPA is slow in bfloat16 on CPU, see PERF-NOTES). The compiled CPU
kernels (`layer_ops.KernelOps`) replace the decode part and the cache writes, and run
prefills through torch's fused attention (`sdpa_prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from otel_engine.model.layers import soft_cap_


@dataclass(slots=True)
class PrefillSeq:
    """One prefill chunk: query rows [query_start, query_end), keys at `slots`.

    `mask` is additive float32 [num_query, num_keys] (`prefill_attention`), or for
    `sdpa_prefill` boolean (True: may attend), and None for a fresh prompt (plain causal).
    """

    query_start: int
    query_end: int
    slots: torch.Tensor | None  # None: nothing cached before, keys are this chunk's own
    mask: torch.Tensor | None
    window_mask: torch.Tensor | None = None  # `mask` with keys outside the sliding window


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step indices shared by every layer (built once per step by the layer ops)."""

    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    num_decodes: int
    prefills: list[PrefillSeq]
    # torch path: block tables as gather indices, and the padding mask
    decode_blocks: torch.Tensor | None = None  # [num_decodes, max_blocks] int64, 0-padded
    decode_mask: torch.Tensor | None = None  # [1, num_decodes, 1, max_len] additive, float32
    # kernel path: block tables and lengths as the C kernels read them
    decode_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32, 0-padded
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32
    prefill_tables: list[torch.Tensor] | None = None  # per prefill chunk, its block table int32
    # torch path: cos/sin rows of this step's positions, [T, 1, D]
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # models with sliding-window layers: their decode mask, and their own rotary rows
    decode_window_mask: torch.Tensor | None = None
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None


def padded_tables(block_tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in block_tables)
    return [t + [0] * (width - len(t)) for t in block_tables]


def prefill_seqs(
    num_decodes: int,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    *,
    for_sdpa: bool = False,
    window: int | None = None,
    masks: bool = True,
) -> list[PrefillSeq]:
    """Gather indices and causal masks of the step's prefill chunks (after the decodes):
    additive float masks, or with `for_sdpa` boolean ones (None for a fresh prompt); none
    without `masks` (a kernel that applies causality itself). With a sliding `window`, also
    the additive mask of the window's layers (a query sees the `window` keys up to its own,
    as transformers' sliding_window_overlay)."""
    neg_inf = float("-inf")
    prefills = []
    query_start = num_decodes
    for i in range(num_decodes, len(query_lens)):
        num_query, num_keys = query_lens[i], seq_lens[i]
        start = num_keys - num_query
        slots = None
        if start > 0:
            blocks = torch.tensor(block_tables[i], dtype=torch.long, device=device)
            offsets = torch.arange(block_size, device=device)
            slots = (blocks.unsqueeze(-1) * block_size + offsets).flatten()[:num_keys]
        key_pos = torch.arange(num_keys, device=device).unsqueeze(0)
        query_pos = torch.arange(start, num_keys, device=device).unsqueeze(1)
        mask: torch.Tensor | None
        if not masks:
            mask = None
        elif for_sdpa:
            mask = None if slots is None else key_pos <= query_pos
        else:
            mask = torch.zeros((num_query, num_keys), dtype=torch.float32, device=device)
            mask.masked_fill_(key_pos > query_pos, neg_inf)
        window_mask = None
        if window is not None:
            window_mask = torch.zeros((num_query, num_keys), dtype=torch.float32, device=device)
            window_mask.masked_fill_(
                (key_pos > query_pos) | (key_pos <= query_pos - window), neg_inf
            )
        prefills.append(PrefillSeq(query_start, query_start + num_query, slots, mask, window_mask))
        query_start += num_query
    return prefills


def decode_window_mask(decode_mask: torch.Tensor, seq_lens: list[int], window: int) -> torch.Tensor:
    """`decode_mask` with the keys before each sequence's window masked too."""
    num_decodes, max_len = decode_mask.shape[1], decode_mask.shape[-1]
    lens = torch.tensor(seq_lens[:num_decodes], device=decode_mask.device).unsqueeze(1)
    before = torch.arange(max_len, device=decode_mask.device).unsqueeze(0) < lens - window
    return decode_mask.masked_fill(before.view(1, num_decodes, 1, max_len), float("-inf"))


def decode_gather_indices(
    num_decodes: int,
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's decode block indices [B, max_blocks] and mask [1, B, 1, max_len]."""
    tables = padded_tables(block_tables[:num_decodes])
    decode_blocks = torch.tensor(tables, dtype=torch.long, device=device)
    max_len = len(tables[0]) * block_size
    lens = torch.tensor(seq_lens[:num_decodes], device=device).unsqueeze(1)
    invalid = torch.arange(max_len, device=device).unsqueeze(0) >= lens
    decode_mask = torch.zeros(invalid.shape, dtype=torch.float32, device=device)
    decode_mask.masked_fill_(invalid, float("-inf"))
    return decode_blocks, decode_mask.view(1, num_decodes, 1, max_len)


def write_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store this step's K/V [T, Hkv, D] at their slots, in the cache's dtype (a float32
    model's float16 cache: rounded once, here)."""
    num_kv_heads, head_dim, stored = k.shape[1], k.shape[2], k_cache.dtype
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1).to(stored))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1).to(stored))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D] -> [B, Hq, D]; `softcap`: scores pass
    through cap * tanh(score / cap) before the mask (Gemma's attention soft-capping).

    The caches are head-major [Hkv, num_blocks, block_size, D]: gathering whole blocks
    yields [Hkv, batch, len, D], which batched matmuls consume without another copy.
    """
    assert meta.decode_blocks is not None
    assert meta.decode_mask is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    blocks = meta.decode_blocks.view(-1)
    max_len = meta.decode_mask.shape[-1]
    keys = k_cache.index_select(1, blocks).view(num_kv_heads * batch, max_len, head_dim)
    values = v_cache.index_select(1, blocks).view(num_kv_heads * batch, max_len, head_dim)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a float16 cache of a float32 model
    qd = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.bmm(qd.reshape(num_kv_heads * batch, group, head_dim), keys.transpose(1, 2))
    scores = scores.view(num_kv_heads, batch, group, max_len).float().mul_(scale)
    if softcap:
        scores = soft_cap_(scores, softcap)
    probs = torch.softmax(scores.add_(meta.decode_mask if mask is None else mask), dim=-1)
    probs = probs.to(q.dtype)
    context = torch.bmm(probs.view(num_kv_heads * batch, group, max_len), values)
    return (
        context.view(num_kv_heads, batch, group, head_dim)
        .transpose(0, 1)
        .reshape(batch, num_heads, head_dim)
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One prefill chunk, q [N, Hq, D] (k, v: the chunk's own [N, Hkv, D]) -> [N, Hq, D];
    `mask` replaces the chunk's causal one (a sliding window's); `softcap` as in decode."""
    num_query, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    keys, values = _prefill_keys(k, v, k_cache, v_cache, seq)
    mask = seq.mask if mask is None else mask
    assert mask is not None
    qp = q.view(num_query, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qp = qp.reshape(num_kv_heads, group * num_query, head_dim)
    scores = torch.bmm(qp, keys.transpose(1, 2)).view(num_kv_heads, group, num_query, -1)
    scores = scores.float().mul_(scale)
    if softcap:
        scores = soft_cap_(scores, softcap)
    scores = scores.add_(mask)
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads, group * num_query, -1)
    context = torch.bmm(probs, values).view(num_kv_heads, group, num_query, head_dim)
    return context.permute(2, 0, 1, 3).reshape(num_query, num_heads, head_dim)


def sdpa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
) -> torch.Tensor:
    """`prefill_attention` through torch's fused CPU attention (tiled, no score matrix in
    memory): 4x faster on a 1,024-token prompt. Takes a boolean mask (`for_sdpa`)."""
    keys, values = _prefill_keys(k, v, k_cache, v_cache, seq)
    context = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return context[0].transpose(0, 1)


def _prefill_keys(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's keys and values [Hkv, num_keys, D]: its own for a fresh prompt,
    else gathered from the cache (earlier chunks and this one, already written)."""
    if seq.slots is None:
        return k.transpose(0, 1), v.transpose(0, 1)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    keys = k_cache.view(num_kv_heads, -1, head_dim).index_select(1, seq.slots)
    values = v_cache.view(num_kv_heads, -1, head_dim).index_select(1, seq.slots)
    return keys.to(k.dtype), values.to(v.dtype)  # a float16 cache of a float32 model
