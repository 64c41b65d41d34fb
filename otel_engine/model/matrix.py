"""One weight matrix of this rank, in the form the fast-path plan chose for it
(`fast_paths.Form`), behind one call: `matrix(x)` is x @ W.T (+ bias) in the model dtype.

  DenseMatrix   the model dtype, `F.linear`
  PackedMatrix  the model dtype reordered once for oneDNN
  Int4Matrix    a Q4_0/Q4_1 matrix by its exact 4-bit weights (`q4_linear_bf16`), larger steps
                by bfloat16 panels (`panel_linear_bf16`) or by tiles of the file's blocks
  BlockMatrix   a GGUF matrix by its blocks (model/quant.py's `QuantLinear`), in bfloat16
                or float32

`build` makes the one the plan names from a projection's parts (this rank's shard, `Shard`);
`MatrixKernels` holds the kernels and scratch buffers the quantized forms share. The
embedding is looked up from its rows, dense or in blocks (`Embedding`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from otel_engine.config import QuantActivations
from otel_engine.memory import huge_page_copies
from otel_engine.model.fast_paths import INT4_FORMS, FastPaths, Form, Larger
from otel_engine.model.int4 import INT4_MAX_ROWS, Int4Weight, pack_int4
from otel_engine.model.projections import Split
from otel_engine.model.quant import QuantLinear, QuantWeight, pack_quant, shard_columns
from otel_engine.model.weights import INT4_GROUP, QuantTensor, int4_tensor


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's part of a matrix split across `size` ranks."""

    rank: int
    size: int

    def of(self, tensor: torch.Tensor, split: Split) -> torch.Tensor:
        """The rank's rows (Split.ROWS) or columns (Split.COLUMNS) of a dense tensor."""
        if split is Split.ROWS:
            rows = tensor.shape[0] // self.size
            return tensor[self.rank * rows : (self.rank + 1) * rows]
        cols = tensor.shape[1] // self.size
        return tensor[:, self.rank * cols : (self.rank + 1) * cols]

    def of_blocks(self, tensor: QuantTensor, split: Split) -> QuantTensor:
        """The same of a matrix in its blocks (the plan checked it holds whole blocks)."""
        if split is Split.COLUMNS:
            shard = shard_columns(tensor, self.rank, self.size)
            assert shard is not None, "the plan chose blocks for a shard that splits blocks"
            return shard
        return QuantTensor(self.of(tensor.raw, split), tensor.kind, tensor.cols)


class MatrixKernels:
    """The compiled matmuls the quantized forms call, chosen by the plan's dtype and
    sub-choices, and their shared scratch: in bfloat16 a build for AVX-512 BF16's; in float32
    (the plan chooses blocks there only with x in 8 bits) `quant_linear_q8_f32` and, for
    larger steps, `quant_gemm_f32` (each level's micro-kernel), in every build from AVX2 up."""

    def __init__(self, plan: FastPaths) -> None:
        library = plan.library
        assert library is not None, "quantized forms need the kernels library"
        self.dtype = plan.dtype
        if plan.dtype == torch.float32:
            self.dequantize = library.gguf_dequantize_f32
            self.blocks = QuantLinear(
                library.quant_linear_q8_f32,
                self.dequantize,
                None,
                torch.float32,
                gemm=library.quant_gemm_f32,
            )
        else:
            small = {
                QuantActivations.INT8: library.quant_linear_q8_bf16,
                QuantActivations.BFLOAT16: library.quant_linear_bf16,
            }
            amx = library.quant_linear_amx_bf16 if plan.blocks_larger is Larger.AMX else None
            self.dequantize = library.gguf_dequantize_bf16
            self.blocks = QuantLinear(small[plan.activations], self.dequantize, amx)
        self._library = library
        self._sums = torch.empty(0, dtype=torch.float32)  # the 4-bit kernel's sums of x

    # the 4-bit kernels, in AVX-512 BF16 builds alone (the plan takes them in bfloat16 alone)
    @property
    def q4_linear(self) -> Callable[..., None]:
        return self._library.q4_linear_bf16

    @property
    def q4_build_panels(self) -> Callable[..., None]:
        return self._library.q4_build_panels_bf16

    @property
    def panel_linear(self) -> Callable[..., None]:
        return self._library.panel_linear_bf16

    def sums(self, need: int) -> torch.Tensor:
        if self._sums.numel() < need:
            self._sums = torch.empty(need, dtype=torch.float32)
        return self._sums


class Matrix:
    """x @ W.T (+ bias) for this rank's shard of one matrix; `blocks` are the file's GGUF
    blocks it reads (None: it reads none), which `LlamaModel.place_blocks` may move."""

    form: Form
    rows: int
    cols: int
    bias: torch.Tensor | None
    blocks: QuantWeight | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out.add_(self.bias)


class DenseMatrix(Matrix):
    form = Form.DENSE

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.rows, self.cols = weight.shape
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedMatrix(DenseMatrix):
    """The weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor)."""

    form = Form.PACKED

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(torch.ops.mkldnn._reorder_linear_weight(weight, 1), bias)
        self.rows, self.cols = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class BlockMatrix(Matrix):
    form = Form.BLOCKS

    def __init__(
        self, blocks: QuantWeight, kernels: MatrixKernels, bias: torch.Tensor | None
    ) -> None:
        self.blocks = blocks
        self.rows, self.cols = blocks.rows, blocks.cols
        self.kernels = kernels
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self.blocks is not None
        return self._add_bias(self.kernels.blocks(x.contiguous(), self.blocks))


class Int4Matrix(Matrix):
    """Up to INT4_MAX_ROWS rows the exact 4-bit kernel; more by the panels or, where the
    plan chose tiles, by the file's blocks a tile at a time."""

    def __init__(self, int4: Int4Weight, kernels: MatrixKernels, bias: torch.Tensor | None) -> None:
        self.int4 = int4
        self.form = Form.INT4_PANELS if int4.panels is not None else Form.INT4_TILES
        self.rows, self.cols = int4.rows, int4.cols
        self.blocks = int4.blocks
        self.kernels = kernels
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, int4, kernels = x.contiguous(), self.int4, self.kernels
        rows = x.shape[0]
        out = torch.empty((rows, int4.rows), dtype=x.dtype)
        if rows <= INT4_MAX_ROWS:
            sums = kernels.sums(rows * (int4.cols // INT4_GROUP))
            kernels.q4_linear(
                out=out, x=x, w=int4.packed, params=int4.params, sums=sums, rows=rows,
                n=int4.rows, k=int4.cols,
            )  # fmt: skip
        elif int4.panels is not None:
            kernels.panel_linear(
                out=out, x=x, panels=int4.panels, rows=rows, n=int4.rows, k=int4.cols
            )
        else:
            assert self.blocks is not None
            out = kernels.blocks.larger(x, self.blocks, out)
        return self._add_bias(out)


def build(
    form: Form,
    parts: list[QuantTensor],
    split: Split,
    shard: Shard,
    kernels: MatrixKernels,
    bias: torch.Tensor | None,
) -> Matrix:
    """The matrix of `form` (a quantized one) from a projection's parts in their blocks."""
    blocks = pack_quant([shard.of_blocks(part, split) for part in parts])
    assert blocks is not None, "the plan chose blocks for parts of different widths"
    if form is Form.BLOCKS:
        return BlockMatrix(blocks, kernels, bias)
    assert form in INT4_FORMS, form
    fours = [int4_tensor(part) for part in parts]

    def sharded(tensor: torch.Tensor) -> torch.Tensor:
        return shard.of(tensor, split)

    if form is Form.INT4_TILES:
        int4 = pack_int4(fours, sharded, None, blocks)
    else:
        int4 = pack_int4(fours, sharded, kernels.q4_build_panels)
    assert int4 is not None, "the plan chose 4 bits for a shard that does not fit"
    return Int4Matrix(int4, kernels, bias)


def dense(form: Form, weight: torch.Tensor, bias: torch.Tensor | None) -> Matrix:
    return PackedMatrix(weight, bias) if form is Form.PACKED else DenseMatrix(weight, bias)


class Embedding:
    """Token ids -> rows, from a dense matrix or from the file's blocks (dequantized per
    looked-up row, in the model dtype: in float32 gguf-py's values exactly)."""

    def __init__(
        self,
        weight: torch.Tensor | None,
        blocks: QuantTensor | None = None,
        kernels: MatrixKernels | None = None,
    ) -> None:
        self.weight = weight
        self.blocks = blocks
        self.kernels = kernels

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            assert self.weight is not None
            return F.embedding(input_ids, self.weight)
        assert self.kernels is not None
        rows = self.blocks.raw.index_select(0, input_ids.to(self.blocks.raw.device))
        out = torch.empty((rows.shape[0], self.blocks.cols), dtype=self.kernels.dtype)
        self.kernels.dequantize(
            out=out, w=rows, type=self.blocks.type_id, n=rows.shape[0], k=out.shape[1]
        )
        return out


def place_blocks(matrices: list[Matrix], embedding: Embedding) -> None:
    """Copy every GGUF block `matrices` and `embedding` read out of the checkpoint file's
    mapping into one region of 2 MiB pages (`memory.huge_page_copies`), dropping the
    mapping: a token reads them all, and from the page cache's 4 KiB pages that ran at two
    thirds of the speed (Llama-3.1-8B Q4_K_M: 504 ms a token). The resident bytes stay the
    blocks' own: once unmapped, the file's pages no longer count."""
    readers = [m for m in matrices if m.blocks is not None]
    found = [part for m in readers if m.blocks is not None for part in m.blocks.parts]
    if embedding.blocks is not None:
        found.append(embedding.blocks)
    tensors = list({id(t): t for t in found}.values())  # a tied LM head's once
    if not tensors:
        return
    copies = huge_page_copies([t.raw for t in tensors], "the model's GGUF blocks")
    placed = {
        id(tensor): QuantTensor(copy, tensor.kind, tensor.cols)
        for tensor, copy in zip(tensors, copies, strict=True)
    }
    for m in readers:
        assert m.blocks is not None
        parts = _joined(tuple(placed[id(part)] for part in m.blocks.parts))
        m.blocks = dataclasses.replace(m.blocks, parts=parts)
        if isinstance(m, Int4Matrix):
            m.int4 = dataclasses.replace(m.int4, blocks=m.blocks)
    if embedding.blocks is not None:
        embedding.blocks = placed[id(embedding.blocks)]


def _joined(parts: tuple[QuantTensor, ...]) -> tuple[QuantTensor, ...]:
    """A fused matrix's parts with each run of neighbours of one format that the copy left
    back to back (no cache-line padding between them) as one part: one kernel call for them
    instead of one each (the default model in float32, q/k/v and gate/up: 90 calls fewer a
    step). Every kernel computes each row of W's outputs alone, so the outputs are the same
    bits."""
    joined = [parts[0]]
    for part in parts[1:]:
        last = joined[-1]
        row_bytes = last.raw.shape[1]
        if (
            part.kind == last.kind
            and part.cols == last.cols
            and part.raw.untyped_storage().data_ptr() == last.raw.untyped_storage().data_ptr()
            and part.raw.data_ptr() == last.raw.data_ptr() + last.raw.nbytes
        ):
            raw = last.raw.as_strided((last.rows + part.rows, row_bytes), (row_bytes, 1))
            joined[-1] = QuantTensor(raw, last.kind, last.cols)
        else:
            joined.append(part)
    return tuple(joined)
