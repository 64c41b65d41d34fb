"""Which fast path a model runs, decided once per rank from what this CPU, this torch, the
kernel build and the checkpoint's metadata allow: the one place that turns `--kernels`,
`--int4` and `--quant-activations` into paths, sub-choices and each matrix's stored form.
The model, its matrices and the layer ops only read the plan.

  compiled_kernels  RMSNorm, rotary + cache write, decode attention, SiLU and argmax in
                    cpu_kernels.c (else torch ops): CPU, float32 or bfloat16, a kernels
                    build where it pays off (`kernels_pay_off`)
  onednn_packing    dense weights prepacked for oneDNN (else `F.linear`): CPU, float32, or
                    bfloat16 where oneDNN has a bfloat16 path on this CPU
  int4_kernels      Q4_0/Q4_1 matrices multiplied by their own 4-bit weights (else another
                    form): bfloat16, a build for AVX-512 BF16; steps of more than 16 rows by
                    tiles of the blocks where torch's matmul runs on AMX (`int4_larger`
                    TILES), else by bfloat16 panels
  quant_kernels     a GGUF file's Q8_0, Q4_K, Q5_K and Q6_K matrices (and Q4_0/Q4_1 ones the
                    4-bit kernels do not take), and then its embedding and LM head, multiplied
                    from their blocks (else their dense copies): bfloat16, a build for AVX-512
                    BF16 (and VNNI); steps of up to 8 rows with x in 8 bits or bfloat16
                    (`activations`); larger ones in AMX tiles up to 48 rows where the CPU has
                    AMX (`blocks_larger` AMX), else tiles through torch's matmul. float32: x
                    in 8 bits (`activations` int8; float32: dense exact copies instead), a
                    build from AVX2 up (where the layer kernels are off, the build is
                    loaded for this matmul alone); larger steps on the file's exact
                    values (`quant_gemm_f32`: x exact in AVX2 builds, in 16 bits in
                    AVX-512 ones)
  prefill_kernel    prompt attention in cpu_kernels.c (else torch's fused attention):
                    bfloat16, head size 64 or 128, a build for AVX-512 BF16; where torch's
                    matmul runs on AMX only steps whose chunks are all of at most 32 tokens
                    (`prefill_kernel_max_query`)
  decoder_stack     a whole model's layers in one call (else the per-layer loop): every
                    matrix of every layer in the 4-bit kernels, one rank, head size 64

Each is on only where it can run; otherwise the next correct path runs (in brackets). The
decisions and their reasons are logged once at start (`kernels.selected`), go into the crash
dump's engine config and reach the API server (`GET /v1/models` and the
`otel_engine_fast_path_info` metric).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from otel_engine.config import Int4Mode, KernelsMode, QuantActivations
from otel_engine.model import kernels
from otel_engine.model.checkpoint import Blocks, Checkpoint
from otel_engine.model.kernels import STACK_HEAD_DIM, IsaLevel, KernelLibrary
from otel_engine.model.projections import Projection, Split
from otel_engine.model.quant import AMX_MAX_ROWS
from otel_engine.model.weights import INT4_GROUP, INT4_TYPES

BF16_ISA = IsaLevel.AVX512BF16  # the 4-bit matmuls, GGUF blocks, prefill attention, the stack
PREFILL_KERNEL_HEAD_DIMS = (64, 128)  # prefill attention in cpu_kernels.c
# Where torch's fused attention packs its bfloat16 matmuls for AMX, it is faster than the
# compiled prefill attention on chunks longer than this (bench/attention.py: 2.3-4x at 1,024
# tokens, even at 32); those run there, the shorter ones in the kernel.
PREFILL_KERNEL_MAX_QUERY_AMX = 32
# Where x is quantized to 8 bits, a file whose Q4_0/Q4_1 layer matrices are larger than this
# runs them from their blocks like every other format, not in the 4-bit kernels' own layout
# (0.75 bytes a weight beside the blocks). Measured on a CPU with AMX, one after the other:
# SmolLM2-135M (Q4_1 layers, 66 MB) 121 / 339 / 447 tok/s offline at batch 1 / 8 / 32 in
# the 4-bit kernels, 111 / 303 / 442 from its blocks; a Llama-3.2-1B shape as Q4_0 (554 MB)
# 21.3 / 54.1 tok/s at 1 / 16 streams in the 4-bit kernels (engine core 2,878 MB resident),
# 23.1 / 66.9 from its blocks (1,677 MB).
INT4_KERNELS_MAX_BYTES = 256 << 20
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
Q8_F32 = "quant_linear_q8_f32"  # a float32 model's GGUF matmul, in every build from AVX2 up


class Path(enum.Enum):
    COMPILED_KERNELS = "compiled_kernels"
    ONEDNN_PACKING = "onednn_packing"
    INT4_KERNELS = "int4_kernels"
    QUANT_KERNELS = "quant_kernels"
    PREFILL_KERNEL = "prefill_kernel"
    DECODER_STACK = "decoder_stack"


_EXACT_DTYPES = {QuantActivations.BFLOAT16: torch.bfloat16, QuantActivations.FLOAT32: torch.float32}


class Larger(enum.Enum):
    """How steps of more rows than the small-step kernels take are multiplied."""

    PANELS = "panels"  # 4-bit: bfloat16 panels built once at load
    TILES = "tiles"  # the blocks dequantized a tile at a time for torch's matmul
    AMX = "amx"  # blocks: up to AMX_MAX_ROWS rows in AMX tiles, beyond that TILES


class Form(enum.Enum):
    """How one matrix is stored and multiplied (`matrix.py` has a class for each)."""

    DENSE = "dense"  # the model dtype, F.linear
    PACKED = "packed"  # the model dtype, reordered once for oneDNN
    INT4_PANELS = "int4_panels"  # 4-bit kernels; larger steps by bfloat16 panels
    INT4_TILES = "int4_tiles"  # 4-bit kernels; larger steps by tiles of the file's blocks
    BLOCKS = "blocks"  # the file's GGUF blocks


INT4_FORMS = (Form.INT4_PANELS, Form.INT4_TILES)

_QUANT_X = {
    QuantActivations.INT8: "x in 8 bits per block (integer dot products, as llama.cpp's)",
    QuantActivations.BFLOAT16: "x in bfloat16 by the exact weights",
    QuantActivations.FLOAT32: "x in float32 by the exact weights",
}


@dataclass(frozen=True, slots=True)
class Choice:
    enabled: bool
    reason: str


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the plan needs to know of the model on this rank."""

    head_dim: int
    rotary_dim: int
    tp_size: int
    # each layer's projections (a layer with experts has no MLP projections)
    layers: tuple[tuple[Projection, ...], ...] = ()
    # why the decoder stack cannot run this family's layers (biases, q/k norms, experts)
    stack_blocker: str | None = None
    # why this family never runs the compiled kernels or prepacked weights (None: it may)
    kernels_blocker: str | None = None


@dataclass
class FastPaths:
    """The decisions for one model of `dtype` on one rank. `library` is the kernels build the
    enabled compiled paths call (None when none is)."""

    cpu_isa: str
    dtype: torch.dtype = torch.bfloat16
    kernel_isa: str | None = None
    library: KernelLibrary | None = None
    choices: dict[Path, Choice] = field(default_factory=dict)
    activations: QuantActivations = QuantActivations.INT8
    int4_larger: Larger = Larger.PANELS
    blocks_larger: Larger = Larger.TILES
    # the longest prefill chunk the compiled prefill attention takes (None: any)
    prefill_kernel_max_query: int | None = None
    # each layer's matrices by projection name, and the LM head's and embedding's forms
    forms: list[dict[Projection, Form]] = field(default_factory=list)
    lm_head: Form = Form.DENSE
    embedding: Form = Form.DENSE

    def is_on(self, path: Path) -> bool:
        return self.choices[path].enabled

    def decide(self, path: Path, enabled: bool, reason: str) -> None:
        """Record one decision: called by `choose` alone (tests hold this)."""
        self.choices[path] = Choice(enabled, reason)

    def summary(self) -> dict[str, Any]:
        """Plain data for the start log, the crash dump and the API server."""
        counts: dict[str, int] = {}
        for form in (f for layer in self.forms for f in layer.values()):
            counts[form.value] = counts.get(form.value, 0) + 1
        return {
            "cpu_isa": self.cpu_isa,
            "kernel_isa": self.kernel_isa,
            "paths": {
                path.value: {"enabled": c.enabled, "reason": c.reason}
                for path, c in self.choices.items()
            },
            "choices": {
                "activations": self.activations.value,
                "int4_larger": self.int4_larger.value,
                "blocks_larger": self.blocks_larger.value,
                "prefill_kernel_max_query": self.prefill_kernel_max_query,
            },
            "matrices": {
                **counts,
                "lm_head": self.lm_head.value,
                "embedding": self.embedding.value,
            },
        }


def choose(
    *,
    kernels_flag: KernelsMode,
    int4_flag: Int4Mode,
    device: torch.device,
    dtype: torch.dtype,
    shape: ModelShape,
    block_size: int,
    quant_activations: QuantActivations = QuantActivations.INT8,
    checkpoint: Checkpoint | None = None,
) -> FastPaths:
    """Every decision for a model of `shape` with `checkpoint`'s weights on this rank."""
    checkpoint = checkpoint or Checkpoint()
    activations = QuantActivations(quant_activations)
    exact = _EXACT_DTYPES.get(activations)
    if exact is not None and dtype in _KERNEL_DTYPES and exact != dtype:
        raise ValueError(
            f"--quant-activations {activations.value} is for a {_name(exact)} model; this one"
            f" is {_name(dtype)} (int8 or {_name(dtype)})"
        )
    plan = FastPaths(cpu_isa=_cpu_isa(device), dtype=dtype, activations=activations)
    # a float32 model's GGUF matrices in 8 bits need the library even where nothing else does
    q8_f32 = dtype == torch.float32 and activations is QuantActivations.INT8
    matmul = q8_f32 and int4_flag != Int4Mode.OFF and bool(checkpoint.blocks)
    _decide_kernels(plan, kernels_flag, device, dtype, shape, block_size, matmul)
    blocker = shape.kernels_blocker or _packing_blocker(kernels_flag, device, dtype)
    plan.decide(Path.ONEDNN_PACKING, blocker is None, blocker or "oneDNN prepacked weights")
    has_bf16 = plan.kernel_isa == BF16_ISA and dtype == torch.bfloat16
    needs = "needs the kernels for avx512bf16 and bfloat16"
    if dtype == torch.bfloat16 and not plan.is_on(Path.COMPILED_KERNELS):
        needs = f"needs the compiled kernels (off: {plan.choices[Path.COMPILED_KERNELS].reason})"
    larger = _larger_way(plan, _decide_larger_steps(plan, has_bf16))
    _decide_matrices(plan, int4_flag, has_bf16, needs, shape, checkpoint, larger)
    _decide_prefill(plan, has_bf16, needs, shape.head_dim)
    _decide_stack(plan, shape)
    _settle_library(plan)
    return plan


def _decide_kernels(
    plan: FastPaths,
    kernels_flag: KernelsMode,
    device: torch.device,
    dtype: torch.dtype,
    shape: ModelShape,
    block_size: int,
    matmul: bool,
) -> None:
    """The layer kernels and the library they call; where they are off for this model but
    not for this CPU and a float32 model's GGUF matrices may run in 8 bits (`matmul`), the
    library is loaded for that matmul (`_settle_library` keeps it only if it runs)."""
    blocker = shape.kernels_blocker or _cpu_blocker(kernels_flag, device, dtype)
    target = kernels.target_isa() if blocker is None else None
    reason = blocker
    if reason is None and shape.rotary_dim != shape.head_dim:
        reason = "partial rotary embedding (the kernels rotate whole heads)"
    if reason is None and target is not None and not kernels_pay_off(target, dtype):
        reason = f"{_name(dtype)} on {target}: torch ops are as fast (bench/kernel_isa.py)"
    if target is not None and (reason is None or matmul):
        plan.library = kernels.load(target)
    if reason is None and plan.library is None:
        reason = "the kernels could not be built (see kernels.unavailable)"
    elif reason is None and plan.library is not None and block_size > plan.library.max_block_size:
        reason = f"--block-size {block_size} > {plan.library.max_block_size}"
    if reason is not None and not (
        matmul and plan.library is not None and plan.library.has(Q8_F32)
    ):
        plan.library = None
    if plan.library is not None:
        plan.kernel_isa = plan.library.isa
    plan.decide(Path.COMPILED_KERNELS, reason is None, reason or f"built for {plan.kernel_isa}")


def _settle_library(plan: FastPaths) -> None:
    """A library loaded for a float32 model's 8-bit matmul alone stays where that matmul runs
    (and the layer kernels' reason says so), else it is let go."""
    if plan.library is None or plan.is_on(Path.COMPILED_KERNELS):
        return
    reason = plan.choices[Path.COMPILED_KERNELS].reason
    if plan.is_on(Path.QUANT_KERNELS):
        loaded = f"; the {plan.kernel_isa} build is loaded for quant_kernels' {Q8_F32} alone"
        plan.decide(Path.COMPILED_KERNELS, False, reason + loaded)
    else:
        plan.library = None
        plan.kernel_isa = None


def _decide_larger_steps(plan: FastPaths, has_bf16: bool) -> str | None:
    """Larger steps of 4-bit matrices: tiles of their blocks where torch's matmul runs on AMX,
    else panels; of GGUF blocks: the AMX kernel where it runs, else tiles. Returns why the
    AMX kernel does not run (None: it does)."""
    if not (has_bf16 and _torch_has_amx()):
        return "no AMX"
    plan.int4_larger = Larger.TILES
    reason = _amx_blocker(plan)
    if reason is None:
        plan.blocks_larger = Larger.AMX
    return reason


def _larger_way(plan: FastPaths, amx_blocker: str | None) -> str:
    tiles = "tiles of the blocks in torch's matmul (AMX)"
    if plan.blocks_larger is Larger.AMX:
        return f"up to {AMX_MAX_ROWS} rows in AMX tiles of the blocks, beyond in " + tiles
    if plan.int4_larger is Larger.TILES:
        return tiles + f"; not the AMX kernel: {amx_blocker}"
    return "tiles of the blocks in torch's matmul"


def _decide_matrices(
    plan: FastPaths,
    int4_flag: Int4Mode,
    has_bf16: bool,
    needs: str,
    shape: ModelShape,
    checkpoint: Checkpoint,
    larger: str,
) -> None:
    """Each matrix's form, and from them the int4_kernels and quant_kernels paths."""
    dense = Form.PACKED if plan.is_on(Path.ONEDNN_PACKING) else Form.DENSE
    int4_blocker = "--int4 off" if int4_flag == Int4Mode.OFF else None if has_bf16 else needs
    blocker = int4_blocker
    if int4_flag != Int4Mode.OFF and plan.dtype == torch.float32:
        blocker = _float32_blocks_blocker(plan)
    too_large = _int4_too_large(plan, checkpoint)
    int4 = int4_blocker is None and too_large is None
    for index, projections in enumerate(shape.layers):
        plan.forms.append(
            {
                p: _form(plan, p, index, shape.tp_size, checkpoint, blocker, int4, dense)
                for p in projections
            }
        )
    forms = [form for layer in plan.forms for form in layer.values()]
    quant = Form.BLOCKS in forms
    head = checkpoint.blocks.get("lm_head.weight") or checkpoint.blocks.get(
        "model.embed_tokens.weight"
    )
    embed = checkpoint.blocks.get("model.embed_tokens.weight")
    plan.lm_head = Form.BLOCKS if quant and head is not None else dense
    plan.embedding = Form.BLOCKS if quant and embed is not None else Form.DENSE
    int4_on = any(form in INT4_FORMS for form in forms)
    reason = int4_blocker or too_large or "the checkpoint has no 4-bit weights"
    if int4_on:
        reason = "the checkpoint's 4-bit weights; larger steps: " + (
            larger if plan.int4_larger is Larger.TILES else "panels"
        )
    plan.decide(Path.INT4_KERNELS, int4_on, reason)
    if blocker is not None:
        plan.decide(Path.QUANT_KERNELS, False, blocker)
        return
    reason = "no matrix in GGUF blocks that the 4-bit kernels do not take"
    if quant:
        reason = f"GGUF blocks; {_QUANT_X[plan.activations]}; larger steps: {larger}"
    plan.decide(Path.QUANT_KERNELS, quant, reason)


def _float32_blocks_blocker(plan: FastPaths) -> str | None:
    """Why a float32 model's GGUF matrices are not multiplied from their blocks (None: they
    are, with x in 8 bits)."""
    if plan.activations is not QuantActivations.INT8:
        return "--quant-activations float32: dense float32 copies of the file's exact weights"
    if plan.library is None or not plan.library.has(Q8_F32):
        off = plan.choices[Path.COMPILED_KERNELS].reason
        return f"x in 8 bits needs a kernels build from avx2 up (the kernels: {off})"
    return None


def _int4_too_large(plan: FastPaths, checkpoint: Checkpoint) -> str | None:
    """Why Q4_0/Q4_1 layers may not run in the 4-bit kernels' layout (None: they may): with x
    in 8 bits, they are more than INT4_KERNELS_MAX_BYTES (then from their blocks)."""
    if plan.activations is not QuantActivations.INT8:
        return None
    size = sum(
        b.rows * b.cols // INT4_GROUP * (18 if b.kind == "Q4_0" else 20)
        for name, b in checkpoint.blocks.items()
        if b.kind in INT4_TYPES and name.startswith("model.layers.")
    )
    if size <= INT4_KERNELS_MAX_BYTES:
        return None
    return (
        f"{size >> 20} MiB of Q4_0/Q4_1 layers (over {INT4_KERNELS_MAX_BYTES >> 20}): "
        "from their blocks with x in 8 bits"
    )


def _form(
    plan: FastPaths,
    projection: Projection,
    layer: int,
    tp_size: int,
    checkpoint: Checkpoint,
    blocker: str | None,
    int4: bool,
    dense: Form,
) -> Form:
    """One matrix's form: its 4-bit weights where they fit the kernel's layout, else its
    blocks where this rank's shard holds whole blocks, else dense."""
    names = projection.weight_names(layer)
    parts = [checkpoint.blocks.get(name) for name in names]
    if blocker is not None or any(part is None for part in parts):
        return dense
    blocks = [part for part in parts if part is not None]
    by_columns = projection.split is Split.COLUMNS
    rows = sum(b.rows for b in blocks) // (1 if by_columns else tp_size)
    cols = blocks[0].cols // (tp_size if by_columns else 1)
    whole_blocks = all(_shard_holds_whole_blocks(b, tp_size, by_columns) for b in blocks)
    same_width = len({b.cols for b in blocks}) == 1
    fits = rows % 16 == 0 and cols % INT4_GROUP == 0  # the 4-bit kernels' layout
    if int4 and same_width and fits and all(b.kind in INT4_TYPES for b in blocks):
        tiles = plan.int4_larger is Larger.TILES and whole_blocks
        return Form.INT4_TILES if tiles else Form.INT4_PANELS
    return Form.BLOCKS if whole_blocks and same_width else dense


def _shard_holds_whole_blocks(blocks: Blocks, tp_size: int, by_columns: bool) -> bool:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not by_columns:
        return blocks.rows % tp_size == 0
    width = GGML_QUANT_SIZES[GGMLQuantizationType[blocks.kind]][0]
    return blocks.cols % tp_size == 0 and (blocks.cols // tp_size) % width == 0


def _decide_prefill(plan: FastPaths, has_bf16: bool, needs: str, head_dim: int) -> None:
    if has_bf16 and head_dim not in PREFILL_KERNEL_HEAD_DIMS:
        plan.decide(Path.PREFILL_KERNEL, False, f"head size {head_dim} (the kernel takes 64, 128)")
        return
    reason = f"bfloat16, head size {head_dim}" if has_bf16 else needs
    if has_bf16 and _torch_has_amx():
        plan.prefill_kernel_max_query = PREFILL_KERNEL_MAX_QUERY_AMX
        reason += (
            f"; chunks over {PREFILL_KERNEL_MAX_QUERY_AMX} tokens in torch's fused attention (AMX)"
        )
    plan.decide(Path.PREFILL_KERNEL, has_bf16, reason)


def _decide_stack(plan: FastPaths, shape: ModelShape) -> None:
    """The compiled stack runs one rank's layers whose matrices are all 4-bit, without
    biases, q/k norms or experts, with head size 64."""
    if shape.tp_size != 1:
        reason: str | None = f"{shape.tp_size} ranks (the stack runs on one)"
    elif shape.head_dim != STACK_HEAD_DIM:
        reason = f"head size {shape.head_dim} (the stack takes {STACK_HEAD_DIM})"
    elif not (plan.is_on(Path.INT4_KERNELS) and plan.is_on(Path.PREFILL_KERNEL)):
        reason = "needs the 4-bit and prefill kernels"
    else:
        reason = shape.stack_blocker or _stack_forms_blocker(plan)
    plan.decide(Path.DECODER_STACK, reason is None, reason or "every layer in 4 bits")


def _stack_forms_blocker(plan: FastPaths) -> str | None:
    for index, layer in enumerate(plan.forms):
        if any(form not in INT4_FORMS for form in layer.values()):
            return f"layer {index} is not all 4-bit"
    return None


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


def _cpu_isa(device: torch.device) -> IsaLevel:
    return kernels.cpu_isa() if device.type == "cpu" else IsaLevel.GENERIC


def _packing_blocker(
    kernels_flag: KernelsMode, device: torch.device, dtype: torch.dtype
) -> str | None:
    reason = _cpu_blocker(kernels_flag, device, dtype)
    if reason is not None:
        return reason
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 path on this CPU"
    return None


def _cpu_blocker(kernels_flag: KernelsMode, device: torch.device, dtype: torch.dtype) -> str | None:
    """What rules out every CPU fast path: --kernels torch, another device, another dtype."""
    if kernels_flag == KernelsMode.TORCH:
        return "--kernels torch"
    if device.type != "cpu":
        return f"device {device.type} (the fast paths are for CPUs)"
    if dtype not in _KERNEL_DTYPES:
        return f"dtype {_name(dtype)} (the fast paths take float32 and bfloat16)"
    return None


def kernels_pay_off(isa: str, dtype: torch.dtype) -> bool:
    """The measured rule (bench/kernel_isa.py, output tok/s over torch ops capped at the same
    level, batch 1 / 8): built for AVX-512 (16-lane loops by hand) the kernels win in
    bfloat16 (1.31x / 1.28x) and overall in float32 (0.91x / 1.34x); built for AVX2 (8-lane
    loops by hand) they win in bfloat16 (1.20x / 1.00x) and in float32 (the default GGUF
    model's decode steps with its 8-bit matmul either way, the layers' torch ops against
    these kernels: 52.5 / 105.8 -> 141.4 / 262.2 tok/s); built for the x86-64 baseline (one
    element at a time) they win in bfloat16 only (1.09x / 1.08x), while in float32 torch's
    vectorized ops are faster (0.75x / 0.68x); off x86 (never measured) torch ops."""
    if isa in (IsaLevel.AVX512, IsaLevel.AVX512BF16, IsaLevel.AVX2):
        return True
    return isa == IsaLevel.BASELINE and dtype == torch.bfloat16


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
