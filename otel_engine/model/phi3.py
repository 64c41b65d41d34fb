"""Phi-3 / 3.5 / 4-mini: the Llama decoder with q/k/v and gate/up stored fused
(`qkv_proj`, `gate_up_proj`: split here, then sharded like Llama's), and LongRoPE
(`rope_type: longrope`, layers.py) for the long-context variants."""

from __future__ import annotations

import torch

from otel_engine.model.llama import LlamaModel, Take
from otel_engine.model.projections import GATE_UP, QKV, Projection


class Phi3Model(LlamaModel):
    def _dense_parts(self, take: Take, projection: Projection) -> list[torch.Tensor]:
        arch = self.arch
        if projection is QKV:
            q_size = arch.num_attention_heads * arch.head_dim
            kv_size = arch.num_key_value_heads * arch.head_dim
            return list(take("self_attn.qkv_proj.weight").split([q_size, kv_size, kv_size]))
        if projection is GATE_UP:
            return list(take("mlp.gate_up_proj.weight").chunk(2))
        return super()._dense_parts(take, projection)
