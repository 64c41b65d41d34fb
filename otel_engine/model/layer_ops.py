"""What a decoder layer does besides its matmuls (RMSNorm with its residual add, rotary with
the cache write, attention, SiLU-and-mul), the attention metadata of a step, and the greedy
argmax of the LM head's output, in two implementations with one interface.

`TorchOps` is plain torch (any device, any head size; the reference), and the only one with
sliding-window layers. `KernelOps` calls the compiled CPU kernels (`kernels.py`, float32 or
bfloat16): one call replaces each chain of small torch ops, whose dispatch cost dominates a
decode step on a small CPU, and decode attention reads each cached block once instead of
copying it (any even head size: 64 and 128 have their own code up to 8 query heads per KV
head, the others a generic loop). Prefill chunks run in the compiled prefill attention where
the plan enabled it (bfloat16, head size 64 or 128: `fast_paths.PREFILL_KERNEL_HEAD_DIMS`;
where torch runs on AMX, chunks of up to 32 tokens), else in torch's fused attention.
`KernelOps` also hands the decoder stack (model/decoder_stack.py, head size 64) its call and
its prefill chunks. Which one a model gets is `fast_paths.choose`'s decision
(`make_layer_ops`).

Every op takes and returns [tokens, ...] tensors in the model dtype. `add_rms_norm` adds the
residual `delta` into `hidden` in place (the residual stream is owned by the forward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from otel_engine.model.attention import (
    AttentionMetadata,
    decode_attention,
    decode_gather_indices,
    decode_window_mask,
    padded_tables,
    prefill_attention,
    prefill_seqs,
    sdpa_prefill,
    write_cache,
)
from otel_engine.model.fast_paths import FastPaths, Path
from otel_engine.model.kernels import CACHE_SUFFIXES, PREFILL_CHUNK_FIELDS, PREFILL_TILE_KEYS
from otel_engine.model.layers import RotaryEmbedding, rms_norm


class TorchOps:
    """The layer's ops as torch ops (any device), and the interface of every implementation
    (`LayerOps`)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        device: torch.device,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        local_rotary: RotaryEmbedding | None = None,
        softcap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.rotary = rotary
        self.device = device
        # Models whose layers alternate full and sliding-window attention (Gemma 3): the
        # window, and the rotary embedding of the sliding layers (`attend(sliding=True)`).
        self.sliding_window = sliding_window
        self.local_rotary = local_rotary or rotary
        self.softcap = softcap  # attention logit soft-capping (Gemma 2 style configs)

    # prefill masks for `sdpa_prefill` (boolean) rather than `prefill_attention` (additive)
    prefill_sdpa = False
    # argmax(out, logits, rows, vocab): each row's greedy token (`LlamaModel.greedy_tokens`)
    argmax: Callable[..., None] | None = None

    def prefill_in_kernel(self, query_lens: list[int]) -> bool:
        """Whether a step's prefill chunks (their query lengths) run in the compiled prefill
        attention, which needs no masks (torch ops: never)."""
        return False

    def build_metadata(
        self,
        *,
        positions: list[int],
        slot_mapping: list[int],
        num_decodes: int,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> AttentionMetadata:
        device = self.device
        prefills = prefill_seqs(
            num_decodes,
            query_lens,
            seq_lens,
            block_tables,
            block_size,
            device,
            for_sdpa=self.prefill_sdpa,
            window=self.sliding_window,
            masks=not self.prefill_in_kernel(query_lens[num_decodes:]),
        )
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            num_decodes=num_decodes,
            prefills=prefills,
        )
        self._complete_metadata(meta, seq_lens, block_tables, block_size)
        return meta

    def _complete_metadata(
        self,
        meta: AttentionMetadata,
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> None:
        """What this implementation reads besides the common fields."""
        meta.cos, meta.sin = self.rotary.lookup(meta.positions)
        if meta.num_decodes:
            meta.decode_blocks, meta.decode_mask = decode_gather_indices(
                meta.num_decodes, seq_lens, block_tables, block_size, self.device
            )
        if self.sliding_window is not None:
            meta.local_cos, meta.local_sin = self.local_rotary.lookup(meta.positions)
            if meta.num_decodes:
                assert meta.decode_mask is not None
                meta.decode_window_mask = decode_window_mask(
                    meta.decode_mask, seq_lens, self.sliding_window
                )

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if delta is not None:
            hidden.add_(delta)
        return rms_norm(hidden, weight, eps)

    def attend(
        self,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        sliding: bool = False,
    ) -> torch.Tensor:
        """Rotate q and k, write k and v to the cache, attend; `sliding`: a layer of the
        sliding window, with its own rotary embedding (torch ops only)."""
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        rotary, cos, sin = self.rotary, meta.cos, meta.sin
        if sliding:
            rotary, cos, sin = self.local_rotary, meta.local_cos, meta.local_sin
        assert cos is not None
        assert sin is not None
        qk = qkv[:, : q_size + kv_size].view(-1, num_heads + num_kv_heads, head_dim)
        q, k = rotary.apply(qk, cos, sin).split([num_heads, num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        batch = meta.num_decodes
        if batch:
            mask = meta.decode_window_mask if sliding else None
            out[:batch] = decode_attention(
                q[:batch], k_cache, v_cache, meta, self.scale, mask, self.softcap
            )
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_end)
            out[rows] = prefill_attention(
                q[rows],
                k[rows],
                v[rows],
                k_cache,
                v_cache,
                seq,
                self.scale,
                seq.window_mask if sliding else None,
                self.softcap,
            )
        return out.view(-1, num_heads * head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class KernelOps(TorchOps):
    """The layer's ops as calls into the compiled CPU kernels (CPU, float32 or bfloat16)."""

    def __init__(
        self,
        plan: FastPaths,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
    ) -> None:
        """The kernels `plan` (fast_paths.choose) enabled, from its library."""
        super().__init__(num_heads, num_kv_heads, head_dim, rotary, torch.device("cpu"))
        library = plan.library
        assert library is not None
        suffix = _SUFFIX[dtype]
        self._add_rms_norm = getattr(library, f"add_rms_norm_{suffix}")
        # the cache write and decode attention by the cache's dtype (kernels.CACHE_SUFFIXES)
        by_cache = {getattr(torch, name): s for name, s in CACHE_SUFFIXES[suffix].items()}
        self._rope_and_cache = {
            d: getattr(library, f"rope_and_cache_{s}") for d, s in by_cache.items()
        }
        self._decode_attention = {
            d: getattr(library, f"decode_attention_{s}") for d, s in by_cache.items()
        }
        self._silu_mul = getattr(library, f"silu_mul_{suffix}")
        self.argmax = getattr(library, f"argmax_{suffix}")
        self._prefill_attention = None
        if plan.is_on(Path.PREFILL_KERNEL):
            self._prefill_attention = library.prefill_attention_bf16
        # a whole 4-bit model's layers in one call (model/decoder_stack.py)
        self.decoder_stack = None
        if plan.is_on(Path.DECODER_STACK):
            self.decoder_stack = library.decoder_stack_bf16
        self.stack_layout = library.contract  # the order of decoder_stack's fields and dims
        # the longest chunk the kernel takes (None: any); longer ones run in torch's fused
        # attention, as does the whole step's prefill then (fast_paths.PREFILL_KERNEL_MAX_QUERY_AMX)
        self.prefill_kernel_max_query = plan.prefill_kernel_max_query
        self._prefill_scratch = torch.empty(0, dtype=dtype)  # its packed keys and values
        half = head_dim // 2
        # [max_positions, head_dim] float32: cos of each frequency, then its sin
        self.cos_sin = torch.cat(
            [rotary.cos[:, :half].float(), rotary.sin[:, :half].float()], dim=1
        ).contiguous()

    prefill_sdpa = True

    def prefill_in_kernel(self, query_lens: list[int]) -> bool:
        if self._prefill_attention is None:
            return False
        longest = self.prefill_kernel_max_query
        return longest is None or all(n <= longest for n in query_lens)

    def _complete_metadata(
        self,
        meta: AttentionMetadata,
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> None:
        if meta.num_decodes:
            num_decodes = meta.num_decodes
            meta.decode_tables = torch.tensor(
                padded_tables(block_tables[:num_decodes]), dtype=torch.int32
            )
            meta.decode_lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.int32)
        chunks = [seq.query_end - seq.query_start for seq in meta.prefills]
        if meta.prefills and self.prefill_in_kernel(chunks):
            meta.prefill_tables = [
                torch.tensor(table, dtype=torch.int32) for table in block_tables[meta.num_decodes :]
            ]

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        out = torch.empty_like(hidden)
        rows, width = hidden.shape
        self._add_rms_norm(
            hidden=hidden, delta=delta, weight=weight, out=out, rows=rows, width=width, eps=eps
        )
        return out

    def attend(
        self,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        sliding: bool = False,
    ) -> torch.Tensor:
        if sliding:  # the kernels attend to every cached token
            raise NotImplementedError("sliding-window layers run on TorchOps")
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        num_tokens = qkv.shape[0]
        num_slots = k_cache.shape[1] * k_cache.shape[2]
        self._rope_and_cache[k_cache.dtype](
            qkv=qkv,
            cos_sin=self.cos_sin,
            positions=meta.positions,
            slots=meta.slot_mapping,
            k_cache=k_cache,
            v_cache=v_cache,
            tokens=num_tokens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_slots=num_slots,
        )
        out = torch.empty((num_tokens, num_heads * head_dim), dtype=qkv.dtype)
        batch = meta.num_decodes
        if batch:
            assert meta.decode_tables is not None
            assert meta.decode_lens is not None
            self._decode_attention[k_cache.dtype](
                out=out,
                qkv=qkv,
                k_cache=k_cache,
                v_cache=v_cache,
                block_tables=meta.decode_tables,
                seq_lens=meta.decode_lens,
                batch=batch,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=k_cache.shape[2],
                max_blocks=meta.decode_tables.shape[1],
                num_slots=num_slots,
                qkv_width=qkv.shape[1],
                scale=self.scale,
            )
        if meta.prefills:
            self._prefill(out, qkv, k_cache, v_cache, meta)
        return out

    def _prefill(
        self,
        out: torch.Tensor,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Each prefill chunk's attention in the compiled kernel, keys and values read from
        the cache (the chunk's own already written there): 3.5x faster than torch's fused
        attention on a 1,024-token prompt (2.8 vs 9.5 ms a layer); where the step's chunks
        do not all run there (`prefill_in_kernel`), in torch's fused attention."""
        if meta.prefill_tables is None:
            num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
            q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
            q = qkv[:, :q_size].view(-1, num_heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
            v = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
            heads = out.view(-1, num_heads, head_dim)
            for seq in meta.prefills:
                rows = slice(seq.query_start, seq.query_end)
                heads[rows] = sdpa_prefill(
                    q[rows], k[rows], v[rows], k_cache, v_cache, seq, self.scale
                )
            return
        assert self._prefill_attention is not None
        num_slots = k_cache.shape[1] * k_cache.shape[2]
        chunks, scratch = self.prefill_chunks(meta)
        for row in chunks.tolist():  # the chunk's fields are the kernel's parameters
            self._prefill_attention(
                **dict(zip(PREFILL_CHUNK_FIELDS, row, strict=True)),
                out=out,
                qkv=qkv,
                k_cache=k_cache,
                v_cache=v_cache,
                scratch=scratch,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                block_size=k_cache.shape[2],
                num_slots=num_slots,
                qkv_width=qkv.shape[1],
                scale=self.scale,
            )

    def prefill_chunks(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's prefill chunks as the compiled stack takes them, int64 [chunks,
        fields] in the contract's order (`kernels.PREFILL_CHUNK_FIELDS`: query_start,
        num_query, num_keys, the address of the block table, int32); and the scratch that the
        longest needs for its packed keys and values."""
        assert meta.prefill_tables is not None
        rows, tiles = [], 0
        for seq, table in zip(meta.prefills, meta.prefill_tables, strict=True):
            num_query = seq.query_end - seq.query_start
            num_keys = num_query if seq.slots is None else seq.slots.numel()
            fields = {
                "query_start": seq.query_start,
                "num_query": num_query,
                "num_keys": num_keys,
                "table": table.data_ptr(),
            }
            rows.append(tuple(fields[name] for name in PREFILL_CHUNK_FIELDS))
            tiles = max(tiles, -(-num_keys // PREFILL_TILE_KEYS))
        need = 2 * self.num_kv_heads * tiles * PREFILL_TILE_KEYS * self.head_dim
        if self._prefill_scratch.numel() < need:
            self._prefill_scratch = torch.empty(need, dtype=self._prefill_scratch.dtype)
        chunks = torch.tensor(rows, dtype=torch.int64).view(-1, len(PREFILL_CHUNK_FIELDS))
        return chunks, self._prefill_scratch

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, width), dtype=gate_up.dtype)
        self._silu_mul(out=out, gate_up=gate_up, rows=rows, width=width)
        return out


LayerOps = TorchOps  # the interface: KernelOps overrides what it does in compiled code


def make_layer_ops(
    plan: FastPaths,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary: RotaryEmbedding,
    dtype: torch.dtype,
    device: torch.device,
) -> LayerOps:
    """The compiled kernels where `plan` (fast_paths.choose) enabled them, else torch ops."""
    if plan.library is None or not plan.is_on(Path.COMPILED_KERNELS):
        return TorchOps(num_heads, num_kv_heads, head_dim, rotary, device)
    return KernelOps(plan, num_heads, num_kv_heads, head_dim, rotary, dtype)
