"""The compiled CPU kernels (`KernelOps`) against the torch ops they replace (`TorchOps`):
the same results within rounding, in float32 and bfloat16, for decode, prefill and mixed
batches, block boundaries, odd sizes (masked vector tails) and every group size; each for
this CPU's build and for the builds of the levels below it that a user's CPU may select
(AVX-512 without BF16, AVX2, baseline x86-64: the loops without AVX-512 BF16, or without
AVX-512 at all)."""

from __future__ import annotations

import functools

import pytest
import torch

from otel_engine.config import EngineConfig
from otel_engine.engine.batch import prepare_model_input
from otel_engine.executor.model_runner import ModelRunner
from otel_engine.model import kernels
from otel_engine.model.fast_paths import PREFILL_KERNEL_HEAD_DIMS, FastPaths, Form, Path
from otel_engine.model.kernels import KernelLibrary
from otel_engine.model.layer_ops import KernelOps, TorchOps
from otel_engine.model.layers import RotaryEmbedding
from otel_engine.model.projections import QKV
from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk
from tests.helpers.isa import require_isa
from tests.helpers.paged import step_metadata

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
CPU = torch.device("cpu")
# This CPU's build, then the levels a user's CPU may have below CI's AVX-512 BF16.
BUILDS = ("native", "avx512", "avx2", "baseline")


@pytest.fixture(scope="module", params=BUILDS)
def library(request: pytest.FixtureRequest) -> KernelLibrary:
    """The kernels build for this CPU ("native"), or for a lower level that it also runs."""
    if request.param == "native":
        library = kernels.load()
        level = kernels.target_isa()
    else:
        level = request.param
        require_isa(level)
        library = kernels.load(level)
    assert library is not None, "the kernels did not build (is a C compiler installed?)"
    assert library.isa == level
    return library


def test_each_build_is_for_the_level_asked(library: KernelLibrary) -> None:
    """The library's own tag and contract name the level it was asked for, and it has the
    optional functions of its level and those below (`kernels.OPTIONAL_FROM`), no others
    (elsewhere the callers fall back)."""
    assert kernels.build_tag(library.path) == (kernels.ABI_VERSION, library.isa)
    assert library.contract.isa == library.isa
    level = kernels.ISA_LEVELS.index(library.isa)
    for name in kernels.OPTIONAL_SIGNATURES:
        expected = level >= kernels.ISA_LEVELS.index(kernels.OPTIONAL_FROM[name])
        assert expected == library.has(name), name


@functools.cache
def _rotary(head_dim: int, dtype: torch.dtype) -> RotaryEmbedding:
    """The cos/sin tables (read only), made once: every build's tests share them."""
    return RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype, CPU)


def both(
    library: KernelLibrary, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> tuple[TorchOps, KernelOps]:
    rotary = _rotary(head_dim, dtype)
    return (
        TorchOps(heads, kv_heads, head_dim, rotary, CPU),
        KernelOps(kernels_plan(library, dtype, head_dim), heads, kv_heads, head_dim, rotary, dtype),
    )


def kernels_plan(
    library: KernelLibrary, dtype: torch.dtype, head_dim: int, max_query: int | None = None
) -> FastPaths:
    """A plan that runs `library`'s layer kernels, its prefill attention where it applies
    (chunks of at most `max_query` tokens), and no decoder stack."""
    plan = FastPaths(cpu_isa=library.isa, kernel_isa=library.isa, library=library)
    plan.prefill_kernel_max_query = max_query
    plan.decide(Path.COMPILED_KERNELS, True, "the build under test")
    prefill = (
        library.has("prefill_attention_bf16")
        and dtype == torch.bfloat16
        and head_dim in PREFILL_KERNEL_HEAD_DIMS
    )
    plan.decide(Path.PREFILL_KERNEL, prefill, "where it applies")
    plan.decide(Path.DECODER_STACK, False, "layer ops alone")
    return plan


def assert_close(expected: torch.Tensor, actual: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, expected.float().abs().max().item())
    assert (expected.float() - actual.float()).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (5, 100), (33, 64)])
@pytest.mark.parametrize("has_delta", [True, False])
def test_add_rms_norm_matches(
    library: KernelLibrary, dtype: torch.dtype, rows: int, width: int, has_delta: bool
) -> None:
    """Residual add (in place) and RMSNorm: the same stream and the same normed rows."""
    torch_ops, kernel_ops = both(library, dtype, 4, 2, 16)
    hidden = torch.randn(rows, width).to(dtype) * 3
    delta = torch.randn(rows, width).to(dtype) if has_delta else None
    weight = torch.randn(width).to(dtype)
    expected_hidden, actual_hidden = hidden.clone(), hidden.clone()

    expected = torch_ops.add_rms_norm(expected_hidden, delta, weight, 1e-5)
    actual = kernel_ops.add_rms_norm(actual_hidden, delta, weight, 1e-5)

    assert torch.equal(expected_hidden, actual_hidden)
    assert_close(expected, actual, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (7, 40), (20, 128)])
def test_silu_mul_matches(
    library: KernelLibrary, dtype: torch.dtype, rows: int, width: int
) -> None:
    """SiLU of the gate half times the up half, large and negative gates included."""
    torch_ops, kernel_ops = both(library, dtype, 4, 2, 16)
    gate_up = (torch.randn(rows, 2 * width) * 8).to(dtype)

    assert_close(torch_ops.silu_mul(gate_up), kernel_ops.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (32, 49152), (4, 33), (3, 1)])
def test_argmax_is_torch_s_max_index(
    library: KernelLibrary, dtype: torch.dtype, rows: int, vocab: int
) -> None:
    """Greedy tokens from the compiled argmax: torch's max(dim=-1) index exactly, with a tie
    (the first wins), a row of -inf (0) and a row with a NaN (the NaN's index)."""
    _, kernel_ops = both(library, dtype, 4, 2, 16)
    logits = torch.randn(rows, vocab).to(dtype)
    if vocab > 2:
        logits[0, 3] = logits[0].max() + 1
        logits[0, vocab - 1] = logits[0, 3]
    if rows > 1:
        logits[1] = float("-inf")
    if rows > 2:
        logits[2, vocab // 2] = float("nan")
    out = torch.empty(rows, dtype=torch.int64)
    assert kernel_ops.argmax is not None
    kernel_ops.argmax(out=out, logits=logits, rows=rows, vocab=vocab)

    assert torch.equal(out, logits.float().max(dim=-1).indices)


BATCHES = {
    "decode": ([1, 1, 1], [17, 33, 5]),  # one token each, lengths across block boundaries
    "prefill": ([7], [7]),  # a fresh prompt
    "chunk": ([5], [21]),  # a later chunk of a long prompt (keys from the cache)
    "mixed": ([1, 1, 6, 9], [16, 40, 6, 30]),  # decodes first, then prefill chunks
    "full": ([1], [64]),  # a sequence at the cache's capacity for it (max_model_len)
    "long": ([70], [70]),  # a prompt over several of the prefill kernel's 32-key tiles
    "long chunk": ([37], [101]),  # a later chunk whose keys span four tiles
    "long decode": ([1, 1, 1], [256, 300, 515]),  # over the decode kernel's 256-key passes
}


# (activations, cache): each model dtype over its own cache, and float32 over float16 (the
# cache of a half-precision checkpoint run in float32)
CACHE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
]


@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHE_DTYPES)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (4, 2, 16, 4),
        (9, 3, 64, 16),
        (4, 4, 32, 8),
        (8, 1, 64, 16),
        (6, 2, 40, 4),
        (4, 2, 64, 1),
        (16, 2, 128, 16),  # Qwen2.5-3B's group of 8 at head size 128
        (6, 2, 128, 1),
        (18, 2, 128, 16),  # a group of 9: past the specialised kernels
    ],
)
def test_attend_matches(
    library: KernelLibrary,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    batch: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """Rotary, the cache writes and attention over scattered blocks: the same output, and
    the same cache contents; a float16 cache rounded alike by both."""
    query_lens, seq_lens = BATCHES[batch]
    torch_ops, kernel_ops = both(library, dtype, heads, kv_heads, head_dim)
    num_blocks = max(96, 2 * sum(-(-n // block_size) for n in seq_lens))
    seed = len(query_lens) * head_dim + block_size
    metadata = step_metadata(query_lens, seq_lens, block_size, num_blocks, seed)
    positions = metadata["positions"]
    cache_shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(cache_shape).to(cache_dtype)
    v_cache = torch.randn(cache_shape).to(cache_dtype)
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim).to(dtype)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]

    expected = torch_ops.attend(qkv.clone(), *caches[0], torch_ops.build_metadata(**metadata))
    actual = kernel_ops.attend(qkv.clone(), *caches[1], kernel_ops.build_metadata(**metadata))

    if cache_dtype == torch.float16:  # a key the two paths rounded a step apart moves the
        # scores that read it by up to 2^-11 of their size, beyond float32's own rounding
        scale = max(1.0, expected.abs().max().item())
        assert (expected - actual).abs().max().item() <= 2e-4 * scale
    else:
        assert_close(expected, actual, dtype)
    for written_by_torch, written_by_kernel in zip(caches[0], caches[1], strict=True):
        if cache_dtype == torch.float16:  # the two float32 rotations' roundings differ at
            # most where they straddle a half-precision step: one unit in the last place
            torch.testing.assert_close(
                written_by_kernel.float(), written_by_torch.float(), rtol=2**-10, atol=2**-24
            )
        else:
            assert_close(written_by_torch, written_by_kernel, dtype)


def test_a_float16_cache_holds_each_value_as_torch_rounds_it(library: KernelLibrary) -> None:
    """A float32 model's values (never rotated) written to a float16 cache are torch's
    float32 -> float16 conversion bit for bit, at every build: ties to even, subnormals and
    what rounds into or out of them, 65504 and the first value rounded to infinity, signed
    zeros, infinities and NaN, and random values over 13 orders of magnitude."""
    heads, kv_heads, head_dim = 2, 1, 16
    special = [1 + 2**-11, 1 + 3 * 2**-11, 2**-24, 2**-25, 3 * 2**-25, 2**-14 - 2**-26]
    special += [65504.0, 65519.0, 65520.0, 1e6, -0.0, 0.0, float("inf"), float("-inf")]
    special += [float("nan"), 1e-30, -(2**-24) * 0.75, 2**-14 * (1 - 2**-11)]
    generator = torch.Generator().manual_seed(16)
    magnitudes = 10.0 ** torch.randint(-8, 5, (110,), generator=generator).float()
    values = torch.cat([torch.tensor(special), torch.randn(110, generator=generator) * magnitudes])
    tokens = values.numel() // head_dim
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    qkv[:, (heads + kv_heads) * head_dim :] = values.view(tokens, head_dim)
    num_slots = 2 * tokens
    k_cache, v_cache = (
        torch.zeros(kv_heads, num_slots, head_dim, dtype=torch.float16) for _ in "kv"
    )
    library.rope_and_cache_f32_f16(
        qkv=qkv,
        cos_sin=torch.cat([torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)], dim=1),
        positions=torch.zeros(tokens, dtype=torch.int64),
        slots=torch.arange(1, 2 * tokens, 2),
        k_cache=k_cache,
        v_cache=v_cache,
        tokens=tokens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_slots=num_slots,
    )
    written, expected = v_cache[0, 1::2].flatten(), values.to(torch.float16)
    nan = expected.isnan()
    assert torch.equal(nan, written.isnan())
    assert torch.equal(expected[~nan].view(torch.int16), written[~nan].view(torch.int16))
    assert not v_cache[0, 0::2].any()  # only the slots given were written


@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHE_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (8, 2, 128)])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_attention_never_reads_past_the_sequence(
    library: KernelLibrary,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    step: str,
) -> None:
    """Cache slots past a sequence's length (the rest of its last block) may hold anything, a
    NaN included: attention gives the same finite output as with zeros there, for odd and
    even lengths (the bfloat16 kernels take value rows two at a time), in decode steps and
    in prefill chunks (fresh prompts and a later chunk)."""
    _, kernel_ops = both(library, dtype, heads, kv_heads, head_dim)
    block_size, seq_lens = 16, [1, 2, 5, 16, 17, 30, 33]
    query_lens = [1] * len(seq_lens) if step == "decode" else [1, 2, 5, 16, 17, 3, 33]
    tables = [[2 * i, 2 * i + 1, 2 * i + 14] for i in range(len(seq_lens))]
    shape = (kv_heads, 2 * len(seq_lens) + 14, block_size, head_dim)
    positions = [p for q, n in zip(query_lens, seq_lens, strict=True) for p in range(n - q, n)]
    rows = [i for i, q in enumerate(query_lens) for _ in range(q)]
    metadata = kernel_ops.build_metadata(
        positions=positions,
        slot_mapping=[
            tables[i][p // block_size] * block_size + p % block_size
            for i, p in zip(rows, positions, strict=True)
        ],
        num_decodes=sum(1 for q in query_lens if q == 1),
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        block_size=block_size,
    )
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim).to(dtype)
    valid = torch.zeros(shape[1] * block_size, dtype=torch.bool)
    for table, n in zip(tables, seq_lens, strict=True):
        for p in range(n):
            valid[table[p // block_size] * block_size + p % block_size] = True
    contents = [torch.randn(shape).to(cache_dtype) for _ in range(2)]
    outputs = []
    for filler in (0.0, float("nan")):
        k_cache, v_cache = (c.clone() for c in contents)
        for cache in (k_cache, v_cache):
            cache.view(kv_heads, -1, head_dim)[:, ~valid] = filler
        outputs.append(kernel_ops.attend(qkv.clone(), k_cache, v_cache, metadata))
    assert bool(outputs[1].isfinite().all())
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_masks_only_where_attention_reads_them(
    library: KernelLibrary, dtype: torch.dtype
) -> None:
    """A later prefill chunk (keys from the cache) needs a mask on torch's fused attention;
    the compiled prefill attention (bfloat16, head size 64) applies causality itself, so
    none is built for it (a [queries, keys] tensor per chunk, every step)."""
    _, kernel_ops = both(library, dtype, 9, 3, 64)
    meta = kernel_ops.build_metadata(
        positions=list(range(16, 21)),
        slot_mapping=list(range(16, 21)),
        num_decodes=0,
        query_lens=[5],
        seq_lens=[21],
        block_tables=[[0, 1]],
        block_size=16,
    )
    uses_kernel = dtype == torch.bfloat16 and library.has("prefill_attention_bf16")
    assert (meta.prefills[0].mask is None) == uses_kernel
    assert (meta.prefill_tables is not None) == uses_kernel


@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunks_over_the_kernel_s_limit_run_in_torch_s_fused_attention(
    library: KernelLibrary, head_dim: int
) -> None:
    """With a longest chunk for the prefill kernel (set where torch's attention is faster on
    long ones: AMX), a step whose chunks all fit runs in the kernel, one with a longer chunk
    runs every chunk in torch's fused attention (masks built, no kernel tables); both give
    torch ops' output within bfloat16's rounding."""
    if not library.has("prefill_attention_bf16"):
        pytest.skip("no bfloat16 prefill kernel in this build")
    dtype, heads, kv_heads, block_size = torch.bfloat16, 8, 2, 16
    rotary = _rotary(head_dim, dtype)
    torch_ops = TorchOps(heads, kv_heads, head_dim, rotary, CPU)
    plan = kernels_plan(library, dtype, head_dim, max_query=8)
    kernel_ops = KernelOps(plan, heads, kv_heads, head_dim, rotary, dtype)
    steps = [([1, 8, 3], [20, 30, 3], True), ([1, 9, 3], [20, 30, 3], False)]
    for query_lens, seq_lens, in_kernel in steps:
        metadata = step_metadata(query_lens, seq_lens, block_size, 32, head_dim)
        shape = (kv_heads, 32, block_size, head_dim)
        k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        qkv = torch.randn(sum(query_lens), (heads + 2 * kv_heads) * head_dim).to(dtype)
        meta = kernel_ops.build_metadata(**metadata)
        expected = torch_ops.attend(
            qkv.clone(), k_cache.clone(), v_cache.clone(), torch_ops.build_metadata(**metadata)
        )

        actual = kernel_ops.attend(qkv.clone(), k_cache.clone(), v_cache.clone(), meta)

        assert (meta.prefill_tables is not None) == in_kernel
        assert (meta.prefills[0].mask is None) == in_kernel  # the later chunk's, for torch
        assert_close(expected, actual, dtype)


def _runner(model_dir: str, dtype: str, kernels_choice: str) -> ModelRunner:
    config = EngineConfig.from_kwargs(
        model=model_dir,
        dtype=dtype,
        kernels=kernels_choice,
        block_size=4,
        num_kv_blocks=64,
        multiprocess=False,
    )
    return ModelRunner(config, model_dir)


def _step_logits(runner: ModelRunner, step_id: int, chunks: list[ScheduledChunk]) -> torch.Tensor:
    step = prepare_model_input(step_id, chunks, 4)
    input_ids, meta = runner.forward_inputs(step)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model.forward(input_ids, runner.kv_caches, meta))


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 0.04)])
def test_model_logits_agree_between_the_paths(
    tiny_model_dir: str, tiny_prompts: list[list[int]], dtype: str, tolerance: float
) -> None:
    """The whole model on the kernels and on torch ops: prefill, then decodes mixed with a
    new prefill, crossing block boundaries; logits agree within `tolerance` of the largest
    logit (bfloat16: both paths round at every op, at different places) and the greedy
    tokens are the same."""
    runners = [_runner(tiny_model_dir, dtype, choice) for choice in ("auto", "torch")]
    # packed where oneDNN has a path for the dtype (bfloat16: not on AVX2)
    packed = runners[0].model.fast_paths.is_on(Path.ONEDNN_PACKING)
    assert (Form.PACKED if packed else Form.DENSE) is runners[0].model.layers[0].matrices[QKV].form
    assert Form.DENSE is runners[1].model.layers[0].matrices[QKV].form
    a, b, c = (list(p) for p in tiny_prompts[2:5])  # 8, 13 and 21 tokens
    blocks = {"a": list(range(10)), "b": list(range(10, 20)), "c": list(range(20, 30))}
    requests = {
        name: Request(name, ids, SamplingParams(temperature=0.0))
        for name, ids in (("a", a), ("b", b), ("c", c))
    }
    for name, request in requests.items():
        request.block_ids = blocks[name]
    steps = [
        [ScheduledChunk(requests["a"], 0, len(a)), ScheduledChunk(requests["b"], 0, len(b))],
        [
            ScheduledChunk(requests["a"], len(a), 1),
            ScheduledChunk(requests["b"], len(b), 1),
            ScheduledChunk(requests["c"], 0, len(c)),
        ],
        [ScheduledChunk(requests[n], len(requests[n].prompt_token_ids) + 1, 1) for n in "abc"],
    ]
    for step_id, chunks in enumerate(steps, start=1):
        for chunk in chunks:  # the next token of each sequence is its last greedy pick
            while chunk.request.num_tokens < chunk.start + chunk.num_tokens:
                chunk.request.output_token_ids.append(7 + step_id)
        fast, reference = (_step_logits(r, step_id, chunks) for r in runners)
        scale = reference.abs().max().item()
        assert (fast - reference).abs().max().item() <= tolerance * scale
        ends = [sum(c.num_tokens for c in chunks[: i + 1]) - 1 for i in range(len(chunks))]
        assert reference[ends].argmax(-1).tolist() == fast[ends].argmax(-1).tolist()
