"""`quant_linear_q8_f32`: float32 x quantized to 8 bits per 32, times a GGUF matrix's blocks
by integer dot products, in every build from AVX2 up: against a float64 NumPy reference that
quantizes x the same way and dequantizes W with gguf-py, for every format, random blocks and
odd shapes; natively for each level this CPU runs, and the AVX2 build under QEMU's Haswell
(no AVX-512) too."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from otel_engine import LLM
from otel_engine.memory import huge_page_copies
from otel_engine.model import kernels
from otel_engine.model.kernels import KernelLibrary
from otel_engine.model.matrix import BlockMatrix, PackedMatrix, _joined
from otel_engine.model.projections import QKV
from otel_engine.model.quant import QUANT_F32_MAX_ROWS, QuantLinear, pack_quant
from otel_engine.model.weights import QuantTensor
from tests.helpers.gguf_blocks import FORMATS, random_blocks
from tests.helpers.greedy import greedy_with_tops
from tests.helpers.isa import QEMU_CPU, QEMU_ISA, require_isa, require_qemu
from tests.helpers.paths import REPO_ROOT
from tests.helpers.tiny_model import write_tiny_gguf, write_tiny_llama

LEVELS = ("avx2", "avx512", "avx512bf16")  # the builds that have the kernel
# values of x per scale: 32 (ggml's Q8_0), a K-quant's block of 256 (ggml's Q8_K)
X_GROUP = 32
MAX_ROWS = 9
N = 37  # outputs: odd, and more than the 16 below which the kernel runs on one thread
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# k: one and three K-quant blocks; one, five and 23 blocks of the 32-weight formats
WIDTHS = {name: (256, 768) if name in K_QUANTS else (32, 160, 736) for name in FORMATS}
# the bytes of each block that hold q, for the formats whose offset (Q4_1's m, the K-quants'
# -dmin * m) meets x unquantized: the same blocks with those bytes 0 dequantize to the offsets
Q_BYTES = {"Q4_1": slice(4, 20), "Q4_K": slice(16, 144), "Q5_K": slice(16, 176)}
# the kernel's float32 sums against the float64 reference, relative to the sum of |terms|
SUM_ROUNDING = 1e-5


def _library(level: str) -> KernelLibrary:
    require_isa(level)
    library = kernels.load(level)
    assert library is not None, "the kernels did not build (is a C compiler installed?)"
    return library


def _x_group(name: str) -> int:
    return 256 if name in K_QUANTS else X_GROUP


def _quantized(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, k] float32 as the kernel quantizes it, in float32 steps: per `group` values
    d = max |x| / 127 and q = x * (1 / d) rounded to nearest even; returns q and d per value."""
    groups = x.reshape(x.shape[0], -1, group)
    d = np.abs(groups).max(axis=2, keepdims=True) / np.float32(127)
    inverse = np.float32(1) / np.where(d > 0, d, np.float32(1))
    inverse = np.where(d > 0, inverse, np.float32(0))
    q = np.rint(np.clip(groups * inverse, -127, 127))
    return q.reshape(x.shape), np.broadcast_to(d, groups.shape).reshape(x.shape)


def _offsets(raw: np.ndarray, name: str) -> np.ndarray:
    """Each weight's offset that the kernel multiplies by x as it is (0 for the formats whose
    offset is in their integer q)."""
    if name not in Q_BYTES:
        return np.zeros((raw.shape[0], 1))
    zeroed = raw.reshape(raw.shape[0], -1, _block_bytes(name)).copy()
    zeroed[:, :, Q_BYTES[name]] = 0
    return dequantize(zeroed.reshape(raw.shape), GGMLQuantizationType[name]).astype(np.float64)


def _block_bytes(name: str) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]


class Reference:
    """A matrix in its blocks and x, with what the kernel must give in float64."""

    def __init__(self, name: str, n: int, k: int, seed: int) -> None:
        self.name, self.n, self.k = name, n, k
        self.raw = random_blocks(name, n, k, seed=seed)
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((MAX_ROWS, k)).astype(np.float32)
        self.x[1, : _x_group(name)] = 0.0  # a group of zeros: scale 0
        weight = dequantize(self.raw, GGMLQuantizationType[name]).astype(np.float64)
        offset = np.broadcast_to(_offsets(self.raw, name), weight.shape)
        q, d = _quantized(self.x, _x_group(name))
        x8 = q * d.astype(np.float64)  # x as the kernel's integers and scales say
        x = self.x.astype(np.float64)
        scaled = weight - offset
        self.expected = x8 @ scaled.T + x @ offset.T
        self.terms = np.abs(x8) @ np.abs(scaled).T + np.abs(x) @ np.abs(offset).T
        self.exact = x @ weight.T
        # what rounding x to 8 bits may cost each output, at most
        self.x_error = np.abs(x8 - x) @ np.abs(scaled).T

    def run(self, library: KernelLibrary, rows: int) -> np.ndarray:
        out = np.full((rows, self.n + 3), np.nan, dtype=np.float32)  # row stride past n
        library.quant_linear_q8_f32(
            out=out.ctypes.data, x=self.x.ctypes.data, w=self.raw.ctypes.data,
            type=GGMLQuantizationType[self.name].value, rows=rows, n=self.n, k=self.k,
            ldo=self.n + 3,
        )  # fmt: skip
        assert np.isnan(out[:, self.n :]).all()  # nothing past n written
        return out[:, : self.n]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", FORMATS)
def test_the_8_bit_product_is_the_float64_reference_s(level: str, name: str) -> None:
    """For 1 to 9 rows of x and k of one and several blocks: each output within float32
    summation of the reference (x quantized as the kernel does, gguf-py's weights), within
    what rounding x to 8 bits may cost of the exact product, and the same whatever the
    other rows are."""
    library = _library(level)
    for k in WIDTHS[name]:
        for n in (N, 5):
            reference = Reference(name, n, k, seed=k + n)
            first = None
            for rows in range(1, MAX_ROWS + 1):
                out = reference.run(library, rows).astype(np.float64)
                bound = SUM_ROUNDING * reference.terms[:rows] + 1e-30
                assert (np.abs(out - reference.expected[:rows]) <= bound).all(), (k, n, rows)
                exact = reference.exact[:rows]
                assert (np.abs(out - exact) <= reference.x_error[:rows] + bound).all(), (k, rows)
                first = out[0] if first is None else first
                assert np.array_equal(first, out[0]), (k, n, rows)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", FORMATS)
def test_each_row_of_a_many_row_step_is_that_row_alone_bit_for_bit(level: str, name: str) -> None:
    """Steps of several rows of x (W in transposed panels of 8 rows, 1,024 values at a time;
    with AVX-512 of 16 rows, 512 values at a time; two passes of 8 rows of x and a partial
    one, the rows of W past the last whole panel by the row kernel) give every output the
    float32 bits of that row of x multiplied alone; k is 2 chunks and a part (more with
    AVX-512), 8 blocks and 1 (K-quants), 40 and 3; n is 37, 8 (one 8-row panel, or the row
    kernel alone) and 24 (a 16-row panel and 8 rows left over)."""
    library = _library(level)
    k = 2304 if name in K_QUANTS else 1376
    for n in (N, 8, 24):
        raw = random_blocks(name, n, k, seed=n)
        x = np.random.default_rng(n).standard_normal((21, k)).astype(np.float32)
        x[3] = 0.0  # a row of zeros: every scale 0
        outs = []
        for rows, part in ((21, x), *((1, x[r : r + 1]) for r in range(21))):
            out = np.empty((rows, n), dtype=np.float32)
            library.quant_linear_q8_f32(
                out=out.ctypes.data, x=part.ctypes.data, w=raw.ctypes.data,
                type=GGMLQuantizationType[name].value, rows=rows, n=n, k=k, ldo=n,
            )  # fmt: skip
            outs.append(out)
        alone = np.concatenate(outs[1:])
        assert np.array_equal(alone.view(np.uint32), outs[0].view(np.uint32)), n


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", FORMATS)
def test_larger_steps_are_the_exact_float64_reference_s(level: str, name: str) -> None:
    """`quant_gemm_f32` (the steps past QUANT_F32_MAX_ROWS): every output within float32
    summation of x times gguf-py's weights in float64, and in AVX-512 builds (x in 16 bits
    per 32 values) within x's rounding too: half a step of max |x| / 32767 (Q6_K: 16383) per
    32 values, times those values' |w|. For n of 37 (a partial micro-kernel of W's rows) and
    300 (two threads' chunks of 256 and a part), k of several chunks of 256 and a part, rows
    of 6 and a partial micro-kernel; each row's output the bits of that row alone."""
    library = _library(level)
    k = 2304 if name in K_QUANTS else 1376
    for n in (37, 300):
        raw = random_blocks(name, n, k, seed=n)
        weight = dequantize(raw, GGMLQuantizationType[name]).astype(np.float64)
        x = np.random.default_rng(n).standard_normal((15, k)).astype(np.float32)
        outs = []
        for rows, part in ((15, x), *((1, x[r : r + 1]) for r in range(15))):
            out = np.full((rows, n + 3), np.nan, dtype=np.float32)  # row stride past n
            library.quant_gemm_f32(
                out=out.ctypes.data, x=part.ctypes.data, w=raw.ctypes.data,
                type=GGMLQuantizationType[name].value, rows=rows, n=n, k=k, ldo=n + 3,
            )  # fmt: skip
            assert np.isnan(out[:, n:]).all()  # nothing past n written
            outs.append(out[:, :n])
        exact = x.astype(np.float64) @ weight.T
        terms = np.abs(x).astype(np.float64) @ np.abs(weight).T
        bound = SUM_ROUNDING * terms
        if level != "avx2":  # x in 16 bits: each 32 values' largest / 32767 / 2, times |w|
            top = 16383 if name == "Q6_K" else 32767  # Q6_K's q times its scale: int32 sums
            step = np.abs(x).reshape(15, k // 32, 32).max(axis=2).astype(np.float64) / top
            bound += (step / 2) @ np.abs(weight).reshape(n, k // 32, 32).sum(axis=2).T
        assert (np.abs(outs[0] - exact) <= bound).all(), n
        alone = np.concatenate(outs[1:])
        assert np.array_equal(alone.view(np.uint32), outs[0].view(np.uint32)), n


@pytest.mark.parametrize("level", LEVELS)
def test_a_nan_in_x_makes_its_row_of_a_larger_step_nan(level: str) -> None:
    """`quant_gemm_f32` with a NaN in one row of x: that row's outputs are NaN (as float32's
    arithmetic gives; AVX-512 builds, which round x to 16 bits, make its scale NaN), the
    other rows' are the bits they have without it."""
    library = _library(level)
    raw = random_blocks("Q4_K", 40, 512, seed=5)
    x = np.random.default_rng(5).standard_normal((9, 512)).astype(np.float32)
    outs = []
    for part in (x, np.where(np.arange(512) == 300, np.float32("nan"), x[4])[None]):
        rows = len(part)
        out = np.empty((rows, 40), dtype=np.float32)
        library.quant_gemm_f32(
            out=out.ctypes.data, x=np.ascontiguousarray(part).ctypes.data, w=raw.ctypes.data,
            type=GGMLQuantizationType.Q4_K.value, rows=rows, n=40, k=512, ldo=40,
        )  # fmt: skip
        outs.append(out)
    assert np.isnan(outs[1]).all()
    x[4, 300] = np.nan
    out = np.empty((9, 40), dtype=np.float32)
    library.quant_gemm_f32(
        out=out.ctypes.data, x=x.ctypes.data, w=raw.ctypes.data,
        type=GGMLQuantizationType.Q4_K.value, rows=9, n=40, k=512, ldo=40,
    )  # fmt: skip
    assert np.isnan(out[4]).all()
    others = [r for r in range(9) if r != 4]
    assert np.array_equal(out[others].view(np.uint32), outs[0][others].view(np.uint32))


@pytest.mark.parametrize("level", ["baseline", *LEVELS])
def test_dequantization_is_gguf_py_s_bit_for_bit_at_each_level(level: str) -> None:
    """`gguf_dequantize_f32` (the float32 tiles of larger steps): by block below AVX2, from
    the 8-bit kernel's unpacked rows above; gguf-py's float32 values either way."""
    library = _library(level)
    for name in FORMATS:
        raw = random_blocks(name, 19, 768, seed=4)
        out = np.empty((19, 768), dtype=np.float32)
        library.gguf_dequantize_f32(
            out=out.ctypes.data, w=raw.ctypes.data, type=GGMLQuantizationType[name].value, n=19,
            k=768,
        )  # fmt: skip
        expected = dequantize(raw, GGMLQuantizationType[name]).astype(np.float32)
        assert np.array_equal(expected.view(np.uint32), out.view(np.uint32)), name


@pytest.mark.parametrize("name", FORMATS)
def test_the_8_bit_error_on_gaussian_x_is_within_2_percent(name: str) -> None:
    """On x from a normal distribution, rounding x to 8 bits costs each output at most 2% of
    its row's largest (what the --quant-activations help states of the 8-bit kernels)."""
    library = _library("avx2")
    reference = Reference(name, 64, 1024, seed=5)
    out = reference.run(library, MAX_ROWS).astype(np.float64)
    error = np.abs(out - reference.exact).max(axis=1)
    assert (error <= 0.02 * np.abs(reference.exact).max(axis=1)).all()


# The AVX2 build called under QEMU, without torch (importing it there takes 20 s): each case's
# inputs and output as .npy files, the argument types from the contract.
EMULATED = """
import ctypes, json, sys
import numpy as np
from otel_engine.model import kernels

library, folder, cases = ctypes.CDLL(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
function = library.quant_linear_q8_f32
params = kernels.OPTIONAL_SIGNATURES["quant_linear_q8_f32"]
function.argtypes = [kind for _, kind in params]
statuses = []
for case, arguments in enumerate(cases):
    x, w = np.load(f"{folder}/{case}-x.npy"), np.load(f"{folder}/{case}-w.npy")
    out = np.zeros((arguments["rows"], arguments["n"]), dtype=np.float32)
    pointers = {"out": out.ctypes.data, "x": x.ctypes.data, "w": w.ctypes.data}
    statuses.append(function(*[pointers.get(n, arguments.get(n)) for n, _ in params]))
    np.save(f"{folder}/{case}-out.npy", out)
print(json.dumps(statuses))
"""


def test_the_avx2_build_under_qemu_haswell_gives_the_native_bits(tmp_path: Path) -> None:
    """On an emulated CPU without AVX-512 the AVX2 build's output for every format is the
    reference's, bit for bit what the same build gives natively."""
    qemu = require_qemu()
    library = _library(QEMU_ISA)
    references = [Reference(name, N, WIDTHS[name][-1], seed=3) for name in FORMATS]
    cases = []
    for case, reference in enumerate(references):
        np.save(tmp_path / f"{case}-x.npy", reference.x)
        np.save(tmp_path / f"{case}-w.npy", reference.raw)
        cases.append({
            "type": GGMLQuantizationType[reference.name].value, "rows": MAX_ROWS, "n": N,
            "k": reference.k, "ldo": N,
        })  # fmt: skip
    python = [qemu, "-cpu", QEMU_CPU, "-0", sys.executable, str(Path(sys.executable).resolve())]
    result = subprocess.run(
        [*python, "-c", EMULATED, str(library.path), str(tmp_path), json.dumps(cases)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip

    assert 0 == result.returncode, result.stderr[-3000:]
    assert [kernels.KernelStatus.OK] * len(FORMATS) == json.loads(result.stdout.splitlines()[-1])
    for case, reference in enumerate(references):
        emulated = np.load(tmp_path / f"{case}-out.npy")
        native = reference.run(library, MAX_ROWS)
        assert np.array_equal(native.view(np.uint32), emulated.view(np.uint32)), reference.name
        bound = SUM_ROUNDING * reference.terms + 1e-30
        assert (np.abs(emulated - reference.expected) <= bound).all(), reference.name


def _float32_linear(library: KernelLibrary) -> QuantLinear:
    """A float32 model's `QuantLinear`: the 8-bit kernel, and the GEMM past its rows."""
    return QuantLinear(
        library.quant_linear_q8_f32,
        library.gguf_dequantize_f32,
        None,
        torch.float32,
        gemm=library.quant_gemm_f32,
    )


def _parts(*shapes: tuple[str, int]) -> list[QuantTensor]:
    """Random blocks of (format, rows) each, 512 columns: a fused matrix's parts."""
    return [
        QuantTensor(torch.from_numpy(random_blocks(name, rows, 512, seed=rows)), name, 512)
        for name, rows in shapes
    ]


def test_a_float32_block_matrix_runs_small_steps_in_8_bits_and_larger_ones_exactly() -> None:
    """`QuantLinear` in float32 on a Q4_K_M-like fused q/k/v (parts in Q4_K and Q6_K): up to
    QUANT_F32_MAX_ROWS rows each part's columns are `quant_linear_q8_f32`'s; more rows run on
    gguf-py's exact values (`quant_gemm_f32`), within float32 rounding of the exact product."""
    library = _library("avx2")
    linear = _float32_linear(library)
    parts = _parts(("Q4_K", 64), ("Q6_K", 32))
    weight = pack_quant(parts)
    assert weight is not None
    exact_weight = torch.cat(
        [torch.from_numpy(dequantize(p.raw.numpy(), GGMLQuantizationType[p.kind])) for p in parts]
    ).double()
    x = torch.randn(QUANT_F32_MAX_ROWS + 7, 512, generator=torch.Generator().manual_seed(0))
    for rows in (1, QUANT_F32_MAX_ROWS):
        out = linear(x[:rows].contiguous(), weight)
        column = 0
        for part in parts:
            alone = torch.empty((rows, part.rows))
            library.quant_linear_q8_f32(
                out=alone, x=x[:rows].contiguous(), w=part.raw, type=part.type_id, rows=rows,
                n=part.rows, k=512, ldo=part.rows,
            )  # fmt: skip
            assert torch.equal(alone, out[:, column : column + part.rows])
            column += part.rows
    out = linear(x, weight)
    assert torch.float32 == out.dtype
    exact = x.double() @ exact_weight.T
    terms = x.double().abs() @ exact_weight.abs().T
    assert ((out.double() - exact).abs() <= 1e-5 * terms).all()


@pytest.mark.parametrize("level", LEVELS)
def test_joined_neighbour_parts_give_the_same_bits(level: str) -> None:
    """A fused matrix's parts copied back to back (`huge_page_copies`), neighbours of one
    format joined into one part (`matrix._joined`: one kernel call for them): the same bits
    as part by part, at one row, a step of panels and a step past QUANT_F32_MAX_ROWS."""
    linear = _float32_linear(_library(level))
    parts = _parts(("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32), ("Q6_K", 16))
    weight = pack_quant(parts)
    assert weight is not None
    copies = huge_page_copies([p.raw for p in parts], "a test's blocks")
    placed = tuple(QuantTensor(c, p.kind, p.cols) for p, c in zip(parts, copies, strict=True))
    joined = dataclasses.replace(weight, parts=_joined(placed))
    assert [(p.kind, p.rows) for p in joined.parts] == [("Q4_K", 96), ("Q6_K", 48)]
    x = torch.randn(QUANT_F32_MAX_ROWS + 7, 512, generator=torch.Generator().manual_seed(1))
    for rows in (1, 16, QUANT_F32_MAX_ROWS + 7):
        alone = linear(x[:rows].contiguous(), weight)
        assert torch.equal(
            alone.view(torch.int32), linear(x[:rows].contiguous(), joined).view(torch.int32)
        )


# llama.cpp's Q4_K_M: Q4_K, with (some of) the v and down projections in Q6_K
_Q4_K_M = {
    **dict.fromkeys(("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"), "Q4_K"),
    **dict.fromkeys(("v_proj", "down_proj", "lm_head"), "Q6_K"),
    "embed_tokens": "Q8_0",
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 11, list(range(10, 50))]  # decodes and prefills


def _greedy(path: str, activations: str) -> tuple[list[list[int]], list[dict[int, float]], type]:
    """Greedy tokens, top-5 log-probs per token and the first layer's q/k/v matrix class of
    a float32 engine with `activations`."""
    with LLM(model=path, dtype="float32", quant_activations=activations) as llm:
        runner = llm._frontend.client.core.executor.runner  # type: ignore[attr-defined]
        matrix = type(runner.model.layers[0].matrices[QKV])
        tokens, tops = greedy_with_tops(llm, PROMPTS)
    return tokens, tops, matrix


def test_a_float32_gguf_model_in_8_bits_gives_the_exact_path_s_tokens(tmp_path: Path) -> None:
    """A float32 engine on a Q4_K_M-like file multiplies its matrices from their blocks with
    x in 8 bits (by default) and gives the greedy tokens of --quant-activations float32 (dense
    copies of the exact values), but where the exact path's two candidates were within 0.5
    nats."""
    require_isa("avx2")
    hf = write_tiny_llama(tmp_path / "hf", hidden=256, heads=4, kv_heads=2, intermediate=512)
    path = write_tiny_gguf(hf, tmp_path / "model.gguf", "llama", quant=_Q4_K_M)
    tokens, _, matrix = _greedy(path, "int8")
    reference, tops, dense = _greedy(path, "float32")

    assert (BlockMatrix, PackedMatrix) == (matrix, dense)
    for i, (x, y) in enumerate(zip(tokens, reference, strict=True)):
        diverged = [j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b]
        if diverged:
            top = tops[i * len(y) + diverged[0]]
            assert x[diverged[0]] in top, (i, diverged[0], top)
            assert top[y[diverged[0]]] - top[x[diverged[0]]] <= 0.5, (i, diverged[0], top)
