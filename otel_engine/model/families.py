"""The model families, one record each in `FAMILIES`: the Hugging Face `architectures` names a
family runs, how llama.cpp's GGUF files store it, what its config.json leaves unsaid, and its
decoder class. Every reader (config.json, the GGUF converter, the model registry) asks this
table. No torch here: the decoder class is named by its import path and resolved by
`registry.decoder_class`.

A new family is one record here and one small module: a `LlamaModel` subclass that loads its
checkpoint's tensors into the shared layer (and, where it computes something new, a building
block in layers.py or moe.py, switched on by a `ModelArch` field)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GgufKind:
    """A `general.architecture` of llama.cpp's GGUF files, converted to this family's
    Hugging Face checkpoint (model/gguf.py)."""

    name: str  # the file's `general.architecture`
    architecture: str  # the `architectures` name the converted config.json says
    model_type: str  # and its `model_type`
    is_qk_permuted: bool = False  # llama.cpp interleaved each head's q and k rows
    # the kind's files with experts (a `llama` file with experts is Mixtral); a file whose
    # experts say otherwise than every record of its kind converts as the first one
    has_experts: bool = False
    # layer tensors named otherwise than the shared map (gguf._GGUF_LAYER_NAMES), fused ones
    # as the Hugging Face checkpoint stores them
    layer_names: Mapping[str, str] = field(default_factory=dict)
    # experts stored as one 3-D tensor per kind: GGUF name -> the per-expert Hugging Face
    # name ({e}: the expert), and the router
    expert_names: Mapping[str, str] = field(default_factory=dict)
    # the RMSNorms scale by (1 + w) and llama.cpp stores 1 + w (the converter takes 1 off)
    has_norms_plus_one: bool = False


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: its architectures, its GGUF kinds and its decoder class."""

    name: str  # `ModelArch.family`
    architectures: tuple[str, ...]  # the `architectures` names in config.json
    decoder: str  # the decoder class's import path (a `LlamaModel` subclass)
    gguf_kinds: tuple[GgufKind, ...] = ()
    # an RMSNorm over each q and k head before RoPE (`ModelArch.qk_norm`)
    has_qk_norm: bool = False
    # whether the top-k routing weights are renormalized where config.json does not say
    norm_topk_prob: bool = False
    # architectures whose q/k/v have biases whatever config.json says
    biased_architectures: tuple[str, ...] = ()
    # Gemma: config.json read as Gemma's (arch._gemma_config), a full-attention layer every
    # this many where it lists no `layer_types`; 0: not a Gemma config
    sliding_pattern: int = 0


_MIXTRAL_EXPERTS = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}
_QWEN3_MOE_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GEMMA3_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
        "otel_engine.model.llama.LlamaModel",
        gguf_kinds=(
            GgufKind("llama", "LlamaForCausalLM", "llama", is_qk_permuted=True),
            GgufKind("qwen2", "Qwen2ForCausalLM", "qwen2"),
        ),
        biased_architectures=("Qwen2ForCausalLM",),
    ),
    Family(
        "qwen3",
        ("Qwen3ForCausalLM",),
        "otel_engine.model.llama.LlamaModel",
        gguf_kinds=(GgufKind("qwen3", "Qwen3ForCausalLM", "qwen3"),),
        has_qk_norm=True,
    ),
    Family(
        "phi3",
        ("Phi3ForCausalLM",),
        "otel_engine.model.phi3.Phi3Model",
        gguf_kinds=(GgufKind("phi3", "Phi3ForCausalLM", "phi3", layer_names=_PHI3_FUSED),),
    ),
    Family(
        "mixtral",
        ("MixtralForCausalLM",),
        "otel_engine.model.mixtral.MixtralModel",
        gguf_kinds=(
            GgufKind(
                "llama",
                "MixtralForCausalLM",
                "mixtral",
                is_qk_permuted=True,
                has_experts=True,
                expert_names=_MIXTRAL_EXPERTS,
            ),
        ),
        norm_topk_prob=True,
    ),
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        "otel_engine.model.qwen3_moe.Qwen3MoeModel",
        gguf_kinds=(
            GgufKind(
                "qwen3moe",
                "Qwen3MoeForCausalLM",
                "qwen3_moe",
                has_experts=True,
                expert_names=_QWEN3_MOE_EXPERTS,
            ),
        ),
        has_qk_norm=True,
    ),
    Family(
        "gemma3",
        ("Gemma3ForCausalLM",),
        "otel_engine.model.gemma3.Gemma3Model",
        gguf_kinds=(
            GgufKind(
                "gemma3",
                "Gemma3ForCausalLM",
                "gemma3_text",
                layer_names=_GEMMA3_NORMS,
                has_norms_plus_one=True,
            ),
        ),
        has_qk_norm=True,
        sliding_pattern=6,
    ),
    # Gemma 3's decoder without q/k norms, one RoPE base for every layer (`ModelArch` says so)
    Family(
        "gemma2",
        ("Gemma2ForCausalLM",),
        "otel_engine.model.gemma3.Gemma3Model",
        sliding_pattern=2,
    ),
)


_BY_NAME = {family.name: family for family in FAMILIES}
_BY_ARCHITECTURE = {name: family for family in FAMILIES for name in family.architectures}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
SUPPORTED_GGUF_KINDS = tuple(sorted({kind.name for f in FAMILIES for kind in f.gguf_kinds}))


def family_named(name: str) -> Family:
    """The family `ModelArch.family` names."""
    return _BY_NAME[name]


def family_of(architecture: str) -> Family | None:
    """The family that runs a config.json's `architectures` name (None: no family does)."""
    return _BY_ARCHITECTURE.get(architecture)


def gguf_kind(name: str, has_experts: bool) -> GgufKind | None:
    """The record a GGUF file of kind `name` converts by, with experts or without (None: the
    kind is not supported)."""
    kinds = [kind for family in FAMILIES for kind in family.gguf_kinds if kind.name == name]
    exact = [kind for kind in kinds if kind.has_experts == has_experts]
    return next(iter(exact or kinds), None)
