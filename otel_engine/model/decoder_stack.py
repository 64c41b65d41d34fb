"""A 4-bit model's decoder layers as one call into `decoder_stack_bf16` (cpu_kernels.c): the
binding of the C stack's fields (each layer's tensor addresses, by the names the contract
string lists) and dims, apart from the model code (model/llama.py) that builds it. It reads
the model through `StackModel`, what it needs of one, so it does not import the model code."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from otel_engine.model.arch import ModelArch
from otel_engine.model.attention import AttentionMetadata
from otel_engine.model.fast_paths import Form
from otel_engine.model.int4 import INT4_MAX_ROWS
from otel_engine.model.kernels import PREFILL_CHUNK_FIELDS
from otel_engine.model.layer_ops import KernelOps
from otel_engine.model.matrix import Int4Matrix, Matrix
from otel_engine.model.projections import DOWN, GATE_UP, O_PROJ, QKV, Projection
from otel_engine.model.weights import INT4_GROUP


class StackLayer(Protocol):
    """What the stack reads of one decoder layer (`llama.LlamaLayer`)."""

    @property
    def input_norm(self) -> torch.Tensor: ...
    @property
    def post_norm(self) -> torch.Tensor: ...
    @property
    def matrices(self) -> Mapping[Projection, Matrix]: ...


class StackModel(Protocol):
    """What the stack reads of the model on this rank (`llama.LlamaModel`)."""

    @property
    def arch(self) -> ModelArch: ...
    @property
    def layers(self) -> Sequence[StackLayer]: ...
    @property
    def norm(self) -> torch.Tensor: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate(self) -> int: ...


class DecoderStack:
    """A 4-bit model's decoder layers as one call into `decoder_stack_bf16` (cpu_kernels.c):
    the same kernels, in the same order, as `LlamaModel.forward`'s loop with KernelOps (the
    same results to the bit), without the Python and ctypes around each of them."""

    def __init__(
        self,
        model: StackModel,
        ops: KernelOps,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        assert ops.decoder_stack is not None
        self.kv_caches = kv_caches
        self._call = ops.decoder_stack
        self._ops = ops
        self._model = model
        self._dim_names = ops.stack_layout.stack_dims  # the C side's order of fields and dims
        fields = []
        for layer, caches in zip(model.layers, kv_caches, strict=True):
            addresses = _layer_addresses(layer, caches)
            fields += [addresses[name] for name in ops.stack_layout.stack_fields]
        self._layers = torch.tensor(fields, dtype=torch.int64)
        self._has_panels = all(
            m.form is Form.INT4_PANELS for layer in model.layers for m in layer.matrices.values()
        )
        k_cache = kv_caches[0][0]
        self._cache_dims = (k_cache.shape[2], k_cache.shape[1] * k_cache.shape[2])
        # the widest k of the four matrices: hidden (q/k/v, gate/up), heads (o), intermediate
        widest = max(model.arch.hidden_size, model.num_heads * model.head_dim, model.intermediate)
        self._sums = torch.empty(INT4_MAX_ROWS * widest // INT4_GROUP, dtype=torch.float32)

    def runs(self, tokens: int, meta: AttentionMetadata) -> bool:
        """Whether the stack takes this step: not one whose prefill runs in torch's fused
        attention, nor one of more than INT4_MAX_ROWS tokens where the 4-bit matrices have
        no panels (those steps multiply tiles by torch's matmul): both go layer by layer."""
        if meta.prefills and meta.prefill_tables is None:
            return False
        return tokens <= INT4_MAX_ROWS or self._has_panels

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        model, ops = self._model, self._ops
        tokens, size = hidden.shape
        heads, kv_heads, inter = model.num_heads, model.num_kv_heads, model.intermediate
        block_size, num_slots = self._cache_dims
        decodes = meta.num_decodes
        tables, lens = meta.decode_tables, meta.decode_lens
        if meta.prefills:
            chunks, scratch = ops.prefill_chunks(meta)
        else:
            chunks, scratch = _NO_CHUNKS, _NO_CHUNKS
        dims = {
            "tokens": tokens,
            "hidden": size,
            "intermediate": inter,
            "heads": heads,
            "kv_heads": kv_heads,
            "block_size": block_size,
            "num_slots": num_slots,
            "int4_max_rows": INT4_MAX_ROWS,
            "decodes": decodes,
            "max_blocks": tables.shape[1] if decodes and tables is not None else 0,
            "prefills": chunks.shape[0],
            "layers": len(model.layers),
        }
        dims_tensor = torch.tensor([dims[name] for name in self._dim_names], dtype=torch.int64)
        dtype = hidden.dtype
        out = torch.empty_like(hidden)
        x, delta = torch.empty_like(hidden), torch.empty_like(hidden)
        attn = torch.empty((tokens, heads * model.head_dim), dtype=dtype)
        qkv = torch.empty((tokens, (heads + 2 * kv_heads) * model.head_dim), dtype=dtype)
        gate_up = torch.empty((tokens, 2 * inter), dtype=dtype)
        act = torch.empty((tokens, inter), dtype=dtype)
        self._call(
            hidden=hidden,
            out=out,
            layers=self._layers,
            dims=dims_tensor,
            final_norm=model.norm,
            cos_sin=ops.cos_sin,
            positions=meta.positions,
            slots=meta.slot_mapping,
            decode_tables=tables if decodes else None,
            decode_lens=lens if decodes else None,
            prefills=chunks,
            x=x,
            qkv=qkv,
            attn=attn,
            delta=delta,
            gate_up=gate_up,
            act=act,
            sums=self._sums,
            prefill_scratch=scratch,
            eps=model.arch.rms_norm_eps,
            scale=ops.scale,
        )
        return out


def _layer_addresses(
    layer: StackLayer, caches: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, int]:
    """A layer's tensors by the names of `decoder_stack_bf16`'s fields (cpu_kernels.c)."""
    addresses = {
        "input_norm": layer.input_norm.data_ptr(),
        "post_norm": layer.post_norm.data_ptr(),
        "k_cache": caches[0].data_ptr(),
        "v_cache": caches[1].data_ptr(),
    }
    for projection, name in _FIELD_NAMES.items():
        matrix = layer.matrices[projection]
        assert isinstance(matrix, Int4Matrix), "the plan runs the stack on 4-bit layers only"
        weight = matrix.int4
        addresses[f"{name}_packed"] = weight.packed.data_ptr()
        addresses[f"{name}_params"] = weight.params.data_ptr()
        # none where larger steps run tiles instead (`DecoderStack.runs`): never read
        addresses[f"{name}_panels"] = 0 if weight.panels is None else weight.panels.data_ptr()
    return addresses


_NO_CHUNKS = torch.zeros((0, len(PREFILL_CHUNK_FIELDS)), dtype=torch.int64)
_FIELD_NAMES = {QKV: "qkv", O_PROJ: "o", GATE_UP: "gate_up", DOWN: "down"}  # C's prefixes
