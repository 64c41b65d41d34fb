"""Qwen3-MoE: Qwen3 (q/k norms) with a mixture of experts (`mlp.experts.*`, router `mlp.gate`)
in every layer but those `mlp_only_layers` / `decoder_sparse_step` keep dense."""

from __future__ import annotations

from otel_engine.model.llama import LlamaLayer, LlamaModel, Take


class Qwen3MoeModel(LlamaModel):
    def _load_extras(self, take: Take, layer: LlamaLayer, index: int) -> None:
        super()._load_extras(take, layer, index)
        if index in self.dense_layers:
            return
        experts = [
            tuple(take(f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
            for e in range(self.arch.num_experts)
        ]
        self._set_experts(layer, take("mlp.gate.weight"), experts)  # type: ignore[arg-type]
