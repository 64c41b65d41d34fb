"""A checkpoint directory's weights, by Hugging Face name (`iter_weights`). A GGUF conversion
keeps its layer matrices in their GGUF blocks (`QUANT_FILE`, `QuantTensor`): read as they
are by the quantized kernels (model/quant.py) and the 4-bit ones (`iter_int4`), or
dequantized to bfloat16 as they are read otherwise. Torch is imported by the functions that
need it."""

from __future__ import annotations

import enum
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


QUANT_FILE = os.path.join("quant", "weights.safetensors")


INT4_GROUP = 32  # weights per scale and offset in the 4-bit formats


class GgmlType(enum.IntEnum):
    """The GGUF formats kept in their blocks, by ggml type id (gguf-py's GGMLQuantizationType
    values): the kernels read every one of them (cpu_kernels.c, "GGUF block formats", states
    the same ids in its contract, which kernels.load() compares with these)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


INT4_TYPES = frozenset({GgmlType.Q4_0.name, GgmlType.Q4_1.name})  # also the 4-bit kernels'


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A matrix [rows, cols] in its GGUF blocks: `raw` uint8 [rows, row bytes], each row
    cols / block weights-per-block blocks of format `kind` (a `GgmlType` name). `rows` and
    `type_id` are computed once: every matmul call of a step reads them."""

    raw: torch.Tensor
    kind: str
    cols: int
    rows: int = field(init=False)
    type_id: GgmlType = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", int(self.raw.shape[0]))
        object.__setattr__(self, "type_id", GgmlType[self.kind])

    def dequantize(self) -> torch.Tensor:
        """The matrix as float32, as gguf-py's dequantize computes it."""
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.raw.numpy(), GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def iter_weights(
    model_dir: str, *, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """Every tensor of every *.safetensors file in `model_dir` with its Hugging Face name; the
    matrices a GGUF conversion kept in their blocks as `QuantTensor`s (`keep_quantized`) or
    dequantized to bfloat16."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
    for name, tensor in iter_quant(model_dir):
        if keep_quantized:
            yield name, tensor
        else:
            import torch

            yield name, tensor.dequantize().to(torch.bfloat16)


def iter_quant(model_dir: str) -> Iterator[tuple[str, QuantTensor]]:
    """The matrices kept in their GGUF blocks, by Hugging Face name (none for a checkpoint
    that is not a GGUF conversion)."""
    from safetensors import safe_open

    path = os.path.join(model_dir, QUANT_FILE)
    if not os.path.isfile(path):
        return
    with safe_open(path, framework="pt") as f:
        formats = json.loads((f.metadata() or {}).get("formats", "{}"))
        for name in f.keys():  # noqa: SIM118
            kind, cols = formats[name]
            yield name, QuantTensor(f.get_tensor(name), kind, int(cols))


@dataclass(frozen=True, slots=True)
class Int4Tensor:
    """A weight stored in 4 bits: w = scale * q + offset, per group of `INT4_GROUP` weights
    along a row. `q` [rows, cols] uint8 in 0..15; `scale`, `offset` [rows, cols / group];
    `blocks`: the Q4_0/Q4_1 blocks they were read from (None: built otherwise)."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    blocks: QuantTensor | None = None


def iter_int4(model_dir: str) -> dict[str, Int4Tensor]:
    """The checkpoint's Q4_0 and Q4_1 matrices as 4-bit weights, by Hugging Face name without
    `.weight` (empty when it has none)."""
    return {
        name.removesuffix(".weight"): int4_tensor(tensor)
        for name, tensor in iter_quant(model_dir)
        if tensor.kind in INT4_TYPES
    }


def int4_tensor(tensor: QuantTensor) -> Int4Tensor:
    """A Q4_0 (w = d * (q - 8)) or Q4_1 (w = d * q + m) matrix's 4-bit weights, scales and
    offsets (the f16 fields widened to float32: exact)."""
    import numpy as np
    import torch

    halves = 1 if tensor.kind == "Q4_0" else 2
    raw = tensor.raw.numpy()
    blocks = raw.reshape(raw.shape[0], -1, 2 * halves + INT4_GROUP // 2)
    header = blocks[..., : 2 * halves].copy().view(np.float16).astype(np.float32)
    nibbles = blocks[..., 2 * halves :]
    # low nibbles are elements 0..15 of a block, high ones 16..31
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1)
    scale = header[..., 0]
    offset = -8.0 * scale if tensor.kind == "Q4_0" else header[..., 1]
    return Int4Tensor(
        torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(offset), tensor
    )
