"""The fast paths a model runs, decided in one place (`fast_paths.choose`) from what the CPU,
torch, the kernel build and the checkpoint's metadata allow; each off path says why, and the
next correct path runs. Every decision and sub-choice is a member of a closed set in the plan,
and nothing outside `fast_paths.py` decides one."""

from __future__ import annotations

import ast

import pytest
import torch

from otel_engine.config import EngineConfig, QuantActivations
from otel_engine.executor.model_runner import ModelRunner
from otel_engine.model import fast_paths, kernels
from otel_engine.model.checkpoint import Blocks, Checkpoint
from otel_engine.model.fast_paths import (
    BF16_ISA,
    Form,
    Larger,
    ModelShape,
    Path,
    choose,
)
from otel_engine.model.layer_ops import KernelOps, TorchOps, make_layer_ops
from otel_engine.model.layers import RotaryEmbedding
from otel_engine.model.matrix import MatrixKernels
from otel_engine.model.projections import PROJECTIONS
from tests.helpers.isa import require_isa
from tests.helpers.paths import REPO_ROOT

CPU = torch.device("cpu")
LAYERS = 2


def _checkpoint(kind: str | None = "Q4_1", hidden: int = 256) -> Checkpoint:
    """Facts of a 2-layer checkpoint whose layer matrices are all of GGUF format `kind`
    (None: dense)."""
    if kind is None:
        return Checkpoint()
    blocks = {}
    for layer in range(LAYERS):
        for projection in PROJECTIONS:
            for name in projection.weight_names(layer):
                blocks[name] = Blocks(kind, hidden, hidden)
    return Checkpoint(blocks)


def _choose(kind: str | None = "Q4_1", **overrides: object) -> fast_paths.FastPaths:
    head_dim = int(overrides.pop("head_dim", 64))  # type: ignore[call-overload]
    shape = ModelShape(
        head_dim=head_dim,
        rotary_dim=int(overrides.pop("rotary_dim", head_dim)),  # type: ignore[call-overload]
        tp_size=int(overrides.pop("tp_size", 1)),  # type: ignore[call-overload]
        layers=(PROJECTIONS,) * LAYERS,
    )
    options: dict[str, object] = {
        "kernels_flag": "auto",
        "int4_flag": "auto",
        "device": CPU,
        "dtype": torch.bfloat16,
        "shape": shape,
        "block_size": 16,
        "checkpoint": _checkpoint(kind),
    }
    options.update(overrides)
    return choose(**options)  # type: ignore[arg-type]


def _ops(plan: fast_paths.FastPaths, head_dim: int, dtype: torch.dtype) -> object:
    """The layer ops `plan` gives a model of 4 heads (2 KV heads) of `head_dim`."""
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, dtype, CPU)
    return make_layer_ops(
        plan, num_heads=4, num_kv_heads=2, head_dim=head_dim, rotary=rotary, dtype=dtype,
        device=CPU,
    )  # fmt: skip


def test_every_path_is_decided_with_a_reason() -> None:
    plan = _choose()

    assert set(Path) == set(plan.choices)
    assert all(choice.reason for choice in plan.choices.values())
    summary = plan.summary()
    assert kernels.cpu_isa() == summary["cpu_isa"]
    assert {p.value for p in Path} == set(summary["paths"])
    choices = {"activations", "int4_larger", "blocks_larger", "prefill_kernel_max_query"}
    assert choices == set(summary["choices"])
    counts = [v for v in summary["matrices"].values() if isinstance(v, int)]
    assert 4 * LAYERS == sum(counts)


def test_kernels_torch_turns_every_path_off() -> None:
    """--kernels torch is the reference: torch ops and F.linear, whatever the machine has."""
    plan = _choose(kernels_flag="torch")

    assert not any(c.enabled for c in plan.choices.values())
    assert plan.library is None
    assert "--kernels torch" == plan.choices[Path.COMPILED_KERNELS].reason
    assert {Form.DENSE} == {f for layer in plan.forms for f in layer.values()}


def test_on_avx512_bf16_a_4_bit_checkpoint_runs_every_path_but_blocks() -> None:
    """Q4_1 layers: the 4-bit kernels and the decoder stack; no matrix is left to the
    GGUF-block kernels, so that path is off and says why."""
    require_isa(BF16_ISA)
    plan = _choose()

    on = {p for p in Path if plan.is_on(p)}
    assert set(Path) - {Path.QUANT_KERNELS} == on
    assert "avx512bf16" == plan.kernel_isa
    assert plan.library is not None
    forms = {f for layer in plan.forms for f in layer.values()}
    assert forms <= {Form.INT4_PANELS, Form.INT4_TILES}


def test_a_k_quant_checkpoint_runs_from_its_blocks() -> None:
    """Q4_K layers: every matrix from its blocks; no 4-bit kernels, no stack."""
    require_isa(BF16_ISA)
    plan = _choose("Q4_K")

    assert plan.is_on(Path.QUANT_KERNELS)
    assert not plan.is_on(Path.INT4_KERNELS)
    assert not plan.is_on(Path.DECODER_STACK)
    assert {Form.BLOCKS} == {f for layer in plan.forms for f in layer.values()}
    assert Form.BLOCKS is plan.lm_head or "lm_head.weight" not in _checkpoint("Q4_K").blocks


def test_a_dense_checkpoint_settles_the_block_paths_before_loading() -> None:
    require_isa(BF16_ISA)
    plan = _choose(None)

    assert not plan.is_on(Path.INT4_KERNELS)
    assert not plan.is_on(Path.QUANT_KERNELS)
    assert "no 4-bit weights" in plan.choices[Path.INT4_KERNELS].reason
    assert "no matrix in GGUF blocks" in plan.choices[Path.QUANT_KERNELS].reason
    assert {Form.PACKED} == {f for layer in plan.forms for f in layer.values()}


@pytest.mark.parametrize(
    ("activations", "function", "says"),
    [("int8", "quant_linear_q8_bf16", "8 bits"), ("bfloat16", "quant_linear_bf16", "bfloat16")],
)
def test_quant_activations_choose_the_gguf_blocks_kernel(
    activations: str, function: str, says: str
) -> None:
    """--quant-activations picks which fused kernel multiplies GGUF blocks, and says so."""
    require_isa(BF16_ISA)
    plan = _choose("Q8_0", quant_activations=activations)
    assert QuantActivations(activations) is plan.activations
    assert says in plan.choices[Path.QUANT_KERNELS].reason
    assert plan.library is not None
    assert MatrixKernels(plan).blocks._linear is getattr(plan.library, function)


def test_amx_runs_mid_size_steps_where_linux_lends_the_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU with AMX the AMX kernel takes steps of 9-48 rows and the reasons say so;
    where the process is refused the tile registers it stays off, with that reason."""
    require_isa(BF16_ISA)
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    plan = _choose("Q4_K")
    assert Larger.AMX is plan.blocks_larger
    assert "48 rows in AMX tiles" in plan.choices[Path.QUANT_KERNELS].reason
    assert plan.library is not None
    library = plan.library
    monkeypatch.setattr(kernels, "load", lambda target=None: library)
    monkeypatch.setattr(library, "amx_ready", lambda: 0)
    refused = _choose("Q4_K")
    assert Larger.TILES is refused.blocks_larger
    reason = refused.choices[Path.QUANT_KERNELS].reason
    assert "refused this process the AMX tile registers" in reason
    assert MatrixKernels(refused).blocks._amx is None
    monkeypatch.setattr(library, "has", lambda name: name != "quant_linear_amx_bf16")
    older = _choose()
    assert Larger.TILES is older.blocks_larger
    assert "the kernels build has no AMX kernel" in older.choices[Path.INT4_KERNELS].reason


def test_an_unknown_quant_activations_value_is_refused() -> None:
    with pytest.raises(ValueError, match="quant_activations must be one of"):
        EngineConfig.from_kwargs(quant_activations="int4")


def test_head_size_128_runs_the_prefill_kernel_and_amx_sends_large_steps_to_torch() -> None:
    """Head size 128 has its prefill kernel. Where torch's matmuls run on AMX tiles, its
    fused attention is faster on long chunks, so the kernel takes chunks up to
    PREFILL_KERNEL_MAX_QUERY_AMX tokens; elsewhere every chunk."""
    require_isa(BF16_ISA)
    plan = _choose(head_dim=128, rotary_dim=128)

    assert plan.is_on(Path.PREFILL_KERNEL)
    if torch.cpu._is_amx_tile_supported():
        assert fast_paths.PREFILL_KERNEL_MAX_QUERY_AMX == plan.prefill_kernel_max_query
        assert "(AMX)" in plan.choices[Path.PREFILL_KERNEL].reason
    else:
        assert plan.prefill_kernel_max_query is None
    # likewise steps of more than 16 rows of 4-bit matrices: tiles with AMX, else panels
    tiles = plan.int4_larger is Larger.TILES
    assert tiles == torch.cpu._is_amx_tile_supported()
    assert ("AMX" in plan.choices[Path.INT4_KERNELS].reason) == tiles
    forms = {f for layer in plan.forms for f in layer.values()}
    assert {Form.INT4_TILES if tiles else Form.INT4_PANELS} == forms


@pytest.mark.parametrize(
    ("overrides", "off", "reason"),
    [
        ({"head_dim": 96, "rotary_dim": 96}, Path.PREFILL_KERNEL, "head size 96"),
        ({"head_dim": 128, "rotary_dim": 128}, Path.DECODER_STACK, "head size 128"),
        ({"tp_size": 2}, Path.DECODER_STACK, "2 ranks"),
        ({"dtype": torch.float32}, Path.INT4_KERNELS, "bfloat16"),
        ({"int4_flag": "off"}, Path.INT4_KERNELS, "--int4 off"),
        (
            {"dtype": torch.float32, "quant_activations": "float32"},
            Path.QUANT_KERNELS,
            "--quant-activations float32",
        ),
        ({"int4_flag": "off"}, Path.QUANT_KERNELS, "--int4 off"),
        ({"rotary_dim": 32}, Path.COMPILED_KERNELS, "partial rotary"),
        ({"block_size": 512}, Path.COMPILED_KERNELS, "--block-size 512"),
        ({"dtype": torch.float16}, Path.COMPILED_KERNELS, "dtype float16"),
    ],
)
def test_a_path_that_does_not_apply_is_off_with_its_reason(
    overrides: dict[str, object], off: Path, reason: str
) -> None:
    require_isa(BF16_ISA)
    plan = _choose(**overrides)

    assert not plan.is_on(off)
    assert reason in plan.choices[off].reason


def test_without_a_compiler_torch_ops_run_and_packing_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No compiler: torch ops at each dtype, and where the kernels would run (bfloat16 on
    every x86 level, float32 from AVX-512) the reason says the build failed; oneDNN's packing
    is as it is with a compiler (it does not depend on the kernels)."""
    dtypes = (torch.float32, torch.bfloat16)
    with_compiler = {dtype: _choose(dtype=dtype) for dtype in dtypes}
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(kernels.shutil, "which", lambda _: None)
    kernels.load.cache_clear()
    try:
        plans = {dtype: _choose(dtype=dtype) for dtype in dtypes}
    finally:
        kernels.load.cache_clear()

    assert any(plan.is_on(Path.COMPILED_KERNELS) for plan in with_compiler.values())
    for dtype, plan in plans.items():
        assert not plan.is_on(Path.COMPILED_KERNELS)
        if with_compiler[dtype].is_on(Path.COMPILED_KERNELS):
            assert "could not be built" in plan.choices[Path.COMPILED_KERNELS].reason
        assert with_compiler[dtype].is_on(Path.ONEDNN_PACKING) == plan.is_on(Path.ONEDNN_PACKING)
        ops = _ops(plan, 16, dtype)
        assert isinstance(ops, TorchOps)
        assert not isinstance(ops, KernelOps)


def test_packing_is_off_where_onednn_has_no_bfloat16_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check that oneDNN itself answers (False under ONEDNN_MAX_CPU_ISA=AVX2 or on a CPU
    without AVX-512): bfloat16 weights stay plain, float32 ones are still packed."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)

    bf16, f32 = _choose(), _choose(dtype=torch.float32)

    assert not bf16.is_on(Path.ONEDNN_PACKING)
    assert "no bfloat16 path" in bf16.choices[Path.ONEDNN_PACKING].reason
    assert f32.is_on(Path.ONEDNN_PACKING)


@pytest.mark.parametrize(
    ("isa", "dtype", "expected"),
    [
        ("avx512bf16", torch.bfloat16, True),
        ("avx512", torch.float32, True),
        ("avx2", torch.bfloat16, True),
        ("avx2", torch.float32, True),
        ("baseline", torch.bfloat16, True),
        ("baseline", torch.float32, False),
        ("generic", torch.float32, False),
    ],
)
def test_the_kernels_run_where_they_pay_off(isa: str, dtype: torch.dtype, expected: bool) -> None:
    """The measured rule (bench/kernel_isa.py)."""
    assert expected == fast_paths.kernels_pay_off(isa, dtype)


def test_below_the_rule_torch_ops_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a float32 model with kernels for the x86-64 baseline only (one element at a time),
    torch ops run and the reason says so; without GGUF blocks no library is loaded."""
    monkeypatch.setenv(kernels.ISA_ENV, "baseline")

    plan = _choose(None, dtype=torch.float32)

    assert not plan.is_on(Path.COMPILED_KERNELS)
    assert "torch ops are as fast" in plan.choices[Path.COMPILED_KERNELS].reason
    assert plan.library is None
    assert plan.kernel_isa is None


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_float32_gguf_model_on_avx2_runs_its_blocks_in_8_bits(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A float32 model on AVX2: the layer kernels (8 lanes) and every GGUF matrix (and the
    LM head, the embedding) from its blocks by `quant_linear_q8_f32`, of one AVX2 build."""
    require_isa("avx2")
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")

    plan = _choose(kind, dtype=torch.float32)

    assert plan.is_on(Path.COMPILED_KERNELS)
    assert "built for avx2" == plan.choices[Path.COMPILED_KERNELS].reason
    assert plan.is_on(Path.QUANT_KERNELS)
    assert "8 bits" in plan.choices[Path.QUANT_KERNELS].reason
    assert not plan.is_on(Path.INT4_KERNELS)
    assert "bfloat16" in plan.choices[Path.INT4_KERNELS].reason
    assert {Form.BLOCKS} == {f for layer in plan.forms for f in layer.values()}
    assert plan.library is not None
    assert "avx2" == plan.kernel_isa == plan.library.isa
    matrices = MatrixKernels(plan)
    assert matrices.blocks._linear is plan.library.quant_linear_q8_f32
    assert matrices.dequantize is plan.library.gguf_dequantize_f32
    assert torch.float32 == matrices.blocks.dtype
    assert isinstance(_ops(plan, 64, torch.float32), KernelOps)


def test_where_the_layer_kernels_cannot_run_the_build_is_loaded_for_the_8_bit_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A float32 GGUF model whose layers the kernels cannot run (a partial rotary
    embedding): the AVX2 build is loaded for the 8-bit matmul alone, the layers on torch
    ops, each reason saying so."""
    require_isa("avx2")
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")

    plan = _choose("Q4_K", dtype=torch.float32, rotary_dim=32)

    assert not plan.is_on(Path.COMPILED_KERNELS)
    reason = plan.choices[Path.COMPILED_KERNELS].reason
    assert "partial rotary embedding" in reason
    assert "loaded for quant_kernels' quant_linear_q8_f32 alone" in reason
    assert plan.is_on(Path.QUANT_KERNELS)
    assert {Form.BLOCKS} == {f for layer in plan.forms for f in layer.values()}
    assert plan.library is not None
    assert "avx2" == plan.kernel_isa
    assert MatrixKernels(plan).blocks._linear is plan.library.quant_linear_q8_f32
    assert isinstance(_ops(plan, 64, torch.float32), TorchOps)


def test_float32_activations_keep_a_float32_model_exact() -> None:
    """--quant-activations float32: every GGUF matrix dense in float32 (the file's exact
    values), no blocks, no library loaded for them."""
    plan = _choose("Q4_K", dtype=torch.float32, quant_activations="float32")

    assert not plan.is_on(Path.QUANT_KERNELS)
    assert Form.BLOCKS not in {f for layer in plan.forms for f in layer.values()}
    assert Form.BLOCKS not in (plan.lm_head, plan.embedding)


@pytest.mark.parametrize(
    ("dtype", "activations"), [(torch.float32, "bfloat16"), (torch.bfloat16, "float32")]
)
def test_the_other_dtype_s_exact_activations_are_refused(
    dtype: torch.dtype, activations: str
) -> None:
    with pytest.raises(ValueError, match=f"--quant-activations {activations} is for a"):
        _choose("Q4_K", dtype=dtype, quant_activations=activations)


def test_a_bfloat16_model_on_avx2_runs_the_avx2_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an AVX2 CPU gets in bfloat16: the kernels built for AVX2, none of the AVX-512
    BF16 paths."""
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")

    plan = _choose()

    assert plan.is_on(Path.COMPILED_KERNELS)
    assert "avx2" == plan.kernel_isa
    for path in (Path.INT4_KERNELS, Path.QUANT_KERNELS, Path.PREFILL_KERNEL, Path.DECODER_STACK):
        assert not plan.is_on(path)


def _runner(model_dir: str, **kwargs: object) -> ModelRunner:
    config = EngineConfig.from_kwargs(
        model=model_dir, block_size=4, num_kv_blocks=64, multiprocess=False, **kwargs
    )
    return ModelRunner(config, model_dir)


def test_a_checkpoint_without_4_bit_weights_settles_those_paths(tiny_model_dir: str) -> None:
    """A loaded model's plan says what the checkpoint held, not what might have run."""
    runner = _runner(tiny_model_dir, dtype="bfloat16")
    plan = runner.model.fast_paths

    assert not plan.is_on(Path.INT4_KERNELS)
    assert not plan.is_on(Path.QUANT_KERNELS)
    assert not plan.is_on(Path.DECODER_STACK)
    if plan.library is not None and plan.library.isa == "avx512bf16":
        assert "no 4-bit weights" in plan.choices[Path.INT4_KERNELS].reason
        assert "no matrix in GGUF blocks" in plan.choices[Path.QUANT_KERNELS].reason


# the plan's closed sets: their values are the wire format of `FastPaths.summary()` (the
# activations' values are also the --quant-activations flag's, which config.py checks)
_PLAN_VALUES = {m.value for e in (Path, Form, Larger) for m in e}
# modules that read the wire format (and import no torch, so not the enums)
_WIRE_READERS = {"otel_engine/executor/rank_plans.py"}


def _string_reads(tree: ast.AST) -> list[tuple[int, object]]:
    """Strings compared, subscripted with, or passed to `get`/`is_on` in `tree`."""
    found = []
    for node in ast.walk(tree):
        operands: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("get", "is_on"):
            operands = list(node.args)
        found += [(o.lineno, o.value) for o in operands if isinstance(o, ast.Constant)]
    return found


def test_every_decision_has_one_home() -> None:
    """Only `fast_paths.py` decides a path or reads one of the plan's members by its string
    (the readers of its summary aside): the model, its matrices and the ops read the plan."""
    found = []
    for path in sorted((REPO_ROOT / "otel_engine").rglob("*.py")):
        name = str(path.relative_to(REPO_ROOT))
        if name == "otel_engine/model/fast_paths.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "decide":
                found.append(f"{name}:{node.lineno} decides")
        if name not in _WIRE_READERS:
            reads = [(line, v) for line, v in _string_reads(tree) if v in _PLAN_VALUES]
            found += [f"{name}:{line} {value!r}" for line, value in reads]
    assert [] == found
