"""A GGUF file's matrices in the block formats the kernels read (Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K): dequantized by cpu_kernels.c to gguf-py's float32 values bit for bit (and to
those values rounded, in bfloat16), multiplied from their blocks by `quant_linear_bf16` and
by dequantized tiles (model/quant.py) within the output's rounding, and served
natively, with no bfloat16 copy, with the reference path's greedy output at one and two
ranks, head size 64 and 128, and a Q4_K_M-like mix of formats within a layer."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from otel_engine import LLM
from otel_engine.engine.core_client import InprocClient
from otel_engine.model import fast_paths, kernels
from otel_engine.model.fast_paths import BF16_ISA, Form
from otel_engine.model.kernels import KernelLibrary
from otel_engine.model.matrix import BlockMatrix, Int4Matrix
from otel_engine.model.projections import DOWN, GATE_UP, O_PROJ, QKV
from otel_engine.model.quant import (
    AMX_MAX_ROWS,
    QUANT_MAX_ROWS,
    QuantLinear,
    pack_quant,
    shard_columns,
)
from otel_engine.model.weights import QuantTensor
from tests.helpers.gguf_blocks import FORMATS, random_blocks
from tests.helpers.greedy import greedy_with_tops
from tests.helpers.isa import require_isa
from tests.helpers.tiny_model import write_tiny_gguf, write_tiny_llama

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# llama.cpp's Q4_K_M: Q4_K, with (some of) the v and down projections in Q6_K
Q4_K_M = {
    **dict.fromkeys(PROJECTIONS, "Q4_K"),
    "v_proj": "Q6_K",
    "down_proj": "Q6_K",
    "embed_tokens": "Q4_K",  # as in Llama-3.1-8B's Q4_K_M file (a tied one: Q6_K)
    "lm_head": "Q6_K",
}


def _library() -> KernelLibrary:
    library = kernels.load()
    assert library is not None
    return library


def _reference(raw: np.ndarray, name: str) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType[name]).astype(np.float32)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(("rows", "cols"), [(1, 256), (3, 512), (17, 1280), (5, 4096)])
def test_dequantized_values_are_gguf_py_s_bit_for_bit(name: str, rows: int, cols: int) -> None:
    """In every kernels build (this one: the CPU's level)."""
    raw = random_blocks(name, rows, cols, seed=rows * cols)
    out = np.empty((rows, cols), dtype=np.float32)
    _library().gguf_dequantize_f32(
        out=out.ctypes.data, w=raw.ctypes.data, type=GGMLQuantizationType[name].value, n=rows,
        k=cols,
    )  # fmt: skip
    assert np.array_equal(out.view(np.uint32), _reference(raw, name).view(np.uint32))


@pytest.mark.parametrize("name", FORMATS)
def test_bfloat16_dequantization_is_the_rounded_float32(name: str) -> None:
    require_isa(BF16_ISA)
    rows, cols = 19, 768
    raw = random_blocks(name, rows, cols, seed=7)
    out = torch.empty((rows, cols), dtype=torch.bfloat16)
    _library().gguf_dequantize_bf16(
        out=out, w=raw.ctypes.data, type=GGMLQuantizationType[name].value, n=rows, k=cols
    )
    expected = torch.from_numpy(_reference(raw, name)).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def _quant_linear() -> QuantLinear:
    library = _library()
    return QuantLinear(library.quant_linear_bf16, library.gguf_dequantize_bf16)


def _tensor(name: str, rows: int, cols: int, seed: int) -> QuantTensor:
    return QuantTensor(torch.from_numpy(random_blocks(name, rows, cols, seed=seed)), name, cols)


def _bf16(tensor: QuantTensor) -> torch.Tensor:
    return torch.from_numpy(_reference(tensor.raw.numpy(), tensor.kind)).to(torch.bfloat16)


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("name", FORMATS)
def test_matmul_from_blocks_within_output_rounding(name: str) -> None:
    """Every row count of a decode step (the fused kernel) and beyond (tiles and torch's
    matmul), each output within bfloat16 rounding of the float64 product: with the file's
    exact weights where the fused kernel multiplies by them (the K-quants), else with their
    bfloat16 values (Q4_0, Q4_1, Q8_0 fused; every format in tiles); each row the same
    whatever the other rows are."""
    require_isa(BF16_ISA)
    generator = torch.Generator().manual_seed(3)
    tensor = _tensor(name, 80, 512, seed=11)
    weight = pack_quant([tensor])
    assert weight is not None
    linear = _quant_linear()
    x = torch.randn(QUANT_MAX_ROWS + 9, 512, generator=generator).to(torch.bfloat16)
    exact = x.double() @ torch.from_numpy(_reference(tensor.raw.numpy(), name)).double().T
    rounded = x.double() @ _bf16(tensor).double().T
    for rows in (1, 2, 3, 5, QUANT_MAX_ROWS, QUANT_MAX_ROWS + 1, QUANT_MAX_ROWS + 9):
        expected = (exact if rows <= QUANT_MAX_ROWS and name in K_QUANTS else rounded)[:rows]
        out = linear(x[:rows].contiguous(), weight).double()
        error = (out - expected).abs()
        assert (error <= 2**-8 * expected.abs() + 1e-4).all(), (rows, error.max())
        if rows <= QUANT_MAX_ROWS:
            assert torch.equal(out[:1], linear(x[:1].contiguous(), weight).double())


def _on_the_8_bit_grid(rows: int, cols: int, group: int, seed: int) -> torch.Tensor:
    """x that 8-bit quantization in groups of `group` keeps exactly: each group's values
    integers q times a power of two d (q in -127..127, 127 or -127 in every 32), so
    d = max |x| / 127, x / d = q and q * d = x are all exact."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-126, 127, size=(rows, cols // 32, 32))
    q[:, :, 0] = rng.choice([-127, 127], size=(rows, cols // 32))
    d = 2.0 ** rng.integers(-12, -2, size=(rows, cols // group, 1))
    x = (q.reshape(rows, cols // group, group) * d).reshape(rows, cols)
    return torch.from_numpy(x).to(torch.bfloat16)


# columns: K-quant blocks (256, 768); runs of 4 blocks of 32 with and without a last shorter
# run (Q8_0, Q4_0 and Q4_1: 256, 768; 160 = 5 blocks, 736 = 23)
_Q8_SHAPES = {name: (256, 768) if name in K_QUANTS else (160, 256, 736) for name in FORMATS}


@pytest.mark.parametrize("name", FORMATS)
def test_8_bit_activations_are_exact_where_quantizing_x_is(name: str) -> None:
    """`quant_linear_q8_bf16` (x in 8 bits, integer dot products) on x that quantizes exactly:
    the float64 product with the file's weights, within the output's bfloat16 rounding, for
    every row count of a fused step; each row the same whatever the other rows are."""
    require_isa(BF16_ISA)
    library = _library()
    for cols in _Q8_SHAPES[name]:
        tensor = _tensor(name, 40, cols, seed=cols)
        weight = _reference(tensor.raw.numpy(), name)
        group = 256 if name in K_QUANTS else 32  # llama.cpp's Q8_K and Q8_0
        x = _on_the_8_bit_grid(QUANT_MAX_ROWS + 1, cols, group, seed=cols)
        exact = x.double() @ torch.from_numpy(weight).double().T
        for rows in range(1, QUANT_MAX_ROWS + 2):
            out = torch.empty((rows, 40), dtype=torch.bfloat16)
            library.quant_linear_q8_bf16(
                out=out, x=x, w=tensor.raw, type=tensor.type_id, rows=rows, n=40, k=cols, ldo=40
            )
            error = (out.double() - exact[:rows]).abs()
            bound = 2**-8 * exact[:rows].abs() + 1e-5
            assert (error <= bound).all(), (cols, rows, error.max())
            if rows == 1:
                first = out
            assert torch.equal(out[:1], first), (cols, rows)


@pytest.mark.parametrize("name", FORMATS)
def test_8_bit_activations_error_on_gaussian_x(name: str) -> None:
    """On x from a normal distribution the quantization of x costs each output at most 2% of
    its row's largest (the --quant-activations help states it): measured 0.4-1.2%."""
    require_isa(BF16_ISA)
    linear = QuantLinear(_library().quant_linear_q8_bf16, _library().gguf_dequantize_bf16)
    tensor = _tensor(name, 64, 1024, seed=2)
    weight = pack_quant([tensor])
    assert weight is not None
    x = torch.randn(QUANT_MAX_ROWS, 1024, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    exact = x.double() @ torch.from_numpy(_reference(tensor.raw.numpy(), name)).double().T
    error = (linear(x, weight).double() - exact).abs().amax(dim=1)
    assert (error <= 0.02 * exact.abs().amax(dim=1)).all(), error / exact.abs().amax(dim=1)


def _require_amx() -> KernelLibrary:
    """The kernels library where the AMX kernel runs (machines of this project's kind differ:
    some have AMX, some not; skipped, even in CI, where the CPU has none)."""
    require_isa(BF16_ISA)
    library = _library()
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    assert library.has("quant_linear_amx_bf16")
    assert library.amx_ready() == 1
    return library


@pytest.mark.parametrize("name", FORMATS)
def test_amx_tiles_multiply_by_the_bfloat16_weights(name: str) -> None:
    """`quant_linear_amx_bf16`: the reference path's bfloat16 weights times x in float32 sums,
    within the output's rounding, for rows in one pass and several (48 a pass), a number of
    W rows not a multiple of 16 and, for the 32-weight formats, k not a multiple of 256."""
    library = _require_amx()
    for n, cols in ((37, 768), (16, 160 if name not in K_QUANTS else 256)):
        tensor = _tensor(name, n, cols, seed=n + cols)
        x = torch.randn(100, cols, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        expected = x.double() @ _bf16(tensor).double().T
        for rows in (1, 9, 16, 17, 48, 49, 100):
            out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
            library.quant_linear_amx_bf16(
                out=out, x=x, w=tensor.raw, type=tensor.type_id, rows=rows, n=n, k=cols, ldo=n
            )
            error = (out.double() - expected[:rows]).abs()
            assert (error <= 2**-8 * expected[:rows].abs() + 1e-4).all(), (n, rows, error.max())


def test_steps_of_9_to_48_rows_run_in_amx_tiles() -> None:
    """QuantLinear: up to QUANT_MAX_ROWS the fused kernel, then the AMX kernel up to
    AMX_MAX_ROWS, then tiles through torch's matmul; the same values within rounding."""
    library = _require_amx()
    calls: list[tuple[str, int]] = []

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            arguments = inspect.signature(function).bind(*args, **kwargs).arguments
            calls.append((name, list(arguments.values())[4]))
            function(*args, **kwargs)

        return call

    linear = QuantLinear(
        counted("fused", library.quant_linear_q8_bf16),
        counted("tiles", library.gguf_dequantize_bf16),
        counted("amx", library.quant_linear_amx_bf16),
    )
    tensor = _tensor("Q4_K", 48, 512, seed=1)
    weight = pack_quant([tensor])
    assert weight is not None
    x = torch.randn(AMX_MAX_ROWS + 1, 512, generator=torch.Generator().manual_seed(2))
    x = x.to(torch.bfloat16)
    expected = x.double() @ _bf16(tensor).double().T
    for rows, way in (
        (QUANT_MAX_ROWS, "fused"),
        (QUANT_MAX_ROWS + 1, "amx"),
        (AMX_MAX_ROWS, "amx"),
    ):
        calls.clear()
        out = linear(x[:rows].contiguous(), weight).double()
        assert [way] == [name for name, _ in calls], rows
        tolerance = 0.02 * expected[:rows].abs().amax() if way == "fused" else 1e-4
        assert ((out - expected[:rows]).abs() <= 2**-8 * expected[:rows].abs() + tolerance).all()
    calls.clear()
    out = linear(x, weight).double()
    assert {"tiles"} == {name for name, _ in calls}
    assert ((out - expected).abs() <= 2**-8 * expected.abs() + 1e-4).all()


def test_fused_parts_in_different_formats_and_column_shards() -> None:
    """A Q4_K_M-like fused q/k/v (Q4_K, Q4_K, Q6_K): each part's columns of the output from
    its own blocks; a column shard of a K-quant matrix is its whole blocks."""
    require_isa(BF16_ISA)
    parts = [_tensor("Q4_K", 64, 512, 1), _tensor("Q4_K", 32, 512, 2), _tensor("Q6_K", 32, 512, 3)]
    weight = pack_quant(parts)
    assert weight is not None
    assert [p.kind for p in weight.parts] == ["Q4_K", "Q4_K", "Q6_K"]  # each as stored
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = [torch.from_numpy(_reference(p.raw.numpy(), p.kind)) for p in parts]
    expected = x.double() @ torch.cat(exact).double().T
    out = _quant_linear()(x, weight).double()
    assert ((out - expected).abs() <= 2**-8 * expected.abs() + 1e-4).all()
    shard = shard_columns(parts[0], 1, 2)
    assert shard is not None
    assert torch.equal(_bf16(shard), _bf16(parts[0])[:, 256:])
    assert shard_columns(_tensor("Q4_K", 16, 256, 4), 0, 2) is None  # half a block per rank


def _gguf(tmp_path: Path, head_dim: int, quant: dict[str, str], tie: bool = False) -> str:
    checkpoint = write_tiny_llama(
        tmp_path / "hf",
        hidden=256,
        heads=256 // head_dim * 2 if head_dim == 64 else 2,
        kv_heads=2,
        head_dim=head_dim,
        intermediate=512,
        num_layers=2,
        tie=tie,
    )
    return write_tiny_gguf(checkpoint, tmp_path / "model.gguf", "llama", quant=quant)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 11, list(range(10, 50))]  # decodes and long prefills


def _mapping_of(address: int) -> str:
    """The path of the file mapped at `address` in this process ("" for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


def _greedy(model: str, int4: str, tp: int) -> tuple[list[list[int]], list[dict[int, float]]]:
    with LLM(model, dtype="bfloat16", int4=int4, tensor_parallel_size=tp, num_kv_blocks=256) as llm:
        client = llm._frontend.client
        runner = getattr(client.core.executor, "runner", None)  # type: ignore[union-attr]
        if isinstance(client, InprocClient) and runner is not None:  # one rank, in process
            model = runner.model
            qkv = model.layers[0].matrices[QKV]
            assert (int4 == "auto") == isinstance(qkv, BlockMatrix)
            if int4 == "auto":  # every matrix in its blocks, no dense copy
                assert isinstance(model.layers[0].matrices[DOWN], BlockMatrix)
                assert isinstance(model.lm_head, BlockMatrix)
                assert model.embedding.blocks is not None
                assert model.embedding.weight is None
                # copied out of the checkpoint file's mapping into anonymous memory
                assert qkv.blocks is not None
                for raw in (model.embedding.blocks.raw, qkv.blocks.parts[0].raw):
                    assert _mapping_of(raw.data_ptr()) == ""
        return greedy_with_tops(llm, PROMPTS)


def _assert_same_but_near_ties(
    native: list[list[int]], reference: list[list[int]], tops: list[dict[int, float]]
) -> None:
    """Equal, or leaving the reference first where its two candidates were within 0.5 nats
    (the two paths sum the same bfloat16 products in different orders)."""
    for i, (x, y) in enumerate(zip(native, reference, strict=True)):
        diverged = [j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b]
        if diverged:
            top = tops[i * len(y) + diverged[0]]
            chosen = x[diverged[0]]
            assert chosen in top, (i, diverged[0], top)
            assert top[y[diverged[0]]] - top[chosen] <= 0.5, (i, diverged[0], top)


@pytest.mark.parametrize(
    ("head_dim", "quant", "tie"),
    [
        (64, "Q4_K_M", False),
        (128, "Q4_K_M", False),
        (64, "Q8_0", False),
        (128, "Q5_K", False),
        (64, "Q6_K", True),  # one matrix for the embedding and the LM head, in its blocks
    ],
)
def test_native_greedy_output_is_the_reference_path_s(
    tmp_path: Path, head_dim: int, quant: str, tie: bool
) -> None:
    """Every layer matrix, the embedding and the LM head multiplied (looked up) from their
    blocks give the reference path's greedy tokens (its bfloat16 copies of the same values),
    but for near ties."""
    require_isa(BF16_ISA)
    if quant == "Q4_K_M":
        formats = Q4_K_M
    else:
        formats = dict.fromkeys((*PROJECTIONS, "embed_tokens", "lm_head"), quant)
    model = _gguf(tmp_path, head_dim, formats, tie)
    native, _ = _greedy(model, "auto", 1)
    reference, tops = _greedy(model, "off", 1)
    _assert_same_but_near_ties(native, reference, tops)


@pytest.mark.slow
def test_native_greedy_output_at_two_ranks(tmp_path: Path) -> None:
    """Each rank multiplies its rows (q/k/v, gate/up) and its columns (o, down: whole K-quant
    blocks) from the file's blocks."""
    require_isa(BF16_ISA)
    model = _gguf(tmp_path, 128, Q4_K_M)
    native, _ = _greedy(model, "auto", 2)
    reference, tops = _greedy(model, "off", 1)
    _assert_same_but_near_ties(native, reference, tops)


def _loaded(model_dir: str, tp_size: int = 1, **options: str) -> Any:
    from otel_engine.model.registry import load_model

    cpu = torch.device("cpu")
    return load_model(model_dir, dtype=torch.bfloat16, device=cpu, tp_size=tp_size, **options)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_large_4_bit_layers_run_from_their_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """With x in 8 bits, Q4_0/Q4_1 layers of more than INT4_KERNELS_MAX_BYTES (here: any) are
    multiplied from their blocks like the other formats, the 4-bit kernels off with the
    reason, and give the reference path's greedy output but for near ties; with x in
    bfloat16 they stay in the 4-bit kernels."""
    require_isa(BF16_ISA)
    from otel_engine.model.loader import prepare_model_dir

    formats = dict.fromkeys((*PROJECTIONS, "embed_tokens", "lm_head"), name)
    path = _gguf(tmp_path, 64, formats)
    model_dir = prepare_model_dir(path)
    kept = _loaded(model_dir, quant_activations="bfloat16")
    assert kept.fast_paths.is_on(fast_paths.Path.INT4_KERNELS)
    assert isinstance(kept.layers[0].matrices[QKV], Int4Matrix)  # the 4-bit kernels
    monkeypatch.setattr(fast_paths, "INT4_KERNELS_MAX_BYTES", 0)
    model = _loaded(model_dir)
    choice = model.fast_paths.choices[fast_paths.Path.INT4_KERNELS]
    assert not choice.enabled
    assert "from their blocks with x in 8 bits" in choice.reason
    assert isinstance(model.layers[0].matrices[QKV], BlockMatrix)
    assert isinstance(model.layers[0].matrices[DOWN], BlockMatrix)
    native, _ = _greedy(path, "auto", 1)
    reference, tops = _greedy(path, "off", 1)
    _assert_same_but_near_ties(native, reference, tops)


def test_parts_of_different_widths_are_not_fused() -> None:
    """A fused group whose parts disagree on the width is left to the bfloat16 loaders."""
    assert pack_quant([_tensor("Q4_K", 16, 512, 1), _tensor("Q4_K", 16, 256, 2)]) is None


def test_a_shard_that_splits_blocks_falls_back_to_bfloat16(tmp_path: Path) -> None:
    """At two ranks a hidden size of 256 gives each rank half a K-quant block of the o
    projection's columns: it loads as a bfloat16 shard (dequantized), while q/k/v and gate/up
    keep their rows in blocks and down (512 columns) a whole block per rank."""
    require_isa(BF16_ISA)
    from otel_engine.model.loader import prepare_model_dir

    model_dir = prepare_model_dir(_gguf(tmp_path, 128, dict.fromkeys(PROJECTIONS, "Q4_K")))
    model = _loaded(model_dir, tp_size=2)
    matrices = model.layers[0].matrices

    for projection in (QKV, GATE_UP, DOWN):
        assert isinstance(matrices[projection], BlockMatrix)
    assert 256 == matrices[DOWN].cols
    assert Form.PACKED == matrices[O_PROJ].form
    assert (256, 128) == (matrices[O_PROJ].rows, matrices[O_PROJ].cols)  # this rank's columns
    assert model.fast_paths.is_on(fast_paths.Path.QUANT_KERNELS)
