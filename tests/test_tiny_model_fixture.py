"""The tiny model fixture is a real, usable checkpoint: transformers loads it, greedy output
varies, the tokenizer round-trips multi-byte text and applies the ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.tiny_model import IM_END, hf_greedy


def test_checkpoint_has_expected_files(tiny_model_dir: str) -> None:
    """The directory holds config, safetensors weights and the tokenizer files."""
    names = {path.name for path in Path(tiny_model_dir).iterdir()}

    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_config_matches_tokenizer(tiny_model_dir: str) -> None:
    """config.json names LlamaForCausalLM and its vocab_size equals the tokenizer's."""
    from tokenizers import Tokenizer

    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))

    assert ["LlamaForCausalLM"] == config["architectures"]
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.token_to_id(IM_END) == config["eos_token_id"]
    assert 10000.0 == config["rope_theta"]
    assert 512 == config["max_position_embeddings"]


def test_transformers_loads_checkpoint(tiny_model_dir: str) -> None:
    """AutoModelForCausalLM loads the weights as a float32 LlamaForCausalLM."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    assert "LlamaForCausalLM" == type(model).__name__
    assert torch.float32 == next(model.parameters()).dtype


def test_prompts_cover_lengths(tiny_prompts: list[list[int]]) -> None:
    """At least 8 distinct prompts, from 3 up to 120 tokens."""
    lengths = [len(prompt) for prompt in tiny_prompts]

    assert len(tiny_prompts) >= 8
    assert 3 == min(lengths)
    assert 120 == max(lengths)
    assert len(tiny_prompts) == len({tuple(prompt) for prompt in tiny_prompts})


def test_hf_greedy_is_varied(tiny_model_dir: str, tiny_prompts: list[list[int]]) -> None:
    """Greedy output has exactly max_new_tokens tokens, is not one repeated token, and
    differs across prompts."""
    outputs = hf_greedy(tiny_model_dir, tiny_prompts, max_new_tokens=16)

    assert [16] * len(tiny_prompts) == [len(out) for out in outputs]
    assert all(len(set(out)) > 4 for out in outputs)
    assert len(outputs) == len({tuple(out) for out in outputs})


def test_hf_greedy_is_deterministic(tiny_model_dir: str, tiny_prompts: list[list[int]]) -> None:
    """Two reference runs give the same tokens."""
    prompts = tiny_prompts[:2]

    assert hf_greedy(tiny_model_dir, prompts, 8) == hf_greedy(tiny_model_dir, prompts, 8)


@pytest.mark.parametrize("text", ["héllo wörld 世界 🌍", "plain ascii", "👋🏽 ✨ naïve café"])
def test_tokenizer_round_trips_multibyte(tiny_model_dir: str, text: str) -> None:
    """Byte-level BPE decodes back to exactly the encoded text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    assert text == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))


def test_tokenizer_applies_chatml_template(tiny_model_dir: str) -> None:
    """The chat template renders ChatML with an assistant generation prompt; EOS is <|im_end|>."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert expected == rendered
    assert IM_END == tokenizer.eos_token
