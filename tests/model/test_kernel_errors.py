"""Kernels fail like Python: an unknown GGML type id, an allocation that fails and an unmet
precondition each raise KernelError naming the kernel, the reason and the failed check (never
an uninitialized output returned as a result, never a signal)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch

from otel_engine.model import kernels
from otel_engine.model.kernels import KernelError, KernelLibrary, KernelStatus

# what the GGUF kernels take besides the type: x [rows, k] times W [n, k] into out, or W alone
_TYPED = {
    "gguf_dequantize_f32": {"n": 1, "k": 256},
    "gguf_dequantize_bf16": {"n": 1, "k": 256},
    "quant_linear_bf16": {"rows": 1, "n": 1, "k": 256, "ldo": 1},
    "quant_linear_q8_bf16": {"rows": 1, "n": 1, "k": 256, "ldo": 1},
    "quant_linear_q8_f32": {"rows": 1, "n": 1, "k": 256, "ldo": 1},
    "quant_gemm_f32": {"rows": 1, "n": 1, "k": 256, "ldo": 1},
    "quant_linear_amx_bf16": {"rows": 1, "n": 1, "k": 256, "ldo": 1},
}
_NO_ADDRESS_SPACE = 2**60  # bytes no allocation gets on a 64-bit machine
_Q4_1, _Q8_0, _Q4_K, _Q6_K = 3, 8, 12, 14


@pytest.fixture(scope="module")
def library() -> KernelLibrary:
    built = kernels.load()
    assert built is not None, "the kernels did not build (is a C compiler installed?)"
    return built


def _kernel(library: KernelLibrary, name: str) -> Callable[..., None]:
    if not library.has(name):
        pytest.skip(f"{name} is not in the {library.isa} build")
    return getattr(library, name)


def _pointers(name: str) -> dict[str, None]:
    """Every pointer parameter of `name` as NULL: a refusal must come before any is read."""
    params = {**kernels.PLAIN_SIGNATURES, **kernels.OPTIONAL_SIGNATURES}.get(name)
    if params is None:
        params = kernels.SIGNATURES[name.rsplit("_", 1)[0]]
    return {n: None for n, kind in params if kind is ctypes.c_void_p}


@pytest.mark.parametrize("name", sorted(_TYPED))
@pytest.mark.parametrize("type_id", [0, 1, 99, -1])  # F32, F16: GGML ids the kernels do not take
def test_an_unknown_type_id_is_a_bad_type_error(
    library: KernelLibrary, name: str, type_id: int
) -> None:
    """Each kernel that takes a GGML type id refuses one it does not know, before reading or
    writing anything (it used to leave `out` as it was, or divide by zero)."""
    kernel = _kernel(library, name)

    with pytest.raises(KernelError) as caught:
        kernel(**_pointers(name), type=type_id, **_TYPED[name])

    assert (name, KernelStatus.BAD_TYPE) == (caught.value.kernel, caught.value.status)
    assert str(caught.value).startswith(f"kernel {name}: unknown GGML type id")
    assert f"type={type_id}" in caught.value.reason


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        # K-quants: each 32's sum of x, for rows rows
        ("quant_linear_bf16", {"type": _Q4_K, "rows": _NO_ADDRESS_SPACE // 32, "k": 256}),
        # the other formats: a row of k weights per thread, inside the parallel region
        ("quant_linear_bf16", {"type": _Q8_0, "rows": 1, "k": _NO_ADDRESS_SPACE // 2}),
        ("quant_linear_q8_bf16", {"type": _Q4_K, "rows": _NO_ADDRESS_SPACE // 256, "k": 256}),
        ("quant_linear_amx_bf16", {"type": _Q8_0, "rows": 1, "k": _NO_ADDRESS_SPACE // 32}),
        # the call's one scratch allocation: x in 8 bits (rows * k bytes) and, a step of
        # that many rows, each thread's panels (rows * 512 bytes)
        ("quant_linear_q8_f32", {"type": _Q8_0, "rows": _NO_ADDRESS_SPACE // 256, "k": 256}),
        # the same without panels (n < 8: the row kernel alone)
        (
            "quant_linear_q8_f32",
            {"type": _Q4_K, "rows": _NO_ADDRESS_SPACE // 256, "k": 256, "n": 4},
        ),
        # x in tiles of 6 rows (rows * k floats; AVX-512 builds: int16, with scales and sums
        # per 32), and each thread's chunk of W
        ("quant_gemm_f32", {"type": _Q4_K, "rows": _NO_ADDRESS_SPACE // 1024, "k": 256}),
    ],
)
def test_an_allocation_that_fails_is_a_no_memory_error(
    library: KernelLibrary, name: str, arguments: dict[str, int]
) -> None:
    """A scratch buffer the kernel cannot allocate (sizes past any address space) is
    reported, the allocation named; nothing is computed from a NULL buffer."""
    kernel = _kernel(library, name)
    if name == "quant_linear_amx_bf16" and not library.amx_ready():
        pytest.skip("Linux does not lend this process the AMX tiles")

    with pytest.raises(KernelError) as caught:
        kernel(**{**_pointers(name), "n": 32, "ldo": 32, **arguments})

    assert (name, KernelStatus.NO_MEMORY) == (caught.value.kernel, caught.value.status)
    assert "alloc" in caught.value.reason


def test_the_amx_kernel_without_the_tiles_is_unavailable(library: KernelLibrary) -> None:
    """Where Linux does not lend the AMX tiles the AMX kernel refuses to run (it used to
    return with `out` untouched)."""
    kernel = _kernel(library, "quant_linear_amx_bf16")
    if library.amx_ready():
        pytest.skip("this process has the AMX tiles")

    with pytest.raises(KernelError) as caught:
        kernel(**_pointers("quant_linear_amx_bf16"), type=_Q8_0, rows=1, n=1, k=32, ldo=1)

    assert KernelStatus.UNAVAILABLE == caught.value.status


_ATTENTION = {
    "batch": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16,
    "max_blocks": 1, "num_slots": 16, "qkv_width": 512, "scale": 0.125,
}  # fmt: skip
_PREFILL = {
    "query_start": 0, "num_query": 1, "num_keys": 1, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "block_size": 16, "num_slots": 16, "qkv_width": 512, "scale": 0.125,
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "arguments", "check"),
    [
        ("add_rms_norm_f32", {"rows": 1, "width": 0, "eps": 1e-6}, "width > 0"),
        ("silu_mul_bf16", {"rows": -1, "width": 8}, "rows >= 0"),
        ("argmax_f32", {"rows": 1, "vocab": 0}, "vocab > 0"),
        (
            "rope_and_cache_f32",
            {"tokens": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 7, "num_slots": 4},
            "head_dim % 2 == 0",
        ),
        (
            "decode_attention_f32",
            {**_ATTENTION, "num_kv_heads": 3},
            "num_heads % num_kv_heads == 0",
        ),
        ("decode_attention_bf16", {**_ATTENTION, "num_kv_heads": 0}, "num_kv_heads > 0"),
        ("decode_attention_bf16", {**_ATTENTION, "block_size": 24}, "(block_size - 1)"),
        ("decode_attention_f32", {**_ATTENTION, "block_size": 512}, "MAX_BLOCK_SIZE"),
        ("prefill_attention_bf16", {**_PREFILL, "head_dim": 96}, "head_dim == 64"),
        ("prefill_attention_bf16", {**_PREFILL, "num_query": 2}, "num_query <= num_keys"),
        ("q4_linear_bf16", {"rows": 1, "n": 40, "k": 64}, "n % 16 == 0"),
        ("q4_build_panels_bf16", {"n": 16, "k": 40}, "k % Q4_GROUP == 0"),
        ("panel_linear_bf16", {"rows": 1, "n": 16, "k": 0}, "k > 0"),
        (
            "quant_linear_bf16",
            {"type": _Q4_K, "rows": 1, "n": 1, "k": 288, "ldo": 1},
            "k % quant_block_weights(type) == 0",
        ),
        ("gguf_dequantize_f32", {"type": _Q8_0, "n": 2, "k": 48}, "k % quant_block_weights"),
        ("quant_linear_q8_bf16", {"type": _Q8_0, "rows": 2, "n": 8, "k": 32, "ldo": 4}, "ldo >= n"),
        ("quant_linear_q8_f32", {"type": _Q4_K, "rows": 2, "n": 8, "k": 256, "ldo": 4}, "ldo >= n"),
        ("quant_linear_q8_f32", {"type": _Q8_0, "rows": 1, "n": 8, "k": 48, "ldo": 8}, "k % quant"),
        ("quant_gemm_f32", {"type": _Q4_1, "rows": 7, "n": 8, "k": 64, "ldo": 7}, "ldo >= n"),
        ("quant_gemm_f32", {"type": _Q6_K, "rows": 1, "n": 8, "k": 288, "ldo": 8}, "k % quant"),
        ("fault_drill", {"kind": 4, "thread": 0}, "kind"),
    ],
)
def test_an_unmet_precondition_is_a_bad_argument_error(
    library: KernelLibrary, name: str, arguments: dict[str, float], check: str
) -> None:
    """A size, head size or multiple the kernel does not take is refused before any pointer
    is read, with the check that failed as the C source states it."""
    kernel = _kernel(library, name)

    with pytest.raises(KernelError) as caught:
        kernel(**_pointers(name), **arguments)

    assert (name, KernelStatus.BAD_ARGUMENT) == (caught.value.kernel, caught.value.status)
    assert check in caught.value.reason
    assert str(caught.value).startswith(f"kernel {name}: {KernelStatus.BAD_ARGUMENT.reason}")


def test_no_rows_is_no_work_not_a_division_by_zero(library: KernelLibrary) -> None:
    """A step of 0 rows through the panels (whose tiles divide by their count) is a no-op."""
    _kernel(library, "panel_linear_bf16")(out=None, x=None, panels=None, rows=0, n=16, k=32)


@pytest.mark.parametrize("name", ["quant_linear_q8_f32", "quant_gemm_f32"])
def test_no_rows_through_the_float32_gguf_matmuls_is_no_work(
    library: KernelLibrary, name: str
) -> None:
    """A step of 0 rows, or a matrix of 0 rows, is a no-op: nothing allocated for it (an
    allocation of 0 bytes may be NULL), nothing read."""
    kernel = _kernel(library, name)
    for rows, n in ((0, 32), (3, 0)):
        kernel(out=None, x=None, w=None, type=_Q4_K, rows=rows, n=n, k=256, ldo=32)


def test_the_decoder_stack_reports_the_failure_of_a_kernel_it_calls(
    library: KernelLibrary,
) -> None:
    """A check that fails in a kernel the stack calls ends the stack's call with that
    kernel's status and check, under the stack's name."""
    kernel = _kernel(library, "decoder_stack_bf16")
    dims = dict.fromkeys(library.contract.stack_dims, 1) | {"hidden": 0}
    layers = torch.zeros(len(library.contract.stack_fields), dtype=torch.int64)
    tensors = {"layers": layers, "dims": torch.tensor(list(dims.values()))}

    with pytest.raises(KernelError) as caught:
        kernel(**_pointers("decoder_stack_bf16") | tensors, eps=1e-6, scale=0.125)

    assert ("decoder_stack_bf16", KernelStatus.BAD_ARGUMENT) == (
        caught.value.kernel,
        caught.value.status,
    )
    assert "width > 0" in caught.value.reason
