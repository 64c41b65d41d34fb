"""The fast paths a model runs, decided in one place (`fast_paths.choose`) from what the CPU,
torch and the kernel build can run; each off path says why, and the next correct path runs."""

from __future__ import annotations

import pytest
import torch

from otel_engine.config import EngineConfig
from otel_engine.executor.model_runner import ModelRunner
from otel_engine.model import fast_paths, kernels
from otel_engine.model.fast_paths import BF16_ISA, PATHS, choose
from otel_engine.model.layer_ops import KernelOps, TorchOps, make_layer_ops
from otel_engine.model.layers import RotaryEmbedding
from tests.helpers.isa import require_isa

CPU = torch.device("cpu")


def _choose(**overrides: object) -> fast_paths.FastPaths:
    options: dict[str, object] = {
        "kernels_flag": "auto",
        "int4_flag": "auto",
        "device": CPU,
        "dtype": torch.bfloat16,
        "head_dim": 64,
        "rotary_dim": 64,
        "block_size": 16,
        "tp_size": 1,
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

    assert set(PATHS) == set(plan.choices)
    assert all(choice.reason for choice in plan.choices.values())
    summary = plan.summary()
    assert kernels.cpu_isa() == summary["cpu_isa"]
    assert set(PATHS) == set(summary["paths"])


def test_kernels_torch_turns_every_path_off() -> None:
    """--kernels torch is the reference: torch ops and F.linear, whatever the machine has."""
    plan = _choose(kernels_flag="torch")

    assert not any(c.enabled for c in plan.choices.values())
    assert plan.library is None
    assert "--kernels torch" == plan.choices["compiled_kernels"].reason


def test_on_avx512_bf16_every_path_runs_for_the_default_shape() -> None:
    require_isa(BF16_ISA)
    plan = _choose()

    assert all(plan.is_on(name) for name in PATHS)
    assert "avx512bf16" == plan.kernel_isa
    assert plan.library is not None


@pytest.mark.parametrize(
    ("activations", "function", "says"),
    [("int8", "quant_linear_q8_bf16", "8 bits"), ("bfloat16", "quant_linear_bf16", "bfloat16")],
)
def test_quant_activations_choose_the_gguf_blocks_kernel(
    activations: str, function: str, says: str
) -> None:
    """--quant-activations picks which fused kernel multiplies GGUF blocks, and says so."""
    require_isa(BF16_ISA)
    plan = _choose(quant_activations=activations)
    assert says in plan.choices["quant_kernels"].reason
    ops = _ops(plan, 64, torch.bfloat16)
    assert isinstance(ops, KernelOps)
    assert plan.library is not None
    assert ops.quant_linear is getattr(plan.library, function)


def test_amx_runs_mid_size_steps_where_linux_lends_the_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU with AMX the AMX kernel takes steps of 9-48 rows and the reasons say so;
    where the process is refused the tile registers it stays off, with that reason."""
    require_isa(BF16_ISA)
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    plan = _choose()
    assert plan.amx_tiles
    assert "48 rows in AMX tiles" in plan.choices["quant_kernels"].reason
    assert plan.library is not None
    library = plan.library
    monkeypatch.setattr(kernels, "load", lambda target=None: library)
    monkeypatch.setattr(library, "amx_ready", lambda: 0)
    refused = _choose()
    assert not refused.amx_tiles
    assert "refused this process the AMX tile registers" in refused.choices["quant_kernels"].reason
    assert _ops(refused, 64, torch.bfloat16).quant_linear_amx is None  # type: ignore[attr-defined]
    monkeypatch.setattr(library, "has", lambda name: name != "quant_linear_amx_bf16")
    older = _choose()
    assert not older.amx_tiles
    assert "the kernels build has no AMX kernel" in older.choices["int4_kernels"].reason


def test_an_unknown_quant_activations_value_is_refused() -> None:
    with pytest.raises(ValueError, match="quant_activations must be one of"):
        EngineConfig.from_kwargs(quant_activations="int4")


def test_head_size_128_runs_the_prefill_kernel_and_amx_sends_large_steps_to_torch() -> None:
    """Head size 128 has its prefill kernel. Where torch's matmuls run on AMX tiles, its
    fused attention is faster on long chunks, so the kernel takes chunks up to
    PREFILL_KERNEL_MAX_QUERY_AMX tokens; elsewhere every chunk."""
    require_isa(BF16_ISA)
    plan = _choose(head_dim=128, rotary_dim=128)

    assert plan.is_on("prefill_kernel")
    if torch.cpu._is_amx_tile_supported():
        assert fast_paths.PREFILL_KERNEL_MAX_QUERY_AMX == plan.prefill_kernel_max_query
        assert "(AMX)" in plan.choices["prefill_kernel"].reason
    else:
        assert plan.prefill_kernel_max_query is None
    # likewise steps of more than 16 rows of 4-bit matrices: tiles with AMX, else panels
    assert plan.int4_tiles == torch.cpu._is_amx_tile_supported()
    assert ("AMX" in plan.choices["int4_kernels"].reason) == plan.int4_tiles


@pytest.mark.parametrize(
    ("overrides", "off", "reason"),
    [
        ({"head_dim": 96, "rotary_dim": 96}, "prefill_kernel", "head size 96"),
        ({"head_dim": 128, "rotary_dim": 128}, "decoder_stack", "head size 128"),
        ({"tp_size": 2}, "decoder_stack", "2 ranks"),
        ({"dtype": torch.float32}, "int4_kernels", "bfloat16"),
        ({"int4_flag": "off"}, "int4_kernels", "--int4 off"),
        ({"dtype": torch.float32}, "quant_kernels", "bfloat16"),
        ({"int4_flag": "off"}, "quant_kernels", "--int4 off"),
        ({"rotary_dim": 32}, "compiled_kernels", "partial rotary"),
        ({"block_size": 512}, "compiled_kernels", "--block-size 512"),
        ({"dtype": torch.float16}, "compiled_kernels", "dtype float16"),
    ],
)
def test_a_path_that_does_not_apply_is_off_with_its_reason(
    overrides: dict[str, object], off: str, reason: str
) -> None:
    require_isa(BF16_ISA)
    plan = _choose(**overrides)

    assert not plan.is_on(off)
    assert reason in plan.choices[off].reason


def test_without_a_compiler_torch_ops_run_and_packing_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No compiler: torch ops (the kernels' paths off, saying why); oneDNN's packing does not
    depend on the kernels."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(kernels.shutil, "which", lambda _: None)
    kernels.load.cache_clear()
    try:
        plan = _choose(dtype=torch.float32)
    finally:
        kernels.load.cache_clear()

    assert not plan.is_on("compiled_kernels")
    assert "could not be built" in plan.choices["compiled_kernels"].reason
    assert plan.is_on("onednn_packing")
    ops = _ops(plan, 16, torch.float32)
    assert isinstance(ops, TorchOps)
    assert not isinstance(ops, KernelOps)


def test_packing_is_off_where_onednn_has_no_bfloat16_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check that oneDNN itself answers (False under ONEDNN_MAX_CPU_ISA=AVX2 or on a CPU
    without AVX-512): bfloat16 weights stay plain, float32 ones are still packed."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)

    bf16, f32 = _choose(), _choose(dtype=torch.float32)

    assert not bf16.is_on("onednn_packing")
    assert "no bfloat16 path" in bf16.choices["onednn_packing"].reason
    assert f32.is_on("onednn_packing")


@pytest.mark.parametrize(
    ("isa", "dtype", "expected"),
    [
        ("avx512bf16", torch.bfloat16, True),
        ("avx512", torch.float32, True),
        ("avx2", torch.bfloat16, True),
        ("avx2", torch.float32, False),
        ("baseline", torch.bfloat16, True),
        ("baseline", torch.float32, False),
        ("generic", torch.float32, False),
    ],
)
def test_the_kernels_run_where_they_pay_off(isa: str, dtype: torch.dtype, expected: bool) -> None:
    """The measured rule (bench/kernel_isa.py)."""
    assert expected == fast_paths.kernels_pay_off(isa, dtype)


def test_below_the_rule_torch_ops_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a float32 model with kernels for AVX2 only, torch ops run and the reason says so."""
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")

    plan = _choose(dtype=torch.float32)

    assert not plan.is_on("compiled_kernels")
    assert "torch ops are as fast" in plan.choices["compiled_kernels"].reason
    assert plan.library is None


def test_a_bfloat16_model_on_avx2_runs_the_avx2_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an AVX2 CPU gets in bfloat16: the kernels built for AVX2, none of the AVX-512
    BF16 paths."""
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")

    plan = _choose()

    assert plan.is_on("compiled_kernels")
    assert "avx2" == plan.kernel_isa
    for name in ("int4_kernels", "quant_kernels", "prefill_kernel", "decoder_stack"):
        assert not plan.is_on(name)


def _runner(model_dir: str, **kwargs: object) -> ModelRunner:
    config = EngineConfig.from_kwargs(
        model=model_dir, block_size=4, num_kv_blocks=64, multiprocess=False, **kwargs
    )
    return ModelRunner(config, model_dir)


def test_a_checkpoint_without_4_bit_weights_settles_those_paths(tiny_model_dir: str) -> None:
    """After loading, the 4-bit paths say what the checkpoint held, not what might have run."""
    runner = _runner(tiny_model_dir, dtype="bfloat16")
    plan = runner.model.fast_paths

    assert not plan.is_on("int4_kernels")
    assert not plan.is_on("quant_kernels")
    assert not plan.is_on("decoder_stack")
    if plan.library is not None and plan.library.isa == "avx512bf16":
        assert "no 4-bit weights" in plan.choices["int4_kernels"].reason
        assert "no matrix in GGUF blocks" in plan.choices["quant_kernels"].reason
