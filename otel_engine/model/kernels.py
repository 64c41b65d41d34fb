"""The compiled CPU kernels (`cpu_kernels.c`): built on first use, loaded with ctypes.

The C file is compiled once per machine with the system's C compiler (`cc`, `-O3
-march=native -fopenmp`) into `$OTEL_ENGINE_CACHE_DIR/kernels/` (else
~/.cache/otel-engine/kernels/), named by a hash of the source, the flags and the compiler,
and renamed into place atomically, so concurrent engines share one build; a build takes
about 3 s. `load()` returns None, with the reason logged once, when there is no
compiler or the build fails: the model then runs on torch ops alone (the same results
within rounding, slower).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_BUILD_TIMEOUT_S = 120

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
SIGNATURES: dict[str, list[type]] = {
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "rope_and_cache": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I],
    "decode_attention": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F],
    "silu_mul": [_P, _P, _I, _I],
    "argmax": [_P, _P, _I, _I],
}
SUFFIXES = ("f32", "bf16")
# Built only where the CPU has what they need (AVX-512 BF16); absent from the library elsewhere.
OPTIONAL_SIGNATURES: dict[str, list[type]] = {
    "q4_linear_bf16": [_P, _P, _P, _P, _P, _I, _I, _I],
    "prefill_attention_bf16": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F],
    "q4_build_panels_bf16": [_P, _P, _P, _I, _I],
    "panel_linear_bf16": [_P, _P, _P, _I, _I, _I],
    "decoder_stack_bf16": [_P] * 19 + [_F, _F],
}


def _cache_dir() -> Path:
    root = os.environ.get("OTEL_ENGINE_CACHE_DIR") or os.path.expanduser("~/.cache/otel-engine")
    return Path(root) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library_path(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False, timeout=30
    ).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode()):
        digest.update(part)
    return _cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            check=False,
            timeout=_BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels library with typed entry points, or None (logged) when it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("kernels.unavailable", extra={"reason": "no C compiler (cc) found"})
        return None
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
            logger.info("kernels.built", extra={"path": str(path)})
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("kernels.unavailable", extra={"reason": f"{type(error).__name__}: {error}"})
        return None
    for name, argtypes in SIGNATURES.items():
        for suffix in SUFFIXES:
            function = getattr(library, f"{name}_{suffix}")
            function.argtypes = argtypes
            function.restype = None
    for name, argtypes in OPTIONAL_SIGNATURES.items():
        function = getattr(library, name, None)
        if function is not None:
            function.argtypes = argtypes
            function.restype = None
    library.otel_kernels_max_block_size.restype = ctypes.c_int64
    return library
