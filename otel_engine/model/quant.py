"""Matrices multiplied from their GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), never
from a bfloat16 copy of the whole matrix: `QuantWeight`, this rank's shard of a fused row
group (q/k/v, gate/up) whose parts may be in different formats (a Q4_K_M file stores some
v and down projections in Q6_K).

A step of at most `QUANT_MAX_ROWS` rows runs one fused pass over the blocks (cpu_kernels.c):
`quant_linear_q8_bf16` with x quantized to 8 bits (the default, as llama.cpp computes), or
`quant_linear_bf16` with x as it is and each row of the matrix dequantized into a buffer as
it is used. Where the CPU has AMX, steps of up to `AMX_MAX_ROWS` rows run
`quant_linear_amx_bf16` (16 rows of W dequantized at a time into the cache and multiplied in
AMX tiles). A larger step dequantizes tiles of `TILE_BYTES` (`gguf_dequantize_bf16`) and
multiplies by each with torch's matmul (oneDNN: AMX where the CPU has it), so prefill runs
near the speed of bfloat16 weights while only one tile is ever in bfloat16. Every way but
the 8-bit one multiplies x by the float32 values gguf-py's dequantize gives, rounded to
bfloat16: the values of the reference path's bfloat16 copy.

A float32 model's matrices run the same way in float32: up to `QUANT_F32_MAX_ROWS` rows
`quant_linear_q8_f32` (x quantized to 8 bits, integer dot products; every build from AVX2
up), larger steps `quant_gemm_f32` (W unpacked into the cache a chunk at a time, then the
level's micro-kernel over every row of x: in AVX2 builds x exact times gguf-py's float32
values; in AVX-512 builds x in 16 bits per 32 values times W's integers, in int32 sums)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from otel_engine.model.weights import QuantTensor

# Up to this many rows the fused kernel (one pass over the blocks), beyond it tiles and
# torch's matmul. Measured on a Q4_K matrix of 8,192 x 2,048, fused / tiles of 1 MiB: 1 row
# 0.79 / 3.92 ms, 4 rows 1.36 / 3.46, 8 rows 2.59 / 3.73, 16 rows 5.32 / 4.16, 32 rows 10.3 /
# 4.2 (Q6_K and Q8_0 alike; its bfloat16 copy in oneDNN: 1.3-1.5 ms); 16 MiB tiles halve
# the tiles' times beyond 16 rows (TILE_BYTES).
QUANT_MAX_ROWS = 8
# The same for a float32 model (`quant_linear_q8_f32`; beyond it `quant_gemm_f32`, x exact
# or in 16 bits).
# The 8-bit kernel is the faster at every size: a matrix of 8,192 x 2,048, AVX2 build, two
# threads, wall ms, 8-bit / exact at 16 / 32 / 64 / 96 / 128 rows: Q4_0 1.7 / 5.6, 3.3 / 8.7,
# 6.5 / 13.7, 9.7 / 19.5, 13.2 / 24.7; Q4_K 1.8 / 5.0, 3.2 / 7.5, 6.4 / 12.3, 9.6 / 16.8,
# 12.6 / 21.9; Q6_K and Q8_0 between them. The limit is accuracy: steps past 64 rows are
# prefill, where x rounded to 8 bits costs the most (bench/loglik.py), so they keep x exact
# (AVX-512 builds: in 16 bits, a rounding step 1/258 of 8 bits'; there the 8-bit kernel stays
# the faster up to 64 rows for every format but Q8_0: the 1B shape's four layer matrices,
# 8-bit (256-bit panels then; 512-bit ones now, 5-21% less CPU at 16-64 rows) / 15-bit ms,
# Q4_K 10.8 / 14.8 at 16 rows, 23.5 / 32.7 at 64; Q8_0 15.7 / 15.3, 44.1 / 33.4).
QUANT_F32_MAX_ROWS = 64
# bfloat16 bytes per dequantized tile: torch's matmul costs a fixed overhead per call, so
# fewer, larger tiles win. A Q4_K matrix of 16,384 x 2,048 at 16 / 64 / 512 rows: 256 KiB
# tiles 12.3 / 23.2 / 70.8 ms, 1 MiB 9.9 / 18.9 / 44.2, 4 MiB 9.1 / 12.4 / 30.5, 16 MiB
# 7.3 / 9.3 / 28.2 (the buffer is one per model).
TILE_BYTES = 16 << 20
# Where the CPU has AMX (`fast_paths.Larger.AMX`), steps of more than QUANT_MAX_ROWS
# and at most this many rows run `quant_linear_amx_bf16` (one pass of dequantization into
# tiles in L1 per 48 rows: cpu_kernels.c AMX_PASS_ROWS), larger ones the tiles above. A Q4_K
# matrix of 14,336 x 4,096 read from memory at 16 / 32 / 48 / 64 / 128 rows: AMX 7.7 / 9.1 /
# 9.6 / 13.9 / 21.3 ms, tiles and torch's matmul 8.8 / 11.9 / 14.2 / 14.4 / 15.5, x in 8
# bits 8.6 / 18.1 / 21.3 (Q6_K, Q8_0, Q4_0 alike: bench/quant_matmul.py).
AMX_MAX_ROWS = 48


@dataclass(frozen=True)
class QuantWeight:
    """A fused matrix [rows, cols] as its parts' GGUF blocks, in row order."""

    parts: tuple[QuantTensor, ...]
    rows: int
    cols: int


def shard_columns(tensor: QuantTensor, rank: int, size: int) -> QuantTensor | None:
    """Rank `rank` of `size`'s columns of a matrix in its blocks (whole blocks of a row:
    None when the shard's width is not a multiple of the format's block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cols = tensor.cols // size
    block = GGML_QUANT_SIZES[GGMLQuantizationType[tensor.kind]][0]
    if tensor.cols % size or cols % block:
        return None
    width = tensor.raw.shape[1] // size
    raw = tensor.raw[:, rank * width : (rank + 1) * width].contiguous()
    return QuantTensor(raw, tensor.kind, cols)


def pack_quant(parts: list[QuantTensor]) -> QuantWeight | None:
    """This rank's fused rows (already sharded), each part as it is: concatenating q and k,
    gate and up had copied them while the file's pages they were read from stayed resident
    beside the copy (2.4 GB of Llama-3.1-8B's Q4_K_M); `LlamaModel.place_blocks` copies every
    part once, after load. None if the parts' widths differ."""
    cols = {part.cols for part in parts}
    if len(cols) != 1:
        return None
    kept = tuple(QuantTensor(part.raw.contiguous(), part.kind, part.cols) for part in parts)
    return QuantWeight(kept, sum(p.rows for p in kept), cols.pop())


class QuantLinear:
    """x [rows, cols] @ W.T for a `QuantWeight`, x and the output in `dtype` (bfloat16, or
    float32 with `quant_linear_q8_f32` and `quant_gemm_f32`), with the kernels library's
    functions (`amx`: the AMX kernel where the fast paths chose it, else None; `gemm`: the
    float32 kernel of larger steps, else tiles); holds the tile buffer."""

    def __init__(
        self,
        linear: Callable[..., None],
        dequantize: Callable[..., None],
        amx: Callable[..., None] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        gemm: Callable[..., None] | None = None,
    ) -> None:
        self._linear = linear
        self._dequantize = dequantize
        self._amx = amx
        self._gemm = gemm
        self.dtype = dtype
        self.max_rows = QUANT_F32_MAX_ROWS if dtype == torch.float32 else QUANT_MAX_ROWS
        self._tile = torch.empty(0, dtype=dtype)

    def __call__(self, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return self.fused(x, weight)
        return self.larger(x, weight)

    def larger(
        self, x: torch.Tensor, weight: QuantWeight, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A step of many rows: the float32 GEMM kernel where there is one, the AMX kernel up
        to AMX_MAX_ROWS where it runs, else tiles."""
        if self._gemm is not None:
            return self.fused(x, weight, out, self._gemm)
        if self._amx is not None and x.shape[0] <= AMX_MAX_ROWS:
            return self.fused(x, weight, out, self._amx)
        return self.tiles(x, weight, out)

    def fused(
        self,
        x: torch.Tensor,
        weight: QuantWeight,
        out: torch.Tensor | None = None,
        kernel: Callable[..., None] | None = None,
    ) -> torch.Tensor:
        """x @ W.T in one pass over W's blocks (the fused kernel, or `kernel`, any rows)."""
        rows, k = x.shape
        if out is None:
            out = torch.empty((rows, weight.rows), dtype=self.dtype)
        run = kernel or self._linear
        column = 0
        for part in weight.parts:
            run(
                out=out.data_ptr() + out.element_size() * column, x=x, w=part.raw,
                type=part.type_id, rows=rows, n=part.rows, k=k, ldo=weight.rows,
            )  # fmt: skip
            column += part.rows
        return out

    def tiles(
        self, x: torch.Tensor, weight: QuantWeight, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ W.T a tile of W at a time: dequantized to `dtype`, then torch's matmul."""
        rows, k = x.shape
        if out is None:
            out = torch.empty((rows, weight.rows), dtype=self.dtype)
        tile_rows = max(16, TILE_BYTES // (self._tile.element_size() * k) // 16 * 16)
        if self._tile.numel() < tile_rows * k:
            self._tile = torch.empty(tile_rows * k, dtype=self.dtype)
        column = 0
        for part in weight.parts:
            row_bytes = part.raw.shape[1]
            for first in range(0, part.rows, tile_rows):
                count = min(tile_rows, part.rows - first)
                tile = self._tile[: count * k].view(count, k)
                self._dequantize(
                    out=tile, w=part.raw.data_ptr() + first * row_bytes, type=part.type_id,
                    n=count, k=k,
                )  # fmt: skip
                out[:, column + first : column + first + count] = F.linear(x, tile)
            column += part.rows
        return out
