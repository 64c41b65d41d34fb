"""Mixtral: the Llama decoder with a mixture of experts in every layer (`block_sparse_moe`:
experts' `w1` gate, `w3` up, `w2` down; top-k weights always renormalized)."""

from __future__ import annotations

from otel_engine.model.llama import LlamaLayer, LlamaModel, Take


class MixtralModel(LlamaModel):
    def _load_extras(self, take: Take, layer: LlamaLayer, index: int) -> None:
        super()._load_extras(take, layer, index)
        prefix = "block_sparse_moe.experts"
        experts = [
            tuple(take(f"{prefix}.{e}.{name}.weight") for name in ("w1", "w3", "w2"))
            for e in range(self.arch.num_experts)
        ]
        self._set_experts(layer, take("block_sparse_moe.gate.weight"), experts)  # type: ignore[arg-type]
