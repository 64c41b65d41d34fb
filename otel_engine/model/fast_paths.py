"""Which fast path a model runs, decided once from what this CPU, this torch and the kernel
build can run: the one place that turns `--kernels` and `--int4` into paths.

  compiled_kernels  RMSNorm, rotary + cache write, decode attention, SiLU and argmax in
                    cpu_kernels.c (else torch ops): CPU, float32 or bfloat16, a kernels
                    build where it pays off (`kernels_pay_off`)
  onednn_packing    weights prepacked for oneDNN (else `F.linear`): CPU, float32, or
                    bfloat16 where oneDNN has a bfloat16 path on this CPU
  int4_kernels      a 4-bit checkpoint multiplied by its own weights (else their bfloat16
                    copies): bfloat16, a build for AVX-512 BF16; steps of more than 16 rows
                    by tiles of the blocks where torch's matmul runs on AMX (`int4_tiles`),
                    else by bfloat16 panels
  quant_kernels     a GGUF file's Q8_0, Q4_K, Q5_K and Q6_K matrices (and Q4_0/Q4_1 ones the
                    4-bit kernels do not take), and then its embedding and LM head, multiplied
                    from their blocks (else their bfloat16 copies): bfloat16, a build for
                    AVX-512 BF16 (and VNNI); steps of up to 8 rows with x quantized to 8
                    bits (`quant_activations` int8, the default) or as it is (bfloat16);
                    where the CPU has AMX steps of up to 48 rows in AMX tiles of the blocks
                    (`amx_tiles`, also for the 4-bit kernels' larger steps)
  prefill_kernel    prompt attention in cpu_kernels.c (else torch's fused attention):
                    bfloat16, head size 64 or 128, a build for AVX-512 BF16; where torch's
                    matmul runs on AMX only steps whose chunks are all of at most 32 tokens
                    (`prefill_kernel_max_query`)
  decoder_stack     a whole model's layers in one call (else the per-layer loop): the 4-bit
                    kernels on every layer, one rank, head size 64

Each is on only where it can run; otherwise the next correct path runs (in brackets). The
decisions and their reasons are logged once at start (`kernels.selected`), go into the crash
dump's engine config and reach the API server (`GET /v1/models` and the
`otel_engine_fast_path_info` metric).

The compiled kernels' loops are vectorized by hand for AVX-512 only; built for a lower level
they run one element at a time as far as the compiler leaves them. With torch capped at the
same level (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`; bench/kernel_isa.py) they still beat
torch ops in bfloat16, but not in float32: that is the rule `kernels_pay_off` states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from otel_engine.model import kernels
from otel_engine.model.kernels import KernelLibrary
from otel_engine.model.quant import AMX_MAX_ROWS

PATHS = (
    "compiled_kernels",
    "onednn_packing",
    "int4_kernels",
    "quant_kernels",
    "prefill_kernel",
    "decoder_stack",
)
BF16_ISA = "avx512bf16"  # the 4-bit matmuls, prefill attention and the decoder stack
PREFILL_KERNEL_HEAD_DIMS = (64, 128)  # prefill attention in cpu_kernels.c
STACK_HEAD_DIM = 64  # the decoder stack's one head size
# Where torch's fused attention packs its bfloat16 matmuls for AMX, it is faster than the
# compiled prefill attention on chunks longer than this (bench/attention.py: 2.3-4x at 1,024
# tokens, even at 32); those run there, the shorter ones in the kernel.
PREFILL_KERNEL_MAX_QUERY_AMX = 32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Choice:
    enabled: bool
    reason: str


@dataclass
class FastPaths:
    """The decisions for one model on one rank. `library` is the kernels build the enabled
    compiled paths call (None when none is)."""

    cpu_isa: str
    kernel_isa: str | None
    library: KernelLibrary | None
    choices: dict[str, Choice] = field(default_factory=dict)
    # the longest prefill chunk the compiled prefill attention takes (None: any)
    prefill_kernel_max_query: int | None = None
    # 4-bit matrices in steps of more than int4.INT4_MAX_ROWS rows: tiles of the file's blocks
    # through torch's matmul (AMX), else bfloat16 panels (which then are built at load)
    int4_tiles: bool = False
    # how x meets GGUF blocks in the fused kernel: "int8" (quant_linear_q8_bf16) or "bfloat16"
    quant_activations: str = "int8"
    # steps of 9-48 rows of GGUF blocks in AMX tiles (quant_linear_amx_bf16): a build with it,
    # a CPU with AMX and Linux lending this process the tile registers
    amx_tiles: bool = False

    def is_on(self, name: str) -> bool:
        return self.choices[name].enabled

    def decide(self, name: str, enabled: bool, reason: str) -> None:
        """Record (or, once the checkpoint is known, revise) one path's decision."""
        assert name in PATHS, name
        self.choices[name] = Choice(enabled, reason)

    def summary(self) -> dict[str, Any]:
        """Plain data for the start log, the crash dump and the API server."""
        return {
            "cpu_isa": self.cpu_isa,
            "kernel_isa": self.kernel_isa,
            "paths": {
                name: {"enabled": c.enabled, "reason": c.reason} for name, c in self.choices.items()
            },
        }


def choose(
    *,
    kernels_flag: str,
    int4_flag: str,
    device: torch.device,
    quant_activations: str = "int8",
    dtype: torch.dtype,
    head_dim: int,
    rotary_dim: int,
    block_size: int,
    tp_size: int,
    blocker: str | None = None,
) -> FastPaths:
    """Every path's decision that the config and the machine settle; `int4_kernels` and
    `decoder_stack` are settled once the checkpoint is loaded (`LlamaModel.load_int4`), and
    `quant_kernels` by `LlamaModel.load_weights`.
    `blocker`: why the model family runs neither the kernels nor prepacked weights."""
    plan = FastPaths(
        cpu_isa=_cpu_isa(device),
        kernel_isa=None,
        library=None,
        quant_activations=quant_activations,
    )
    reason = blocker or _kernel_blocker(kernels_flag, device, dtype, rotary_dim, head_dim)
    target = kernels.target_isa() if reason is None else None
    if target is not None and not kernels_pay_off(target, dtype):
        reason = f"{_name(dtype)} on {target}: torch ops are as fast (bench/kernel_isa.py)"
    if reason is None:
        plan.library = kernels.load(target)
        if plan.library is None:
            reason = "the kernels could not be built (see kernels.unavailable)"
        elif block_size > plan.library.max_block_size:
            reason = f"--block-size {block_size} > {plan.library.max_block_size}"
            plan.library = None
    if plan.library is not None:
        plan.kernel_isa = plan.library.isa
    plan.decide("compiled_kernels", reason is None, reason or f"built for {plan.kernel_isa}")
    packing = blocker or _packing_blocker(kernels_flag, device, dtype)
    plan.decide("onednn_packing", packing is None, packing or "oneDNN prepacked weights")
    has_bf16 = plan.kernel_isa == BF16_ISA and dtype == torch.bfloat16
    needs = "needs the kernels for avx512bf16 and bfloat16"
    if reason is not None:
        needs = f"needs the compiled kernels (off: {reason})"
    _decide_weight_paths(plan, int4_flag, has_bf16, needs)
    if has_bf16 and head_dim not in PREFILL_KERNEL_HEAD_DIMS:
        plan.decide("prefill_kernel", False, f"head size {head_dim} (the kernel takes 64, 128)")
    else:
        reason = f"bfloat16, head size {head_dim}" if has_bf16 else needs
        if has_bf16 and _torch_has_amx():
            plan.prefill_kernel_max_query = PREFILL_KERNEL_MAX_QUERY_AMX
            reason += (
                f"; chunks over {PREFILL_KERNEL_MAX_QUERY_AMX} tokens in torch's fused attention"
                " (AMX)"
            )
        plan.decide("prefill_kernel", has_bf16, reason)
    if tp_size != 1:
        plan.decide("decoder_stack", False, f"{tp_size} ranks (the stack runs on one)")
    elif head_dim != STACK_HEAD_DIM:
        plan.decide("decoder_stack", False, f"head size {head_dim} (the stack takes 64)")
    else:
        on = plan.is_on("int4_kernels") and plan.is_on("prefill_kernel")
        plan.decide(
            "decoder_stack",
            on,
            "every layer in 4 bits" if on else "needs the 4-bit and prefill kernels",
        )
    return plan


def _decide_weight_paths(plan: FastPaths, int4_flag: str, has_bf16: bool, needs: str) -> None:
    """The two paths that multiply a GGUF file's matrices as stored (both off with --int4 off),
    before the checkpoint is known."""
    plan.int4_tiles = has_bf16 and _torch_has_amx()
    amx = _amx_blocker(plan) if plan.int4_tiles else "no AMX"
    plan.amx_tiles = amx is None
    tiles = "tiles of the blocks in torch's matmul (AMX)"
    if plan.amx_tiles:
        tiles = f"up to {AMX_MAX_ROWS} rows in AMX tiles of the blocks, beyond in " + tiles
    elif plan.int4_tiles:
        tiles += f"; not the AMX kernel: {amx}"
    larger = tiles if plan.int4_tiles else "panels"
    ways = {
        "int4_kernels": f"the checkpoint's 4-bit weights; larger steps: {larger}",
        "quant_kernels": "GGUF blocks; "
        + _QUANT_X[plan.quant_activations]
        + ("; larger steps: " + tiles if plan.int4_tiles else ""),
    }
    for name, way in ways.items():
        if int4_flag == "off":
            plan.decide(name, False, "--int4 off")
        else:
            plan.decide(name, has_bf16, way if has_bf16 else needs)


_QUANT_X = {
    "int8": "x in 8 bits per block (integer dot products, as llama.cpp's)",
    "bfloat16": "x in bfloat16 by the exact weights",
}


def _amx_blocker(plan: FastPaths) -> str | None:
    """Why the AMX kernel cannot run here (None: it can), on a CPU with AMX."""
    library = plan.library
    if library is None or not library.has("quant_linear_amx_bf16"):
        return "the kernels build has no AMX kernel"
    if not library.amx_ready():
        return "Linux refused this process the AMX tile registers (arch_prctl)"
    return None


def _torch_has_amx() -> bool:
    """Whether torch's CPU matmuls (its fused attention's included) run on AMX tiles here."""
    return bool(torch.cpu._is_amx_tile_supported())


def _cpu_isa(device: torch.device) -> str:
    return kernels.cpu_isa() if device.type == "cpu" else "generic"


def _kernel_blocker(
    kernels_flag: str, device: torch.device, dtype: torch.dtype, rotary_dim: int, head_dim: int
) -> str | None:
    reason = _cpu_blocker(kernels_flag, device, dtype)
    if reason is None and rotary_dim != head_dim:
        reason = "partial rotary embedding (the kernels rotate whole heads)"
    return reason


def _packing_blocker(kernels_flag: str, device: torch.device, dtype: torch.dtype) -> str | None:
    reason = _cpu_blocker(kernels_flag, device, dtype)
    if reason is not None:
        return reason
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 path on this CPU"
    return None


def _cpu_blocker(kernels_flag: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """What rules out every CPU fast path: --kernels torch, another device, another dtype."""
    if kernels_flag == "torch":
        return "--kernels torch"
    if device.type != "cpu":
        return f"device {device.type} (the fast paths are for CPUs)"
    if dtype not in _KERNEL_DTYPES:
        return f"dtype {_name(dtype)} (the fast paths take float32 and bfloat16)"
    return None


def kernels_pay_off(isa: str, dtype: torch.dtype) -> bool:
    """The measured rule (bench/kernel_isa.py, output tok/s over torch ops capped at the same
    level, batch 1 / 8): built for AVX-512 (16-lane loops by hand) the kernels win in
    bfloat16 (1.31x / 1.28x) and overall in float32 (0.91x / 1.34x); built for AVX2 or the
    x86-64 baseline they win in bfloat16 only (AVX2 1.18x / 1.12x, baseline 1.09x / 1.08x),
    while in float32 torch's vectorized ops are as fast or faster (AVX2 0.90x / 1.04x,
    baseline 0.75x / 0.68x); off x86 (never measured) torch ops."""
    if isa in ("avx512", "avx512bf16"):
        return True
    return isa in ("avx2", "baseline") and dtype == torch.bfloat16


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
