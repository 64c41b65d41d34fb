"""The compiled CPU kernels (`cpu_kernels.c`): built on first use for this CPU, loaded with ctypes.

The target is the instruction-set level that this process detects on the CPU it runs on
(`cpu_isa()`: torch's cpuinfo, the same source torch uses to pick its own kernels), passed to
the compiler as explicit flags (`TARGET_FLAGS`), never `-march=native`, which is the
compiler process's guess and can disagree with the CPU the engine runs on (an image built
elsewhere, an emulator, a shared cache). The C file is compiled once per target with the
system's C compiler (`cc -O3 -fopenmp` and those flags) into `$OTEL_ENGINE_CACHE_DIR/kernels/`
(else ~/.cache/otel-engine/kernels/), named by the target and a hash of the source, the
flags and the compiler, and renamed into place atomically, so concurrent engines share one
build; one build per cache directory runs at a time (`BUILD_LOCK`), so processes that start
together (the ranks of a TP group) wait for one compile instead of each running it. A build
takes one core 7 s (baseline) to 22 s (avx512bf16) of compiler CPU with GCC 12 on this
project's AMD EPYC (`bench/kernel_build.py` measures it per level; its numbers are in
bench/README.md, "Kernel build time").

The library says what it was built for and which layout it has (`cpu_kernels.c`, "the
contract with kernels.py"): its build tag is read from the file before the file is loaded,
so a library built for another target or ABI (a cache directory copied from another
machine) is rebuilt, never run; its contract string is compared with this module's layout
constants and gives the decoder stack's field order. `load()` returns None, with the reason
logged, when there is no compiler, the build fails or the contract does not match: the
model then runs on torch ops alone (the same results within rounding, slower).

Each function of a `KernelLibrary` is a wrapper made once at load from its SIGNATURES entry,
named as its C entry point: arguments by name, tensors or None for pointers, and a status
that is not OK (`KernelStatus`: an unknown GGML type, a failed allocation, an unmet
precondition) raised as `KernelError` naming the kernel, the reason and the failed check.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_engine.cache import cache_root
from otel_engine.config import Dtype

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_BUILD_TIMEOUT_S = 120  # about 5x the slowest build measured (bench/README.md, "Kernel build time")
ABI_VERSION = 9  # cpu_kernels.c OTEL_KERNELS_ABI


# Instruction-set levels of x86-64, lowest first, and the flags that target each: the
# x86-64 psABI levels (v3: AVX2 and FMA; v4: AVX-512 F/BW/CD/DQ/VL), plus AVX-512 BF16
# with AVX-512 VNNI.
# Elsewhere ("generic") the compiler's default target. The tuning is fixed per level, so a
# build depends on its target alone (with -mtune=skylake-avx512, GCC 12 emits exactly what
# -march=native did on this project's AVX-512 BF16 machine; generic tuning differed in a
# tenth of the instructions).
class IsaLevel(enum.StrEnum):
    """A CPU's instruction-set level and a kernel build's target (the build tag's `isa`)."""

    BASELINE = "baseline"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512BF16 = "avx512bf16"
    GENERIC = "generic"  # not x86: no level to compare


ISA_LEVELS = (IsaLevel.BASELINE, IsaLevel.AVX2, IsaLevel.AVX512, IsaLevel.AVX512BF16)
TARGET_FLAGS: dict[str, tuple[str, ...]] = {
    IsaLevel.BASELINE: ("-march=x86-64",),
    IsaLevel.AVX2: ("-march=x86-64-v3", "-mtune=haswell"),
    IsaLevel.AVX512: ("-march=x86-64-v4", "-mtune=skylake-avx512"),
    IsaLevel.AVX512BF16: (
        "-march=x86-64-v4",
        "-mavx512bf16",
        "-mavx512vnni",
        "-mamx-tile",
        "-mamx-bf16",
        "-mtune=skylake-avx512",
    ),
    IsaLevel.GENERIC: (),
}
BUILD_LOCK = ".build.lock"  # in the cache directory, beside the builds
# Waiting for the lock: at worst one build of every target is ahead (a waiter that gets the
# lock finds a build of its own target done and builds nothing).
_BUILD_LOCK_WAIT_S = _BUILD_TIMEOUT_S * len(TARGET_FLAGS)
# Build for a lower level than the CPU's (tests, or to rule out a kernel on a suspect host);
# a level above what the CPU runs is refused.
ISA_ENV = "OTEL_ENGINE_KERNEL_ISA"

# Layout constants that the Python side builds tensors with; the library states its own
# (otel_kernels_contract) and must agree.
PANEL_BLOCKS = 3  # blocks of 16 output columns per bfloat16 panel
PANEL_COLUMNS = PANEL_BLOCKS * 16
PREFILL_TILE_KEYS = 32  # keys per packed tile of prefill attention
PREFILL_MAX_HEAD_DIM = 128  # prefill attention takes head sizes 64 and 128
STACK_HEAD_DIM = 64  # the one head size decoder_stack_bf16 takes
# A prefill chunk's int64 row in decoder_stack_bf16's `prefills` [chunks, 4], in order: its
# first query row of the step, its number of queries and of keys, its block table's address.
PREFILL_CHUNK_FIELDS = ("query_start", "num_query", "num_keys", "table")

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_ATTENTION = (
    ("out", _P), ("qkv", _P), ("k_cache", _P), ("v_cache", _P), ("block_tables", _P),
    ("seq_lens", _P), ("batch", _I), ("num_heads", _I), ("num_kv_heads", _I),
    ("head_dim", _I), ("block_size", _I), ("max_blocks", _I), ("num_slots", _I),
    ("qkv_width", _I), ("scale", _F),
)  # fmt: skip
# Every exported function's parameters, by name and in order, as cpu_kernels.c declares them
# (tests/model/test_kernel_contract.py reads the C prototypes and compares).
SIGNATURES: dict[str, tuple[tuple[str, type], ...]] = {
    "add_rms_norm": (
        ("hidden", _P), ("delta", _P), ("weight", _P), ("out", _P), ("rows", _I),
        ("width", _I), ("eps", _F),
    ),
    "rope_and_cache": (
        ("qkv", _P), ("cos_sin", _P), ("positions", _P), ("slots", _P), ("k_cache", _P),
        ("v_cache", _P), ("tokens", _I), ("num_heads", _I), ("num_kv_heads", _I),
        ("head_dim", _I), ("num_slots", _I),
    ),
    "decode_attention": _ATTENTION,
    "silu_mul": (("out", _P), ("gate_up", _P), ("rows", _I), ("width", _I)),
    "argmax": (("out", _P), ("logits", _P), ("rows", _I), ("vocab", _I)),
}  # fmt: skip
# Exported once, not per element type.
PLAIN_SIGNATURES: dict[str, tuple[tuple[str, type], ...]] = {
    "gguf_dequantize_f32": (("out", _P), ("w", _P), ("type", _I), ("n", _I), ("k", _I)),
    # the faults a broken kernel makes (1 SIGSEGV, 2 SIGFPE, 3 SIGBUS: a read of `target`),
    # on the calling thread (0) or an OpenMP worker (1), for the fault injector
    "fault_drill": (("kind", _I), ("thread", _I), ("target", _P)),
}  # fmt: skip
_QUANT_LINEAR = (
    ("out", _P), ("x", _P), ("w", _P), ("type", _I), ("rows", _I), ("n", _I), ("k", _I),
    ("ldo", _I),
)  # fmt: skip
SUFFIXES = ("f32", "bf16")
# The cache write and decode attention also take float32 activations over a float16 cache
# (the half-precision KV cache of a float32 model): by the cache's dtype, each activation
# suffix's function.
CACHE_SUFFIXES: dict[str, dict[str, str]] = {
    "f32": {Dtype.FLOAT32: "f32", Dtype.FLOAT16: "f32_f16"},
    "bf16": {Dtype.BFLOAT16: "bf16"},
}
CACHE_KERNELS = ("rope_and_cache", "decode_attention")


def exported_names() -> dict[str, tuple[tuple[str, type], ...]]:
    """Every function of SIGNATURES by its exported name (`name_suffix`), with its
    parameters."""
    names = {f"{n}_{suffix}": p for n, p in SIGNATURES.items() for suffix in SUFFIXES}
    for name in CACHE_KERNELS:
        for suffixes in CACHE_SUFFIXES.values():
            names.update({f"{name}_{s}": SIGNATURES[name] for s in suffixes.values()})
    return names


# Built only for the targets from a level up (`OPTIONAL_FROM`); absent from the library below.
OPTIONAL_SIGNATURES: dict[str, tuple[tuple[str, type], ...]] = {
    "quant_linear_q8_f32": _QUANT_LINEAR,
    "quant_gemm_f32": _QUANT_LINEAR,
    "q4_linear_bf16": (
        ("out", _P), ("x", _P), ("w", _P), ("params", _P), ("sums", _P), ("rows", _I),
        ("n", _I), ("k", _I),
    ),
    "prefill_attention_bf16": (
        ("out", _P), ("qkv", _P), ("k_cache", _P), ("v_cache", _P), ("table", _P),
        ("scratch", _P), ("query_start", _I), ("num_query", _I), ("num_keys", _I),
        ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I), ("block_size", _I),
        ("num_slots", _I), ("qkv_width", _I), ("scale", _F),
    ),
    "quant_linear_bf16": _QUANT_LINEAR,
    "quant_linear_q8_bf16": _QUANT_LINEAR,
    "quant_linear_amx_bf16": _QUANT_LINEAR,
    "gguf_dequantize_bf16": (("out", _P), ("w", _P), ("type", _I), ("n", _I), ("k", _I)),
    "q4_build_panels_bf16": (("panels", _P), ("w", _P), ("params", _P), ("n", _I), ("k", _I)),
    "panel_linear_bf16": (
        ("out", _P), ("x", _P), ("panels", _P), ("rows", _I), ("n", _I), ("k", _I),
    ),
    "decoder_stack_bf16": (
        ("hidden", _P), ("out", _P), ("layers", _P), ("dims", _P), ("final_norm", _P),
        ("cos_sin", _P), ("positions", _P), ("slots", _P), ("decode_tables", _P),
        ("decode_lens", _P), ("prefills", _P), ("x", _P), ("qkv", _P), ("attn", _P),
        ("delta", _P), ("gate_up", _P), ("act", _P), ("sums", _P), ("prefill_scratch", _P),
        ("eps", _F), ("scale", _F),
    ),
}  # fmt: skip
# The lowest level whose build has each optional function (every level above it has it too):
# the float32 GGUF matmuls need AVX2 (integer dot products; FMA), the rest AVX-512 BF16.
OPTIONAL_FROM: dict[str, IsaLevel] = {
    **dict.fromkeys(OPTIONAL_SIGNATURES, IsaLevel.AVX512BF16),
    "quant_linear_q8_f32": IsaLevel.AVX2,
    "quant_gemm_f32": IsaLevel.AVX2,
}
# Built only for AMX targets; these return a value, not a status.
QUERIES: dict[str, tuple[tuple[str, type], ...]] = {
    "amx_ready": (),  # 1 if Linux lends this process the AMX tiles (asked once), else 0
}
_TAG = re.compile(rb"otel-kernels-build:abi=(\d+);isa=([a-z0-9]+);")
# Every call site passes a kernel's arguments by name, so a wrapper refuses them in order
# (argument order is checked against SIGNATURES, never assumed).
KEYWORDS_ONLY = True


def cpu_isa() -> IsaLevel:
    """The highest level of `ISA_LEVELS` this CPU runs, as torch's cpuinfo reads it
    (`ATEN_CPU_CAPABILITY` lowers it, as it lowers torch's own kernels); "generic" off x86."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return IsaLevel.GENERIC
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        # every CPU with AVX-512 BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and
        # later) has AVX-512 VNNI, which the level's 8-bit dot products use: both are checked
        bf16 = torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_vnni_supported()
        return IsaLevel.AVX512BF16 if bf16 else IsaLevel.AVX512
    return IsaLevel.AVX2 if capability == "AVX2" else IsaLevel.BASELINE


def target_isa() -> IsaLevel:
    """What the kernels are built for: the CPU's level, or `OTEL_ENGINE_KERNEL_ISA` below it."""
    detected = cpu_isa()
    wanted = os.environ.get(ISA_ENV, "").strip()
    if not wanted:
        return detected
    check_runnable(wanted, detected, source=f"{ISA_ENV}={wanted}")
    return IsaLevel(wanted)


def check_runnable(isa: str, detected: str, *, source: str) -> None:
    """ValueError unless a build for `isa` can run on a CPU of level `detected`."""
    if isa not in TARGET_FLAGS:
        raise ValueError(f"{source}: expected one of {sorted(map(str, TARGET_FLAGS))}")
    if IsaLevel.GENERIC in (detected, isa):
        if isa != detected:
            raise ValueError(f"{source}: this CPU's kernels target is '{detected}'")
        return
    if ISA_LEVELS.index(IsaLevel(isa)) > ISA_LEVELS.index(IsaLevel(detected)):
        raise ValueError(f"{source} is above what this CPU runs ({detected})")


class KernelStatus(enum.IntEnum):
    """What every kernel returns, by code: cpu_kernels.c's STATUS_LIST in its order (the
    contract's `statuses` names them, and load() compares)."""

    OK = 0
    BAD_TYPE = 1
    NO_MEMORY = 2
    BAD_ARGUMENT = 3
    UNAVAILABLE = 4

    @property
    def reason(self) -> str:
        """What the status says went wrong, as KernelError states it."""
        return _REASONS[self]


_REASONS = {
    KernelStatus.OK: "ok",
    KernelStatus.BAD_TYPE: "unknown GGML type id",
    KernelStatus.NO_MEMORY: "out of memory (an allocation failed)",
    KernelStatus.BAD_ARGUMENT: "an argument outside what the kernel takes",
    KernelStatus.UNAVAILABLE: "this process may not use the kernel's instructions",
}


class KernelError(RuntimeError):
    """A kernel refused its input (its status was not OK): `kernel` names the C entry point,
    `reason` says why."""

    def __init__(self, kernel: str, status: KernelStatus, reason: str) -> None:
        super().__init__(f"kernel {kernel}: {reason}")
        self.kernel = kernel
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Contract:
    """What a built library says of itself (`otel_kernels_contract`)."""

    abi: int
    isa: str
    values: dict[str, int]  # layout constants, the stack's head size
    statuses: tuple[str, ...]  # what the functions return, by code
    stack_fields: tuple[str, ...]  # decoder_stack_bf16's per-layer addresses, in order
    stack_dims: tuple[str, ...]  # and its dims
    prefill_chunk_fields: tuple[str, ...]  # a row of its prefills, in order
    ggml_types: dict[str, int]  # the GGUF formats the kernels take, by name: ggml type id

    @classmethod
    def parse(cls, text: str) -> Contract:
        pairs = dict(item.split("=", 1) for item in text.split(";") if item)
        lists = {
            name: tuple(n for n in pairs.pop(name, "").split(",") if n)
            for name in ("stack_fields", "stack_dims", "prefill_chunk_fields", "statuses")
        }
        types = (item.split(":") for item in pairs.pop("ggml_types", "").split(",") if item)
        return cls(
            abi=int(pairs.pop("abi")),
            isa=pairs.pop("isa"),
            ggml_types={name: int(type_id) for name, type_id in types},
            values={k: int(v) for k, v in pairs.items()},
            **lists,
        )

    def mismatches(self) -> list[str]:
        """Where the library disagrees with this module's constants (empty: none)."""
        from otel_engine.model.weights import INT4_GROUP, GgmlType

        expected = {
            "int4_group": INT4_GROUP,
            "panel_blocks": PANEL_BLOCKS,
            "prefill_tile_keys": PREFILL_TILE_KEYS,
            "prefill_max_head_dim": PREFILL_MAX_HEAD_DIM,
            "stack_head_dim": STACK_HEAD_DIM,
        }
        wrong = [f"abi {self.abi} (expected {ABI_VERSION})"] if self.abi != ABI_VERSION else []
        for key, value in expected.items():
            if self.values.get(key) != value:
                wrong.append(f"{key} {self.values.get(key)} (expected {value})")
        named = {
            "statuses": (self.statuses, tuple(s.name.lower() for s in KernelStatus)),
            "prefill_chunk_fields": (self.prefill_chunk_fields, PREFILL_CHUNK_FIELDS),
            "ggml_types": (
                tuple(f"{n}:{i}" for n, i in self.ggml_types.items()),
                tuple(f"{t.name}:{t.value}" for t in GgmlType),
            ),
        }
        for key, (found, want) in named.items():
            if found != want:
                wrong.append(f"{key} {','.join(found)} (expected {','.join(want)})")
        return wrong


class KernelLibrary:
    """A loaded kernels library: its functions as attributes (optional ones absent where the
    build has none), each a wrapper made once at load (`_wrap`): arguments by the names in
    SIGNATURES, tensors or None for pointers, a status that is not OK raised as KernelError;
    its target and its contract."""

    def __init__(self, cdll: ctypes.CDLL, path: Path, contract: Contract) -> None:
        self.path = path
        self.contract = contract
        self.isa = contract.isa
        self.max_block_size = contract.values["max_block_size"]
        self._functions = _wrappers(cdll)
        for name, wrapper in self._functions.items():
            setattr(self, name, wrapper)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the kernels library built for {self.isa} has no {name}")

    def has(self, name: str) -> bool:
        return name in self._functions


def _cache_dir() -> Path:
    return Path(cache_root()) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *TARGET_FLAGS[isa])


def library_path(compiler: str, isa: str) -> Path:
    """Where the build of this source, for `isa`, by this compiler lives in the cache."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False, timeout=30
    ).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(build_flags(isa)).encode(), version.encode()):
        digest.update(part)
    return _cache_dir() / f"cpu_kernels-{isa}-{digest.hexdigest()[:16]}.so"


def build_tag(path: Path) -> tuple[int, str] | None:
    """The (abi, isa) a library file was built with, read from its bytes (never loaded)."""
    try:
        match = _TAG.search(path.read_bytes())
    except OSError:
        return None
    return (int(match.group(1)), match.group(2).decode()) if match else None


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Held while this process builds (an exclusive flock on `BUILD_LOCK` in the cache
    directory, released when the process exits, however it exits). A process waits for it at
    most `_BUILD_LOCK_WAIT_S`: what one build for each target takes at its longest."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / BUILD_LOCK, "w") as lock:
        deadline = time.monotonic() + _BUILD_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"another process held {directory / BUILD_LOCK} for over "
                        f"{_BUILD_LOCK_WAIT_S} s"
                    ) from None
                time.sleep(0.05)
        yield


def _build(compiler: str, isa: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *build_flags(isa), "-o", tmp, str(SOURCE), "-lm"],
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


def _built(compiler: str, isa: str) -> Path:
    """The library for `isa`, built if the cache has none or has one whose build tag is not
    this source's ABI and target (a copied or stale cache: rebuilt, never loaded). One build
    per cache directory at a time (`_build_lock`): processes that start together (the ranks of
    a TP group) wait for one compile and load its library."""
    path = library_path(compiler, isa)
    if build_tag(path) == (ABI_VERSION, isa):
        return path
    with _build_lock(path.parent):
        if build_tag(path) == (ABI_VERSION, isa):
            return path  # built by another process while this one waited
        if path.exists():
            logger.warning("kernels.rebuilt", extra={"path": str(path), "found": build_tag(path)})
            path.unlink(missing_ok=True)
        started = time.monotonic()
        _build(compiler, isa, path)
        seconds = round(time.monotonic() - started, 1)
    logger.info("kernels.built", extra={"path": str(path), "isa": isa, "seconds": seconds})
    tag = build_tag(path)
    if tag != (ABI_VERSION, isa):
        raise RuntimeError(
            f"the build for {isa} says it is {tag} (abi, isa), not ({ABI_VERSION}, '{isa}'): the"
            " compiler ignored the flags, or ABI_VERSION is not the C file's OTEL_KERNELS_ABI"
        )
    return path


@functools.cache
def load(isa: str | None = None) -> KernelLibrary | None:
    """The kernels library built for `isa` (default: `target_isa()`) with typed entry points,
    or None (logged) when it cannot be built or its contract does not match."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("kernels.unavailable", extra={"reason": "no C compiler (cc) found"})
        return None
    try:
        isa = isa or target_isa()
        check_runnable(isa, cpu_isa(), source=f"kernels for {isa}")
        path = _built(compiler, isa)
        cdll = ctypes.CDLL(str(path))
        cdll.otel_kernels_contract.restype = ctypes.c_char_p
        contract = Contract.parse(cdll.otel_kernels_contract().decode())
        wrong = contract.mismatches()
        if contract.isa != isa:
            wrong.append(f"isa {contract.isa} (expected {isa})")
        if wrong:
            raise RuntimeError(f"{path.name} does not match kernels.py: {', '.join(wrong)}")
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as error:
        logger.warning("kernels.unavailable", extra={"reason": f"{type(error).__name__}: {error}"})
        return None
    return KernelLibrary(cdll, path, contract)


def _exported(cdll: ctypes.CDLL) -> dict[str, tuple[tuple[str, type], ...]]:
    """Every function this build exports, by name, with its parameters."""
    exported = exported_names()
    exported.update(PLAIN_SIGNATURES)
    optional = {**OPTIONAL_SIGNATURES, **QUERIES}
    exported.update({n: p for n, p in optional.items() if hasattr(cdll, n)})
    return exported


def _wrappers(cdll: ctypes.CDLL) -> dict[str, Callable[..., Any]]:
    import torch

    failed_check = cdll.otel_kernels_failure  # the check that failed last on this thread
    failed_check.argtypes = []
    failed_check.restype = ctypes.c_char_p
    namespace = {"_Tensor": torch.Tensor, "_failure": _failure, "_failed_check": failed_check}
    wrappers = {}
    for name, params in _exported(cdll).items():
        function = getattr(cdll, name)
        function.argtypes = [kind for _, kind in params]
        function.restype = ctypes.c_int
        wrappers[name] = _wrap(name, function, params, namespace)
    return wrappers


# The wrapper of a kernel, made from its SIGNATURES entry and compiled as if it stood on this
# template's lines, named as the C function (a faulthandler traceback of a thread inside the
# kernel shows `File ".../kernels.py", line N in <kernel>`). Pointers: a tensor's data_ptr(),
# an address (int) or None.
_WRAPPER = """\
def {name}({parameters}):
    status = _function({arguments})
    if status:
        raise _failure({name!r}, status, _failed_check(), {{{scalars}}})
"""
_QUERY = """\
def {name}():
    return _function()
"""
_WRAPPER_LINE = Path(__file__).read_text().splitlines().index("def {name}({parameters}):")
_QUERY_LINE = Path(__file__).read_text().splitlines().index("def {name}():")


def _wrap(
    name: str, function: Any, params: tuple[tuple[str, type], ...], namespace: dict[str, Any]
) -> Callable[..., Any]:
    """`function` called by its parameters' names (or, unless KEYWORDS_ONLY, in order)."""
    if name in QUERIES:
        source = "\n" * _QUERY_LINE + _QUERY.format(name=name)
    else:
        names = [n for n, _ in params]
        pointer = "{0}.data_ptr() if isinstance({0}, _Tensor) else {0}"
        arguments = [pointer.format(n) if kind is _P else n for n, kind in params]
        scalars = [f"{n!r}: {n}" for n, kind in params if kind is not _P]
        source = "\n" * _WRAPPER_LINE + _WRAPPER.format(
            name=name,
            parameters=", ".join(["*", *names] if KEYWORDS_ONLY and names else names),
            arguments=", ".join(arguments),
            scalars=", ".join(scalars),
        )
    namespace = {**namespace, "_function": function}
    exec(compile(source, __file__, "exec"), namespace)
    wrapper = namespace[name]
    wrapper.c_function = function
    return wrapper


def _failure(name: str, code: int, check: bytes, scalars: dict[str, Any]) -> KernelError:
    """The error of kernel `name`, whose status was `code`: the status's reason, the check
    that failed (as the C source states it) and the scalar arguments."""
    try:
        status = KernelStatus(code)
    except ValueError:
        return KernelError(name, KernelStatus.BAD_ARGUMENT, f"unknown status {code}")
    details = [f"{key}={value}" for key, value in scalars.items()]
    if check:
        details.insert(0, f"failed: {check.decode()}")
    reason = f"{status.reason} ({', '.join(details)})" if details else status.reason
    return KernelError(name, status, reason)
