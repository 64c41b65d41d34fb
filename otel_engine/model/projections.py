"""A decoder layer's weight matrices, declared once: each `Projection` names the checkpoint
tensors it fuses (Hugging Face names, in row order) and how tensor parallelism splits it.
The fast-path plan decides each one's stored form from these (`fast_paths.choose`), the
model loads each one as a `matrix.Matrix` by them (`LlamaModel`); nothing else lists them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Split(enum.Enum):
    """How a matrix is shared across tensor-parallel ranks."""

    ROWS = "rows"  # each rank its output rows (heads, MLP rows); no reduction after
    COLUMNS = "columns"  # each rank its input columns; the outputs are summed (all-reduce)


@dataclass(frozen=True, slots=True, eq=False)
class Projection:
    """One matrix of a layer (the key of `LlamaLayer.matrices`): `name` says which, `sources` the
    checkpoint tensors (without `.weight`) fused in that order, `in_mlp` whether a layer
    with a mixture of experts has experts instead. Compared and hashed by identity (the
    declared instances are the keys of every layer's matrices, looked up per step)."""

    name: str
    sources: tuple[str, ...]
    split: Split
    in_mlp: bool = False

    def weight_names(self, layer: int) -> list[str]:
        return [f"model.layers.{layer}.{source}.weight" for source in self.sources]


QKV = Projection("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), Split.ROWS)
O_PROJ = Projection("o_proj", ("self_attn.o_proj",), Split.COLUMNS)
GATE_UP = Projection("gate_up", ("mlp.gate_proj", "mlp.up_proj"), Split.ROWS, in_mlp=True)
DOWN = Projection("down", ("mlp.down_proj",), Split.COLUMNS, in_mlp=True)
PROJECTIONS = (QKV, O_PROJ, GATE_UP, DOWN)
