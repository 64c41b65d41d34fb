"""Paged attention in plain torch: K/V live in fixed-size blocks, read through block tables.

The cache of one layer is two tensors [num_kv_heads, num_blocks, block_size, head_dim];
a token's slot is block_id * block_size + offset. Decode sequences (one query token) are batched
together; prefill chunks run one sequence at a time with a causal mask that accounts for
the tokens already cached. Query heads are grouped over their KV head and multiplied with
plain matmuls (torch's SDPA is slow in bfloat16 on CPU, see PERF-NOTES).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSeq:
    """One prefill chunk: query rows [query_start, query_end), keys at `slots`."""

    query_start: int
    query_end: int
    slots: torch.Tensor | None  # None: nothing cached before, keys are this chunk's own
    mask: torch.Tensor  # additive [num_query, num_keys]


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step indices shared by every layer (built once per step)."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks] block tables, 0-padded
    decode_mask: torch.Tensor | None  # [1, num_decodes, 1, max_len] additive, float32
    prefills: list[PrefillSeq]


def build_metadata(
    *,
    slot_mapping: torch.Tensor,
    num_decodes: int,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionMetadata:
    """Turn the step's block tables into gather indices and masks."""
    neg_inf = float("-inf")
    dtype = torch.float32  # masks are added to float32 scores
    decode_blocks = decode_mask = None
    if num_decodes:
        max_blocks = max(len(t) for t in block_tables[:num_decodes])
        decode_blocks = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in block_tables[:num_decodes]],
            dtype=torch.long,
            device=device,
        )
        max_len = max_blocks * block_size
        lens = torch.tensor(seq_lens[:num_decodes], device=device).unsqueeze(1)
        invalid = torch.arange(max_len, device=device).unsqueeze(0) >= lens
        decode_mask = torch.zeros(invalid.shape, dtype=dtype, device=device)
        decode_mask.masked_fill_(invalid, neg_inf)
        decode_mask = decode_mask.view(1, num_decodes, 1, max_len)
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
        mask = torch.zeros((num_query, num_keys), dtype=dtype, device=device)
        mask.masked_fill_(key_pos > query_pos, neg_inf)
        prefills.append(PrefillSeq(query_start, query_start + num_query, slots, mask))
        query_start += num_query
    return AttentionMetadata(slot_mapping, num_decodes, decode_blocks, decode_mask, prefills)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q [T, Hq, D] -> [T, Hq * D].

    The caches are head-major [Hkv, num_blocks, block_size, D]: gathering whole blocks
    yields [Hkv, batch, len, D], which batched matmuls consume without another copy.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_slots = k_cache.view(num_kv_heads, -1, head_dim)
    v_slots = v_cache.view(num_kv_heads, -1, head_dim)
    k_slots.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_slots.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = meta.num_decodes
    if batch:
        assert meta.decode_blocks is not None
        assert meta.decode_mask is not None
        blocks = meta.decode_blocks.view(-1)
        max_len = meta.decode_mask.shape[-1]
        keys = k_cache.index_select(1, blocks).view(num_kv_heads * batch, max_len, head_dim)
        values = v_cache.index_select(1, blocks).view(num_kv_heads * batch, max_len, head_dim)
        qd = q[:batch].view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.bmm(qd.reshape(num_kv_heads * batch, group, head_dim), keys.transpose(1, 2))
        scores = scores.view(num_kv_heads, batch, group, max_len).float().mul_(scale)
        probs = torch.softmax(scores.add_(meta.decode_mask), dim=-1).to(q.dtype)
        context = torch.bmm(probs.view(num_kv_heads * batch, group, max_len), values)
        out[:batch] = (
            context.view(num_kv_heads, batch, group, head_dim)
            .transpose(0, 1)
            .reshape(batch, num_heads, head_dim)
        )
    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_end)
        num_query = seq.query_end - seq.query_start
        if seq.slots is None:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys, values = k_slots.index_select(1, seq.slots), v_slots.index_select(1, seq.slots)
        qp = q[rows].view(num_query, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qp = qp.reshape(num_kv_heads, group * num_query, head_dim)
        scores = torch.bmm(qp, keys.transpose(1, 2)).view(num_kv_heads, group, num_query, -1)
        scores = scores.float().mul_(scale).add_(seq.mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads, group * num_query, -1)
        context = torch.bmm(probs, values).view(num_kv_heads, group, num_query, head_dim)
        out[rows] = context.permute(2, 0, 1, 3).reshape(num_query, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)
