"""Model family -> decoder class (`loader.ARCHITECTURE_FAMILIES` maps HF `architectures`
names to the families). A new family is one small module: a `LlamaModel` subclass that loads
its weights into the shared layer (and, where it computes something new, a building block in
layers.py or moe.py), plus a line here and one in the loader's table."""

from __future__ import annotations

from otel_engine.model.arch import ModelArch
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
