"""Paged attention in plain torch: K/V live in fixed-size blocks, read through block tables.

The cache of one layer is two tensors [num_slots, num_kv_heads, head_dim] with
slot = block_id * block_size + offset. Decode sequences (one query token) are batched
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
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] cache slots to read
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] additive
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
    neg_inf = torch.finfo(dtype).min
    decode_slots = decode_mask = None
    if num_decodes:
        max_blocks = max(len(t) for t in block_tables[:num_decodes])
        table = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in block_tables[:num_decodes]],
            dtype=torch.long,
            device=device,
        )
        offsets = torch.arange(block_size, device=device)
        decode_slots = (table.unsqueeze(-1) * block_size + offsets).flatten(1)
        max_len = max(seq_lens[:num_decodes])
        decode_slots = decode_slots[:, :max_len].contiguous()
        lens = torch.tensor(seq_lens[:num_decodes], device=device).unsqueeze(1)
        invalid = torch.arange(max_len, device=device).unsqueeze(0) >= lens
        decode_mask = torch.zeros(invalid.shape, dtype=dtype, device=device)
        decode_mask.masked_fill_(invalid, neg_inf)
        decode_mask = decode_mask.view(num_decodes, 1, 1, max_len)
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
    return AttentionMetadata(slot_mapping, num_decodes, decode_slots, decode_mask, prefills)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q [T, Hq, D] -> [T, Hq * D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    num_decodes = meta.num_decodes
    if num_decodes:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        qd = q[:num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
        kd = k_cache[meta.decode_slots].permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        scores = torch.matmul(qd, kd).mul_(scale).add_(meta.decode_mask)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        vd = v_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
        out[:num_decodes] = torch.matmul(probs, vd).view(num_decodes, num_heads, head_dim)
    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_end)
        num_query = seq.query_end - seq.query_start
        if seq.slots is None:
            keys, values = k[rows], v[rows]
        else:
            keys, values = k_cache[seq.slots], v_cache[seq.slots]
        qp = q[rows].view(num_query, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(qp, keys.permute(1, 2, 0).unsqueeze(1)).mul_(scale)
        scores.add_(seq.mask)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        context = torch.matmul(probs, values.transpose(0, 1).unsqueeze(1))  # [Hkv, G, Q, D]
        out[rows] = context.permute(2, 0, 1, 3).reshape(num_query, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)
