"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain torch, tensor-parallel by heads.

Each rank holds its share of the attention heads (fused q/k/v rows) and of the MLP
(fused gate/up rows); the output projections are split by columns and summed with an
all-reduce. Embeddings and the LM head are replicated; only the sampling rank computes
logits.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from otel_engine.model.attention import AttentionMetadata, paged_attention
from otel_engine.model.layers import RotaryEmbedding, rms_norm
from otel_engine.model.loader import ModelArch


def _pop_prefixed(staged: dict[str, torch.Tensor], prefix: str, key: str) -> torch.Tensor:
    return staged.pop(prefix + key)


def check_tensor_parallel(arch: ModelArch, tp_size: int) -> None:
    """Fail early, with the numbers, when the heads cannot be split across `tp_size` ranks."""
    problems = []
    if arch.num_attention_heads % tp_size:
        problems.append(f"{arch.num_attention_heads} attention heads")
    if arch.num_key_value_heads % tp_size:
        problems.append(f"{arch.num_key_value_heads} key/value heads")
    if arch.intermediate_size % tp_size:
        problems.append(f"an MLP size of {arch.intermediate_size}")
    if problems:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide the model's "
            f"{' and '.join(problems)}; choose a size that divides them"
        )


class LlamaLayer:
    """One decoder layer's weights (this rank's shard) and forward."""

    def __init__(self) -> None:
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.qkv: torch.Tensor
        self.qkv_bias: torch.Tensor | None = None
        self.o_proj: torch.Tensor
        self.gate_up: torch.Tensor
        self.down: torch.Tensor


class LlamaModel:
    """Weights as plain tensors (no nn.Module: inference only, no autograd state)."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        max_positions: int | None = None,
    ) -> None:
        check_tensor_parallel(arch, tp_size)
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.head_dim = arch.head_dim
        self.num_heads = arch.num_attention_heads // tp_size
        self.num_kv_heads = arch.num_key_value_heads // tp_size
        self.intermediate = arch.intermediate_size // tp_size
        self.scale = self.head_dim**-0.5
        self.layers = [LlamaLayer() for _ in range(arch.num_hidden_layers)]
        self.rotary = RotaryEmbedding(
            self.head_dim,
            max_positions or arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            dtype,
            device,
        )
        self.embed: torch.Tensor
        self.norm: torch.Tensor
        self.lm_head: torch.Tensor

    # ---- loading -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named full tensors, keep this rank's shard in the target dtype."""
        staged: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            staged[name] = tensor
        self.embed = self._place(staged.pop("model.embed_tokens.weight"))
        self.norm = self._place(staged.pop("model.norm.weight"))
        lm_head = staged.pop("lm_head.weight", None)
        self.lm_head = (
            self.embed if lm_head is None or self.arch.tie_word_embeddings else self._place(lm_head)
        )
        for i, layer in enumerate(self.layers):
            take = functools.partial(_pop_prefixed, staged, f"model.layers.{i}.")
            layer.input_norm = self._place(take("input_layernorm.weight"))
            layer.post_norm = self._place(take("post_attention_layernorm.weight"))
            q, k, v = (take(f"self_attn.{p}_proj.weight") for p in "qkv")
            layer.qkv = self._place(torch.cat([self._rows(q), self._rows(k), self._rows(v)]))
            if self.arch.attention_bias:
                qb, kb, vb = (take(f"self_attn.{p}_proj.bias") for p in "qkv")
                layer.qkv_bias = self._place(
                    torch.cat([self._rows(qb), self._rows(kb), self._rows(vb)])
                )
            layer.o_proj = self._place(self._cols(take("self_attn.o_proj.weight")))
            gate, up = take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")
            layer.gate_up = self._place(torch.cat([self._rows(gate), self._rows(up)]))
            layer.down = self._place(self._cols(take("mlp.down_proj.weight")))
        unused = [n for n in staged if "rotary_emb" not in n]
        if unused:
            raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")

    def _rows(self, weight: torch.Tensor) -> torch.Tensor:
        size = weight.shape[0] // self.tp_size
        return weight[self.tp_rank * size : (self.tp_rank + 1) * size]

    def _cols(self, weight: torch.Tensor) -> torch.Tensor:
        size = weight.shape[1] // self.tp_size
        return weight[:, self.tp_rank * size : (self.tp_rank + 1) * size]

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    # ---- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        eps = self.arch.rms_norm_eps
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.lookup(positions)
        num_qk_heads = self.num_heads + self.num_kv_heads
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(hidden, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            qk = qkv[:, : q_size + kv_size].view(-1, num_qk_heads, self.head_dim)
            q, k = self.rotary.apply(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            hidden = hidden + self._all_reduce(F.linear(attn, layer.o_proj))
            x = rms_norm(hidden, layer.post_norm, eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + self._all_reduce(F.linear(F.silu(gate) * up, layer.down))
        return rms_norm(hidden, self.norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x)
        return x
