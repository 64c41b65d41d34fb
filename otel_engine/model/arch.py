"""A checkpoint directory's architecture: config.json (and generation_config.json) read
into a `ModelArch`, the one description every process shares. No torch here."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from otel_engine.model.families import SUPPORTED_ARCHITECTURES, Family, family_of


@dataclass(frozen=True, slots=True)
class ModelArch:
    """What the model code needs to build a Llama-family decoder, read from config.json.

    `rope_scaling` is the Hugging Face dict as in config.json (or rebuilt from transformers
    5's `rope_parameters`), always with a `rope_type` key, e.g. `{"rope_type": "llama3",
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}`; None means plain RoPE with `rope_theta`.
    The model code must apply it (or refuse it) when it computes the rotary frequencies:
    ignoring it silently gives wrong outputs past the original context length.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    family: str = "llama"
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    # Mixture of experts: experts per layer, experts per token, each expert's MLP size,
    # whether the top-k routing weights are renormalized, layers with a dense MLP instead.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    sliding_window: int | None = None  # attention sees at most this many tokens back
    partial_rotary_factor: float = 1.0  # the share of each head that RoPE rotates
    # Gemma 3: the layers that use the sliding window (the others attend to everything) and
    # their RoPE base, the attention scale (query_pre_attn_scalar ** -0.5), and the tanh
    # soft caps of the final logits and of the attention scores.
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    def family_limits(self) -> dict[str, Any]:
        """What sets this family apart, for the startup log and crash dumps."""
        limits: dict[str, Any] = {"family": self.family, "sliding_window": self.sliding_window}
        if self.num_experts:
            limits["num_experts"] = self.num_experts
            limits["num_experts_per_tok"] = self.num_experts_per_tok
        if self.sliding_layers:
            limits["num_sliding_layers"] = len(self.sliding_layers)
        if self.attn_logit_softcapping:
            limits["attn_logit_softcapping"] = self.attn_logit_softcapping
        return limits


def load_model_arch(model_dir: str) -> ModelArch:
    """The architecture described by `model_dir`/config.json (and generation_config.json)."""
    config = _read_json(os.path.join(model_dir, "config.json"))
    architecture = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    family = family_of(architecture)
    if family is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r} in {model_dir}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    generation = read_generation_config(model_dir)
    if family.sliding_pattern:
        config = _gemma_config(config, family)
    rope = config.get("rope_parameters") or {}
    scaling, partial = _rope_scaling(config, architecture)
    heads = config["num_attention_heads"]
    has_bias = architecture in family.biased_architectures or config.get("attention_bias", False)
    num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False:  # Qwen2/Qwen3 carry a window they do not use
        window = None
    return ModelArch(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(has_bias),
        bos_token_id=config.get("bos_token_id", generation.get("bos_token_id")),
        eos_token_ids=tuple(
            unique_ids(
                config.get("eos_token_id"), generation.get("eos_token_id"), _eos_id(model_dir)
            )
        ),
        torch_dtype=config.get("torch_dtype") or config.get("dtype") or "float32",
        family=family.name,
        qk_norm=family.has_qk_norm,
        num_experts=num_experts,
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(
            config.get("moe_intermediate_size") or config["intermediate_size"]
        ),
        norm_topk_prob=bool(config.get("norm_topk_prob", family.norm_topk_prob)),
        dense_layers=_dense_layers(config) if num_experts else (),
        sliding_window=int(window) if window else None,
        partial_rotary_factor=partial,
        sliding_layers=tuple(config.get("sliding_layers", ())),
        local_rope_theta=config.get("local_rope_theta"),
        attention_scale=config.get("attention_scale"),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
    )


def _rope_scaling(config: dict[str, Any], architecture: str) -> tuple[dict[str, Any] | None, float]:
    """The RoPE scaling (None: plain RoPE) and the share of each head that RoPE rotates."""
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    partial = float(scaling.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"{architecture}: partial_rotary_factor {partial} is not in (0, 1]")
    if rope_type == "longrope":  # its factor comes from the two context lengths
        scaling.setdefault(
            "original_max_position_embeddings", config.get("original_max_position_embeddings")
        )
        scaling.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    return (None if rope_type == "default" else {**scaling, "rope_type": rope_type}), partial


def _gemma_config(config: dict[str, Any], family: Family) -> dict[str, Any]:
    """Gemma 2's and 3's config.json in the shape `load_model_arch` reads: the full-attention
    layers' RoPE as the model's (`rope_theta`, `rope_scaling`), the sliding layers' base and
    indices apart (Gemma 2: one base for both), the attention scale; what is not implemented
    refused."""
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"{family.name} with hidden_activation {activation!r} is not supported")
    if family.name == "gemma3" and config.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 (5.x) ignores the field, Gemma 2 applies it: a checkpoint
        # trained with one would run as the other (no Gemma 3 release sets it)
        raise ValueError(
            "Gemma3ForCausalLM with attn_logit_softcapping is ambiguous (transformers' Gemma 3 "
            "ignores it); remove it from config.json, or use Gemma2ForCausalLM, which applies it"
        )
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if not types:
        pattern = int(
            config.get("sliding_window_pattern")
            or config.get("_sliding_window_pattern")
            or family.sliding_pattern
        )
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # Gemma 2: one RoPE for every layer
        rope = {"full_attention": rope, "sliding_attention": rope}
    full = dict(rope.get("full_attention") or {})
    local = rope.get("sliding_attention") or {}
    if not full:  # transformers 4 keys
        full = dict(config.get("rope_scaling") or {})
        full["rope_theta"] = config.get("rope_theta", 1_000_000.0)
        if family.name == "gemma2":
            local = {"rope_theta": full["rope_theta"]}
    return {
        **config,
        "rope_parameters": None,
        "rope_theta": full.pop("rope_theta", 1_000_000.0),
        "rope_scaling": full or None,
        "local_rope_theta": float(
            local.get("rope_theta") or config.get("rope_local_base_freq") or 10_000.0
        ),
        "sliding_layers": [i for i, kind in enumerate(types) if kind == "sliding_attention"],
        "attention_scale": float(config.get("query_pre_attn_scalar") or config["head_dim"]) ** -0.5,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def _dense_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """Layers of a mixture-of-experts model whose MLP is dense (Qwen3-MoE's `mlp_only_layers`
    and `decoder_sparse_step`)."""
    step = int(config.get("decoder_sparse_step") or 1)
    listed = set(config.get("mlp_only_layers") or ())
    return tuple(
        i for i in range(config["num_hidden_layers"]) if i in listed or (i + 1) % step != 0
    )


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """`model_dir`/generation_config.json ({} when there is none); ValueError, naming the
    file, when it is not a JSON object."""
    path = os.path.join(model_dir, "generation_config.json")
    return _read_json(path) if os.path.isfile(path) else {}


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        content = json.load(f)
    if not isinstance(content, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return content


def unique_ids(*values: Any) -> list[int]:
    """Unique token ids, in order, from a mix of None, ints and lists of ints."""
    flat: list[Any] = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [] if value is None else [value])
    return list(dict.fromkeys(int(v) for v in flat))


def _eos_id(model_dir: str) -> int | None:
    """The tokenizer's eos id, read from its JSON files without building the tokenizer."""
    try:
        eos = _read_json(os.path.join(model_dir, "tokenizer_config.json")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        tokenizer = _read_json(os.path.join(model_dir, "tokenizer.json"))
    except (OSError, ValueError):
        return None
    added = {token.get("content"): token.get("id") for token in tokenizer.get("added_tokens", [])}
    vocab = (tokenizer.get("model") or {}).get("vocab")
    found = added.get(eos) if eos in added else vocab.get(eos) if isinstance(vocab, dict) else None
    return found if isinstance(found, int) else None
