"""Default sampling values for requests that omit them, as vLLM takes them: from the
model's `generation_config.json` (`--generation-config auto`), overridden field by field by
`--override-generation-config`.

The default model's GGUF carries no generation config, so its defaults are the ones its
model card recommends (SmolLM2-135M-Instruct: temperature 0.2, top_p 0.9); at temperature
1.0 and no top_p its answers are word salad. Every default in force is logged at startup
with where it came from, and listed in `GET /v1/models`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_engine.sampling_params import SamplingParams

# Request fields a generation config may set, with their names there (HF's) and here.
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
DEFAULT_MODEL_CARD = {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's card


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The values requests get for the fields they omit, and where each came from."""

    values: dict[str, float]
    sources: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return {"values": self.values, "sources": self.sources}


def resolve(
    mode: str, model_dir: str, *, is_default_model: bool, override: dict[str, Any] | None
) -> GenerationDefaults:
    """`mode` auto: the model's generation config (the model card's values for the default
    model, whose GGUF has none); none: no model defaults. `override` wins field by field."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    if mode == "auto":
        found = _generation_config(model_dir)
        for hf_name, name in FIELDS.items():
            if hf_name in found and found[hf_name] is not None:
                values[name] = found[hf_name]
                sources[name] = "generation_config.json"
        check_values(values, os.path.join(model_dir, "generation_config.json"))
        if is_default_model and not values:
            values.update(DEFAULT_MODEL_CARD)
            sources.update(dict.fromkeys(DEFAULT_MODEL_CARD, "default model card"))
    for name, value in (override or {}).items():
        values[name] = value
        sources[name] = "--override-generation-config"
    return GenerationDefaults(values, sources)


def parse_override(text: str | None) -> dict[str, Any] | None:
    """`--override-generation-config` JSON: an object of known fields with numbers."""
    if text is None:
        return None
    try:
        parsed = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--override-generation-config is not JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    unknown = sorted(set(parsed) - set(FIELDS.values()))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown field(s) {', '.join(unknown)}; "
            f"known: {', '.join(FIELDS.values())}"
        )
    for name, value in parsed.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"--override-generation-config: {name} must be a number")
    check_values(parsed, "--override-generation-config")
    return parsed


def check_values(values: dict[str, Any], source: str) -> None:
    """Raise ValueError naming `source` when a default is out of the range a request's own
    value must be in (the same rules, `SamplingParams.validate`): a default no request
    could send would turn into a 400 for a field the client never sent."""
    from otel_engine.errors import RequestError

    for name, value in values.items():
        if name == "top_k" and value != int(value):
            raise ValueError(f"{source}: top_k must be an integer, got {value}")
        try:
            sampling_params({name: value}).validate()
        except RequestError as error:
            raise ValueError(f"{source}: {error.message}") from None


def sampling_params(values: dict[str, Any]) -> SamplingParams:
    """`SamplingParams()` with `values` (defaults' fields; `top_k` as an integer)."""
    from otel_engine.sampling_params import SamplingParams

    fields: dict[str, Any] = {
        name: int(value) if name == "top_k" else float(value) for name, value in values.items()
    }
    return SamplingParams(**fields)


def _generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as file:
        loaded = json.load(file)
    return loaded if isinstance(loaded, dict) else {}
