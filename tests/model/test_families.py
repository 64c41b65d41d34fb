"""Model families beyond Llama (Qwen3, Phi-3, Mixtral, Qwen3-MoE): tiny random checkpoints
written from the real transformers config classes; greedy output equals transformers' token
for token with chunked prefill and preemption forced, at TP=1 and TP=2; what is specific to
each family (LongRoPE tables, expert routing, sliding windows, limits in the config log)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from otel_engine import LLM, SamplingParams
from otel_engine.config import EngineConfig
from otel_engine.engine.core_client import InprocClient
from otel_engine.model.arch import load_model_arch
from otel_engine.model.families import SUPPORTED_ARCHITECTURES
from otel_engine.model.layers import RotaryEmbedding
from otel_engine.model.moe import MoeWeights, moe_forward, moe_forward_dense
from otel_engine.observability.crash_dump import engine_config_part
from tests.helpers.tiny_model import (
    FAMILY_CONFIGS,
    hf_greedy,
    write_tiny_family,
    write_tiny_gguf,
)

FAMILIES = sorted(FAMILY_CONFIGS)
MAX_TOKENS = 12
# One request fits the cache, the batch does not; prompts are longer than the step budget.
SMALL_CACHE: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 24}
# What a GGUF file cannot say: Qwen3-MoE's dense layers, and Gemma 3's attention scale (llama.cpp
# derives it from the model size) and final logit soft cap (llama.cpp has none for Gemma 3).
GGUF_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"mlp_only_layers": []},
    "gemma3": {"query_pre_attn_scalar": 32, "final_logit_softcapping": None},
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_prompts: list[list[int]],
) -> tuple[str, list[list[int]]]:
    """A family's tiny checkpoint and transformers' greedy tokens for the test prompts."""
    model_dir = write_tiny_family(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
    return model_dir, hf_greedy(model_dir, tiny_prompts, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers_with_chunks_and_preemption(
    family_model: tuple[str, list[list[int]]], tp: int, tiny_prompts: list[list[int]]
) -> None:
    model_dir, expected = family_model
    with LLM(model_dir, dtype="float32", tensor_parallel_size=tp, **SMALL_CACHE) as llm:
        outputs = llm.generate(tiny_prompts, GREEDY)
        client = llm._frontend.client
        assert isinstance(client, InprocClient)
        assert client.core.scheduler.num_preemptions > 0

    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_architecture_and_family_limits_are_in_the_config_dump(tmp_path: Path) -> None:
    arch = load_model_arch(write_tiny_family(tmp_path, "qwen3_moe"))
    part = engine_config_part(EngineConfig.from_kwargs(model="x"), arch)

    assert part["architecture"] == "Qwen3MoeForCausalLM"
    assert part["family"] == "qwen3_moe"
    assert (part["num_experts"], part["num_experts_per_tok"]) == (4, 2)
    assert part["sliding_window"] is None
    assert arch.qk_norm
    assert arch.dense_layers == (1,)


def test_a_sliding_window_caps_the_context(tmp_path: Path) -> None:
    """Attention here sees the whole context, which is what a sliding-window model computes
    within its window: the context stops there, so outputs stay exact."""
    from otel_engine.model.limits import resolve_limits

    model_dir = write_tiny_family(tmp_path, "phi3", sliding_window=100)
    arch = load_model_arch(model_dir)
    limits = resolve_limits(EngineConfig.from_kwargs(model=model_dir, num_kv_blocks=64), arch)

    assert arch.sliding_window == 100
    assert (100, "sliding_window") == (limits.max_model_len, limits.limited_by)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"num_kv_blocks": 4096}, (512, "model")),
        ({"num_kv_blocks": 4096, "max_model_len": 300}, (300, "max_model_len")),
        ({"num_kv_blocks": 8}, (8 * 16, "kv_cache")),
        ({"kv_cache_memory_gib": 2**-16}, None),
    ],
)
def test_the_context_says_what_sets_it(
    tiny_model_dir: str, options: dict[str, float], expected: tuple[int, str] | None
) -> None:
    """Issue 24: the smallest of the model's context, the flag and the KV cache; when the
    KV cache sets it, the 400's words say so and name the flags that raise it."""
    from otel_engine.engine.validation import check_context
    from otel_engine.errors import RequestError
    from otel_engine.model.limits import resolve_limits

    arch = load_model_arch(tiny_model_dir)
    limits = resolve_limits(EngineConfig.from_kwargs(model=tiny_model_dir, **options), arch)
    if expected is None:  # a budget of 16 KiB: the block count, not the model, decides
        assert "kv_cache" == limits.limited_by
        assert limits.max_model_len == limits.num_kv_blocks * 16 < arch.max_position_embeddings
        return
    assert expected == (limits.max_model_len, limits.limited_by)
    with pytest.raises(RequestError) as raised:
        check_context(10, limits.max_model_len, limits.max_model_len, limits.limited_by)
    assert "context_length_exceeded" == raised.value.code
    if limits.limited_by == "kv_cache":
        assert "this server's maximum context length is 128 tokens" in raised.value.message
        assert "--kv-cache-memory-gib or --num-kv-blocks" in raised.value.message
    else:
        assert f"maximum context length is {expected[0]} tokens" in raised.value.message


@pytest.mark.slow
def test_partial_rotary_equals_transformers(tmp_path: Path, tiny_prompts: list[list[int]]) -> None:
    """Phi-4-mini rotates 3/4 of each head: here half, the rest passing through unrotated
    (on the torch ops: the compiled kernels rotate whole heads)."""
    model_dir = write_tiny_family(tmp_path, "phi3", partial_rotary_factor=0.5)
    assert load_model_arch(model_dir).partial_rotary_factor == 0.5
    prompts = tiny_prompts[:4]
    with LLM(model_dir, dtype="float32") as llm:
        outputs = llm.generate(prompts, GREEDY)

    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(
        model_dir, prompts, MAX_TOKENS
    )


def test_longrope_tables_equal_transformers_on_both_sides_of_the_original_context() -> None:
    """Phi-3 LongRoPE: positions inside the original context use the short factors, beyond
    it the long ones, cos/sin scaled by the attention factor, as transformers computes them
    for a sequence within (short) and past (long) the original context."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    head_dim, original, longest = 16, 64, 256
    short = [1.0 + 0.1 * i for i in range(head_dim // 2)]
    long = [2.0 + 0.5 * i for i in range(head_dim // 2)]
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long}
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=longest,
        original_max_position_embeddings=original,
        rope_scaling=dict(scaling),
    )
    hf = Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(
        head_dim,
        longest,
        10000.0,
        {
            **scaling,
            "original_max_position_embeddings": original,
            "max_position_embeddings": longest,
        },
        torch.float32,
        torch.device("cpu"),
    )
    x = torch.zeros(1, 1, head_dim)
    for length in (original, longest):  # transformers switches factors by sequence length
        positions = torch.arange(length).unsqueeze(0)
        cos, sin = hf(x, positions)
        rows = slice(0, original) if length == original else slice(original, longest)
        torch.testing.assert_close(ours.cos[rows], cos[0, rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.sin[rows], sin[0, rows], rtol=1e-5, atol=1e-5)
    factor = math.sqrt(1 + math.log(longest / original) / math.log(original))
    assert math.isclose(float(ours.cos[0, 0]), factor, rel_tol=1e-6)  # cos(0), scaled


def test_grouped_experts_equal_the_dense_loop() -> None:
    """Each expert runs only on its tokens, and the result is the dense loop's (every expert
    on every token, weighted by 0 where not chosen)."""
    generator = torch.Generator().manual_seed(0)
    experts, hidden, inner = 6, 32, 16
    moe = MoeWeights(
        router=torch.randn(experts, hidden, generator=generator),
        gate_up=torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.2,
        down=torch.randn(experts, hidden, inner, generator=generator) * 0.2,
        top_k=2,
        normalize=False,
    )

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    x = torch.randn(37, hidden, generator=generator)
    torch.testing.assert_close(
        moe_forward(x, moe, silu_mul), moe_forward_dense(x, moe, silu_mul), rtol=1e-5, atol=1e-5
    )


def test_an_unsupported_architecture_fails_at_startup_listing_the_supported(
    tmp_path: Path,
) -> None:
    """Falcon is not implemented: starting an engine on it fails in under 2 s, before any
    process starts, with every supported architecture named."""
    import json
    import time

    model_dir = write_tiny_family(tmp_path, "qwen3")
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["FalconForCausalLM"]
    config_path.write_text(json.dumps(config))

    started = time.monotonic()
    with pytest.raises(ValueError, match="FalconForCausalLM") as raised:
        LLM(model_dir)

    assert time.monotonic() - started < 2.0
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_gemma_logprobs_equal_transformers_across_the_sliding_window(
    tmp_path: Path, tiny_prompts: list[list[int]], family: str
) -> None:
    """A 200-token prompt, 12 times the window: every position's log-probabilities (the
    logits up to a constant) agree with transformers' within 1e-4 in float32, on the
    sliding layers (which must not see past the window) and the full ones; for Gemma 2
    with attention soft-capping, at a cap that changes every layer's scores."""
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny_family(tmp_path, family)
    prompt = [t for p in tiny_prompts for t in p][:200]
    with LLM(model_dir, dtype="float32", max_num_batched_tokens=64) as llm:  # chunked too
        [output] = llm.generate(
            [prompt], SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0.0)
        )
    # transformers' SDPA path refuses a soft cap; its eager path applies it
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.inference_mode():
        reference = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0], -1)
        if family == "gemma2":
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
            uncapped = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0], -1)
            assert (uncapped - reference).abs().max() > 0.01  # the cap matters here

    assert output.prompt_logprobs is not None
    assert len(output.prompt_logprobs) == len(prompt) - 1
    for position, entry in enumerate(output.prompt_logprobs):
        expected = reference[position]
        assert abs(entry.logprob - float(expected[prompt[position + 1]])) < 1e-4
        top = expected.topk(5).values.tolist()
        assert max(abs(a - b) for a, b in zip(entry.top_logprobs, top, strict=True)) < 1e-4


@pytest.mark.parametrize("kind", ["gemma2", "qwen2moe"])
def test_gguf_of_another_kind_fails_naming_it(tmp_path: Path, kind: str) -> None:
    """The GGUF converter reads `llama` (Mixtral too), `qwen2`, `qwen3`, `qwen3moe`, `phi3`
    and `gemma3` files; another kind fails at once with its name and the supported ones."""
    import gguf
    import numpy as np

    from otel_engine.model.loader import prepare_model_dir

    path = tmp_path / f"tiny-{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), arch=kind)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ValueError, match=rf"GGUF architecture '{kind}' is not supported.*llama"):
        prepare_model_dir(str(path))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "kind", "architecture"),
    [
        ("qwen3", "qwen3", "Qwen3ForCausalLM"),
        ("phi3", "phi3", "Phi3ForCausalLM"),
        ("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM"),
        ("mixtral", "llama", "MixtralForCausalLM"),  # llama.cpp writes Mixtral as llama
        ("gemma3", "gemma3", "Gemma3ForCausalLM"),
    ],
)
def test_a_gguf_converts_to_a_checkpoint_that_runs_like_transformers(
    tmp_path: Path, tiny_prompts: list[list[int]], family: str, kind: str, architecture: str
) -> None:
    """Qwen3 (q/k norms, head_dim 32 != hidden / heads), Phi-3 (fused qkv and gate/up), the
    mixtures of experts (3-D expert tensors split per expert; Mixtral's q/k rows in
    llama.cpp's order) and Gemma 3 (norms stored as 1 + w, renamed, sliding layers and the
    full layers' linear RoPE scaling from the file's keys) become checkpoints of their
    family: the engine's greedy tokens on the .gguf equal transformers' on the converted
    directory."""
    from safetensors.torch import load_file

    from otel_engine.model.loader import prepare_model_dir

    overrides: dict[str, Any] = GGUF_OVERRIDES.get(family, {})
    model_dir = write_tiny_family(tmp_path / "hf", family, **overrides)
    path = write_tiny_gguf(model_dir, tmp_path / f"tiny-{family}.gguf", kind)
    converted = prepare_model_dir(path)
    arch = load_model_arch(converted)
    prompts = tiny_prompts[:4]
    with LLM(path, dtype="float32") as llm:
        outputs = llm.generate(prompts, GREEDY)

    assert (arch.architecture, arch.head_dim) == (architecture, load_model_arch(model_dir).head_dim)
    assert arch.qk_norm == family.startswith(("qwen3", "gemma3"))
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(
        converted, prompts, MAX_TOKENS
    )
    original = load_file(f"{model_dir}/model.safetensors")
    for name, tensor in load_file(f"{converted}/model.safetensors").items():
        if name in original and name.endswith("norm.weight"):  # Gemma's back to w from 1 + w
            assert torch.allclose(tensor.float(), original[name].float(), atol=1e-2), name
    as_read = dataclasses.replace(arch, torch_dtype="float32")
    assert as_read == dataclasses.replace(load_model_arch(model_dir), torch_dtype="float32")


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is ambiguous"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
    ],
)
def test_gemma_variants_not_implemented_are_refused_at_load(
    tmp_path: Path, override: dict[str, Any], words: str
) -> None:
    """Another activation would compute something else, and attention soft-capping on Gemma 3
    means what transformers' Gemma 3 does not do: refused with a message, before any engine
    starts."""
    model_dir = write_tiny_family(tmp_path, "gemma3", **override)
    with pytest.raises(ValueError, match=words):
        load_model_arch(model_dir)


@pytest.mark.parametrize(("layers", "scalar"), [(26, 256), (62, 168)])
def test_gemma3_gguf_keys_llama_cpp_leaves_out_get_its_values(layers: int, scalar: int) -> None:
    """A Gemma 3 file without a sliding-window pattern has a full-attention layer every 6th
    (as llama.cpp assumes); the 27B model (62 layers) scales attention by hidden / heads, the
    others by head_dim; the sliding layers' RoPE base is 10,000."""
    from otel_engine.model.gguf import _gemma3_gguf_config

    base = {"num_hidden_layers": layers, "hidden_size": 5376, "num_attention_heads": 32}
    base |= {"head_dim": 256, "sliding_window": 1024, "rope_theta": 1e6, "rope_scaling": None}
    config = _gemma3_gguf_config(base, None)

    full = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    assert full == list(range(5, layers, 6))
    assert scalar == config["query_pre_attn_scalar"]
    assert {"rope_type": "default", "rope_theta": 1e6} == config["rope_parameters"][
        "full_attention"
    ]
    assert 10_000.0 == config["rope_parameters"]["sliding_attention"]["rope_theta"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"sliding_window": None}, "without gemma3.attention.sliding_window"),
        ({"pattern": [True, False, True]}, "3 sliding-window flags for 4 layers"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' RoPE scaling"),
    ],
)
def test_a_gemma3_gguf_the_model_cannot_run_as_written_is_refused(
    change: dict[str, Any], words: str
) -> None:
    """No sliding window, a per-layer pattern of the wrong length, or a RoPE scaling Gemma 3
    does not use: refused with what is wrong, not run as something else."""
    from otel_engine.model.gguf import _gemma3_gguf_config

    pattern = change.pop("pattern", None)
    base = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}
    base |= {"sliding_window": 16, "rope_theta": 1e6, "rope_scaling": None, **change}
    with pytest.raises(ValueError, match=words):
        _gemma3_gguf_config(base, pattern)
