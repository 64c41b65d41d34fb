"""Model family -> decoder class (`loader.ARCHITECTURE_FAMILIES` maps HF `architectures`
names to the families). A new family is one small module: a `LlamaModel` subclass that loads
its weights into the shared layer (and, where it computes something new, a building block in
layers.py or moe.py), plus a line here and one in the loader's table."""

from __future__ import annotations

from typing import Any

from otel_engine.model.arch import ModelArch, load_model_arch
from otel_engine.model.checkpoint import Checkpoint
from otel_engine.model.gemma3 import Gemma3Model
from otel_engine.model.llama import LlamaModel
from otel_engine.model.mixtral import MixtralModel
from otel_engine.model.phi3 import Phi3Model
from otel_engine.model.qwen3_moe import Qwen3MoeModel

MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,  # Llama, Mistral, Qwen2
    "qwen3": LlamaModel,  # q/k norms: `ModelArch.qk_norm`
    "phi3": Phi3Model,
    "mixtral": MixtralModel,
    "qwen3_moe": Qwen3MoeModel,
    "gemma3": Gemma3Model,
    "gemma2": Gemma3Model,  # Gemma 3 without q/k norms, one RoPE base: `ModelArch` says so
}


def model_class(arch: ModelArch) -> type[LlamaModel]:
    return MODEL_CLASSES[arch.family]


def load_model(model_dir: str, arch: ModelArch | None = None, **options: Any) -> LlamaModel:
    """`model_dir`'s model on this rank: its plan decided from the checkpoint's metadata,
    its weights loaded in the forms the plan chose (`options`: the model's keyword
    arguments), its GGUF blocks moved off the file's mapping."""
    from otel_engine.model.weights import iter_weights

    arch = arch or load_model_arch(model_dir)
    model = model_class(arch)(arch, checkpoint=Checkpoint.read(model_dir), **options)
    # matrices in GGUF blocks arrive as they are: the model keeps or dequantizes each as its
    # plan says (exactly, in float32, before the model dtype)
    model.load_weights(iter_weights(model_dir, keep_quantized=True))
    model.place_blocks()
    return model
