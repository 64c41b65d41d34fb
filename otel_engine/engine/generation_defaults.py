"""Default sampling values for requests that omit them, as vLLM takes them: from the
model's `generation_config.json` (`--generation-config auto`), overridden field by field by
`--override-generation-config`.

The default model's GGUF carries no generation config, so its defaults are the ones its
model card recommends (`DefaultModel.card_defaults`). Every default in force is logged at startup
with where it came from, and listed in `GET /v1/models`. `apply_generation_defaults` (defined
beside the rules in sampling_params.py) is how every caller applies them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from otel_engine.config import GenerationConfigMode
from otel_engine.model.arch import read_generation_config
from otel_engine.model.default_model import DEFAULT_MODEL
from otel_engine.sampling_params import (
    DEFAULTABLE_FIELDS,
    apply_generation_defaults,
    check_default_values,
    parse_override,
)

if TYPE_CHECKING:
    from otel_engine.config import EngineConfig

__all__ = [
    "GenerationDefaults",
    "apply_generation_defaults",
    "for_config",
    "parse_override",
    "resolve",
]

# Request fields a generation config may set, with their names there (HF's) and here.
FIELDS = {name: name for name in DEFAULTABLE_FIELDS}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The values requests get for the fields they omit, and where each came from."""

    values: dict[str, float]
    sources: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return {"values": self.values, "sources": self.sources}


def resolve(
    mode: GenerationConfigMode,
    model_dir: str,
    *,
    is_default_model: bool,
    override: dict[str, Any] | None,
) -> GenerationDefaults:
    """`mode` auto: the model's generation config (the model card's values for the default
    model, whose GGUF has none); none: no model defaults. `override` wins field by field."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    if mode == GenerationConfigMode.AUTO:
        found = read_generation_config(model_dir)
        for hf_name, name in FIELDS.items():
            if hf_name in found and found[hf_name] is not None:
                values[name] = found[hf_name]
                sources[name] = "generation_config.json"
        check_default_values(values, os.path.join(model_dir, "generation_config.json"))
        if is_default_model and not values:
            values.update(DEFAULT_MODEL.card_defaults)
            sources.update(dict.fromkeys(DEFAULT_MODEL.card_defaults, "default model card"))
    for name, value in (override or {}).items():
        values[name] = value
        sources[name] = "--override-generation-config"
    return GenerationDefaults(values, sources)


def for_config(config: EngineConfig, model_dir: str) -> GenerationDefaults:
    """The defaults of an engine of `config` over the model files in `model_dir`
    (`--generation-config`, `--override-generation-config`)."""
    return resolve(
        config.model.generation_config,
        model_dir,
        is_default_model=config.model.model is None,
        override=parse_override(config.model.override_generation_config),
    )
