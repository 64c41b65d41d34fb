"""The compiled decoder stack (`decoder_stack_bf16`, one call for all of a 4-bit model's
layers) against the Python layer loop it replaces, on the default model's own 4-bit weights:
the same output, residual stream and KV cache contents to the bit, for decode, prefill,
chunked and mixed steps on either side of `INT4_MAX_ROWS` rows; and the models it does not
apply to keep the loop."""

from __future__ import annotations

import random

import pytest
import torch

from otel_engine.model.arch import load_model_arch
from otel_engine.model.checkpoint import Checkpoint
from otel_engine.model.fast_paths import BF16_ISA, Form, Path
from otel_engine.model.int4 import INT4_MAX_ROWS
from otel_engine.model.llama import LlamaModel
from otel_engine.model.loader import prepare_model_dir
from otel_engine.model.projections import O_PROJ
from otel_engine.model.registry import load_model
from tests.helpers.isa import require_isa
from tests.helpers.paged import step_metadata
from tests.helpers.tiny_model import write_tiny_gguf, write_tiny_llama

pytestmark = pytest.mark.slow  # loads the default model

BLOCK_SIZE = 16
NUM_BLOCKS = 160
# (query_lens, seq_lens): decodes first, then prefill chunks
BATCHES = {
    "decode": ([1, 1, 1], [17, 33, 5]),
    "decode 32": ([1] * 32, [3 + 3 * i for i in range(32)]),  # past INT4_MAX_ROWS rows
    "prefill": ([7], [7]),
    "chunk": ([40], [70]),  # a later chunk: keys from the cache
    "mixed": ([1, 1, 6, 8], [16, 40, 6, 30]),
    "mixed large": ([1] * 5 + [25, 3], [30, 2, 300, 16, 65, 25, 90]),
}


def _load(model_dir: str) -> LlamaModel:
    require_isa(BF16_ISA)
    model = load_model(
        model_dir, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=1024
    )
    plan = model.fast_paths
    assert plan.is_on(Path.DECODER_STACK), plan.choices[Path.DECODER_STACK]
    return model


@pytest.fixture(scope="module", params=["default", "wide heads"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    """The default model with its own 4-bit weights; and a tiny Llama written as a GGUF file
    of Q4_1 matrices, whose 4 heads of 64 are wider than its hidden size of 128 (o_proj's
    input is wider than the residual stream)."""
    if request.param == "default":
        return _load(prepare_model_dir(None))
    path = tmp_path_factory.mktemp("tiny-llama-wide-heads")
    model_dir = write_tiny_llama(
        path, hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=160, context=1024
    )
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    gguf = write_tiny_gguf(
        model_dir, path / "model.gguf", "llama", dict.fromkeys(projections, "Q4_1")
    )
    return _load(prepare_model_dir(gguf))


def _step(model: LlamaModel, batch: str) -> tuple[torch.Tensor, dict[str, object]]:
    query_lens, seq_lens = BATCHES[batch]
    metadata = step_metadata(query_lens, seq_lens, BLOCK_SIZE, NUM_BLOCKS, batch)
    rng = random.Random(batch)
    ids = torch.tensor([rng.randrange(model.arch.vocab_size) for _ in metadata["positions"]])
    return ids, metadata


def _caches(model: LlamaModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cached keys and values of the earlier tokens: random, the same for both runs."""
    generator = torch.Generator().manual_seed(0)
    shape = (model.num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, model.head_dim)
    return [
        tuple(torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(2))  # type: ignore[misc]
        for _ in model.layers
    ]


@pytest.mark.parametrize("batch", list(BATCHES))
def test_stack_gives_the_layer_loop_s_bits(model: LlamaModel, batch: str) -> None:
    ids, metadata = _step(model, batch)
    results = []
    for use_stack in (True, False):
        caches = _caches(model)
        model._stack = None
        if not use_stack:
            model._decoder_stack = lambda kv_caches: None  # type: ignore[method-assign]
        try:
            hidden = model.forward(ids, caches, model.ops.build_metadata(**metadata))
            if use_stack:
                assert model._stack is not None  # it ran
        finally:
            model.__dict__.pop("_decoder_stack", None)
        results.append((hidden, caches))

    (stacked, stack_caches), (looped, loop_caches) = results
    assert (ids.numel() > INT4_MAX_ROWS) == (batch in ("decode 32", "chunk", "mixed large"))
    assert torch.isfinite(stacked.float()).all()
    assert torch.equal(stacked, looped)
    for (k1, v1), (k2, v2) in zip(stack_caches, loop_caches, strict=True):
        assert torch.equal(k1, k2)
        assert torch.equal(v1, v2)


def test_the_stack_applies_only_to_a_4bit_model_on_one_rank(model: LlamaModel) -> None:
    """The plan runs the stack where every layer's four matrices are in 4 bits on one rank
    (decided from the checkpoint's metadata); it is then built once per set of caches."""
    assert model.fast_paths.is_on(Path.DECODER_STACK)
    caches = _caches(model)
    model._stack = None
    assert model._decoder_stack(caches) is not None
    assert model._decoder_stack(caches) is model._decoder_stack(caches)  # built once
    other = _caches(model)
    assert model._decoder_stack(other) is not None
    assert model._stack is not None
    assert model._stack.kv_caches is other  # rebuilt for them


def test_a_layer_not_all_in_4_bits_keeps_the_loop() -> None:
    """One matrix stored otherwise (here: dense) and the plan keeps the layer loop."""
    require_isa(BF16_ISA)
    model_dir = prepare_model_dir(None)
    checkpoint = Checkpoint.read(model_dir)
    blocks = dict(checkpoint.blocks)
    del blocks["model.layers.29.self_attn.o_proj.weight"]
    arch = load_model_arch(model_dir)
    options = {"dtype": torch.bfloat16, "device": torch.device("cpu")}
    model = LlamaModel(arch, checkpoint=Checkpoint(blocks), **options)  # type: ignore[arg-type]
    choice = model.fast_paths.choices[Path.DECODER_STACK]
    assert not choice.enabled
    assert "layer 29 is not all 4-bit" == choice.reason
    assert model.fast_paths.forms[29][O_PROJ] is Form.PACKED
