"""The bytes one forward reads from memory on this rank: weights in their stored form and
the KV cache its attention reads. Decode speed is held against the machine's read bandwidth
(`model/bandwidth.py`) with this count.

Counted, once per step: every layer matrix in the form it is read from (`matrix_bytes`: the
4-bit kernels' packed weights and scales up to INT4_MAX_ROWS rows, their bfloat16 panels or
the file's blocks beyond; GGUF blocks; dense and oneDNN-packed weights at the model dtype),
the experts a mixture routes the step's tokens to (at most `top_k` per token), the LM head
when the step computes logits (the sampling rank only), the embedding rows looked up, and
every cached K and V of every sequence, in every layer. Norm weights (under 0.1% of the
default model) are not counted. Everything but the KV sum is worked out once at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from otel_engine.model.int4 import INT4_MAX_ROWS
from otel_engine.model.matrix import DenseMatrix, Int4Matrix, Matrix

if TYPE_CHECKING:
    import torch

    from otel_engine.model.llama import LlamaModel

# A form this count does not know yet is counted as bfloat16, never refused: the count is
# telemetry, and must not stop a model from loading.
UNKNOWN_FORM_BYTES = 2


def matrix_bytes(matrix: Matrix, rows: int) -> int:
    """The bytes `matrix(x)` reads for an x of `rows` rows: its stored form's, and its bias."""
    bias = 0 if matrix.bias is None else matrix.bias.nbytes
    if isinstance(matrix, Int4Matrix):
        int4 = matrix.int4
        if rows <= INT4_MAX_ROWS:
            return int4.packed.nbytes + int4.params.nbytes + bias
        if int4.panels is not None:
            return int4.panels.nbytes + bias
    if matrix.blocks is not None:
        return sum(part.raw.nbytes for part in matrix.blocks.parts) + bias
    if isinstance(matrix, DenseMatrix):  # and PackedMatrix: oneDNN's layout, the same bytes
        return matrix.rows * matrix.cols * matrix.weight.dtype.itemsize + bias
    return matrix.rows * matrix.cols * UNKNOWN_FORM_BYTES + bias


@dataclass(frozen=True, slots=True)
class StepReads:
    """What a step reads, by its size: `layers` and `lm_head` by step rows up to
    INT4_MAX_ROWS and beyond; per expert of a mixture, per token's embedding row, per token
    of KV cache (every layer, K and V, this rank's heads)."""

    layers: tuple[int, int]
    lm_head: tuple[int, int]
    expert_bytes: int  # one expert of every mixture layer, together
    num_experts: int
    top_k: int
    embedding_row: int
    kv_per_token: int

    @classmethod
    def of(
        cls, model: LlamaModel, *, computes_logits: bool, kv_dtype: torch.dtype | None = None
    ) -> StepReads:
        """Counted once from the loaded model; `computes_logits`: this rank runs the LM head;
        `kv_dtype`: what its KV cache stores (None: the model's dtype)."""
        matrices = [m for layer in model.layers for m in layer.matrices.values()]
        sizes = (1, INT4_MAX_ROWS + 1)
        layers = [sum(matrix_bytes(m, rows) for m in matrices) for rows in sizes]
        lm_head = [matrix_bytes(model.lm_head, rows) if computes_logits else 0 for rows in sizes]
        experts = [layer.moe for layer in model.layers if layer.moe is not None]
        for moe in experts:
            layers = [total + moe.router.nbytes for total in layers]
        expert_bytes = sum(m.gate_up[0].nbytes + m.down[0].nbytes for m in experts)
        embedding = model.embedding
        if embedding.blocks is not None:
            row = embedding.blocks.raw[0].nbytes
        else:
            assert embedding.weight is not None
            row = embedding.weight[0].nbytes
        kv_heads, head_dim = model.num_kv_heads, model.head_dim
        kv_itemsize = (model.dtype if kv_dtype is None else kv_dtype).itemsize
        return cls(
            layers=(layers[0], layers[1]),
            lm_head=(lm_head[0], lm_head[1]),
            expert_bytes=expert_bytes,
            num_experts=experts[0].gate_up.shape[0] if experts else 0,
            top_k=experts[0].top_k if experts else 0,
            embedding_row=row,
            kv_per_token=2 * len(model.layers) * kv_heads * head_dim * kv_itemsize,
        )

    def bytes_read(self, num_tokens: int, seq_lens: Sequence[int], num_logit_rows: int) -> int:
        """A step of `num_tokens` tokens over sequences whose context after the step is
        `seq_lens`, computing logits for `num_logit_rows` rows."""
        larger = num_tokens > INT4_MAX_ROWS
        total = self.layers[larger] + num_tokens * self.embedding_row
        total += self.kv_per_token * sum(seq_lens)
        if num_logit_rows:
            total += self.lm_head[num_logit_rows > INT4_MAX_ROWS]
        if self.num_experts:
            total += min(self.num_experts, num_tokens * self.top_k) * self.expert_bytes
        return total
