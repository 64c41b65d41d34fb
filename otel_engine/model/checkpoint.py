"""What a checkpoint stores, read from its metadata before any weight is loaded: which
matrices a GGUF conversion kept in their blocks, in which format and of which shape. The
fast-path plan is decided from these facts (`fast_paths.choose`), so that loading only
carries the plan out."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from otel_engine.model.weights import QUANT_FILE


@dataclass(frozen=True, slots=True)
class Blocks:
    """A matrix [rows, cols] stored in GGUF blocks of format `kind` (`weights.GgmlType`)."""

    kind: str
    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The matrices kept in their blocks, by Hugging Face name (empty: every weight dense)."""

    blocks: dict[str, Blocks] = field(default_factory=dict)

    @classmethod
    def read(cls, model_dir: str) -> Checkpoint:
        """The facts of `model_dir`'s weights, from the safetensors header alone."""
        path = os.path.join(model_dir, QUANT_FILE)
        if not os.path.isfile(path):
            return cls()
        from safetensors import safe_open

        found = {}
        with safe_open(path, framework="pt") as f:
            formats = json.loads((f.metadata() or {}).get("formats", "{}"))
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                kind, cols = formats[name]
                rows = f.get_slice(name).get_shape()[0]
                found[name] = Blocks(kind, int(rows), int(cols))
        return cls(found)

    def kinds(self, names: list[str]) -> list[str | None]:
        """Each tensor's block format (None: stored dense)."""
        return [self.blocks[n].kind if n in self.blocks else None for n in names]
