"""A model's decoder class, resolved from its family's record (`families.FAMILIES`, which
names it by import path so that the table is read without torch), and the model loaded."""

from __future__ import annotations

import importlib
from typing import Any

from otel_engine.model.arch import ModelArch, load_model_arch
from otel_engine.model.checkpoint import Checkpoint
from otel_engine.model.families import Family, family_named
from otel_engine.model.llama import LlamaModel


def decoder_class(family: Family) -> type[LlamaModel]:
    """The class `family.decoder` names (a `LlamaModel` subclass)."""
    module, _, name = family.decoder.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, LlamaModel)):
        raise TypeError(f"family {family.name!r}: {family.decoder} is not a LlamaModel class")
    return cls


def load_model(model_dir: str, arch: ModelArch | None = None, **options: Any) -> LlamaModel:
    """`model_dir`'s model on this rank: its plan decided from the checkpoint's metadata,
    its weights loaded in the forms the plan chose (`options`: the model's keyword
    arguments), its GGUF blocks moved off the file's mapping."""
    from otel_engine.model.weights import iter_weights

    arch = arch or load_model_arch(model_dir)
    decoder = decoder_class(family_named(arch.family))
    model = decoder(arch, checkpoint=Checkpoint.read(model_dir), **options)
    # matrices in GGUF blocks arrive as they are: the model keeps or dequantizes each as its
    # plan says (exactly, in float32, before the model dtype)
    model.load_weights(iter_weights(model_dir, keep_quantized=True))
    model.place_blocks()
    return model
