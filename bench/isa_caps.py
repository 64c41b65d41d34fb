"""Each instruction-set level of the compiled kernels (`kernels.ISA_LEVELS`) as both engines
are held to it, so that a benchmark measures a CPU of that level on any machine that has it.

- otel-engine: three caps in the environment of its processes (`Level.env`): torch's own
  kernels (`ATEN_CPU_CAPABILITY`), oneDNN's (`ONEDNN_MAX_CPU_ISA`) and the compiled kernels'
  build (`OTEL_ENGINE_KERNEL_ISA`). `--dtype auto` chooses under them as it would on a CPU of
  that level (otel_engine/model/cpu.py).
- llama.cpp: a build for the level (`Level.ggml_options`): `GGML_NATIVE=OFF` and every x86
  instruction option of ggml set, on for the level's extensions and off for the rest, so
  that neither `-march=native` nor ggml's defaults (AVX2 and its companions on) add any.

Levels follow the x86-64 psABI as the kernels' `TARGET_FLAGS` do: avx2 is x86-64-v3 (AVX2,
FMA, F16C, BMI2; no AVX-VNNI), avx512 is x86-64-v4 (AVX-512 F/CD/VL/DQ/BW; no VNNI, no
VBMI), avx512bf16 adds AVX-512 VNNI and BF16. AMX stays off in every llama.cpp build
(`models.llama_cpp_options` says why). oneDNN has no level below SSE4.1, so baseline caps
oneDNN there and torch and the kernels at x86-64.
"""

from __future__ import annotations

from dataclasses import dataclass

from otel_engine.model.kernels import ISA_ENV, check_runnable, cpu_isa

# ggml's x86 instruction options (ggml/CMakeLists.txt), each set on or off in a level's build.
GGML_X86_OPTIONS = (
    "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C",
    "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
    "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16",
)  # fmt: skip
_X86_64_V3 = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C")


@dataclass(frozen=True)
class Level:
    """One level, and what holds each engine to it."""

    name: str  # a member of kernels.ISA_LEVELS
    aten: str  # ATEN_CPU_CAPABILITY
    onednn: str  # ONEDNN_MAX_CPU_ISA
    ggml_on: tuple[str, ...]  # the GGML_X86_OPTIONS on in llama.cpp's build; the rest off

    def env(self) -> dict[str, str]:
        """The caps otel-engine's processes run under."""
        return {
            "ATEN_CPU_CAPABILITY": self.aten,
            "ONEDNN_MAX_CPU_ISA": self.onednn,
            ISA_ENV: self.name,
        }

    def ggml_options(self) -> dict[str, str]:
        """llama.cpp's cmake cache entries for this level's instructions."""
        on_off = {option: "ON" if option in self.ggml_on else "OFF" for option in GGML_X86_OPTIONS}
        return {"GGML_NATIVE": "OFF", **on_off}


LEVELS: dict[str, Level] = {
    level.name: level
    for level in (
        Level("baseline", "default", "SSE41", ()),
        Level("avx2", "avx2", "AVX2", _X86_64_V3),
        Level("avx512", "avx512", "AVX512_CORE", (*_X86_64_V3, "GGML_AVX512")),
        Level(
            "avx512bf16",
            "avx512",
            "AVX512_CORE_BF16",
            (*_X86_64_V3, "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"),
        ),
    )
}


def runnable(name: str) -> Level:
    """The level `name`; ValueError when this CPU does not run it (or is not x86)."""
    check_runnable(name, cpu_isa(), source=f"--isa {name}")
    return LEVELS[name]


def reported_features(system_info: str) -> list[str]:
    """The CPU features a llama.cpp build reports as compiled in, from its `system_info:`
    line (`CPU : SSE3 = 1 | AVX = 1 | ... |`): the names whose value is 1, in its order."""
    features = []
    for part in system_info.split("|"):
        name, equals, value = part.rpartition("=")
        name = name.split(":")[-1].strip()
        if equals and name and value.strip() == "1":
            features.append(name)
    return features
