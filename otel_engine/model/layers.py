"""Small building blocks of the decoders: RMSNorm and rotary position embeddings (plain,
Llama 3, linear and LongRoPE scaling)."""

from __future__ import annotations

import math
from typing import Any

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in float32 like the reference implementation."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a float32 `weight` applied before rounding to x's dtype (Gemma's order;
    Llama's rounds first)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.x frequency scaling: long wavelengths slowed down, short ones kept."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_freqs(
    positions: torch.Tensor, bases: torch.Tensor, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 long-context): frequencies divided by `short_factor` for positions
    inside the pretrained context and by `long_factor` beyond it, and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original context)). HF transformers switches a whole sequence
    to the long factors once it grows past the original context, keys already computed
    included; a paged cache keeps those keys, so here each position keeps the factors of
    its own range (the same as HF for every sequence within the original context)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float64) * bases)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float64) * bases)
    inside = (positions < original).unsqueeze(1)
    freqs = torch.where(inside, torch.outer(positions, short), torch.outer(positions, long))
    return freqs, float(attention_factor)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position (HF rotate_half layout), over the first
    `head_dim` dimensions of each head (fewer than the head's with a partial rotary factor:
    the rest pass unrotated)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = 1.0 / (theta**exponents)
        attention_factor = 1.0
        scaling = scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        positions = torch.arange(max_positions, dtype=torch.float64)
        if kind == "longrope":
            freqs, attention_factor = _longrope_freqs(positions, theta**exponents, scaling)
        else:
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                inv_freq = inv_freq / float(scaling["factor"])
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope scaling type {kind!r}")
            freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * attention_factor).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * attention_factor).to(dtype=dtype, device=device)
        self.dim = head_dim
        self.half = head_dim // 2

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, [T, 1, D]; done once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (q and k heads together) by their positions."""
        if x.shape[-1] != self.dim:  # partial: rotate the first `dim`, keep the rest
            return torch.cat((self.apply(x[..., : self.dim], cos, sin), x[..., self.dim :]), -1)
        rotated = torch.cat((-x[..., self.half :], x[..., : self.half]), dim=-1)
        return x * cos + rotated * sin


def soft_cap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in place: Gemma's soft caps on attention scores and logits."""
    return x.div_(cap).tanh_().mul_(cap)
