"""Whether this CPU computes in a half-precision dtype or only stores it.

`--dtype auto` runs a bfloat16 (or float16) checkpoint in that dtype only where the CPU has
the instructions that multiply in it: AVX-512 BF16 or AMX-BF16 for bfloat16 (AVX-512 FP16 or
AMX-FP16 for float16) on x86, the BF16 extension on Arm. Elsewhere torch emulates the
arithmetic element by element and the same model runs several times slower than in float32
(bench/README.md, "Which dtype"), so `auto` takes float32 there. The caps that lower what
torch and the kernels use (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`,
`OTEL_ENGINE_KERNEL_ISA`) lower this too, so a capped run chooses as that CPU would.

No torch here: the engine core decides the dtype (the KV cache's size depends on it) before
any model is loaded, and at TP > 1 it never loads torch.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from otel_engine.config import Dtype
from otel_engine.model.kernels import ISA_ENV, ISA_LEVELS, IsaLevel

# What each dtype needs, by the flag names of /proc/cpuinfo (x86 "flags", Arm "Features").
_X86_FLAGS: dict[str, tuple[str, ...]] = {
    Dtype.BFLOAT16: ("avx512_bf16", "amx_bf16"),
    Dtype.FLOAT16: ("avx512_fp16", "amx_fp16"),
}
_ARM_FLAGS: dict[str, tuple[str, ...]] = {Dtype.BFLOAT16: ("bf16",), Dtype.FLOAT16: ("asimdhp",)}
# Caps below the level that has the instructions (the values that keep them are not listed).
_TORCH_CAPS = ("default", "avx2")  # ATEN_CPU_CAPABILITY
_KERNEL_CAPS = ISA_LEVELS[: ISA_LEVELS.index(IsaLevel.AVX512BF16)]  # OTEL_ENGINE_KERNEL_ISA
_ONEDNN_NATIVE = ("BF16", "FP16", "AMX", "ALL")  # in an ONEDNN_MAX_CPU_ISA that keeps them


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (empty where /proc/cpuinfo is not readable)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def half_precision_blocker(dtype: str, flags: frozenset[str] | None = None) -> str | None:
    """Why this CPU would only emulate `dtype` ("bfloat16" or "float16"); None: it computes
    in it. `flags` defaults to this machine's."""
    flags = cpu_flags() if flags is None else flags
    machine = platform.machine().lower()
    table = _ARM_FLAGS if machine in ("aarch64", "arm64") else _X86_FLAGS
    needed = table.get(dtype, ())
    if not any(flag in flags for flag in needed):
        return f"this CPU has no {' or '.join(needed) or dtype} arithmetic"
    env = os.environ
    if env.get("ATEN_CPU_CAPABILITY", "").strip().lower() in _TORCH_CAPS:
        return f"ATEN_CPU_CAPABILITY={env['ATEN_CPU_CAPABILITY']} caps torch below it"
    onednn = env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if onednn and not any(part in onednn for part in _ONEDNN_NATIVE):
        return f"ONEDNN_MAX_CPU_ISA={onednn} caps oneDNN below it"
    if env.get(ISA_ENV, "").strip() in _KERNEL_CAPS:
        return f"{ISA_ENV}={env[ISA_ENV]} caps the kernels below it"
    return None
