"""The contract between kernels.py and cpu_kernels.c: every exported function's parameters
(names, kinds, order) as the C source declares them, the layout constants and the decoder
stack's fields as the library reports them, and a build made for another target is never
loaded."""

from __future__ import annotations

import concurrent.futures
import ctypes
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from otel_engine.model import kernels
from otel_engine.model.kernels import (
    OPTIONAL_SIGNATURES,
    PLAIN_SIGNATURES,
    SIGNATURES,
    SOURCE,
)
from otel_engine.model.weights import GgmlType
from tests.helpers.isa import require_isa

_PROTOTYPE = re.compile(r"^(?:void|int) ([a-z0-9_]+(?:##SUFFIX)?)\(([^)]*)\)", re.MULTILINE)
_KINDS = {"float": ctypes.c_float, "int64_t": ctypes.c_int64}


def _c_prototypes() -> dict[str, list[tuple[str, type]]]:
    """Every exported `void name(...)` or `int name(...)` of the C source (macro line
    continuations removed; `name_##SUFFIX` as `name_`), its parameters as (name, ctypes
    kind): pointers c_void_p."""
    text = SOURCE.read_text().replace("\\\n", "\n")
    found = {}
    for match in _PROTOTYPE.finditer(text):
        params: list[tuple[str, type]] = []
        declarations = " ".join(match.group(2).split())
        for declaration in [] if declarations == "void" else declarations.split(","):
            words = declaration.replace("*", " * ").split()
            kind = ctypes.c_void_p if "*" in words else _KINDS[words[-2]]
            params.append((words[-1], kind))
        found[match.group(1).removesuffix("##SUFFIX")] = params
    return found


def test_every_signature_matches_the_c_prototype() -> None:
    """kernels.py declares each function's parameters by name, kind and order as the C
    source does (a reordered or retyped argument would be silent memory corruption)."""
    prototypes = _c_prototypes()
    declared = {
        **{f"{n}_": p for n, p in SIGNATURES.items()},
        **PLAIN_SIGNATURES,
        **OPTIONAL_SIGNATURES,
        "amx_ready": (),
    }

    for name, params in declared.items():
        assert list(params) == prototypes[name], name
    assert set(declared) == set(prototypes)


@pytest.fixture(scope="module")
def library() -> kernels.KernelLibrary:
    built = kernels.load()
    assert built is not None, "the kernels did not build (is a C compiler installed?)"
    return built


def test_the_library_states_this_modules_layout(library: kernels.KernelLibrary) -> None:
    """The ABI number, target and layout constants the library reports are the ones the
    Python side builds its tensors with."""
    contract = library.contract

    assert [] == contract.mismatches()
    assert kernels.ABI_VERSION == contract.abi
    assert kernels.target_isa() == contract.isa == library.isa
    assert (kernels.ABI_VERSION, contract.isa) == kernels.build_tag(library.path)


def test_the_stack_fields_are_named_in_c_order(library: kernels.KernelLibrary) -> None:
    """The decoder stack's per-layer fields and dims come from the C side's one list: a
    matrix is its bytes, parameters and panels in that order (stack_linear reads them so)."""
    fields = library.contract.stack_fields

    assert ("input_norm", "post_norm") == fields[:2]
    assert ("k_cache", "v_cache") == fields[-2:]
    for matrix in ("qkv", "o", "gate_up", "down"):
        at = fields.index(f"{matrix}_packed")
        assert (f"{matrix}_params", f"{matrix}_panels") == fields[at + 1 : at + 3]
    assert "tokens" == library.contract.stack_dims[0]
    assert len(set(library.contract.stack_dims)) == len(library.contract.stack_dims) == 12


def _declared(library: kernels.KernelLibrary) -> dict[str, tuple[tuple[str, type], ...]]:
    """Every function of SIGNATURES that this build has, by its exported name."""
    declared = kernels.exported_names()
    declared.update(PLAIN_SIGNATURES)
    declared.update({n: p for n, p in OPTIONAL_SIGNATURES.items() if library.has(n)})
    return declared


def test_every_declared_function_is_typed(library: kernels.KernelLibrary) -> None:
    """load() gives each present function its argtypes (ctypes would otherwise pass
    Python ints as C ints and floats not at all)."""
    for name, params in _declared(library).items():
        assert [k for _, k in params] == getattr(library, name).c_function.argtypes, name


def test_each_wrapper_is_named_as_its_kernel(library: kernels.KernelLibrary) -> None:
    """A function of the library is a wrapper whose Python name is the C entry point's, in
    kernels.py (a faulthandler traceback of a thread inside the kernel names it), and whose
    parameters are SIGNATURES' names in order."""
    for name, params in _declared(library).items():
        wrapper = getattr(library, name)

        assert (name, name, name) == (
            wrapper.__name__,
            wrapper.__qualname__,
            wrapper.__code__.co_name,
        )
        assert str(SOURCE.with_name("kernels.py")) == wrapper.__code__.co_filename
        assert [n for n, _ in params] == list(inspect.signature(wrapper).parameters)


def test_a_wrong_or_missing_argument_name_is_a_type_error_naming_the_kernel(
    library: kernels.KernelLibrary,
) -> None:
    """Arguments go by name: one the kernel does not have, or one left out, is refused
    before the kernel runs."""
    out, gate_up = torch.empty(1, 8), torch.empty(1, 16)

    with pytest.raises(TypeError, match=r"silu_mul_f32.*'widht'"):
        library.silu_mul_f32(out=out, gate_up=gate_up, rows=1, widht=8)
    with pytest.raises(TypeError, match=r"silu_mul_f32.*'width'"):
        library.silu_mul_f32(out=out, gate_up=gate_up, rows=1)


def test_with_keywords_only_a_positional_call_is_refused(
    library: kernels.KernelLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernels.KEYWORDS_ONLY makes every wrapper take its arguments by name alone (argument
    order is then never trusted); the same call by name runs."""
    monkeypatch.setattr(kernels, "KEYWORDS_ONLY", True)
    c_function = library.silu_mul_f32.c_function
    namespace = library.silu_mul_f32.__globals__
    strict = kernels._wrap("silu_mul_f32", c_function, SIGNATURES["silu_mul"], namespace)
    out, gate_up = torch.zeros(1, 8), torch.ones(1, 16)

    with pytest.raises(TypeError, match="silu_mul_f32"):
        strict(out, gate_up, 1, 8)
    strict(out=out, gate_up=gate_up, rows=1, width=8)
    assert torch.allclose(torch.nn.functional.silu(torch.ones(1, 8)), out)


def test_a_wrapper_takes_tensors_addresses_and_none_for_pointers(
    library: kernels.KernelLibrary,
) -> None:
    """A pointer parameter takes a tensor (its data_ptr()), an address or None (NULL)."""
    hidden = torch.randn(2, 16)
    weight = torch.rand(16)
    by_tensor, by_address = torch.empty(2, 16), torch.empty(2, 16)

    library.add_rms_norm_f32(
        hidden=hidden, delta=None, weight=weight, out=by_tensor, rows=2, width=16, eps=1e-6
    )
    library.add_rms_norm_f32(
        hidden=hidden.data_ptr(), delta=None, weight=weight.data_ptr(),
        out=by_address.data_ptr(), rows=2, width=16, eps=1e-6,
    )  # fmt: skip

    assert torch.equal(by_tensor, by_address)
    assert torch.allclose(by_tensor, torch.rms_norm(hidden, (16,), weight, 1e-6))


def test_a_status_that_is_not_ok_is_a_kernel_error(library: kernels.KernelLibrary) -> None:
    """A kernel that refuses its input raises KernelError naming the kernel and the reason,
    the scalar arguments shown."""
    with pytest.raises(kernels.KernelError) as caught:
        library.fault_drill(kind=4, thread=1, target=None)

    assert "fault_drill" == caught.value.kernel
    assert kernels.KernelStatus.BAD_ARGUMENT == caught.value.status
    assert caught.value.reason.startswith(kernels.KernelStatus.BAD_ARGUMENT.reason)
    assert str(caught.value).startswith("kernel fault_drill: ")
    assert "kind=4, thread=1" in str(caught.value)


def _fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OTEL_ENGINE_CACHE_DIR", str(tmp_path))
    kernels.load.cache_clear()


def _shared_build(isa: str) -> Path:
    """The shared cache's real build for `isa` (compiled there once, as every kernels test
    loads it), for a test to copy into its fresh cache instead of compiling it again. Call it
    before `_fresh_cache`."""
    compiler = kernels._compiler()
    assert compiler is not None
    return kernels._built(compiler, isa)


def _build_by_copying(monkeypatch: pytest.MonkeyPatch, isa: str) -> list[str]:
    """`kernels._build` as a copy of the shared cache's real build for `isa`: the levels
    built, in order, for the test to count (what a rebuild test checks is that the build
    happens and its library is the one loaded, not how long the compiler takes)."""
    shared = _shared_build(isa)
    builds: list[str] = []

    def build(compiler: str, level: str, target: Path) -> None:
        builds.append(level)
        assert isa == level
        shutil.copyfile(shared, target)

    monkeypatch.setattr(kernels, "_build", build)
    return builds


def test_each_target_has_its_own_cache_entry() -> None:
    """The cache key includes the target: builds for two levels never share a file."""
    compiler = kernels._compiler()
    assert compiler is not None

    paths = {isa: kernels.library_path(compiler, isa) for isa in kernels.ISA_LEVELS}

    assert len(kernels.ISA_LEVELS) == len(set(paths.values()))
    for isa, path in paths.items():
        assert path.name.startswith(f"cpu_kernels-{isa}-")


@pytest.mark.slow  # compiles the kernels
def test_a_copied_build_for_another_target_is_rebuilt_not_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A cache holding, under this target's name, a library built for another level (a
    cache directory copied from another machine) is rebuilt: its build tag is read from the
    file before anything loads it."""
    target = kernels.target_isa()
    other_isa = "avx2" if target == "baseline" else "baseline"  # another level, one it runs
    require_isa(other_isa)
    other = _shared_build(other_isa)
    builds = _build_by_copying(monkeypatch, target)
    _fresh_cache(monkeypatch, tmp_path)
    try:
        compiler = kernels._compiler()
        assert compiler is not None
        wanted = kernels.library_path(compiler, target)
        wanted.parent.mkdir(parents=True)
        shutil.copyfile(other, wanted)
        assert (kernels.ABI_VERSION, other_isa) == kernels.build_tag(wanted)

        library = kernels.load()
    finally:
        kernels.load.cache_clear()

    assert [target] == builds
    assert library is not None
    assert target == library.isa
    assert (kernels.ABI_VERSION, target) == kernels.build_tag(wanted)


@pytest.mark.slow  # compiles the kernels
def test_a_library_of_another_abi_is_rebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A file whose build tag names another ABI (an older build of the same name) is
    replaced by a fresh build."""
    target = kernels.target_isa()
    builds = _build_by_copying(monkeypatch, target)
    _fresh_cache(monkeypatch, tmp_path)
    compiler = kernels._compiler()
    assert compiler is not None
    wanted = kernels.library_path(compiler, target)
    wanted.parent.mkdir(parents=True)
    wanted.write_bytes(b"\x7fELF junk otel-kernels-build:abi=1;isa=" + target.encode() + b";")
    try:
        library = kernels.load()
    finally:
        kernels.load.cache_clear()

    assert [target] == builds
    assert library is not None
    assert (kernels.ABI_VERSION, target) == kernels.build_tag(wanted)


def test_a_target_above_the_cpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_ENGINE_KERNEL_ISA can lower the target, never raise it past the CPU."""
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx2")
    monkeypatch.setenv(kernels.ISA_ENV, "avx512bf16")

    with pytest.raises(ValueError, match="above what this CPU runs"):
        kernels.target_isa()
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert "avx2" == kernels.target_isa()


def test_the_build_flags_name_the_target_never_native() -> None:
    """The compiler is told the target; -march=native (its own guess) is never used."""
    for isa in (*kernels.ISA_LEVELS, "generic"):
        flags = kernels.build_flags(isa)
        assert "-march=native" not in flags
        assert "-mtune=native" not in flags
    assert "-mavx512bf16" in kernels.build_flags("avx512bf16")
    assert "-march=x86-64-v3" in kernels.build_flags("avx2")


_CONTRACT = (
    "abi={abi};isa=avx2;max_block_size=256;int4_group=32;panel_blocks=3;prefill_tile_keys=32;"
    "prefill_max_head_dim=128;stack_fields=a,b,;stack_dims=c,;stack_head_dim=64;"
    "prefill_chunk_fields=query_start,num_query,num_keys,table,;"
    "ggml_types=Q4_0:2,Q4_1:3,Q8_0:8,Q4_K:12,Q5_K:13,Q6_K:14,;"
    "statuses=ok,bad_type,no_memory,bad_argument,unavailable,;"
)


def test_a_contract_that_agrees_is_parsed_whole() -> None:
    """Every part of the contract is read: the lists in order, the GGML types by name."""
    contract = kernels.Contract.parse(_CONTRACT.format(abi=kernels.ABI_VERSION))

    assert [] == contract.mismatches()
    assert ("a", "b") == contract.stack_fields
    assert kernels.PREFILL_CHUNK_FIELDS == contract.prefill_chunk_fields
    assert 12 == contract.ggml_types["Q4_K"]
    assert kernels.STACK_HEAD_DIM == contract.values["stack_head_dim"]


@pytest.mark.parametrize(
    ("change", "mismatch"),
    [
        (("abi=" + str(kernels.ABI_VERSION), "abi=1"), f"abi 1 (expected {kernels.ABI_VERSION})"),
        (("panel_blocks=3", "panel_blocks=4"), "panel_blocks 4 (expected 3)"),
        (("stack_head_dim=64", "stack_head_dim=128"), "stack_head_dim 128 (expected 64)"),
        (("Q5_K:13", "Q5_K:15"), "ggml_types Q4_0:2,Q4_1:3,Q8_0:8,Q4_K:12,Q5_K:15,Q6_K:14"),
        (("num_query,num_keys", "num_keys,num_query"), "prefill_chunk_fields query_start,num_k"),
        (("no_memory,bad_argument", "bad_argument,no_memory"), "statuses ok,bad_type,bad_arg"),
    ],
)
def test_a_contract_that_disagrees_is_reported(change: tuple[str, str], mismatch: str) -> None:
    """A library whose ABI, layout constants, stack head size, prefill chunk fields, GGML
    type ids or status names differ from the Python side's is named as such (load() then
    refuses it: torch ops run, never a mismatched kernel)."""
    text = _CONTRACT.format(abi=kernels.ABI_VERSION).replace(*change)

    wrong = kernels.Contract.parse(text).mismatches()

    assert 1 == len(wrong)
    assert wrong[0].startswith(mismatch)


def test_the_ggml_type_ids_are_gguf_py_s() -> None:
    """weights.GgmlType, the one Python home of the ids (the C side's are compared at load),
    gives each format gguf-py's GGMLQuantizationType value."""
    for ggml_type in GgmlType:
        assert GGMLQuantizationType[ggml_type.name].value == ggml_type.value


@pytest.mark.slow  # compiles the kernels
def test_a_build_that_is_not_its_target_is_never_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A compiler that ignores the target flags (the fresh build's tag names another level):
    load() refuses the library and the model runs on torch ops."""
    require_isa("avx512")  # else load("avx512") is refused before any build
    other = _shared_build("avx2")
    _fresh_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(kernels, "_build", lambda c, isa, target: shutil.copyfile(other, target))
    try:
        library = kernels.load("avx512")
    finally:
        kernels.load.cache_clear()

    assert library is None


_DRILL = """
import ctypes, faulthandler, mmap, os, sys, tempfile
from otel_engine.model import kernels
faulthandler.enable()
library = kernels.load()
kind, thread = int(sys.argv[1]), int(sys.argv[2])
with tempfile.TemporaryFile() as file:
    file.write(bytes(mmap.PAGESIZE))
    file.flush()
    mapping = mmap.mmap(file.fileno(), mmap.PAGESIZE)
    target = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    os.ftruncate(file.fileno(), 0)  # the mapping now lies past the file's end
    library.fault_drill(kind=kind, thread=thread, target=target)
    print("returned", flush=True)
"""


@pytest.mark.parametrize(
    ("kind", "thread", "signal_number"),
    [(1, 1, signal.SIGSEGV), (1, 0, signal.SIGSEGV), (2, 1, signal.SIGFPE), (3, 1, signal.SIGBUS)],
)
def test_the_fault_drill_makes_its_signal_on_the_chosen_thread(
    library: kernels.KernelLibrary, kind: int, thread: int, signal_number: int
) -> None:
    """fault_drill(kind, thread) ends the process with the kind's signal, made on the calling
    thread (0) or an OpenMP worker (1); faulthandler's traceback of the thread that called
    names the kernel in kernels.py."""
    result = subprocess.run(
        [sys.executable, "-c", _DRILL, str(kind), str(thread)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert -signal_number == result.returncode, result.stdout + result.stderr
    assert re.search(r'File ".*/kernels\.py", line \d+ in fault_drill\n', result.stderr)


def test_the_fault_drill_refuses_an_unknown_kind(library: kernels.KernelLibrary) -> None:
    """A kind or thread outside the drill's set makes no fault: the bad-argument status."""
    for kind, thread in ((4, 1), (0, 0), (1, 2)):
        with pytest.raises(kernels.KernelError) as caught:
            library.fault_drill(kind=kind, thread=thread, target=None)
        assert kernels.KernelStatus.BAD_ARGUMENT == caught.value.status


def test_concurrent_loads_build_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Threads that find the cache cold together (as TP ranks starting at once do) wait for
    the one that holds the build lock, then find its library: one build."""
    monkeypatch.setenv("OTEL_ENGINE_CACHE_DIR", str(tmp_path))
    builds: list[str] = []

    def slow_build(compiler: str, isa: str, target: Path) -> None:
        builds.append(isa)
        time.sleep(0.5)  # every other thread is waiting by now
        tag = f"otel-kernels-build:abi={kernels.ABI_VERSION};isa={isa};"
        target.write_bytes(b"\x7fELF " + tag.encode())

    monkeypatch.setattr(kernels, "_build", slow_build)
    compiler = kernels._compiler()
    assert compiler is not None
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(lambda _: kernels._built(compiler, "baseline"), range(4)))

    assert ["baseline"] == builds
    assert {kernels.library_path(compiler, "baseline")} == paths
    assert (tmp_path / "kernels" / kernels.BUILD_LOCK).exists()


_LOAD = """
from otel_engine.model import kernels
library = kernels.load()
print(library.isa if library is not None else "none")
"""


@pytest.mark.slow  # compiles the kernels
def test_processes_that_start_together_on_a_cold_cache_compile_once(tmp_path: Path) -> None:
    """Three processes loading the kernels at once with an empty cache run the compiler
    once (a compiler wrapper counts the builds) and all load the library it built."""
    log = tmp_path / "builds.log"
    wrapper = tmp_path / "cc"
    real = kernels._compiler()
    assert real is not None
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in *" -o "*) echo build >> "{log}";; esac\nexec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    env = {
        **os.environ,
        "CC": str(wrapper),
        "OTEL_ENGINE_CACHE_DIR": str(tmp_path / "cache"),
        kernels.ISA_ENV: "baseline",  # the quickest build
    }
    processes = [
        subprocess.Popen([sys.executable, "-c", _LOAD], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=600)[0].split() for process in processes]

    assert [["baseline"]] * 3 == outputs
    assert ["build"] == log.read_text().split()


def _measured_build_seconds() -> dict[str, float]:
    """bench/README.md's table of bench/kernel_build.py's numbers: the compiler's CPU seconds
    per level (what a build costs one core; the wall time grows with the machine's load)."""
    readme = Path(__file__).parents[2] / "bench" / "README.md"
    section = readme.read_text().split("## Kernel build time", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", section, re.MULTILINE)
    return {level: float(cpu) for level, cpu in rows}


def test_the_stated_build_time_is_the_benchmark_s() -> None:
    """The build time kernels.py and docs/architecture.md state is bench/kernel_build.py's,
    as bench/README.md records it, for every level."""
    measured = _measured_build_seconds()
    fastest, slowest = round(measured["baseline"]), round(measured["avx512bf16"])
    architecture = Path(__file__).parents[2] / "docs" / "architecture.md"

    assert set(kernels.ISA_LEVELS) == set(measured)
    assert f"{fastest} s (baseline) to {slowest} s (avx512bf16)" in " ".join(
        (kernels.__doc__ or "").split()
    )
    assert f"{fastest}-{slowest} s of one core" in architecture.read_text()
