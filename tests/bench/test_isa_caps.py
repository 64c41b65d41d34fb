"""bench/isa_caps.py and `bench/models.py --isa`: what holds each engine to a level (the caps
otel-engine runs under, the cmake options llama.cpp is built with) and the refusal of a level
above the CPU. Nothing is built or started."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from otel_engine.model import kernels

BENCH = Path(__file__).resolve().parents[2] / "bench"
# llama-server's line on this project's Zen 4 (native build), as it logs it at trace level
SYSTEM_INFO = (
    "system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | "
    "AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | "
    "AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    """bench/isa_caps.py and bench/llama_cpp_tools.py, imported as the scripts import each
    other."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("isa_caps"), importlib.import_module("llama_cpp_tools")


def _on(options: dict[str, str]) -> set[str]:
    return {key for key, value in options.items() if value == "ON"}


def test_one_level_per_kernels_level_in_order(bench: tuple[ModuleType, ModuleType]) -> None:
    isa_caps, _ = bench
    assert kernels.ISA_LEVELS == tuple(isa_caps.LEVELS)


def test_otel_engine_caps_per_level(bench: tuple[ModuleType, ModuleType]) -> None:
    """torch, oneDNN and the kernels' build, each capped at the level."""
    isa_caps, _ = bench
    expected = {
        "baseline": ("default", "SSE41"),
        "avx2": ("avx2", "AVX2"),
        "avx512": ("avx512", "AVX512_CORE"),
        "avx512bf16": ("avx512", "AVX512_CORE_BF16"),
    }
    for name, (aten, onednn) in expected.items():
        env = {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn, kernels.ISA_ENV: name}
        assert env == isa_caps.LEVELS[name].env()


def test_llama_cpp_options_per_level(bench: tuple[ModuleType, ModuleType]) -> None:
    """Not native; the level's ggml instruction options on, every other one set off."""
    isa_caps, llama_cpp = bench
    v3 = {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C"}
    expected = {
        "baseline": set(),
        "avx2": v3,
        "avx512": v3 | {"GGML_AVX512"},
        "avx512bf16": v3 | {"GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"},
    }
    for name, level in isa_caps.LEVELS.items():
        options = llama_cpp.llama_cpp_options(level)
        assert ("OFF", expected[name]) == (options["GGML_NATIVE"], _on(options))
        assert set(isa_caps.GGML_X86_OPTIONS) <= set(options)
        assert ("Release", "OFF") == (options["CMAKE_BUILD_TYPE"], options["GGML_CUDA"])
        assert "CMAKE_C_FLAGS" not in options  # no -m flag beside ggml's own


def test_native_llama_cpp_build_is_unchanged(bench: tuple[ModuleType, ModuleType]) -> None:
    """Without --isa the build is today's: native, in build/ (its stamp still matches)."""
    isa_caps, llama_cpp = bench
    options = llama_cpp.llama_cpp_options()
    assert "ON" == options["GGML_NATIVE"]
    assert not set(isa_caps.GGML_X86_OPTIONS) & set(options)
    assert "build" == llama_cpp.llama_cpp_build_dir().name
    assert "build-avx2" == llama_cpp.llama_cpp_build_dir(isa_caps.LEVELS["avx2"]).name


def test_features_read_from_system_info(bench: tuple[ModuleType, ModuleType]) -> None:
    isa_caps, _ = bench
    expected = ["SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "AVX512"]
    expected += ["AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "LLAMAFILE", "OPENMP", "REPACK"]
    assert expected == isa_caps.reported_features(SYSTEM_INFO)
    assert [] == isa_caps.reported_features("")


def test_a_level_above_the_cpu_is_refused_before_any_build(
    bench: tuple[ModuleType, ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    isa_caps, _ = bench
    models = importlib.import_module("models")
    monkeypatch.setattr(isa_caps, "cpu_isa", lambda: "avx2")
    monkeypatch.setattr(models, "build_llama_cpp", pytest.fail)

    assert 2 == models.main(["--isa", "avx512"])
    assert "above what this CPU runs (avx2)" in capsys.readouterr().err
    assert "avx2" == isa_caps.runnable("avx2").name
