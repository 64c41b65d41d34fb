"""llama.cpp for bench/models.py: its tools built from the sources vendored in the
`llama-cpp-python` sdist on PyPI (`build_llama_cpp`; cmake, Release, CPU only, without AMX, for
this CPU or for one instruction-set level alone: `llama_cpp_options`), the features a build
reports (`llama_cpp_system_info`), and `llama-server` as a benchmark's server process
(`LlamaServerProcess`). Everything lives under `.cache/llama.cpp` (git-ignored): the sources in
`src/`, the binaries in `build/bin` (`build-<level>/bin` for a level).
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from common import ServerProcess
from isa_caps import Level

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP_DIR = REPO / ".cache" / "llama.cpp"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # vendors llama.cpp 0c1e570 (December 2026)
LLAMA_CPP_TARGETS = ("llama-quantize", "llama-server", "llama-bench")
BUILD_JOBS = 2


def run_command(command: list[object], **options: Any) -> float:
    """Run `command` (output through), raise on failure; seconds it took."""
    print("+ " + " ".join(str(c) for c in command), flush=True)
    began = time.monotonic()
    subprocess.run([str(c) for c in command], check=True, **options)
    return time.monotonic() - began


def llama_cpp_source() -> Path:
    """The llama.cpp tree vendored in the `llama-cpp-python` sdist, downloaded with pip and
    unpacked under `.cache/llama.cpp/src` once."""
    src = LLAMA_CPP_DIR / "src"
    tree = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    sdist = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        run_command([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", src])
    with tarfile.open(sdist) as archive:
        archive.extractall(src, filter="tar")
    return tree


def llama_cpp_options(level: Level | None = None) -> dict[str, str]:
    """The cmake cache entries of the build: Release, CPU only, static, no network features;
    for this CPU (`level` None) or for `level`'s instructions alone (`Level.ggml_options`).
    On x86-64 never AMX: ggml's AMX matmul crashes in its first call on this project's
    Sapphire Rapids VM (SIGSEGV at `ldtilecfg`; llama.cpp issue #20824, a fix proposed in PR
    #26954), so llama.cpp runs its AVX-512 VNNI kernels there."""
    options = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "OFF",
        "GGML_NATIVE": "ON",
        "GGML_CUDA": "OFF",
        "GGML_METAL": "OFF",
        "GGML_VULKAN": "OFF",
        "LLAMA_CURL": "OFF",  # older trees; this one has LLAMA_OPENSSL
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_APP": "OFF",
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",  # the web UI from a Hugging Face bucket: not wanted
    }
    if level is not None:
        return options | level.ggml_options()
    if platform.machine() in ("x86_64", "AMD64"):
        # Explicit -mno-* flags win over what -march=native implies, whatever their order.
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        options |= {"CMAKE_C_FLAGS": no_amx, "CMAKE_CXX_FLAGS": no_amx}
    return options


def llama_cpp_build_dir(level: Level | None = None) -> Path:
    """Where llama.cpp is built: `build` for this CPU, `build-<level>` for a level."""
    return LLAMA_CPP_DIR / ("build" if level is None else f"build-{level.name}")


def build_llama_cpp(level: Level | None = None) -> Path:
    """Build llama.cpp's tools once (`llama_cpp_options`); the directory of the binaries.
    Skipped when they exist and were built with the same options (a stamp file says)."""
    build = llama_cpp_build_dir(level)
    bin_dir, stamp = build / "bin", build / "otel-bench-options.json"
    options = llama_cpp_options(level)
    wanted = json.dumps({"version": LLAMA_CPP_PYTHON_VERSION, **options}, sort_keys=True)
    built = all((bin_dir / target).exists() for target in LLAMA_CPP_TARGETS)
    if built and stamp.exists() and stamp.read_text() == wanted:
        return bin_dir
    source = llama_cpp_source()
    began = time.monotonic()
    stamp.unlink(missing_ok=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", source, "-B", build, *generator]
    run_command(configure + [f"-D{key}={value}" for key, value in options.items()])
    targets = [arg for target in LLAMA_CPP_TARGETS for arg in ("--target", target)]
    run_command(["cmake", "--build", build, "-j", str(BUILD_JOBS), *targets])
    stamp.write_text(wanted)
    print(f"[build] llama.cpp built in {time.monotonic() - began:.0f} s: {bin_dir}", flush=True)
    return bin_dir


def llama_cpp_system_info(bin_dir: Path) -> str:
    """The `system_info:` line llama-server logs at start (at trace verbosity, before it
    loads a model): the CPU features the build has compiled in. Read by starting it on a
    file that does not exist, so it exits at once."""
    command = [bin_dir / "llama-server", "-lv", "4", "-m", bin_dir / "no-such-model.gguf"]
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=60, check=False
    )
    for line in (done.stdout + done.stderr).splitlines():
        if "system_info:" in line:
            return line[line.index("system_info:") :].strip()
    return ""


class LlamaServerProcess(ServerProcess):
    """`llama-server` under the same process handling as otel-engine's server (own session,
    log file, descendants remembered, stopped by pid)."""

    def __init__(self, binary: Path, args: list[str], port: int) -> None:
        self.binary = binary
        super().__init__(args, port)

    @property
    def command(self) -> list[str]:
        return [str(self.binary), "--host", "127.0.0.1", "--port", str(self.port), *self.args]
