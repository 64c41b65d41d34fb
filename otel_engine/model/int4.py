"""A 4-bit checkpoint's matrices laid out for the kernels: `Int4Weight` (the exact 4-bit
weights for `q4_linear_bf16`, cpu_kernels.c, and for larger steps either bfloat16 panels built
from them for `panel_linear_bf16` or the file's blocks, dequantized a tile at a time for
torch's matmul: model/quant.py) and `pack_int4`, which builds one from a fused row group's
parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from otel_engine.model.kernels import PANEL_COLUMNS
from otel_engine.model.quant import QuantWeight
from otel_engine.model.weights import INT4_GROUP, Int4Tensor

# Up to this many rows the exact 4-bit kernel is the faster (the default model's 30 layers,
# weights in cache: 0.74 ms at 1 row, 2.63 at 8, 5.0 at 16; oneDNN bfloat16 2.6 / 3.5 / 4.9;
# read from memory, bench/int4_rows.py: 10.3 ms at 16 rows, the panels 11.4 at 17),
# beyond it the bfloat16 panels (6.8 ms at 32 rows, 405 at 2,048, weights read from memory;
# oneDNN 8.8 / 422), measured on a CPU without AMX. Where torch's matmul runs on AMX, tiles of
# the blocks dequantized for it beat the panels beyond 16 rows (the default model's four
# matrices of a layer at 32 / 64 / 256 rows: panels 1.30 / 2.45 / 9.28 ms, tiles 1.33 / 1.63
# / 2.61; `fast_paths.Form.INT4_TILES`), and no panels are built.
INT4_MAX_ROWS = 16


@dataclass(frozen=True)
class Int4Weight:
    """A fused matrix [rows, cols] in 4 bits, in `q4_linear_bf16`'s layout (cpu_kernels.c):
    `packed` uint8 [rows / 16, groups, 256] (two weights a byte); `params` float32 [rows /
    16, groups, 2, 16]: each group's scale d, then its offset m + 8d, for 16 rows. `panels`:
    the same weights as bfloat16 (d * q + m rounded: the bfloat16 copy's values) in
    `panel_linear_bf16`'s layout, for steps of more than INT4_MAX_ROWS rows; or instead
    `blocks`, the file's blocks of this shard, for such steps in tiles."""

    packed: torch.Tensor
    params: torch.Tensor
    rows: int
    cols: int
    panels: torch.Tensor | None
    blocks: QuantWeight | None = None


def pack_int4(
    parts: list[Int4Tensor],
    shard: Callable[[torch.Tensor], torch.Tensor],
    build_panels: Callable[..., None] | None,
    blocks: QuantWeight | None = None,
) -> Int4Weight | None:
    """Fused rows of 4-bit matrices, this rank's shard, laid out for the kernels, with the
    panels by `build_panels` (q4_build_panels_bf16) or else the shard's `blocks`; None if it
    does not fit (a shard's columns must hold whole groups, its rows a multiple of 16)."""
    q = torch.cat([shard(p.q) for p in parts])
    scale = torch.cat([shard(p.scale) for p in parts]).float()
    offset = torch.cat([shard(p.offset) for p in parts]).float()
    rows, cols = q.shape
    groups = scale.shape[1]
    if cols != groups * INT4_GROUP or rows % 16:
        return None
    # k = 32 group + 4 j + 2 nibble + e:
    # [blocks, 16 rows, groups, j, nibble, e] -> [blocks, groups, j, 16 rows, e, nibble]
    nibbles = q.view(rows // 16, 16, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(rows // 16, groups, 256)
    per_block = [
        t.view(rows // 16, 16, groups).transpose(1, 2) for t in (scale, offset + 8 * scale)
    ]
    params = torch.stack(per_block, dim=2).contiguous()
    packed = packed.contiguous()
    if build_panels is None:
        assert blocks is not None
        assert (blocks.rows, blocks.cols) == (rows, cols)
        return Int4Weight(packed, params, rows, cols, None, blocks)
    panels = torch.empty(-(-rows // PANEL_COLUMNS) * PANEL_COLUMNS * cols, dtype=torch.bfloat16)
    build_panels(panels=panels, w=packed, params=params, n=rows, k=cols)
    return Int4Weight(packed, params, rows, cols, panels)
