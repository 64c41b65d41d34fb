"""A tiny random Llama checkpoint written in seconds, with no network, and a reference greedy.

`write_tiny_llama` produces a complete Hugging Face directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML chat template) whose tokenizer is a
byte-level BPE trained here on a built-in corpus, so multi-byte text round-trips. Weights are
random but scaled so that greedy continuations vary with the prompt and the top logits are
well separated (engine-vs-transformers parity is then robust to float rounding).

`hf_greedy` is the reference: transformers' LlamaForCausalLM in float32, one prompt at a time,
argmax at every step over the whole sequence, exactly `max_new_tokens` tokens, never
stopping at EOS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The engine schedules requests in steps. Each step takes the waiting requests, gives them "
    "blocks of the key value cache, runs the model once for the whole batch, and samples one "
    "new token for every running sequence.",
    "When a worker process dies, the engine core notices within a second, writes a crash dump "
    "with the state of the scheduler, answers every client with an error, and shuts down.",
    "A quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly. "
    "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!",
    "Once upon a time there was a small town by the sea. The people of the town were fishers, "
    "bakers and carpenters, and every morning the bells rang at seven o'clock.",
    "Observability means that you can ask new questions of a running system without shipping "
    "new code: traces show where the time went, metrics show trends, and logs tell the story.",
    "def generate(prompt, max_tokens=16):\n    return model.sample(prompt, max_tokens)\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -1 +1 = < > ( ) [ ] { }",
    "You are a helpful assistant. What is the capital of France? The capital of France is "
    "Paris. What is two plus two? Two plus two is four.",
    "héllo wörld 世界 🌍 naïve café résumé Grüße 日本語のテキスト Ελληνικά русский текст 👋🏽 ✨",
    "<|im_start|>user\nHello there!<|im_end|>\n"
    "<|im_start|>assistant\nHi! How can I help?<|im_end|>",
]


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, out: Path, context: int) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=IM_START,
        eos_token=IM_END,
        unk_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        model_max_length=context,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out)
    # transformers 4.x readers need a class name they know and the template inside the config.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))


def _scale_weights(model: Any, seed: int) -> None:
    """Re-draw every matrix with a larger std so logits spread out; norms stay at one."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            std = 0.5 if "embed_tokens" in name or "lm_head" in name else 0.25
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 768,
    tie: bool = False,
    seed: int = 0,
    context: int = 512,
    head_dim: int | None = None,
) -> str:
    """Write a random LlamaForCausalLM checkpoint with a trained BPE tokenizer; return its dir.
    Heads are hidden / heads wide unless `head_dim` says otherwise."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab)
    _save_tokenizer(tokenizer, out, context)

    config_kwargs: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": tie,
        "bos_token_id": tokenizer.token_to_id(IM_START),
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "architectures": ["LlamaForCausalLM"],
    }
    config = LlamaConfig(**config_kwargs)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    _scale_weights(model, seed)
    if tie:
        model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)

    # Readers written against transformers 4.x expect these two top-level keys.
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved.setdefault("rope_theta", 10000.0)
    saved.setdefault("torch_dtype", "float32")
    config_path.write_text(json.dumps(saved, indent=2))
    return str(out)


# Each family's tiny shape, from its real transformers config class: GQA, and a head_dim
# other than hidden / heads where the family has the field.
FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"intermediate_size": 128, "head_dim": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"intermediate_size": 128}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_hidden_layers": 3,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],  # one dense layer among the sparse ones
            "head_dim": 32,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            # a window shorter than most test prompts, on every other layer
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
        },
    ),
}
# Gemma 2: Gemma 3's tiny shape with one RoPE for every layer and attention soft-capping, at a
# cap low enough to change the scores of a random model (Gemma 2 ships 50).
FAMILY_CONFIGS["gemma2"] = (
    "Gemma2Config",
    "Gemma2ForCausalLM",
    {
        **FAMILY_CONFIGS["gemma3"][2],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "attn_logit_softcapping": 2.0,
    },
)


def write_tiny_family(
    path: str | os.PathLike[str],
    family: str,
    *,
    seed: int = 0,
    context: int = 512,
    **overrides: Any,
) -> str:
    """A random checkpoint of `family` (FAMILY_CONFIGS) with the tiny tokenizer; its dir."""
    import torch
    import transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(768)
    _save_tokenizer(tokenizer, out, context)
    config_name, model_name, shape = FAMILY_CONFIGS[family]
    kwargs: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id(IM_START),
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "architectures": [model_name],
        **shape,
        **overrides,
    }
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    _scale_weights(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def hf_greedy(
    model_dir: str | os.PathLike[str], prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations from transformers in float32: exactly max_new_tokens per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    results: list[list[int]] = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                # Whole-sequence forward each step: no KV-cache API that changes across versions.
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
                ids.append(int(logits[0, -1].argmax()))
            results.append(ids[len(prompt) :])
    return results


def write_tiny_gguf(
    model_dir: str,
    path: str | os.PathLike[str],
    kind: str,
    quant: dict[str, str] | None = None,
    seed: int = 0,
) -> str:
    """The checkpoint at `model_dir` as a float32 GGUF file of architecture `kind` (the names
    and keys llama.cpp writes, via the gguf package's tensor name map), its byte-level BPE
    tokenizer included; for the converter's tests. `quant`: layer matrices by projection name
    ("q_proj", ..., "down_proj") written instead as random blocks of that GGUF format
    (tests/helpers/gguf_blocks.py), a random-weight model of the same shape."""
    import gguf
    from safetensors.torch import load_file

    from tests.helpers.gguf_blocks import random_blocks

    config = json.loads((Path(model_dir) / "config.json").read_text())
    spec = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), kind)
    _write_gguf_hparams(writer, config, kind)
    _write_gguf_tokenizer(writer, spec, config)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == kind)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    stacks: dict[str, dict[int, Any]] = {}
    for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        moe = _gguf_expert_name(name)
        if moe is not None:  # llama.cpp stores each layer's experts as one 3-D tensor
            gguf_name, expert = moe
            stacks.setdefault(gguf_name, {})[expert] = tensor.float().numpy()
            continue
        rows = tensor
        if kind == "llama" and (".q_proj." in name or ".k_proj." in name):  # llama.cpp's order
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            rows = _llama_cpp_rows(tensor, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if kind == "gemma3" and name.endswith("norm.weight"):  # llama.cpp stores 1 + w
            rows = rows.float() + 1.0
        projection = name.split(".")[-2]
        if quant and projection in quant and name.endswith(".weight"):
            blocks = random_blocks(quant[projection], *tensor.shape, seed=seed + len(stacks))
            seed += 1
            writer.add_tensor(
                gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType[quant[projection]]
            )
            continue
        writer.add_tensor(gguf_name, rows.float().numpy())
    import numpy as np

    for gguf_name, by_expert in stacks.items():
        tensor = (
            by_expert[-1]
            if -1 in by_expert
            else np.stack([by_expert[e] for e in sorted(by_expert)])
        )
        writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _write_gguf_hparams(writer: Any, config: dict[str, Any], kind: str) -> None:
    """The model's shape as llama.cpp's converter writes it for `kind`."""
    import gguf

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if kind == "gemma3":  # as llama.cpp's Gemma3Model writes it
        rope = rope["full_attention"]
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_freq_base(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _write_gguf_tokenizer(writer: Any, spec: dict[str, Any], config: dict[str, Any]) -> None:
    """The byte-level BPE tokenizer as GGUF metadata (tokens, types, merges, special ids)."""
    tokens = [""] * len(spec["model"]["vocab"])
    for token, index in spec["model"]["vocab"].items():
        tokens[index] = token
    special = {added["id"] for added in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])


def _llama_cpp_rows(weight: Any, heads: int) -> Any:
    """q/k rows in llama.cpp's order for `llama` files (the converter undoes it)."""
    shape = weight.shape
    grouped = weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
    return grouped.swapaxes(1, 2).reshape(shape)


_EXPERT_PARTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}


def _gguf_expert_name(name: str) -> tuple[str, int] | None:
    """(GGUF name, expert) of an HF expert or router tensor (router: expert -1), or None."""
    import re

    expert = re.fullmatch(
        r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name
    )
    if expert:
        return f"blk.{expert[1]}.{_EXPERT_PARTS[expert[3]]}.weight", int(expert[2])
    router = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight", name)
    if router:
        return f"blk.{router[1]}.ffn_gate_inp.weight", -1
    return None


# Qwen2.5's tool markup (its chat template's structure): the tools as JSON lines between
# <tools> tags in the system turn, each call as a <tool_call> JSON object, results in
# <tool_response> tags of a user turn.
HERMES_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and"
    ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_tiny_tool_model(path: str | os.PathLike[str]) -> str:
    """The tiny Llama with Qwen2.5's tool markup as its chat template."""
    out = Path(write_tiny_llama(path, context=4096))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TOOL_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(HERMES_TOOL_TEMPLATE)
    return str(out)
