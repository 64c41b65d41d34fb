"""`--dtype auto` runs a half-precision checkpoint in that dtype only on a CPU that computes in
it, and says why at start; an explicit half-precision dtype on a CPU that only emulates it is
a warning with its measured cost. Caps (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
OTEL_ENGINE_KERNEL_ISA) count as the CPU they cap to, which is how an AVX2 CPU is tested on a
machine that has more."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from otel_engine.config import EngineConfig
from otel_engine.model.arch import load_model_arch
from otel_engine.model.cpu import cpu_flags, half_precision_blocker
from otel_engine.model.limits import choose_dtype, choose_kv_cache_dtype, resolve_limits

_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OTEL_ENGINE_KERNEL_ISA")
_ZEN3 = frozenset({"avx2", "fma", "f16c"})  # no AVX-512: what a Zen 3 reports, in part
_ZEN4 = _ZEN3 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}


@pytest.fixture
def uncapped(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _CAPS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def bf16_checkpoint(tiny_model_dir: str, tmp_path: Path) -> str:
    """The tiny checkpoint, saying it is stored in bfloat16."""
    model_dir = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return str(model_dir)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86 flag names")
def test_the_blocker_reads_the_flags_and_every_cap(
    uncapped: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "no avx512_bf16 or amx_bf16" in str(half_precision_blocker("bfloat16", _ZEN3))
    assert half_precision_blocker("bfloat16", _ZEN4) is None
    assert "no avx512_fp16" in str(half_precision_blocker("float16", _ZEN4))
    for name, value in zip(_CAPS, ("avx2", "AVX512_CORE", "avx512"), strict=True):
        monkeypatch.setenv(name, value)
        assert name in str(half_precision_blocker("bfloat16", _ZEN4))
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert half_precision_blocker("bfloat16", _ZEN4) is None


def test_auto_follows_the_cpu_and_an_explicit_dtype_is_kept(
    bf16_checkpoint: str, uncapped: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch = load_model_arch(bf16_checkpoint)
    auto = choose_dtype(EngineConfig.from_kwargs(model=bf16_checkpoint), arch)
    native = half_precision_blocker("bfloat16") is None
    assert ("bfloat16" if native else "float32") == auto.name
    assert auto.reason.startswith("auto: the checkpoint's bfloat16")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    capped = choose_dtype(EngineConfig.from_kwargs(model=bf16_checkpoint), arch)
    assert ("float32", True) == (capped.name, "ATEN_CPU_CAPABILITY=avx2" in capped.reason)
    config = EngineConfig.from_kwargs(model=bf16_checkpoint, dtype="bfloat16")
    assert ("bfloat16", "--dtype") == (choose_dtype(config, arch).name, "--dtype")


def test_a_half_precision_checkpoint_run_in_float32_keeps_its_kv_in_float16(
    bf16_checkpoint: str, tiny_model_dir: str, uncapped: None
) -> None:
    """`--kv-cache-dtype auto`: float16 where a bfloat16 checkpoint runs in float32 (half
    the bytes a block, so twice the blocks in the same memory budget), the model's dtype
    elsewhere; an explicit float16 only under a float32 model; any other pairing refused at
    start, naming what would go."""
    half, full = load_model_arch(bf16_checkpoint), load_model_arch(tiny_model_dir)
    as_float32 = EngineConfig.from_kwargs(model=bf16_checkpoint, dtype="float32")
    chosen = choose_kv_cache_dtype(as_float32, half)
    assert ("float16", True) == (chosen.name, chosen.reason.startswith("auto: a bfloat16"))
    as_bfloat16 = EngineConfig.from_kwargs(model=bf16_checkpoint, dtype="bfloat16")
    assert "bfloat16" == choose_kv_cache_dtype(as_bfloat16, half).name
    stored_float32 = EngineConfig.from_kwargs(model=tiny_model_dir)
    assert "float32" == choose_kv_cache_dtype(stored_float32, full).name  # parity: unrounded
    explicit = EngineConfig.from_kwargs(model=tiny_model_dir, kv_cache_dtype="float16")
    assert ("float16", "--kv-cache-dtype") == tuple(
        getattr(choose_kv_cache_dtype(explicit, full), f) for f in ("name", "reason")
    )
    budget = {"kv_cache_memory_gib": 0.01}
    blocks = [
        resolve_limits(EngineConfig.from_kwargs(model=tiny_model_dir, **budget, **kv), full)
        for kv in ({}, {"kv_cache_dtype": "float16"})
    ]
    assert blocks[1].num_kv_blocks in (2 * blocks[0].num_kv_blocks + i for i in (0, 1))
    refused = EngineConfig.from_kwargs(
        model=bf16_checkpoint, dtype="bfloat16", kv_cache_dtype="float16"
    )
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 does not go with the model's"):
        choose_kv_cache_dtype(refused, half)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_kwargs(model=tiny_model_dir, kv_cache_dtype="int8")


def _start_log(model_dir: str, *flags: str) -> list[dict[str, object]]:
    """The JSON log of `generate` on an AVX2-capped CPU (torch, oneDNN and the kernels)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    env.pop("OTEL_ENGINE_KERNEL_ISA", None)
    command = [sys.executable, "-m", "otel_engine.cli", "generate", "--model", model_dir]
    command += ["--num-kv-blocks", "8", "--max-tokens", "2", "--log-format", "json", *flags]
    done = subprocess.run(
        [*command, "Hello"], capture_output=True, text=True, timeout=180, check=False, env=env
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    return [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]


@pytest.mark.skipif(not cpu_flags(), reason="no /proc/cpuinfo")
def test_an_avx2_cpu_runs_auto_in_float32_and_warns_of_explicit_bfloat16(
    bf16_checkpoint: str,
) -> None:
    """On a CPU capped to AVX2: `auto` on a bfloat16 checkpoint runs float32 and
    kernels.selected says why; `--dtype bfloat16` runs bfloat16 with a warning that states
    how much slower its matmuls are here, measured at start."""
    auto = _start_log(bf16_checkpoint)
    (selected,) = [r for r in auto if r.get("event") == "kernels.selected"]
    assert ("float32", "float16") == (selected["dtype"], selected["kv_cache_dtype"])
    assert "ATEN_CPU_CAPABILITY=avx2" in str(selected["dtype_reason"])
    assert not [r for r in auto if r.get("event") == "dtype.emulated"]

    explicit = _start_log(bf16_checkpoint, "--dtype", "bfloat16")
    (warning,) = [r for r in explicit if r.get("event") == "dtype.emulated"]
    assert ("bfloat16", "warning") == (warning["dtype"], warning["level"])
    assert 1.0 < float(str(warning["matmul_slowdown_vs_float32"]))
    (selected,) = [r for r in explicit if r.get("event") == "kernels.selected"]
    assert ("bfloat16", "--dtype") == (selected["dtype"], selected["dtype_reason"])
    assert "bfloat16" == selected["kv_cache_dtype"]


def test_a_kv_cache_dtype_the_model_cannot_take_stops_the_start_with_the_reason(
    tiny_model_dir: str,
) -> None:
    """`generate` with a float16 cache under a bfloat16 model exits non-zero, and stderr says
    which pairing was refused and what would do."""
    command = [sys.executable, "-m", "otel_engine.cli", "generate", "--model", tiny_model_dir]
    command += ["--dtype", "bfloat16", "--kv-cache-dtype", "float16", "--max-tokens", "2"]
    done = subprocess.run(
        [*command, "Hello"], capture_output=True, text=True, timeout=180, check=False
    )
    assert 0 != done.returncode
    reason = "--kv-cache-dtype float16 does not go with the model's bfloat16: choose bfloat16"
    assert reason in done.stderr
