"""One matrix in its GGUF blocks times a few rows of x, read from memory: the fused kernels
with x in bfloat16 (`quant_linear_bf16`) and in 8 bits (`quant_linear_q8_bf16`), the AMX
tiles kernel (`quant_linear_amx_bf16`, where the CPU has AMX), and the tiles dequantized for
torch's matmul (model/quant.py), in ms per call. `--dtype float32`: a float32 model's ways,
the 8-bit kernel (`quant_linear_q8_f32`, any build from AVX2 up) and float32 tiles.

    .venv/bin/python bench/quant_matmul.py [--formats Q4_K,Q6_K,Q8_0,Q4_0] [--rows 1,4,8,16,32]
        [--shape 14336x4096] [--dtype bfloat16|float32] [--clock wall|cpu]

Under a level's caps (bench/isa_caps.py: `ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`,
`OTEL_ENGINE_KERNEL_ISA`) it measures that level.

Each call reads a different copy of the matrix (2 GB of copies in all), so its blocks come
from memory as a model's do, not from the last-level cache. Random blocks
(tests/helpers/gguf_blocks.py): the kernels' time does not depend on the values.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otel_engine.model import kernels
from otel_engine.model.quant import QuantLinear, QuantWeight, pack_quant
from otel_engine.model.weights import QuantTensor
from tests.helpers.gguf_blocks import random_blocks

COPIES_BYTES = 2e9


def _median_ms(
    call: Callable[[QuantWeight], object],
    weights: list[QuantWeight],
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """ms per call over every copy, the median of 3 passes (after one warm-up call)."""
    call(weights[0])
    passes = []
    for _ in range(3):
        start = clock()
        for weight in weights:
            call(weight)
        passes.append((clock() - start) / len(weights) * 1e3)
    return sorted(passes)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_K,Q6_K,Q8_0,Q4_0")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--shape", default="14336x4096", help="rows x columns of the matrix")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: this process's CPU time (all its threads), not disturbed by other processes "
        "taking turns on the cores (their share of memory bandwidth still counts)",
    )
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    library = kernels.load()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.float32:
        if library is None or not library.has("quant_linear_q8_f32"):
            raise SystemExit("needs the kernels built for avx2 or above")
        fused, names = [library.quant_linear_q8_f32], ["x in 8 bits"]
        dequantize = library.gguf_dequantize_f32
    elif library is None or not library.has("quant_linear_q8_bf16"):
        raise SystemExit("needs the kernels built for avx512bf16 (AVX-512 BF16 and VNNI)")
    else:
        fused = [library.quant_linear_bf16, library.quant_linear_q8_bf16]
        names = ["x in bfloat16", "x in 8 bits"]
        dequantize = library.gguf_dequantize_bf16
    n, k = (int(v) for v in args.shape.split("x"))
    print(
        f"{n} x {k} matrix, {args.dtype}, kernels built for {library.isa}, "
        f"{torch.get_num_threads()} threads, {args.clock} ms per call (median of 3 passes over "
        "the copies)"
    )
    if dtype == torch.bfloat16 and library.has("quant_linear_amx_bf16") and library.amx_ready():
        fused.append(library.quant_linear_amx_bf16)
        names.append("AMX tiles")
    print("| format | rows | " + " | ".join(names) + " | tiles + torch matmul |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for name in args.formats.split(","):
        raw = torch.from_numpy(random_blocks(name, n, k, seed=1))
        count = max(2, int(COPIES_BYTES // raw.numel()))
        weights: list[QuantWeight] = []
        for _ in range(count):
            weight = pack_quant([QuantTensor(raw.clone(), name, k)])
            assert weight is not None
            weights.append(weight)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            ways = [QuantLinear(f, dequantize, dtype=dtype) for f in fused]
            times = [_median_ms(functools.partial(_fused, way, x), weights, clock) for way in ways]
            times.append(_median_ms(functools.partial(ways[0].tiles, x), weights, clock))
            cells = " | ".join(f"{t:.2f}" for t in times)
            print(f"| {name} | {rows} | {cells} |", flush=True)
        del weights


def _fused(linear: QuantLinear, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """The fused kernel whatever the row count (QuantLinear tiles beyond its max_rows)."""
    return linear.fused(x, weight)


if __name__ == "__main__":
    main()
