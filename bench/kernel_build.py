"""Time to build the CPU kernels (otel_engine/model/cpu_kernels.c) for each instruction-set
level, as an engine does on a cold cache.

    .venv/bin/python bench/kernel_build.py [--levels baseline,avx2,avx512,avx512bf16]
        [--repeat 3] [--json PATH]

Each build is `kernels._build`: the system C compiler (`CC`, else cc), the level's flags
(`kernels.build_flags`), into a temporary directory; the levels one after another, never at
once. Levels above this CPU's build too (building needs no support from the CPU, only running
does). Prints per level, of `--repeat` builds, the fastest and the median wall time, the
compiler's CPU seconds (its own work: what contention does not change) and how many cores the
rest of the machine kept busy meanwhile (`other`: on a busy machine the wall time is longer),
with the compiler and the CPU. The build time that kernels.py and docs/architecture.md state
comes from this. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import fmt, print_table, write_json  # (puts the repo root on the path)

from otel_engine.model import kernels


def build_seconds(compiler: str, isa: str, directory: Path) -> tuple[float, float, float]:
    """One cold build for `isa` into `directory`: its wall seconds, the compiler's CPU seconds
    and the cores the rest of the machine kept busy meanwhile."""
    target = directory / f"cpu_kernels-{isa}.so"
    target.unlink(missing_ok=True)
    children, busy = _children_cpu(), _machine_busy()
    start = time.perf_counter()
    kernels._build(compiler, isa, target)
    wall = time.perf_counter() - start
    cpu = _children_cpu() - children
    return wall, cpu, max(0.0, (_machine_busy() - busy - cpu) / wall)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _machine_busy() -> float:
    times = psutil.cpu_times()
    return float(times.user + times.nice + times.system)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default=",".join(kernels.ISA_LEVELS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    compiler = kernels._compiler()
    if compiler is None:
        sys.exit("no C compiler (cc, gcc or $CC) found")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    lines = len(kernels.SOURCE.read_text().splitlines())
    print(f"cpu_kernels.c ({lines} lines), {version}, on {cpu_name()}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kernel-build-") as directory:
        for isa in args.levels.split(","):
            runs = [build_seconds(compiler, isa, Path(directory)) for _ in range(args.repeat)]
            results[isa] = {
                "seconds": [round(wall, 2) for wall, _, _ in runs],
                "cpu_seconds": [round(cpu, 2) for _, cpu, _ in runs],
                "other_cores": [round(other, 2) for _, _, other in runs],
            }
    rows = [
        [
            isa,
            fmt(min(r["seconds"]), 1),
            fmt(statistics.median(r["seconds"]), 1),
            fmt(min(r["cpu_seconds"]), 1),
            fmt(max(r["other_cores"]), 2),
        ]
        for isa, r in results.items()
    ]
    print_table(["level", "best s", "median s", "compiler CPU s", "other cores (max)"], rows)
    write_json(args.json, {"compiler": version, "cpu": cpu_name(), "levels": results})


if __name__ == "__main__":
    main()
