"""Small building blocks of a Llama decoder: RMSNorm and rotary position embeddings."""

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


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position (HF rotate_half layout)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        attention_factor = 1.0
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
        elif kind == "linear":
            inv_freq = inv_freq / float((scaling or {})["factor"])
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope scaling type {kind!r}")
        positions = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * attention_factor).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * attention_factor).to(dtype=dtype, device=device)
        self.half = head_dim // 2

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, [T, 1, D]; done once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (q and k heads together) by their positions."""
        rotated = torch.cat((-x[..., self.half :], x[..., : self.half]), dim=-1)
        return x * cos + rotated * sin
