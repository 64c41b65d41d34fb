"""Gemma 3 (text) and Gemma 2: the shared decoder's weights and attention with Gemma's
differences (Gemma 2: no q/k norms, one RoPE base for every layer).

Embeddings scaled by sqrt(hidden); RMSNorms of weight (1 + w), applied in float32; norms on
both sides of the attention and of the MLP (the residual adds their outputs); a GeGLU MLP
(tanh-approximate GELU); q and k heads normalized before RoPE; attention scaled by
query_pre_attn_scalar ** -0.5, its scores soft-capped (cap * tanh(s / cap)) where the config
has `attn_logit_softcapping`; layers that alternate a sliding window (with their own RoPE
base) and full attention; a tanh soft cap on the final logits where the config has one.
The windowed layers need the torch attention ops (`TorchOps` with a window); the compiled
kernels attend to every cached token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from otel_engine.model.attention import AttentionMetadata
from otel_engine.model.layer_ops import LayerOps, TorchOps
from otel_engine.model.layers import RotaryEmbedding, rms_norm_f32, soft_cap_
from otel_engine.model.llama import LlamaLayer, LlamaModel, Take
from otel_engine.model.projections import DOWN, GATE_UP, O_PROJ, QKV


class Gemma3Layer(LlamaLayer):
    def __init__(self) -> None:
        super().__init__()
        self.pre_ff_norm: torch.Tensor
        self.post_ff_norm: torch.Tensor


class Gemma3Model(LlamaModel):
    layer_class = Gemma3Layer
    head_norm = staticmethod(rms_norm_f32)

    kernels_blocker = "sliding-window attention runs on torch ops"

    def _make_ops(self, max_positions: int | None) -> LayerOps:
        """Torch ops with the window (whatever --kernels says), and the sliding layers' RoPE."""
        arch = self.arch
        self.sliding = frozenset(arch.sliding_layers)
        self.embed_scale = torch.tensor(arch.hidden_size**0.5).to(self.dtype)
        local_rotary = RotaryEmbedding(
            self.head_dim,
            max_positions or arch.max_position_embeddings,
            arch.local_rope_theta or 10_000.0,
            None,
            self.dtype,
            self.device,
        )
        return TorchOps(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.rotary,
            self.device,
            scale=arch.attention_scale,
            sliding_window=arch.sliding_window if self.sliding else None,
            local_rotary=local_rotary,
            softcap=arch.attn_logit_softcapping,
        )

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return (1.0 + weight.float()).to(self.device)

    def _load_extras(self, take: Take, layer: LlamaLayer, index: int) -> None:
        assert isinstance(layer, Gemma3Layer)
        super()._load_extras(take, layer, index)
        layer.pre_ff_norm = self._norm_weight(take("pre_feedforward_layernorm.weight"))
        layer.post_ff_norm = self._norm_weight(take("post_feedforward_layernorm.weight"))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        eps = self.arch.rms_norm_eps
        ops = self.ops
        assert isinstance(ops, TorchOps)
        hidden = self.embedding(input_ids) * self.embed_scale
        for index, (layer, (k_cache, v_cache)) in enumerate(
            zip(self.layers, kv_caches, strict=True)
        ):
            assert isinstance(layer, Gemma3Layer)
            weights = layer.matrices
            qkv = weights[QKV](rms_norm_f32(hidden, layer.input_norm, eps))
            if self.arch.qk_norm:
                self._norm_qk(qkv, layer)
            attn = ops.attend(qkv, k_cache, v_cache, meta, sliding=index in self.sliding)
            out = self._all_reduce(weights[O_PROJ](attn))
            hidden = hidden + rms_norm_f32(out, layer.post_norm, eps)
            x = rms_norm_f32(hidden, layer.pre_ff_norm, eps)
            gate, up = weights[GATE_UP](x).chunk(2, dim=-1)
            out = self._all_reduce(weights[DOWN](F.gelu(gate, approximate="tanh") * up))
            hidden = hidden + rms_norm_f32(out, layer.post_ff_norm, eps)
        return rms_norm_f32(hidden, self.norm, eps)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        return None  # soft-capped logits: compute_logits

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = soft_cap_(logits, cap)
        return logits
