"""A checkpoint directory's weights, by Hugging Face name (`iter_weights`), and the 4-bit
weights a GGUF conversion keeps as they were stored (`iter_int4`). Torch is imported by the
functions that need it."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


INT4_FILE = os.path.join("int4", "weights.safetensors")


INT4_GROUP = 32  # weights per scale and offset in the 4-bit formats


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in `model_dir`, with its Hugging Face name."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


@dataclass(frozen=True, slots=True)
class Int4Tensor:
    """A weight stored in 4 bits: w = scale * q + offset, per group of `INT4_GROUP` weights
    along a row. `q` [rows, cols] uint8 in 0..15; `scale`, `offset` [rows, cols / group]."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


def iter_int4(model_dir: str) -> dict[str, Int4Tensor]:
    """The checkpoint's 4-bit weights by Hugging Face name (empty when it has none)."""
    from safetensors import safe_open

    path = os.path.join(model_dir, INT4_FILE)
    if not os.path.isfile(path):
        return {}
    found: dict[str, Int4Tensor] = {}
    with safe_open(path, framework="pt") as f:
        names = {key.rpartition(".")[0] for key in f.keys()}  # noqa: SIM118
        for name in names:
            packed = f.get_tensor(f"{name}.q4")
            q = _unpack_nibbles(packed)
            scale, offset = f.get_tensor(f"{name}.scale"), f.get_tensor(f"{name}.offset")
            found[name] = Int4Tensor(q, scale, offset)
    return found


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 2] bytes (element 2j in the low nibble) -> [rows, cols] uint8."""
    import torch

    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
