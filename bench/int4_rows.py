"""The 4-bit kernel by rows of x: the default model's 30 layers of 4-bit matrices
(`q4_linear_bf16`, cpu_kernels.c) at 1 to 16 rows, and the bfloat16 panels
(`panel_linear_bf16`) that take steps of more rows, in ms per pass over the 120 matrices.
A decode step of B streams verifying k proposed tokens each is B (k + 1) rows, so this is
what verification costs the step's matrices (bench/spec_verify.py measures whole steps).

    .venv/bin/python bench/int4_rows.py [--rows 1,2,4,8,9,12,16,17,24,32] [--in-cache]
        [--baseline-source OLD.c] [--repeats 7]

Random 4-bit weights of the default model's shapes (the kernels' time does not depend on
the values): 66 MB of them, read from memory as a model's are; `--in-cache` cycles over
one layer's four matrices instead (what the arithmetic alone costs). `--baseline-source`:
also a build of that C file (for instance the last commit's: `git show
HEAD:otel_engine/model/cpu_kernels.c > /tmp/old.c`) with this build's flags, run in turn
with this one, `--repeats` times each, medians printed. Needs a CPU with AVX-512 BF16.
Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otel_engine.model import kernels
from otel_engine.model.int4 import INT4_MAX_ROWS

# The default model's 4-bit matrices of a layer, [n, k]: fused q/k/v, o, fused gate/up, down.
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
NUM_LAYERS = 30
GROUP = 32
_P, _I = ctypes.c_void_p, ctypes.c_int64


def open_library(path: str) -> ctypes.CDLL:
    library = ctypes.CDLL(path)
    library.q4_linear_bf16.argtypes = [_P] * 5 + [_I] * 3
    library.q4_build_panels_bf16.argtypes = [_P] * 3 + [_I] * 2
    library.panel_linear_bf16.argtypes = [_P] * 3 + [_I] * 3
    return library


def build(source: str, directory: str) -> str:
    """`source` compiled as kernels.py compiles its own, for this CPU's level."""
    compiler = kernels._compiler()
    if compiler is None:
        sys.exit("no C compiler (cc, gcc or $CC) found")
    target = str(Path(directory) / "baseline.so")
    flags = kernels.build_flags(kernels.target_isa())
    subprocess.run([compiler, *flags, "-o", target, source, "-lm"], check=True)
    return target


class Matrices:
    """The packed weights (and their panels) of the pass, per library."""

    def __init__(self, library: ctypes.CDLL, in_cache: bool) -> None:
        generator = torch.Generator().manual_seed(0)
        layers = 1 if in_cache else NUM_LAYERS
        self.weights = []
        for n, k in LAYER * layers:
            packed = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=generator)
            params = torch.randn(n // 16 * (k // GROUP) * 32, generator=generator) * 0.01
            panels = torch.empty(-(-n // 48) * 48 * k, dtype=torch.bfloat16)
            library.q4_build_panels_bf16(
                panels.data_ptr(), packed.data_ptr(), params.data_ptr(), n, k
            )
            self.weights.append((n, k, packed, params, panels))
        self.repeat = NUM_LAYERS if in_cache else 1


def pass_over(
    library: ctypes.CDLL, matrices: Matrices, rows: int, panels: bool
) -> Callable[[], None]:
    x = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in LAYER}
    out = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in LAYER}
    sums = torch.empty(rows * max(k for _, k in LAYER) // GROUP)

    def run() -> None:
        for _ in range(matrices.repeat):
            for n, k, packed, params, panel in matrices.weights:
                if panels:
                    library.panel_linear_bf16(
                        out[n].data_ptr(), x[k].data_ptr(), panel.data_ptr(), rows, n, k
                    )
                else:
                    library.q4_linear_bf16(
                        out[n].data_ptr(), x[k].data_ptr(), packed.data_ptr(), params.data_ptr(),
                        sums.data_ptr(), rows, n, k,
                    )  # fmt: skip

    return run


def seconds(run: Callable[[], None], calls: int = 5) -> float:
    run()
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,9,12,16,17,24,32")
    parser.add_argument("--in-cache", action="store_true")
    parser.add_argument("--baseline-source")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    loaded = kernels.load()
    if loaded is None or not loaded.has("q4_linear_bf16"):
        sys.exit("this build has no 4-bit kernel (it needs AVX-512 BF16)")
    with tempfile.TemporaryDirectory() as directory:
        builds = {"this build": open_library(str(loaded.path))}
        if args.baseline_source:
            builds["baseline"] = open_library(build(args.baseline_source, directory))
        matrices = {name: Matrices(library, args.in_cache) for name, library in builds.items()}
        where = "one layer's matrices, in cache" if args.in_cache else "weights from memory"
        print(f"ms per pass over the default model's 120 4-bit matrices ({where}); {loaded.isa}")
        header = ["rows", "kernel", *builds]
        if len(builds) > 1:
            header.append("this / baseline")
        print("  ".join(f"{h:>16}" for h in header))
        for rows in (int(r) for r in args.rows.split(",")):
            panels = rows > INT4_MAX_ROWS
            runs = {n: pass_over(lib, matrices[n], rows, panels) for n, lib in builds.items()}
            times: dict[str, list[float]] = {name: [] for name in builds}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    times[name].append(seconds(run))
            medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            cells = [
                str(rows),
                "panels" if panels else "4-bit",
                *(f"{m:.2f}" for m in medians.values()),
            ]
            if len(builds) > 1:
                cells.append(f"{medians['this build'] / medians['baseline']:.2f}")
            print("  ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
