"""Phi-3 / 3.5 / 4-mini: the Llama decoder with q/k/v and gate/up stored fused
(`qkv_proj`, `gate_up_proj`: split here, then sharded like Llama's), and LongRoPE
(`rope_type: longrope`, layers.py) for the long-context variants."""

from __future__ import annotations

from collections.abc import Callable

import torch

from otel_engine.model.llama import LlamaLayer, LlamaModel


class Phi3Model(LlamaModel):
    def _load_attention(self, take: Callable[[str], torch.Tensor], layer: LlamaLayer) -> None:
        arch = self.arch
        q_size = arch.num_attention_heads * arch.head_dim
        kv_size = arch.num_key_value_heads * arch.head_dim
        q, k, v = take("self_attn.qkv_proj.weight").split([q_size, kv_size, kv_size])
        self._set_qkv(layer, q, k, v)
        layer.o_proj = self._place(self._cols(take("self_attn.o_proj.weight")))

    def _load_mlp(self, take: Callable[[str], torch.Tensor], layer: LlamaLayer, index: int) -> None:
        gate, up = take("mlp.gate_up_proj.weight").chunk(2)
        self._set_gate_up(layer, gate, up)
        layer.down = self._place(self._cols(take("mlp.down_proj.weight")))
